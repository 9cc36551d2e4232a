"""Two-phase commit against a real server: the prepare slot's scan, the slot without two-phase
decoding that delivers a prepared part at its COMMIT PREPARED wherever it was at the PREPARE, and
the builder's check of the parts a plan put in a window."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from changefeed.core import distributed as dist
from changefeed.core.lsn import format_lsn
from changefeed.errors import SourceNotReady, TornTransaction
from changefeed.postgres import consistent_point, twophase
from changefeed.postgres import slots as pgslots
from changefeed.postgres import source as src
from changefeed.postgres.decode.builder import ChangeBuilder
from changefeed.postgres.source import column_catalog
from support.servers import Dbs


@pytest.fixture
def slots(dbs: Dbs) -> Iterator[tuple[psycopg.Connection[Any], int]]:
    """The prepare slot `p2`, then the data slot `s` (as a feed of several nodes creates them)."""
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        c.execute("CREATE TABLE other (id int PRIMARY KEY)")
        c.execute("CREATE PUBLICATION p FOR TABLE t")
        pgslots.create_slot(c, "p2", two_phase=True)
        start = pgslots.create_slot(c, "s")
        yield c, start
        for (gid,) in c.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()").fetchall():
            c.execute(f"ROLLBACK PREPARED '{gid}'")


def prepared(c: psycopg.Connection[Any], gid: str, *ids: int, table: str = "t") -> None:
    c.execute("BEGIN")
    for i in ids:
        c.execute(f"INSERT INTO {table} VALUES (%s{', %s' if table == 't' else ''})",
                  (i, gid) if table == "t" else (i,))
    c.execute(f"PREPARE TRANSACTION '{gid}'")


def window(c: psycopg.Connection[Any], start: int, end: int,
           planned: dict[int, tuple[str, int]] | None = None) -> tuple[list[bytes], ChangeBuilder]:
    builder = ChangeBuilder(start, end, 0, 1 << 60, lambda rel: column_catalog(c, rel), prepared=planned)
    with psycopg.connect(c.info.dsn, password=c.info.password) as reader:
        batches = list(builder.batches(src.peek(reader, "s", "p", end)))
    return [r["after"] for b in batches for r in b.to_pylist() if r["op"] == "c"], builder


def test_the_scan_shows_commits_and_two_phase_records_by_gid(slots: Any) -> None:
    c, start = slots
    c.execute("INSERT INTO t VALUES (1, 'plain'), (2, 'plain')")
    prepared(c, "g1", 3, 4)
    prepared(c, "g2", 5)
    prepared(c, "empty", 1, table="other")  # a part with nothing captured
    c.execute("ROLLBACK PREPARED 'g2'")
    c.execute("INSERT INTO other VALUES (2)")  # a commit of nothing captured: not shown
    c.execute("COMMIT PREPARED 'g1'")
    prepared(c, "g2", 6)  # the gid again, after its rollback
    c.execute("COMMIT PREPARED 'empty'")
    end = src.heartbeat(c, "test")[0]
    events = twophase.scan(c, "p2", "p", start, end)
    # (`changes` counts the messages a transaction carries: its rows, and a table's description first)
    assert [(e.kind, e.gid, e.changes) for e in events] == [
        (dist.COMMIT, "", 3), (dist.PREPARE, "g1", 2), (dist.PREPARE, "g2", 1), (dist.PREPARE, "empty", 0),
        (dist.ROLLBACK_PREPARED, "g2", 0), (dist.COMMIT_PREPARED, "g1", 0), (dist.PREPARE, "g2", 1),
        (dist.COMMIT_PREPARED, "empty", 0)]
    assert [e.start for e in events] == sorted(e.start for e in events) and all(start <= e.start < end for e in events)
    assert all(e.time_us > 1.7e15 for e in events)  # Unix µs
    g1 = [e for e in events if e.gid == "g1"]
    assert g1[0].xid == g1[1].xid

    # the data slot, moved past g1's PREPARE, still delivers g1's rows at its COMMIT PREPARED
    commit = g1[1]
    c.execute("SELECT pg_replication_slot_advance('s', %s::pg_lsn)", (format_lsn(commit.start),))
    rows, builder = window(c, commit.start, end, {commit.start: ("g1", commit.xid)})
    assert rows == [b"3\tg1", b"4\tg1"] and builder.gids == [["g1", commit.xid]]
    # a window starting inside a scan's range: only what starts at or after its start
    assert [e.gid for e in twophase.scan(c, "p2", "p", commit.start, end)] == ["g1", "g2", "empty"]


def test_a_planned_part_the_window_does_not_hold_stops_the_batch(slots: Any) -> None:
    c, start = slots
    prepared(c, "g", 1)
    c.execute("COMMIT PREPARED 'g'")
    end = src.heartbeat(c, "test")[0]
    (_, commit) = twophase.scan(c, "p2", "p", start, end)
    with pytest.raises(TornTransaction, match="xid"):  # the plan named another transaction there
        window(c, start, end, {commit.start: ("g", commit.xid + 1)})
    with pytest.raises(TornTransaction, match="holds no commit of it"):
        window(c, start, end, {commit.start + 8: ("g", commit.xid)})


def test_a_scan_up_to_a_position_inside_a_record_counts_the_record(slots: Any) -> None:
    c, start = slots
    prepared(c, "big", *range(1, 300))  # a PREPARE after many records; cut the scan inside the record
    end = src.heartbeat(c, "test")[0]
    (prepare,) = twophase.scan(c, "p2", "p", start, end)
    inside = twophase.scan(c, "p2", "p", start, prepare.start + 4)
    assert [e.gid for e in inside] == ["big"]
    assert twophase.scan(c, "p2", "p", start, prepare.start) == ()
    c.execute("COMMIT PREPARED 'big'")


def test_a_consistent_point_waits_for_a_prepared_transaction_then_names_it(slots: Any) -> None:
    c, _ = slots
    prepared(c, "stuck", 1)
    began = time.monotonic()
    with pytest.raises(SourceNotReady, match="'stuck'") as e:
        consistent_point.take(c.info.dsn + f" password={c.info.password}", wait_prepared_s=1)
    assert 1 <= time.monotonic() - began < 10 and "COMMIT PREPARED" in e.value.hint
    threading.Timer(0.5, lambda: psycopg.connect(c.info.dsn, password=c.info.password, autocommit=True).execute(
        "COMMIT PREPARED 'stuck'")).start()
    point = consistent_point.take(c.info.dsn + f" password={c.info.password}", wait_prepared_s=30)
    point.close()
