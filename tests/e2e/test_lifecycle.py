"""A feed's life through the CLI: create, list, run, pause (slot holds), resume (catches up), remove."""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from conftest import Dbs, changefeed_cli, fingerprint, start_changefeed

pytestmark = pytest.mark.timeout(600)


def listed(state: str) -> dict[str, str]:
    out = changefeed_cli("list", "--state", state, "--json")
    assert out.returncode == 0, out.stderr
    return {f["name"]: f["state"] for f in json.loads(out.stdout)}


def slot_and_publication(dbs: Dbs) -> tuple[object, object]:
    with dbs.src() as c:
        slot = c.execute("SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s",
                         (f"changefeed_{dbs.name}",)).fetchone()
        pub = c.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (f"changefeed_{dbs.name}",)).fetchone()
    return slot, pub


def wait_until(what: str, check, log: Path, timeout: float = 180) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.3)


def test_create_list_pause_resume_remove(dbs: Dbs, tmp_path: Path) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        c.execute("INSERT INTO t SELECT g, 'old' FROM generate_series(1, 100) g")
    state = str(tmp_path / "state")
    name = ["--name", dbs.name, "--state", state]
    created = changefeed_cli("create", *name, "--source", dbs.source, "--sink", dbs.sink, "--tables", "public.t")
    assert created.returncode == 0, created.stderr
    slot, pub = slot_and_publication(dbs)
    assert slot is not None and pub is not None
    assert listed(state) == {dbs.name: "stopped"}
    again = changefeed_cli("create", *name, "--source", dbs.source, "--sink", dbs.sink, "--tables", "public.t")
    assert again.returncode == 64 and "already exists" in again.stderr

    log = tmp_path / "run.log"
    p = start_changefeed("run", *name, log=log)
    equal = lambda: fingerprint(dbs.source, "public.t") == fingerprint(dbs.sink, "public.t")  # noqa: E731
    try:
        wait_until("the snapshot", equal, log)
        assert listed(state)[dbs.name].startswith("running (pid ")
        busy = changefeed_cli("remove", *name)
        assert busy.returncode == 2 and "is running" in busy.stderr, busy.stderr
        paused = changefeed_cli("pause", *name)
        assert paused.returncode == 0, paused.stderr
        assert p.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    assert "paused" in log.read_text()
    assert listed(state) == {dbs.name: "paused"}
    refused = changefeed_cli("run", *name, "--available-now")
    assert refused.returncode == 64 and "paused" in refused.stderr and "resume" in refused.stderr

    held = slot_and_publication(dbs)[0]
    with dbs.src() as c:
        c.execute("UPDATE t SET v = 'while paused' WHERE id <= 50")
        c.execute("INSERT INTO t SELECT g, 'new' FROM generate_series(101, 150) g")
    time.sleep(2)
    assert slot_and_publication(dbs)[0] == held  # paused: the slot stays where the replica is
    assert not equal()
    resumed = changefeed_cli("resume", *name, "--available-now")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert equal()
    assert listed(state) == {dbs.name: "stopped"}

    removed = changefeed_cli("remove", *name)
    assert removed.returncode == 0, removed.stderr
    assert slot_and_publication(dbs) == (None, None)
    assert listed(state) == {}
    with dbs.dst() as d:
        assert d.execute("SELECT count(*) FROM changefeed.progress WHERE feed = %s", (dbs.name,)).fetchone() == (0,)
        assert d.execute("SELECT count(*) FROM t").fetchone() == (150,)  # the replica's data stays


def test_paused_feed_past_its_wal_budget_fails_with_the_documented_error(dbs: Dbs, tmp_path: Path) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    state = str(tmp_path / "state")
    name = ["--name", dbs.name, "--state", state]
    first = changefeed_cli("run", *name, "--source", dbs.source, "--sink", dbs.sink, "--tables", "public.t",
                           "--max-retained-wal", "1MB", "--available-now")
    assert first.returncode == 0, first.stderr[-3000:]
    assert changefeed_cli("pause", *name).returncode == 0
    with dbs.src() as c:
        c.execute("INSERT INTO t SELECT g, repeat('x', 200) FROM generate_series(1, 20000) g")  # ~5 MB of WAL
    resumed = changefeed_cli("resume", *name, "--available-now")
    slot = f"changefeed_{dbs.name}"
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    for mention in ("past its retention budget", slot, "--max-retained-wal", "changefeed remove", "0/"):
        assert mention in resumed.stderr, (mention, resumed.stderr)
    assert "Traceback" not in resumed.stderr
    status = changefeed_cli("status", *name, "--json")
    assert json.loads(status.stdout)["state"].startswith("failed: feed"), status.stdout
    assert listed(state)[dbs.name].startswith("failed: ")
    assert slot_and_publication(dbs)[0] is not None  # never dropped silently

    bigger = changefeed_cli("run", *name, "--max-retained-wal", "1GB", "--available-now")  # the operator's call
    assert bigger.returncode == 0, bigger.stderr[-3000:]
    assert fingerprint(dbs.source, "public.t") == fingerprint(dbs.sink, "public.t")
    assert listed(state) == {dbs.name: "stopped"}
