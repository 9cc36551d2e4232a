"""The README's first-run example, run as a user would paste it (with free ports, and this
checkout's installed commands): it copies the table, `status` after the clean --available-now
run shows the feed caught up (lag 0), and the console holds changefeed's lines only (no traceback,
no Spark or JVM line: those go to the feed's spark.log)."""
from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
SPARK_NOISE = ("Traceback", "WARN", "WARNING", "ERROR", "log4j", "setLogLevel", "at org.apache", "Exception")

pytestmark = pytest.mark.timeout(600)


def example() -> str:
    text = README.read_text()
    start = text.index("<!-- first-run example: tests/cli/test_readme_example.py runs this block -->")
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert block is not None, "the README's first-run example has no bash block after its marker"
    return block.group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_readme_first_run_works_as_written(tmp_path: Path) -> None:
    script = example()
    assert script.startswith("make install\n")
    bin_dir = Path(sys.executable).parent
    script = script.replace("make install\n", "set -euo pipefail\n").replace(".venv/bin/", f"{bin_dir}/")
    for port in ("54321", "54322"):
        script = script.replace(port, str(free_port()))
    try:
        done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=540)
    finally:  # the servers must not outlive a failed run
        for server in ("pg/source", "pg/replica"):
            subprocess.run([sys.executable, "-m", "changefeed.local.postgres", "stop", str(tmp_path / server)],
                           capture_output=True)
    out = f"--- stdout:\n{done.stdout}\n--- stderr:\n{done.stderr}"
    assert done.returncode == 0, out
    assert re.search(r"^\s*1000 \|\s+100000$", done.stdout, re.M), f"the replica does not hold the rows: {out}"
    assert "lag bytes: 0\n" in done.stdout and "lag seconds: 0.0\n" in done.stdout, f"status is not caught up: {out}"
    noise = [line for line in (done.stdout + done.stderr).splitlines() if any(n in line for n in SPARK_NOISE)]
    assert not noise, f"Spark's or the JVM's lines on the console: {noise}\n{out}"
    assert (tmp_path / "changefeed-state").exists() and not (tmp_path / "changefeed-state" / "first").exists()
