"""A feed's life through the CLI: create, list, run, pause (slot holds), resume (catches up), remove."""
from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from changefeed.local.postgres import LocalPostgres
from support.feeds import changefeed_cli, start_changefeed, wait_for
from support.servers import Dbs, fingerprint

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


@pytest.mark.usefixtures("warm_spark")
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
        wait_for("the snapshot", equal, log)
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


@pytest.fixture
def quiet_source(servers: tuple[LocalPostgres, LocalPostgres], tmp_path: Path) -> Iterator[Dbs]:
    """A source server of its own: a slot holds the whole server's WAL, and on the shared source
    other tests' databases add to it (autovacuum after a big load writes megabytes), which a
    budget of 1MB cannot tell from this test's own."""
    source = LocalPostgres.start(tmp_path / "quiet")
    try:
        name = f"quiet_{os.getpid()}"
        with psycopg.connect(servers[1].uri(), autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
        yield Dbs(source.uri(), servers[1].uri(name), name)
    finally:
        source.stop("immediate")


@pytest.mark.usefixtures("warm_spark")
def test_paused_feed_past_its_wal_budget_fails_with_the_documented_error(quiet_source: Dbs, tmp_path: Path) -> None:
    dbs = quiet_source
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


def test_slot_invalidated_by_postgres_stops_the_running_feed(servers: tuple[LocalPostgres, LocalPostgres],
                                                              tmp_path: Path) -> None:
    """A source that caps slot WAL (max_slot_wal_keep_size) removes WAL the idle feed still needs:
    the running feed stops with the documented error, later runs refuse, remove cleans up."""
    source = LocalPostgres.start(tmp_path / "capped", settings={"max_slot_wal_keep_size": "1MB"})
    try:
        name = "capped"
        with psycopg.connect(servers[1].uri(), autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}_{os.getpid()}")
        sink = servers[1].uri(f"{name}_{os.getpid()}")
        with psycopg.connect(source.uri(), autocommit=True) as c:
            c.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
            c.execute("INSERT INTO t SELECT g, 'x' FROM generate_series(1, 10) g")
        state, log = str(tmp_path / "state"), tmp_path / "feed.log"
        args = ["--name", name, "--state", state]
        # one batch, then none for an hour: the slot stays where that batch left it
        proc = start_changefeed("run", *args, "--source", source.uri(), "--sink", sink, "--tables", "public.t",
                                "--trigger-interval", "3600", log=log)
        try:
            def applied() -> bool:
                with psycopg.connect(sink) as d:
                    if d.execute("SELECT to_regclass('changefeed.progress')").fetchone() == (None,):
                        return False
                    return d.execute("SELECT count(*) FROM changefeed.progress").fetchone() != (0,)
            wait_for("the first batch", applied, log)
            with psycopg.connect(source.uri(), autocommit=True) as c:
                for i in range(3):  # three WAL segments further on, then a checkpoint removes the old ones
                    c.execute("INSERT INTO t VALUES (%s, 'y')", (100 + i,))
                    c.execute("SELECT pg_switch_wal()")
                c.execute("CHECKPOINT")
                lost = c.execute("SELECT wal_status, invalidation_reason FROM pg_replication_slots "
                                 "WHERE slot_name = %s", (f"changefeed_{name}",)).fetchone()
            assert lost == ("lost", "wal_removed"), f"the test did not get PostgreSQL to invalidate the slot: {lost}"
            assert proc.wait(timeout=60) == 2, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        out = log.read_text()
        with psycopg.connect(sink) as d:
            (checkpoint,) = d.execute("SELECT max(end_lsn)::text FROM changefeed.progress").fetchone()  # type: ignore[misc]
        for mention in ("invalidated by PostgreSQL", "wal_removed", f"changefeed_{name}", f"checkpoint at {checkpoint}",
                        f"changefeed remove --name {name}", "fresh snapshot"):
            assert mention in out, (mention, out[-3000:])
        # our error ends the output (Spark may log its own shutdown noise before it)
        assert out.rstrip().splitlines()[-2].startswith("changefeed: error: replication slot"), out[-3000:]
        status = json.loads(changefeed_cli("status", *args, "--json").stdout)
        assert status["state"].startswith("failed: replication slot") and "invalidated" in status["slot_state"], status
        again = changefeed_cli("run", *args)  # refused before Spark starts; the slot is not re-created
        assert again.returncode == 2 and "invalidated by PostgreSQL" in again.stderr, again.stderr[-3000:]
        removed = changefeed_cli("remove", *args)
        assert removed.returncode == 0, removed.stderr
        with psycopg.connect(source.uri()) as c:
            assert c.execute("SELECT count(*) FROM pg_replication_slots").fetchone() == (0,)
    finally:
        source.stop("immediate")
