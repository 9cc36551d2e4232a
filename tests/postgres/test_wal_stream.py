"""The streaming replication reader against a real server: the same windows as the SQL peek.

Random workloads (plain changes, big and rolled-back transactions, transactional and
non-transactional messages that straddle WAL pages, truncates) are cut into windows by bytes
(page boundaries) or by changes (commit ends), and each window is read from the slot by both
readers: the change rows must be identical, and the stream must leave the slot where it was. A
consumer slower than the server's `wal_sender_timeout` keeps the stream alive through status
updates; a walsender terminated mid-window is a retryable ConnectionFailed, and the window read
again is whole.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from changefeed.errors import ConnectionFailed
from changefeed.postgres import replication, slots
from changefeed.postgres import source as src
from changefeed.postgres.connect import connect
from changefeed.postgres.decode.builder import HEARTBEAT_PREFIX, ChangeBuilder
from changefeed.postgres.wal_reader import wal_reader
from changefeed.spec.definition import SourceNode
from support.servers import Dbs
from support.windows import decoded

pytestmark = pytest.mark.timeout(600)

_ids = iter(range(10**9))

step = st.one_of(
    st.tuples(st.just("insert"), st.integers(1, 400)),
    st.tuples(st.just("update"), st.integers(1, 7)),
    st.tuples(st.just("delete"), st.integers(1, 11)),
    st.tuples(st.just("big"), st.integers(2000, 6000)),
    st.tuples(st.just("rollback"), st.integers(1, 300)),
    st.tuples(st.just("note"), st.integers(0, 20000)),  # non-transactional, up to a few pages
    st.tuples(st.just("txnote"), st.integers(0, 9000)),
    st.tuples(st.just("truncate"), st.just(0)),
)


def _write(c: psycopg.Connection[Any], steps: list[tuple[str, int]]) -> None:
    for kind, n in steps:
        if kind in ("insert", "big"):
            first = next(_ids) * 10_000
            c.execute("INSERT INTO t SELECT g, repeat('v', (g %% 50)::int) "
                      "FROM generate_series(%s::bigint, %s::bigint) g", (first, first + n - 1))
        elif kind == "update":
            c.execute("UPDATE t SET v = v || 'u' WHERE id %% 7 = %s", (n,))
        elif kind == "delete":
            c.execute("DELETE FROM t WHERE id %% 11 = %s", (n % 11,))
        elif kind == "rollback":
            with pytest.raises(psycopg.errors.RaiseException), c.transaction():
                c.execute("INSERT INTO t SELECT -g, 'r' FROM generate_series(1, %s) g", (n,))
                c.execute("DO $$ BEGIN RAISE EXCEPTION 'rolled back'; END $$")
        elif kind == "note":
            c.execute("SELECT pg_logical_emit_message(false, 'note', repeat('n', %s))", (n,))
        elif kind == "txnote":
            with c.transaction():
                c.execute("SELECT pg_logical_emit_message(true, 'txnote', repeat('m', %s))", (n,))
                c.execute("INSERT INTO t VALUES (%s, 'with a message')", (next(_ids) * 10_000,))
        else:
            c.execute("TRUNCATE t")


def _rows(conn: Any, node: SourceNode, reader: str, start: int, end: int) -> list[dict[str, Any]]:
    """One window's change rows, read as the Spark source reads it (slot moved to `start` first)."""
    slots.advance(conn, node.slot, start)
    conn.commit()
    builder = ChangeBuilder(start, end, 0, 1 << 62, lambda rel: src.column_catalog(conn, rel))
    blocks = wal_reader(reader).window(conn, node, "source", start, end)
    try:
        rows = [r for rb in builder.batches(blocks, 512) for r in rb.to_pylist()]
    finally:
        blocks.close()  # type: ignore[attr-defined]
    conn.commit()
    return decoded(rows)


@pytest.fixture
def table(dbs: Dbs) -> Dbs:
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text)")
        c.execute("CREATE PUBLICATION p FOR TABLE t")
    return dbs


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(step, min_size=1, max_size=12),
       cuts=st.lists(st.one_of(st.tuples(st.just("bytes"), st.sampled_from([1, 8192, 40_000, 400_000])),
                               st.tuples(st.just("changes"), st.integers(1, 3000))), min_size=1, max_size=6))
def test_the_stream_gives_the_windows_the_peek_gives(table: Dbs, steps: list[tuple[str, int]],
                                                     cuts: list[tuple[str, int]]) -> None:
    slot = f"ws{next(_ids)}"
    node = SourceNode("n1", table.source, slot, "p")
    conn = connect(table.source, "source", autocommit=False)
    try:
        with table.src() as c:
            start = slots.create_slot(c, slot)
            _write(c, steps)
            end, _ = src.heartbeat(c, HEARTBEAT_PREFIX)
        windows, reader = 0, wal_reader("peek")
        while start < end:
            kind, limit = cuts[windows % len(cuts)]
            cut = reader.cut(conn, node, start, end, max_bytes=limit if kind == "bytes" else 0,
                             max_changes=limit if kind == "changes" else 0)
            conn.commit()
            peeked = _rows(conn, node, "peek", start, cut)
            streamed = _rows(conn, node, "stream", start, cut)
            assert streamed == peeked, (start, cut)
            assert slots.slot_state(conn, slot).confirmed_flush == start  # type: ignore[union-attr]
            conn.commit()
            if kind == "changes":  # --max-rate's cut: it says how many row changes its window holds
                rows_cut = reader.cut(conn, node, start, end, max_changes=limit, rows_only=True)
                conn.commit()
                held = [r for r in _rows(conn, node, "peek", start, rows_cut) if r["op"] in "cudt"]
                assert reader.counted == len(held) and (len(held) >= limit or rows_cut == end), (limit, rows_cut)
            start, windows = cut, windows + 1
        assert windows >= 1
    finally:
        conn.rollback()
        conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                     (slot,))
        conn.commit()
        conn.close()


def _window(dbs: Dbs, slot: str, rows: int) -> tuple[SourceNode, int, int]:
    with dbs.src() as c:
        start = slots.create_slot(c, slot)
        for i in range(rows // 1000):
            c.execute("INSERT INTO t SELECT g, repeat('w', 40) FROM generate_series(%s::bigint, %s::bigint) g",
                      (i * 1000, i * 1000 + 999))
        end, _ = src.heartbeat(c, HEARTBEAT_PREFIX)
    return SourceNode("n1", dbs.source, slot, "p"), start, end


@pytest.mark.parametrize("status_interval", [0.3, 100.0])
def test_a_consumer_slower_than_the_sender_timeout_keeps_the_stream(table: Dbs, monkeypatch: pytest.MonkeyPatch,
                                                                    status_interval: float) -> None:
    monkeypatch.setattr(replication, "BLOCK_MESSAGES", 200)
    monkeypatch.setattr(replication, "QUEUE_BLOCKS", 1)  # the receiver waits on the consumer at once
    node, start, end = _window(table, "slow", 20_000)
    with table.src() as c:
        layout = src.wal_layout(c)
    stream = replication.WindowStream(node.uri, "source", node.slot, node.publication, start, end, layout=layout,
                                      status_interval=status_interval, options="-c wal_sender_timeout=1s")
    got, relations = 0, 0
    blocks = stream.blocks()

    def sender_gone() -> bool:
        with psycopg.connect(table.source, autocommit=True) as c:
            return not c.execute("SELECT 1 FROM pg_stat_replication r JOIN pg_replication_slots s "
                                 "ON s.active_pid = r.pid WHERE s.slot_name = 'slow'").fetchone()

    def busy_sink() -> None:
        """The sink applies something big: it takes until the stream has sent five status updates
        meanwhile (the server's 1 s sender timeout passed several times), or, without updates,
        until the server gave the connection up (at most 60 s either way)."""
        updates, deadline = stream.updates, time.monotonic() + 60
        while time.monotonic() < deadline:
            if stream.updates >= updates + 5 or (status_interval > 1 and sender_gone()):
                return
            time.sleep(0.1)

    def consume() -> None:
        nonlocal got, relations
        for i, block in enumerate(blocks):
            got += len(block)
            relations += sum(1 for m in block if m[:1] == b"R")
            if i == 1:
                busy_sink()

    if status_interval > 1:  # no status updates in time: the server gives the connection up
        with pytest.raises(ConnectionFailed, match="lost the connection to the source"):
            consume()
        return
    consume()
    assert stream.updates >= 5  # status updates went out while the consumer slept
    # each insert, each transaction's Begin and Commit, the heartbeat; and the Relation, which pgoutput
    # sends again after a relcache invalidation (autovacuum's ANALYZE of the table, at any moment)
    assert relations >= 1
    assert got - relations == 20_000 + 20 * 2 + 1
    with connect(table.source, "source") as c:
        assert slots.slot_state(c, "slow").confirmed_flush == start  # type: ignore[union-attr]


def test_a_walsender_terminated_mid_window_fails_the_read_and_the_window_reads_again_whole(table: Dbs) -> None:
    node, start, end = _window(table, "term", 60_000)
    conn = connect(table.source, "source", autocommit=False)
    try:
        whole = _rows(conn, node, "peek", start, end)
        builder = ChangeBuilder(start, end, 0, 1 << 62, lambda rel: src.column_catalog(conn, rel))
        blocks = wal_reader("stream").window(conn, node, "source", start, end)
        killed = threading.Event()
        with pytest.raises(ConnectionFailed, match="lost the connection to the source"):
            for i, _ in enumerate(builder.batches(blocks, 512)):
                if i == 1:
                    with table.src() as c:
                        pid = c.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = 'term'"
                                        ).fetchone()[0]  # type: ignore[index]
                        assert c.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0]  # type: ignore[index]
                    killed.set()
        assert killed.is_set()
        conn.rollback()
        assert _rows(conn, node, "stream", start, end) == whole
        assert sum(r["op"] == "c" for r in whole) == 60_000
    finally:
        conn.close()


def test_the_stream_command_quotes_names() -> None:
    cmd = replication.start_command('we"ird', "it's", 0x1_0000_0010).decode()
    assert cmd.startswith('START_REPLICATION SLOT "we""ird" LOGICAL 1/10 ')
    assert "publication_names 'it''s'" in cmd and "messages 'true'" in cmd


def test_a_stalled_path_is_cut(table: Dbs, monkeypatch: pytest.MonkeyPatch) -> None:
    """A path that stops forwarding but stays open (tests/tcp_proxy.py): no data, no answer to the
    pings either, so the stream gives the connection up as lost (the feed retries it)."""
    from urllib.parse import urlsplit

    from tcp_proxy import TcpProxy

    monkeypatch.setattr(replication, "BLOCK_MESSAGES", 200)
    monkeypatch.setattr(replication, "QUEUE_BLOCKS", 1)
    node, start, end = _window(table, "stall", 100_000)
    port = int(urlsplit(table.source).port or 0)
    with TcpProxy(port) as proxy:
        stream = replication.WindowStream(node.uri.replace(f":{port}/", f":{proxy.port}/"), "source", node.slot,
                                          node.publication, start, end, layout=(8192, 16 << 20),
                                          status_interval=0.3, silent=1.5)
        began = time.monotonic()
        with pytest.raises(ConnectionFailed, match="the connection is stalled"):
            for i, _ in enumerate(stream.blocks()):
                if i == 0:
                    proxy.stall()
        assert time.monotonic() - began < 20
