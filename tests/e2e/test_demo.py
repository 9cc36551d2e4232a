"""`changefeed demo` (what `make demo` runs), shortened: its console holds its own lines only.

The demo's feed takes the path that used to print a pyspark `BrokenPipeError` traceback: after
the initial snapshot the runner restarts the query without the shuffle, and the stopped query's
Python worker fails to flush to its closed socket. That output, and Spark's and the JVM's start-up
notices and log lines, now go to the feed's spark.log.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from support.feeds import changefeed_cli

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
NOISE = ("Traceback", "WARN", "WARNING", "ERROR", "log4j", "setLogLevel", "at org.apache", "Exception", "Py4J")


def test_the_demo_shows_only_its_own_lines(tmp_path: Path) -> None:
    done = changefeed_cli("demo", "--workdir", str(tmp_path / "demo"), "--seconds", "25", timeout=800)
    out = f"--- stdout:\n{done.stdout}\n--- stderr:\n{done.stderr}"
    assert done.returncode == 0, out
    assert "demo: verdict: replica == source" in done.stdout, out
    assert "restarting the query without the shuffle" in done.stdout, f"the restart path was not taken: {out}"
    noise = [line for line in (done.stdout + done.stderr).splitlines() if any(n in line for n in NOISE)]
    assert not noise, f"Spark's, the JVM's or a Python traceback's lines on the console: {noise}\n{out}"
    assert done.stderr.strip() == "", out
    log = tmp_path / "demo" / "state" / "demo" / "spark.log"
    assert log.exists() and "Using Spark's default log4j profile" in log.read_text(), "Spark's output went nowhere"


def test_the_delta_demo_queries_the_lake_with_duckdb(tmp_path: Path) -> None:
    done = changefeed_cli("demo", "--sink", "delta", "--workdir", str(tmp_path / "demo"), "--seconds", "10",
                          timeout=800)
    out = f"--- stdout:\n{done.stdout}\n--- stderr:\n{done.stderr}"
    assert done.returncode == 0, out
    assert "demo: verdict: lake == source" in done.stdout, out
    assert done.stdout.count(" equal") == 4, out  # three tables of the mirror, the change log's transfers
    noise = [line for line in (done.stdout + done.stderr).splitlines() if any(n in line for n in NOISE)]
    assert not noise, f"Spark's, the JVM's or a Python traceback's lines on the console: {noise}\n{out}"
