"""Feeds run as users run them: `python -m changefeed` processes, their logs, their kills."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest


def planned(checkpoint: Path, batch: int, end: dict[str, Any], committed: bool = True) -> None:
    """What Spark's offset and commit logs hold after planning (and committing) batch `batch`
    that ends at offset `end` (its JSON)."""
    for log in ("offsets", "commits"):
        (checkpoint / log).mkdir(parents=True, exist_ok=True)
    (checkpoint / "offsets" / str(batch)).write_text('v1\n{"batchWatermarkMs":0}\n' + json.dumps(end))
    if committed:
        (checkpoint / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}')


def wait_for(what: str, check: Callable[[], Any], log: Path, timeout: float = 180) -> Any:
    """Poll `check` until it returns something truthy (returned); past `timeout`, fail with the feed's log."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}; feed log:\n{log.read_text()[-3000:]}"
        time.sleep(0.3)
    return got


def assert_no_traceback(text: str) -> None:
    """No raw traceback reached the console; on failure, show the first one whole."""
    at = text.find("Traceback")
    assert at < 0, f"a traceback on the console:\n{text[max(0, at - 1500):at + 4000]}"


def changefeed_cli(*args: str, timeout: float = 600, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run `python -m changefeed ARGS` as its own process; returns the completed process."""
    return subprocess.run([sys.executable, "-m", "changefeed", *args], capture_output=True, text=True,
                          timeout=timeout, **kwargs)  # type: ignore[call-overload]


def status_of(name: str, state: Path | str) -> dict[str, Any]:
    """What `changefeed status --name NAME --state STATE --json` prints, read in this process: a
    poll costs no Python start of its own."""
    import json

    from changefeed.control.status import status
    from changefeed.spec.state import FeedState

    feed = FeedState(state, name)
    spec = feed.load()
    assert spec is not None, f"no feed {name} under {state}"
    return dict(json.loads(json.dumps(status(spec, feed).__dict__)))


def start_changefeed(*args: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start `python -m changefeed ARGS` in its own process group (so a test can SIGKILL all of it)."""
    out = open(log, "ab")
    return subprocess.Popen([sys.executable, "-m", "changefeed", *args], stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, **(env or {})})


def killed_by_fault(p: subprocess.Popen[bytes], log: Path, timeout: float = 300) -> None:
    """Wait for a feed started with `CHANGEFEED_KILL_AT` to die of it; if it does not in time, kill
    it and fail with the end of its log (what it was doing instead)."""
    try:
        code = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        pytest.fail(f"the feed did not reach its fault point in {timeout:.0f} s:\n{log.read_text()[-5000:]}")
    assert code == -signal.SIGKILL, log.read_text()[-3000:]


def kill_runs(base: list[str], kills: list[str], tmp_path: Path, random_after: tuple[float, float]) -> None:
    """Run the feed (`base` args) once per kill point, each killed there by its fault point
    (CHANGEFEED_KILL_AT), or for "random" SIGKILLed after a random time in `random_after`."""
    import signal

    for i, point in enumerate(kills):
        fault_dir = tmp_path / f"faults{i}"
        fault_dir.mkdir()
        env = {} if point == "random" else {"CHANGEFEED_KILL_AT": point, "CHANGEFEED_FAULT_DIR": str(fault_dir)}
        p = start_changefeed(*base, log=tmp_path / f"run{i}.log", env=env)
        if point == "random":
            time.sleep(random.uniform(*random_after))
            os.killpg(p.pid, signal.SIGKILL)
        rc = p.wait(timeout=300)
        assert rc == -signal.SIGKILL, (point, (tmp_path / f"run{i}.log").read_text()[-3000:])
        time.sleep(0.5)  # let the killed group's sockets close


def processes() -> dict[int, tuple[int, str]]:
    """Every process now (from /proc): pid -> (parent pid, command line); one gone meanwhile is left out."""
    found: dict[int, tuple[int, str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        found[int(stat.parent.name)] = (parent, cmd)
    return found


def process_tree(root: int, procs: dict[int, tuple[int, str]] | None = None) -> dict[int, str]:
    """`root` and every process under it (as a service manager's control group holds them): pid ->
    command line, from `procs` (`processes()`, read now by default)."""
    procs = processes() if procs is None else procs
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in procs.items():
        children.setdefault(parent, []).append(pid)
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in procs:
            found[pid] = procs[pid][1]
        todo.extend(children.get(pid, []))
    return found


def kill_group(p: subprocess.Popen[bytes]) -> None:
    """SIGKILL a runner started by start_changefeed, its whole process group (JVM, workers), and reap it."""
    with suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def kill_running(procs: list[subprocess.Popen[bytes]]) -> None:
    """kill_group each of `procs` still running (a test's clean-up)."""
    for p in procs:
        if p.poll() is None:
            kill_group(p)
