"""Read-ahead (postgres/read_ahead.py): the next window decoded into a spool file while the sink
applies this one must be exactly what the window's task would have peeked from the feed's slot,
must leave that slot where it is, and must never be taken for another window or when partial.
"""
from __future__ import annotations

import fcntl
import itertools
import os
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from changefeed.postgres import read_ahead, slots
from changefeed.postgres import source as src
from changefeed.postgres.connect import connect
from changefeed.postgres.decode.builder import HEARTBEAT_PREFIX, ChangeBuilder
from changefeed.postgres.wal_reader import wal_reader
from changefeed.spec.definition import SourceNode
from support.servers import Dbs
from support.windows import decoded

pytestmark = pytest.mark.timeout(600)

_tails = itertools.count(1)
NODE = SourceNode("n1", "postgresql://u@127.0.0.1:1/db", "s", "p")


@pytest.fixture(autouse=True)
def spool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(read_ahead, "SPOOL", tmp_path / "spool")
    return tmp_path / "spool"


@given(st.lists(st.lists(st.binary(max_size=300), max_size=40), max_size=8))
def test_blocks_come_back_as_they_were_written(blocks: list[list[bytes]]) -> None:
    import io

    out = io.BytesIO()
    read_ahead.write_blocks(out, iter(blocks))
    assert list(read_ahead.read_blocks(io.BytesIO(out.getvalue()))) == blocks


@given(end=st.integers(0, 1 << 40), more=st.integers(0, 1 << 31), later=st.integers(0, 1 << 30),
       max_bytes=st.sampled_from([0, 1, 8191, 8192, 65536, 1 << 20, 64 << 20, 1 << 30]), fixed=st.booleans())
def test_a_prediction_is_the_cut_the_planner_makes_next(end: int, more: int, later: int, max_bytes: int,
                                                        fixed: bool) -> None:
    """Whatever the planner sees next (a frontier at least as far on, the same one in an
    AvailableNow run), a predicted window end is where it cuts the window from `end`."""
    reader = wal_reader("peek")
    reader._layout = (8192, 16 << 20)  # as after the first byte-limit cut
    frontier = end + more
    predicted = read_ahead.predict(end, frontier, max_bytes, reader.block_size, fixed)
    event("no certain cut" if predicted is None else "a cut predicted")
    assume(predicted is not None)  # (about 40% of the examples; test_no_prediction_without_a_certain_cut has them)
    seen_next = frontier if fixed else frontier + later
    cut = reader.cut(None, NODE, end, seen_next, max_bytes=max_bytes)  # type: ignore[arg-type]
    assert predicted == cut
    assert end < predicted <= frontier and predicted - end <= read_ahead.MAX_WINDOW_BYTES


def test_no_prediction_without_a_certain_cut() -> None:
    assert read_ahead.predict(100, 100, 8192, 8192, True) is None  # nothing after the window
    assert read_ahead.predict(100, 5000, 8192, 8192, False) is None  # the next frontier decides
    assert read_ahead.predict(100, 5000, 0, 8192, False) is None  # no limit: the same
    assert read_ahead.predict(100, 5000, 8192, 0, False) is None  # page size not known yet
    huge = read_ahead.MAX_WINDOW_BYTES + 8192
    assert read_ahead.predict(0, 2 * huge, huge, 8192, False) is None  # too long a window to spool
    assert read_ahead.predict(0, huge, 0, 8192, True) is None


def test_only_the_exact_whole_window_is_taken_and_only_once(spool: Path) -> None:
    spool.mkdir()
    path = read_ahead._path(NODE, 100, 200)
    with open(path, "wb") as f:
        read_ahead.write_blocks(f, iter([[b"a", b"bc"]]))
    assert read_ahead.take(NODE, 100, 300) is None  # another window (planned otherwise)
    assert read_ahead.take(SourceNode("n1", NODE.uri, "other", "p"), 100, 200) is None  # another slot
    got = read_ahead.take(NODE, 100, 200)
    assert got is not None and list(got) == [[b"a", b"bc"]]
    assert read_ahead.take(NODE, 100, 200) is None and not path.exists()  # once

    # a read-ahead whose process died left a partial file: never taken, and removed
    partial = path.with_suffix(".part")
    partial.write_bytes(b"\x05\x00")
    assert read_ahead.take(NODE, 100, 200) is None and not partial.exists()

    # the windows before the one read are forgotten (no later batch reads them)
    old, new = read_ahead._path(NODE, 50, 100), read_ahead._path(NODE, 300, 400)
    old.write_bytes(b"")
    new.write_bytes(b"")
    assert read_ahead.take(NODE, 200, 300) is None
    assert not old.exists() and new.exists()

    # any feed's reads sweep away files nobody took for STALE_S (a feed stopped or removed since)
    other = read_ahead._path(SourceNode("n2", "postgresql://u@h/other", "s2", "p2"), 100, 200)
    other.write_bytes(b"")
    assert read_ahead.take(NODE, 300, 400) is not None and other.exists()  # (an empty window)
    os.utime(other, (time.time() - read_ahead.STALE_S - 1,) * 2)
    assert read_ahead.take(NODE, 400, 500) is None and not other.exists()


def test_a_failed_read_ahead_leaves_nothing_and_the_next_one_starts(spool: Path) -> None:
    dead = SourceNode("n1", "postgresql://u@127.0.0.1:9/db", "s", "p")  # nobody listens there
    assert read_ahead.begin(dead, "source", 100, 200)
    assert read_ahead.take(dead, 100, 200) is None  # waited for the writer's end: no file
    assert list(spool.iterdir()) == []
    assert read_ahead.begin(dead, "source", 200, 300)  # the one-at-a-time lock was given back
    assert read_ahead.take(dead, 200, 300) is None


def test_a_window_being_written_is_waited_for(spool: Path) -> None:
    import threading

    spool.mkdir()
    path = read_ahead._path(NODE, 100, 200)
    part = path.with_suffix(".part")
    out = open(part, "xb")
    fcntl.flock(out, fcntl.LOCK_EX)

    def finish() -> None:
        time.sleep(0.5)
        read_ahead.write_blocks(out, iter([[b"late"]]))
        out.flush()
        part.rename(path)
        out.close()

    threading.Thread(target=finish).start()
    got = read_ahead.take(NODE, 100, 200)
    assert got is not None and list(got) == [[b"late"]]


def _rows(conn: Any, blocks: Any, start: int, end: int) -> list[dict[str, Any]]:
    builder = ChangeBuilder(start, end, 0, 1 << 62, lambda rel: src.column_catalog(conn, rel))
    try:
        return decoded([r for rb in builder.batches(blocks, 512) for r in rb.to_pylist()])
    finally:
        blocks.close()
        conn.commit()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(txns=st.lists(st.tuples(st.sampled_from(["insert", "update", "delete", "note"]), st.integers(1, 900)),
                     min_size=1, max_size=14),
       max_bytes=st.sampled_from([8192, 40_000, 100_000]))
def test_the_read_ahead_gives_the_window_the_slot_gives(dbs: Dbs, txns: list[tuple[str, int]], max_bytes: int) -> None:
    """Windows cut by bytes, each read ahead while the feed's slot is still at the window before
    (as while the sink applies it): the same change rows as a peek of the slot once it moved,
    the slot untouched by the read-ahead, and its temporary slot gone."""
    slot = f"ra{abs(hash((tuple(txns), max_bytes))) % 10**8}"
    with dbs.src() as c:
        c.execute("CREATE TABLE IF NOT EXISTS t (id bigint PRIMARY KEY, v text)")
        c.execute("DROP PUBLICATION IF EXISTS p")
        c.execute("CREATE PUBLICATION p FOR TABLE t")
        c.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                  (slot,))
        start = slots.create_slot(c, slot)
        for i, (kind, n) in enumerate(txns):
            if kind == "insert":
                c.execute("INSERT INTO t SELECT %s * 1000 + g, repeat('v', g %% 60) FROM generate_series(1, %s) g "
                          "ON CONFLICT (id) DO NOTHING", (i, n))
            elif kind == "update":
                c.execute("UPDATE t SET v = v || 'u' WHERE id %% 9 = %s", (n % 9,))
            elif kind == "delete":
                c.execute("DELETE FROM t WHERE id %% 13 = %s", (n % 13,))
            else:
                c.execute("SELECT pg_logical_emit_message(false, 'note', repeat('n', %s))", (n * 10,))
        tail = next(_tails) * 10_000
        c.execute("INSERT INTO t SELECT -g, 'tail' FROM generate_series(%s::bigint, %s::bigint) g", (tail, tail + 2999))
        end, _ = src.heartbeat(c, HEARTBEAT_PREFIX)
    node = SourceNode("n1", dbs.source, slot, "p")
    conn = connect(dbs.source, "source", autocommit=False)
    reader = wal_reader("peek")
    try:
        cut = reader.cut(conn, node, start, end, max_bytes=max_bytes)
        windows = aheads = 0
        while start < end:
            following = reader.cut(conn, node, cut, end, max_bytes=max_bytes)
            conn.commit()
            held = slots.slot_state(conn, slot).confirmed_flush  # type: ignore[union-attr]
            ahead = None
            if following > cut:  # the sink applies [start, cut): read [cut, following) ahead
                assert read_ahead.begin(node, "source", cut, following)
                ahead = read_ahead.take(node, cut, following)  # (waits for the thread)
                assert ahead is not None
                assert slots.slot_state(conn, slot).confirmed_flush == held  # not moved by it
                conn.commit()
            slots.advance(conn, slot, cut)  # the sink committed [start, cut)
            conn.commit()
            if ahead is not None:
                spooled = _rows(conn, ahead, cut, following)
                peeked = _rows(conn, src.peek(conn, slot, "p", following), cut, following)
                assert spooled == peeked, (cut, following)
                aheads += 1
            start, cut, windows = cut, following, windows + 1
        assert aheads >= 1 and windows == aheads + 1
        left = conn.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'changefeed_ahead%%'")
        assert left.fetchone() == (0,)  # type: ignore[union-attr]
    finally:
        conn.rollback()
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        conn.commit()
        conn.close()


def test_no_free_slot_means_no_read_ahead(dbs: Dbs) -> None:
    """A server without a free replication slot: the read-ahead gives up, the window's task
    reads the slot itself."""
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id bigint PRIMARY KEY)")
        c.execute("CREATE PUBLICATION p FOR TABLE t")
        start = slots.create_slot(c, "ra_full")
        c.execute("INSERT INTO t SELECT generate_series(1, 100)")
        end, _ = src.heartbeat(c, HEARTBEAT_PREFIX)
        free = c.execute("SELECT current_setting('max_replication_slots')::int - count(*) "
                         "FROM pg_replication_slots").fetchone()[0]  # type: ignore[index]
        fillers = [f"ra_fill{i}" for i in range(free)]
        for name in fillers:
            c.execute("SELECT pg_create_physical_replication_slot(%s)", (name,))
        try:
            with pytest.raises(psycopg.errors.ConfigurationLimitExceeded):  # full indeed
                c.execute("SELECT pg_create_physical_replication_slot('ra_one_more')")
            node = SourceNode("n1", dbs.source, "ra_full", "p")
            assert read_ahead.begin(node, "source", start, end)
            assert read_ahead.take(node, start, end) is None
        finally:
            for name in fillers:
                c.execute("SELECT pg_drop_replication_slot(%s)", (name,))
            c.execute("SELECT pg_drop_replication_slot('ra_full')")


def test_no_read_ahead_past_what_the_synchronized_standbys_flushed(tmp_path: Path) -> None:
    """A copy of a failover slot decodes without waiting for `synchronized_standby_slots`: a
    window past what those standbys flushed is not read ahead (the feed's own slot waits)."""
    from changefeed.core.lsn import parse_lsn
    from changefeed.local.postgres import LocalPostgres

    server = LocalPostgres.start(tmp_path / "pg", settings={"synchronized_standby_slots": "'phys_a, phys_b'"})
    try:
        with psycopg.connect(server.uri(), autocommit=True) as c:
            here = parse_lsn(c.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]
            assert not read_ahead.standbys_have(c, here)  # neither slot exists
            c.execute("SELECT pg_create_physical_replication_slot('phys_a', true)")
            assert not read_ahead.standbys_have(c, here)  # phys_b still missing
            c.execute("SELECT pg_create_physical_replication_slot('phys_b', true)")
            reserved = parse_lsn(c.execute("SELECT min(restart_lsn)::text FROM pg_replication_slots")
                                 .fetchone()[0])  # type: ignore[index]
            assert read_ahead.standbys_have(c, reserved)
            assert not read_ahead.standbys_have(c, reserved + (1 << 20))  # WAL the standbys do not have yet
            with pytest.raises(RuntimeError, match="not flushed"), open(os.devnull, "wb") as sink:
                read_ahead._spool(c, NODE, reserved, reserved + (1 << 20), sink)
            c.execute("ALTER SYSTEM SET synchronized_standby_slots = ''")
            c.execute("SELECT pg_reload_conf()")
            time.sleep(0.5)
            assert read_ahead.standbys_have(c, reserved + (1 << 20))  # none to wait for
    finally:
        server.stop()
