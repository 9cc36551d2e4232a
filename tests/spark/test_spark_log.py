"""pyspark's accumulator server in the driver prints a traceback when the JVM's connection ends
under it (as it may when a run ends on an error): it goes to spark.log, never to the console."""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
from pyspark import accumulators

from changefeed.spark import spark_log


def test_a_connection_ended_under_the_accumulator_server_is_logged_not_printed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AccumulatorTCPServer", "AccumulatorUnixServer"):  # put back after the test
        monkeypatch.setattr(getattr(accumulators, name), "handle_error", getattr(accumulators, name).handle_error)
    log = tmp_path / "spark.log"
    spark_log._errors_of_driver_threads_to(log)
    server = accumulators.AccumulatorTCPServer(("127.0.0.1", 0), accumulators.UpdateRequestHandler, "token")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with socket.create_connection(server.server_address) as s:
            s.sendall(b"token")  # authenticated, then gone before sending its updates: EOFError in the handler
        deadline = time.monotonic() + 10
        while not (log.exists() and "EOFError" in log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        server.shutdown()
    assert "EOFError" in log.read_text()
    assert "Traceback" not in capsys.readouterr().err
