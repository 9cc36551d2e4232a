"""Follow one node's slot as the server writes it, in sub-windows: the reading half of the
low-latency path (issue 42), where one long-lived task delivers many small sink transactions.

A window of today's batches is planned with an end; a followed window has none. The replication
stream (postgres.replication.WindowStream with an end no transaction reaches) stays open and hands
its messages over within `linger`; the change builder (postgres.decode.builder) turns them into
change rows and `cut`s a sub-window at the last commit received once `every` passed since the
last cut and the stream has caught up (a follower behind the server makes fewer, larger ones): its
rows end with a `P` row at that commit record's end, resolved at its commit timestamp, so that a
sink applies and records each sub-window on its own, exactly as it does a batch. Sub-windows
chain: each starts where the last ended and continues its timestamps, which is what a window
read again from the last one's end would give (tested against one window over the same stream).

A server that commits with `synchronous_commit = off` hands its commits to a WAL reader only
once its WAL writer flushes them (every `wal_writer_delay`, 200 ms by default): with `flush`,
the follower looks every that many seconds whether WAL waits unflushed, and if so flushes it
with an empty heartbeat message (PostgreSQL 17+), so that those commits come at once.

What follows the last cut when the follower stops (its deadline passed and no transaction was
being received) is read again by whoever reads from that cut's end: the slot only ever moves
to a position a sink recorded.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any

import psycopg

from changefeed.core.change import HEARTBEAT_PREFIX
from changefeed.core.lsn import Lsn
from changefeed.postgres import slots
from changefeed.postgres import source as src
from changefeed.postgres.connect import one_row, server_version
from changefeed.postgres.decode.builder import ChangeBuilder
from changefeed.postgres.replication import WindowStream
from changefeed.spec.definition import SourceNode

FOLLOWED = Lsn(1 << 62)  # a followed window's end and resolved bound: no transaction lies past it
LINGER_S = 0.002  # the longest a received message waits for more before the builder gets it
IDLE_S = 0.01  # how often a follower waiting for messages looks at its clock
WANTED_S = 1.0  # how often a follower asks whether it should end before its deadline


class Follower:
    """Sub-windows of node `node`'s slot from `at` (the slot's position, its timestamps from
    `start_ts`), one at least every `every` seconds while commits arrive. `conn`: an ordinary
    connection to the node (the catalog's type names). `offset_at(lsn, ts)`: the offset a
    sub-window ending there records (core.offsets, as JSON), for a runner that resumes from it."""

    def __init__(self, conn: psycopg.Connection[Any], node: SourceNode, role: str, at: int, start_ts: int, *,
                 every: float, offset_at: Callable[[int, int], dict[str, Any]] | None = None,
                 rows_per_batch: int = 65536, flush: float | None = None) -> None:
        self.conn, self.node, self.role, self.at, self.every = conn, node, role, at, every
        self.offset_at, self.rows_per_batch = offset_at, rows_per_batch
        self.flush = flush if flush is not None and server_version(conn) >= 170000 else None
        self._looked = float("-inf")  # when the follower last looked for unflushed WAL
        self.flushes = 0  # heartbeats that flushed WAL (tests)
        self.builder = ChangeBuilder(at, FOLLOWED, start_ts, FOLLOWED, lambda rel: src.column_catalog(conn, rel),
                                     node=node.name, publication=node.publication)
        self.cuts = 0  # sub-windows ended so far
        self._ended = (at, start_ts)  # where the last sub-window ended (the builder's ts runs on past it)
        self.mark = slots.RestartMark(WANTED_S)  # the next batch's stream starts near where this one's ends

    @property
    def position(self) -> tuple[int, int]:
        """Where the last sub-window ended (its end LSN and resolved ts): the next starts there."""
        return self._ended

    def windows(self, until: float, wanted: Callable[[], bool] | None = None,
                recorded: Callable[[], int] | None = None) -> Iterator[Any]:
        """Record batches of change rows, each sub-window's last one ending with its `P` row
        (a large one comes in several), until the monotonic clock passes `until`, or `wanted()`
        (asked about once every WANTED_S) says the follower should end, and no transaction is
        being received. `recorded()` (asked as often): how far the sink recorded the feed, which
        the stream confirms to the server, so the slot moves while the window stays open. Rows
        after the last `P` row (a long sub-window's first parts, cut short by the deadline)
        belong to no sub-window: a sink drops them."""
        stream = WindowStream(self.node.uri, self.role, self.node.slot, self.node.publication, self.at, FOLLOWED,
                              layout=src.wal_layout(self.conn), linger=LINGER_S)
        builder, last_cut = self.builder, time.monotonic()
        asked = last_cut
        blocks = stream.blocks(idle=IDLE_S)
        with closing(blocks):  # type: ignore[type-var]  # a generator, typed as the Iterator it is used as
            for block in blocks:
                self._flush_waiting()
                # A sub-window ends at the last commit received once `every` passed, and only when
                # the stream has caught up (or the sub-window is long already): behind the
                # server, fewer and larger sink transactions catch up sooner.
                last = _last_commit(block)
                if last is not None and self._ready(stream, last_cut):
                    builder.feed_block(block[:last + 1])
                    block = block[last + 1:]
                    if builder.cuttable():
                        yield self._cut()
                        last_cut = time.monotonic()
                builder.feed_block(block)
                if builder.cuttable() and self._ready(stream, last_cut):  # (a commit left on a quiet stream)
                    yield self._cut()
                    last_cut = time.monotonic()
                if builder.pending() >= 2 * self.rows_per_batch:  # a long sub-window goes out in parts
                    yield builder.take()
                elif (part := builder.parted(self.rows_per_batch)) is not None:  # and a large transaction
                    yield part
                if time.monotonic() >= asked + WANTED_S:
                    asked = time.monotonic()
                    if recorded is not None:
                        self.mark.maybe(self.conn)  # (confirmed past by a later round)
                        stream.confirm(recorded())
                    if wanted is not None and wanted():
                        until = asked  # (ends now, or once the transaction being received is whole)
                if time.monotonic() >= until and not builder.in_transaction:
                    if builder.cuttable():
                        yield self._cut()
                    return

    def _flush_waiting(self) -> None:
        """With `flush`: at most that often, flush WAL that waits for the server's WAL writer."""
        if self.flush is None or time.monotonic() - self._looked < self.flush:
            return
        self._looked = time.monotonic()
        row = one_row(self.conn.execute(
            "SELECT CASE WHEN pg_current_wal_insert_lsn() > pg_current_wal_flush_lsn() "
            "THEN pg_logical_emit_message(false, %s, '', true) END IS NOT NULL", (HEARTBEAT_PREFIX,)))
        self.flushes += bool(row[0])

    def _ready(self, stream: WindowStream, last_cut: float) -> bool:
        return time.monotonic() - last_cut >= self.every and (
            not stream.backlogged() or self.builder.pending() >= self.rows_per_batch)

    def _cut(self) -> Any:
        builder = self.builder
        self._ended = (builder.last_end or 0, builder.last_ts)
        if self.offset_at is not None:
            builder.offset = self.offset_at(*self._ended)
        self.cuts += 1
        return builder.cut()


def _last_commit(block: list[bytes]) -> int | None:
    """The index of the block's last Commit message, if it holds one."""
    for i in range(len(block) - 1, -1, -1):
        if block[i][:1] == b"C":
            return i
    return None
