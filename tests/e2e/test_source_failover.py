"""Failover of the source (issue 39): the feed's slot is a failover slot, synchronized to a physical
standby; the primary crashes (its postmaster and all its processes SIGKILLed) while the active
runner is SIGKILLed too, the standby is promoted, and a standby runner whose --source names both
servers (target_session_attrs=read-write) takes the feed over on the new primary from the
synchronized slot: no snapshot again, nothing lost or applied twice, no transfer ever half applied,
with either WAL reader. The replica ends equal to what the new primary holds (the commits the old
primary never shipped are in neither)."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import psycopg
import pytest

from changefeed.local.postgres import LocalPostgres
from support.feeds import assert_no_traceback, start_changefeed, wait_for
from support.servers import Dbs, fingerprint
from support.writers import WRITE_PAUSE, writing

pytestmark = pytest.mark.timeout(900)

ACCOUNTS, BALANCE, AMOUNT = 40, 1000, 3
LEAP = 100_000  # ledger rows the writer skips when it reconnects (to the new primary)
PHYSICAL_SLOT = "failover_standby"
DB = "shop"


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[LocalPostgres, LocalPostgres]]:
    """A primary and its hot standby, which keeps a synchronized copy of every failover slot
    (sync_replication_slots; dbname in primary_conninfo): the primary's logical decoding waits
    for the standby's physical slot (synchronized_standby_slots), so no change reaches a feed
    before the standby has it."""
    primary = LocalPostgres.start(tmp_path / "primary")
    standby: LocalPostgres | None = None
    try:
        standby = primary.standby(tmp_path / "standby", PHYSICAL_SLOT)
        with psycopg.connect(primary.uri(), autocommit=True) as c:
            # (after the base backup: the standby, once promoted, has no standby of its own to wait for)
            c.execute(f"ALTER SYSTEM SET synchronized_standby_slots = '{PHYSICAL_SLOT}'")
            c.execute("SELECT pg_reload_conf()")
            c.execute(f"CREATE DATABASE {DB}")
        yield primary, standby
    finally:
        for server in (standby, primary):
            if server is not None:
                server.stop("immediate")


def _both(primary: LocalPostgres, standby: LocalPostgres) -> str:
    """A URI that reaches whichever of the two servers is the primary."""
    return (f"postgresql://postgres:{primary.password}@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/{DB}"
            "?target_session_attrs=read-write&connect_timeout=3")


def _crash(server: LocalPostgres) -> None:
    """SIGKILL the server's postmaster and each of its processes (every backend is a process group of
    its own): a host that dies, nothing left behind to write, answer or ship WAL. The postmaster is
    stopped first, so none of them sees it die and no new one starts meanwhile."""
    pid = int((server.datadir / "postmaster.pid").read_text().split()[0])
    os.kill(pid, signal.SIGSTOP)
    for child in _children(pid):
        with suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError):
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def _moving_money_across_failover(uri: str, stop: threading.Event, written: list[int]) -> None:
    """A `writing` worker: as support.writers.moving_money (transaction n appends ledger row n and moves
    AMOUNT between two accounts), reconnecting to whichever server is the primary. After a
    reconnection it goes on LEAP rows past the last one that server holds: the commits the old
    primary had not shipped when it died are gone, and a replica that got one anyway keeps a row
    no later transaction overwrites. `written` = [n]."""
    leap = 0
    while not stop.is_set():
        try:
            with psycopg.connect(uri, autocommit=True) as c:
                n = _value(c, "SELECT coalesce(max(id), 0) FROM ledger") + leap
                leap = LEAP
                while not stop.is_set():
                    n += 1
                    with c.transaction():
                        c.execute("INSERT INTO ledger (id, v) VALUES (%s, %s)", (n, f"entry {n}"))
                        c.execute("UPDATE accounts SET balance = balance - %s WHERE id = %s", (AMOUNT, n % ACCOUNTS))
                        c.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s",
                                  (AMOUNT, (n * 7 + 1) % ACCOUNTS))
                    written[:] = [n]
                    time.sleep(WRITE_PAUSE)
        except psycopg.OperationalError:
            time.sleep(0.2)  # no primary yet


def _value(c: psycopg.Connection[Any], query: str, *args: object) -> Any:
    """The one value `query` gives."""
    row = c.execute(query, args).fetchone()
    assert row is not None, query
    return row[0]


def _one(uri: str, query: str, *args: object) -> tuple[Any, ...] | None:
    with psycopg.connect(uri, autocommit=True) as c:
        return c.execute(query, args).fetchone()


def _replicated(dbs: Dbs) -> int:
    """The last ledger row on the replica."""
    with psycopg.connect(dbs.sink) as d:
        if _value(d, "SELECT to_regclass('public.ledger') IS NULL"):
            return 0
        return int(_value(d, "SELECT coalesce(max(id), 0) FROM ledger"))


def _money_whole(uri: str) -> None:
    """The database, at whatever batch it is, never holds a transfer in half."""
    with psycopg.connect(uri) as d:
        total = d.execute("SELECT sum(balance), count(*) FROM accounts").fetchone()
    assert total == (ACCOUNTS * BALANCE, ACCOUNTS), total


def _chunks(dbs: Dbs) -> tuple[Any, ...] | None:
    return _one(dbs.sink, "SELECT count(*), count(DISTINCT table_name) FROM changefeed.snapshot_chunks "
                "WHERE feed = %s", dbs.name)


def _stop_all(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


@pytest.mark.parametrize("wal_reader", ["peek", "stream"])
def test_a_primary_crash_and_promotion_during_a_runner_takeover(dbs: Dbs, tmp_path: Path, wal_reader: str,
                                                                 pair: tuple[LocalPostgres, LocalPostgres]) -> None:
    primary, standby = pair
    source = _both(primary, standby)
    with psycopg.connect(primary.uri(DB), autocommit=True) as c:
        c.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        c.execute("INSERT INTO accounts SELECT g, %s FROM generate_series(0, %s) g", (BALANCE, ACCOUNTS - 1))
        c.execute("CREATE TABLE ledger (id bigint PRIMARY KEY, v text)")
    slot = f"changefeed_{dbs.name}"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    written: list[int] = [0]
    runners: list[subprocess.Popen[bytes]] = []
    try:
        with writing(_moving_money_across_failover, source, written):
            runners.append(start_changefeed("run", "--name", dbs.name, "--state", str(tmp_path / "host-a"),
                                            "--source", source, "--sink", dbs.sink, "--tables",
                                            "public.accounts,public.ledger", "--lease", "3s", "--wal-reader",
                                            wal_reader, log=logs[0]))
            wait_for("rows on the replica", lambda: _replicated(dbs) > 50, logs[0])
            assert _one(primary.uri(), "SELECT failover, synced FROM pg_replication_slots WHERE slot_name = %s",
                        slot) == (True, False)
            runners.append(start_changefeed("run", "--standby", "--name", dbs.name, "--state",
                                            str(tmp_path / "host-b"), "--source", source, log=logs[1]))
            wait_for("the standby runner to wait", lambda: "standing by; active: pid " in logs[1].read_text(),
                     logs[1])
            # the standby keeps a copy of the slot (a persistent one: a temporary copy is dropped at promotion)
            # that has followed the feed's progress
            moved = _one(primary.uri(), "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s",
                         slot)
            assert moved is not None
            wait_for("the slot synchronized to the standby", lambda: _one(
                standby.uri(), "SELECT synced AND NOT temporary AND failover AND confirmed_flush_lsn >= %s "
                "FROM pg_replication_slots WHERE slot_name = %s", moved[0], slot) == (True,), logs[0], timeout=90)
            chunks = _chunks(dbs)
            assert chunks == (2, 2), chunks  # the snapshot is read

            # the crash: the primary host and the active runner at once
            _crash(primary)
            os.killpg(runners[0].pid, signal.SIGKILL)
            runners[0].wait()
            killed, at_crash, wrote = time.monotonic(), _replicated(dbs), written[0]
            time.sleep(1)  # (a failover manager notices the primary gone)
            standby.promote()
            new_primary = standby.uri(DB)
            first = wait_for("the writer on the new primary", lambda: _one(
                new_primary, "SELECT min(id) FROM ledger WHERE id > %s", LEAP)[0], logs[1])  # type: ignore[index]
            kept = first - LEAP - 1  # the last row of the old primary that the new one has
            print(f"crash: the writer at row {wrote}, the replica at {at_crash}, the new primary kept {kept}")

            wait_for("the standby runner to take over", lambda: "taking the feed over" in logs[1].read_text(),
                     logs[1], timeout=120)
            wait_for("rows written on the new primary on the replica", lambda: _replicated(dbs) > first + 50,
                     logs[1], timeout=180)
            print(f"{time.monotonic() - killed:.1f}s from the crash to rows of the new primary on the replica")
            _money_whole(dbs.sink)
        # the writer stopped: the replica catches up with the new primary
        wait_for("the replica to catch up", lambda: fingerprint(new_primary, "public.ledger")
                 == fingerprint(dbs.sink, "public.ledger"), logs[1], timeout=180)
        runners[1].send_signal(signal.SIGTERM)
        assert runners[1].wait(timeout=120) == 0, logs[1].read_text()[-3000:]
    finally:
        _stop_all(*runners)
    assert fingerprint(new_primary, "public.accounts") == fingerprint(dbs.sink, "public.accounts")
    _money_whole(new_primary)
    _money_whole(dbs.sink)
    assert _chunks(dbs) == chunks, "the snapshot was read again after the failover"
    # the feed read the slot the standby synchronized (still marked so), not one made anew
    assert _one(new_primary, "SELECT synced, failover FROM pg_replication_slots WHERE slot_name = %s",
                slot) == (True, True)
    batches = _one(dbs.sink, "SELECT count(*), count(DISTINCT end_lsn) FROM changefeed.progress WHERE feed = %s",
                   dbs.name)
    assert batches is not None and batches[0] == batches[1], f"a batch was recorded twice: {batches}"
    for log in logs:
        assert_no_traceback(log.read_text())
