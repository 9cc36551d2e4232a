"""Where a feed's Spark output goes: `STATE/NAME/spark.log`, not the console.

Spark's driver JVM prints its start-up notices, log4j lines and the Java frames of every failed
task, and the Python workers it starts print theirs (a `BrokenPipeError` when a query is stopped
under a task). None of it is for an operator in normal operation: the feed reports progress and
ends with one typed error. The JVM is therefore started with its stdout and stderr on this file;
its children inherit them. `run --verbose` keeps them on the console instead. The driver's own
Python threads that talk to the JVM (the accumulator server) print to the same file too.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

from changefeed.errors import DefiniteError

MAX_BYTES = 16 << 20  # past this at a start, the log moves to spark.log.1 (one old copy kept)


class SparkDidNotStart(DefiniteError):
    """The driver JVM did not come up (no Java, too little memory, a bad SPARK_HOME)."""


def tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def open_log(path: Path) -> Any:
    """The log file for appending, after a line that marks this start (rotated when large)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size > MAX_BYTES:
        path.replace(path.with_name(path.name + ".1"))
    out = open(path, "ab")
    out.write(f"--- changefeed pid {os.getpid()} starts Spark at {time.strftime('%Y-%m-%d %H:%M:%S %z')}\n".encode())
    out.flush()
    return out


def launch_gateway(conf: Any, path: Path | None) -> Any:
    """Start the driver JVM (pyspark's launcher) with its output on `path` (None: the console)."""
    from pyspark.java_gateway import launch_gateway as launch

    if path is None:
        return launch(conf)  # type: ignore[no-untyped-call]  # pyspark's is unannotated
    _errors_of_driver_threads_to(path)

    with open_log(path) as out:  # the JVM has its own copy of the descriptor
        try:
            output = {"stdout": out, "stderr": subprocess.STDOUT}
            return launch(conf, popen_kwargs=output)  # type: ignore[no-untyped-call]  # pyspark's is unannotated
        except Exception as e:  # noqa: BLE001 - pyspark raises plain runtime errors here
            raise SparkDidNotStart(f"Spark's driver JVM did not start ({e}); its last lines, from {path}:\n"
                                   f"{tail(path)}", "check that Java 17+ is installed and on PATH (or JAVA_HOME "
                                   "is set), and CHANGEFEED_DRIVER_MEMORY fits this machine") from None


def _errors_of_driver_threads_to(path: Path) -> None:
    """pyspark's accumulator server (a socketserver in the driver) prints a traceback to stderr
    when the JVM's connection ends under it, as it may when a run ends; write it to `path`."""
    import traceback

    from pyspark import accumulators

    def handle_error(server: Any, request: Any, client_address: Any) -> None:
        with open(path, "a") as out:
            out.write(f"error in pyspark's accumulator server ({client_address}):\n{traceback.format_exc()}")

    for name in ("AccumulatorTCPServer", "AccumulatorUnixServer"):
        server = getattr(accumulators, name, None)
        if server is not None:
            server.handle_error = handle_error
