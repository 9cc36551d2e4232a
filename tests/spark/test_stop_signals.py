"""stop_signals without Spark: the process pyspark's launcher starts ignores SIGINT and SIGTERM,
the launcher's module is left as it was, and the runner's handlers come back after a block that
replaced them (as SparkContext replaces SIGINT's)."""
from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

from changefeed.spark import stop_signals


def _ignored(pid: int) -> set[int]:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigIgn:"))
    mask = int(line.split()[1], 16)
    return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}


def test_the_launched_process_ignores_the_stop_signals_and_the_launcher_is_left_as_it_was() -> None:
    from pyspark import java_gateway

    gateway: Any = java_gateway
    before = gateway.Popen
    with stop_signals.jvm_ignores_stop_signals():
        # (pyspark passes a preexec_fn of its own, which still runs)
        child = gateway.Popen(["sleep", "30"], stdin=subprocess.PIPE, preexec_fn=lambda: signal.alarm(0))
    try:
        assert {signal.SIGINT, signal.SIGTERM} <= _ignored(child.pid)
        child.send_signal(signal.SIGTERM)  # ignored: it still runs
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
    assert gateway.Popen is before
    plain = subprocess.Popen(["sleep", "30"])  # a process started otherwise keeps the default
    try:
        assert signal.SIGTERM not in _ignored(plain.pid)
    finally:
        plain.kill()
        plain.wait()


def test_the_handlers_before_the_block_come_back() -> None:
    def ours(_sig: int, _frame: Any) -> None:
        pass

    previous = signal.signal(signal.SIGINT, ours)
    try:
        with stop_signals.handlers_kept():
            signal.signal(signal.SIGINT, signal.default_int_handler)  # as SparkContext takes it
        assert signal.getsignal(signal.SIGINT) is ours
    finally:
        signal.signal(signal.SIGINT, previous)
