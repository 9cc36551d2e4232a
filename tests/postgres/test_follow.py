"""The slot followed as the server writes it (postgres.follow), against a real server: while a
writer commits, the follower's sub-windows chain from the slot's position, each ends at a commit
with its `P` row, and together they hold exactly the rows one window over the same WAL holds,
commit timestamps included; a long sub-window comes in parts; an idle stream still lets the
follower stop at its deadline; the slot is left where it was."""
from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from changefeed.core import change as ch
from changefeed.postgres import slots
from changefeed.postgres import source as src
from changefeed.postgres.connect import connect, one_row
from changefeed.postgres.decode.builder import ChangeBuilder
from changefeed.postgres.follow import FOLLOWED, Follower
from changefeed.postgres.replication import BLOCK_MESSAGES
from changefeed.spec.definition import SourceNode
from support.servers import Dbs
from support.windows import decoded

pytestmark = pytest.mark.timeout(300)
# The big transaction's rows: more messages than two blocks of the stream hold, so that it never
# reaches the follower whole in one block (a 3,000-row one sometimes did, and went out in one piece).
BIG = 2 * BLOCK_MESSAGES + 1000


def _writer(uri: str, stop: threading.Event, big: list[int] | None = None) -> threading.Thread:
    """Small transactions every few ms (inserts, updates, deletes, a non-transactional message now
    and then), and one of BIG rows, whose end the writer appends to `big`."""
    def run() -> None:
        with psycopg.connect(uri, autocommit=True) as c:
            i = 0
            while not stop.is_set():
                i += 1
                c.execute("INSERT INTO t SELECT g, 'v' FROM generate_series(%s::bigint, %s::bigint) g",
                          (i * 10_000, i * 10_000 + i % 7))
                if i % 5 == 0:
                    c.execute("UPDATE t SET v = v || 'u' WHERE id = %s", ((i - 3) * 10_000,))
                if i % 9 == 0:
                    c.execute("DELETE FROM t WHERE id = %s", ((i - 4) * 10_000,))
                if i % 13 == 0:
                    c.execute("SELECT pg_logical_emit_message(false, 'note', %s)", (str(i),))
                if i == 40:
                    c.execute("INSERT INTO t SELECT -g, 'big' FROM generate_series(1, %s) g", (BIG,))
                    if big is not None:
                        big.append(one_row(c.execute("SELECT pg_current_wal_insert_lsn() - '0/0'"))[0])
                time.sleep(0.003)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _published(dbs: Dbs, slot: str, *then: str) -> tuple[SourceNode, int]:
    """Table t published, slot `slot` made (where it starts), then the statements `then`."""
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text)")
        c.execute("CREATE PUBLICATION p FOR TABLE t")
        start = slots.create_slot(c, slot)
        for sql in then:
            c.execute(sql)
    return SourceNode("n1", dbs.source, slot, "p"), start


def _sub_windows(batches: list[Any]) -> list[list[dict[str, Any]]]:
    """The followed rows split after each `P` row (rows after the last belong to none)."""
    out: list[list[dict[str, Any]]] = [[]]
    for rb in batches:
        out[-1].extend(rb.to_pylist())
        if out[-1] and out[-1][-1]["op"] == ch.PROGRESS:
            out.append([])
    return out[:-1]


def test_followed_sub_windows_chain_and_equal_one_window(dbs: Dbs) -> None:
    node, start = _published(dbs, "follow")
    stop, big = threading.Event(), list[int]()
    writer = _writer(dbs.source, stop, big)
    conn = connect(dbs.source, "source", autocommit=True)
    try:
        follower = Follower(conn, node, "source", start, 0, every=0.02, rows_per_batch=1000,
                            offset_at=lambda lsn, ts: {"lsn": lsn, "ts": ts})
        # At least 3 s, and on past the big transaction however slowly a loaded machine writes it
        # (the writer goes on past the end: the follower stops anyway).
        t0 = time.monotonic()
        batches = list(follower.windows(
            until=t0 + 120, wanted=lambda: time.monotonic() >= t0 + 3 and bool(big) and follower.position[0] > big[0]))
        stop.set()
        writer.join()
        assert big and follower.position[0] > big[0], "the follower read past the big transaction"
        windows = _sub_windows(batches)
        assert len(windows) == follower.cuts > 1
        assert len(batches) > len(windows), "the big transaction came in parts"
        lo, lo_ts = start, 0
        for rows in windows:
            p = ch.Progress.from_meta(rows[-1]["meta"])
            data = [r for r in rows if r["op"] in ch.DATA_OPS]
            assert all(lo <= r["lsn"] < p.end_lsn for r in data if r["xid"]), "commits inside the sub-window"
            assert p.resolved_ts >= lo_ts and all(lo_ts < r["commit_ts"] <= p.resolved_ts for r in data if r["xid"])
            assert p.offset == {"lsn": p.end_lsn, "ts": p.resolved_ts}
            lo, lo_ts = p.end_lsn, p.resolved_ts
        assert follower.position == (lo, lo_ts)
        # the same WAL as one window, read by a peek from the slot (which the follower left alone)
        state = slots.slot_state(conn, "follow")
        assert state is not None and state.confirmed_flush == start
        whole = ChangeBuilder(start, lo, 0, FOLLOWED, lambda rel: src.column_catalog(conn, rel))
        with psycopg.connect(dbs.source) as r:
            one = [row for rb in whole.batches(src.peek(r, "follow", "p", lo)) for row in rb.to_pylist()]
        followed = [r for rows in windows for r in rows]
        assert [r for r in decoded(followed) if r["op"] in ch.DATA_OPS] == \
            [r for r in decoded(one) if r["op"] in ch.DATA_OPS]
    finally:
        stop.set()
        conn.close()


def test_an_idle_follower_stops_at_its_deadline(dbs: Dbs) -> None:
    node, start = _published(dbs, "idle", "INSERT INTO t VALUES (1, 'one')")
    with connect(dbs.source, "source", autocommit=True) as conn:
        follower = Follower(conn, node, "source", start, 0, every=0.0)
        rows = [r for rb in follower.windows(until=time.monotonic() + 3.0) for r in rb.to_pylist()]
    assert [r["op"] for r in rows if r["op"] in ch.DATA_OPS] == ["c"]
    assert rows[-1]["op"] == ch.PROGRESS and follower.cuts == 1


def test_a_commit_on_an_idle_stream_is_cut_once_its_time_comes(dbs: Dbs) -> None:
    """The last commit before the stream goes quiet is not held to the deadline: the sub-window
    ends once `every` passed, with no further message to wake the follower."""
    node, start = _published(dbs, "quiet", "INSERT INTO t VALUES (1, 'one')")
    with connect(dbs.source, "source", autocommit=True) as conn:
        until = time.monotonic() + 60
        follower = Follower(conn, node, "source", start, 0, every=0.2)
        for rb in follower.windows(until):
            if rb.column("op")[rb.num_rows - 1].as_py() == ch.PROGRESS:
                break
        assert follower.cuts == 1 and time.monotonic() < until - 30, "cut long before the deadline"


def test_a_follower_flushes_commits_that_wait_for_the_wal_writer(dbs: Dbs) -> None:
    """A commit made with synchronous_commit off reaches a WAL reader once the WAL is flushed: a
    follower with `flush` flushes it (with a heartbeat) rather than wait for the server's WAL
    writer. (Five commits 50 ms apart: the WAL writer, every 200 ms, does not beat it to all.)"""
    node, start = _published(dbs, "flush")

    def commits() -> None:
        with dbs.src() as w:
            w.execute("SET synchronous_commit = off")
            for i in range(5):
                time.sleep(0.05)
                w.execute("INSERT INTO t VALUES (%s, 'v')", (i,))

    with connect(dbs.source, "source", autocommit=True) as conn:
        follower = Follower(conn, node, "source", start, 0, every=0.0, flush=0.02)
        writer = threading.Thread(target=commits)
        writer.start()
        rows = [r for rb in follower.windows(until=time.monotonic() + 1.5) for r in rb.to_pylist()]
        writer.join()
    assert [r["op"] for r in rows if r["op"] in ch.DATA_OPS] == ["c"] * 5
    assert follower.flushes >= 1


def test_the_slot_moves_with_what_the_sink_recorded_while_the_window_stays_open(dbs: Dbs) -> None:
    """`recorded` says how far the sink is: the stream confirms that, and the slot moves there
    before the follower ends (a slot moved only at batch ends makes each start decode it all)."""
    node, start = _published(dbs, "moves")
    stop = threading.Event()
    writer = _writer(dbs.source, stop)
    ends: list[int] = []
    seen: list[int] = []
    try:
        with connect(dbs.source, "source", autocommit=True) as conn, dbs.src() as look:
            follower = Follower(conn, node, "source", start, 0, every=0.02)
            for rb in follower.windows(until=time.monotonic() + 4.0, recorded=lambda: ends[len(ends) // 2]
                                       if ends else start):
                ends += [ch.Progress.from_meta(m).end_lsn for m, op in zip(rb.column("meta").to_pylist(),
                                                                            rb.column("op").to_pylist())
                         if op == ch.PROGRESS]
                state = slots.slot_state(look, "moves")
                assert state is not None and state.confirmed_flush is not None
                seen.append(state.confirmed_flush)
    finally:
        stop.set()
        writer.join()
    assert start < max(seen) <= ends[-1]  # moved while following, never past what was "recorded"
    assert max(seen) in ends
