"""Two-phase decoding against a real server: the messages, the planner's scan, and the builder's
rule (a prepared part is delivered at its COMMIT PREPARED inside the window, held otherwise)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import Dbs

from changefeed.core import distributed as dist
from changefeed.core.lsn import format_lsn
from changefeed.postgres import source as src
from changefeed.postgres import twophase
from changefeed.postgres.changes import ChangeBuilder
from changefeed.postgres.source import column_catalog


@pytest.fixture
def slot(dbs: Dbs) -> Iterator[tuple[psycopg.Connection[Any], int]]:
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        c.execute("CREATE PUBLICATION p FOR TABLE t")
        start = src.create_slot(c, "s", two_phase=True)
        yield c, start
        for (gid,) in c.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()").fetchall():
            c.execute(f"ROLLBACK PREPARED '{gid}'")


def prepared(c: psycopg.Connection[Any], gid: str, *ids: int) -> None:
    c.execute("BEGIN")
    for i in ids:
        c.execute("INSERT INTO t VALUES (%s, %s)", (i, gid))
    c.execute(f"PREPARE TRANSACTION '{gid}'")


def window(c: psycopg.Connection[Any], start: int, end: int) -> tuple[list[tuple[Any, ...]], ChangeBuilder]:
    builder = ChangeBuilder(start, end, 0, 1 << 60, lambda rel: column_catalog(c, rel))
    with psycopg.connect(c.info.dsn, password=c.info.password) as reader:
        batches = list(builder.batches(src.peek(reader, "s", "p", end)))
    rows = [r for b in batches for r in b.to_pylist() if r["op"] == "c"]
    return [(r["after"], r["lsn"]) for r in rows], builder


def test_prepared_parts_are_delivered_at_their_commit_and_held_until_then(slot: Any) -> None:
    c, start = slot
    prepared(c, "g1", 1, 2)
    c.execute("INSERT INTO t VALUES (3, 'plain')")
    prepared(c, "g2", 4)
    prepared(c, "g3", 5)
    c.execute("ROLLBACK PREPARED 'g2'")
    c.execute("COMMIT PREPARED 'g1'")
    end = src.heartbeat(c, "test")[0]

    events = twophase.events(c, "s", "p", end)
    kinds = [(e.kind, e.gid) for e in events]
    assert kinds == [("prepare", "g1"), ("prepare", "g2"), ("prepare", "g3"), ("rollback", "g2"), ("commit", "g1")]
    commit = events[-1]

    rows, builder = window(c, start, end)
    # the plain insert first, then g1's rows at its COMMIT PREPARED; g2 nothing; g3 held
    assert [a for a, _ in rows] == [b"3\tplain", b"1\tg1", b"2\tg1"]
    assert rows[1][1] == commit.start and builder.gids.keys() == {"g1"} and builder.held == ["g3"]

    # cut before g1's commit: g1 is held too; the next window (slot at g1's PREPARE) delivers it
    rows, builder = window(c, start, commit.start)
    assert [a for a, _ in rows] == [b"3\tplain"] and builder.held == ["g1", "g3"]
    hold = dist.hold(dist.NodeWindow(start, commit.start, end, end, events))
    assert hold == events[0].start  # g1's PREPARE
    c.execute("SELECT pg_replication_slot_advance('s', %s::pg_lsn)", (format_lsn(hold),))
    rows, builder = window(c, commit.start, end)
    assert [a for a, _ in rows] == [b"1\tg1", b"2\tg1"] and builder.held == ["g3"]

    c.execute("COMMIT PREPARED 'g3'")
    later = src.heartbeat(c, "test")[0]
    rows, builder = window(c, end, later)
    assert [a for a, _ in rows] == [b"5\tg3"] and builder.gids.keys() == {"g3"} and not builder.held
