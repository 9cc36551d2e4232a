"""`changefeed` PySpark streaming source: PostgreSQL logical decoding as micro-batches.

Offsets are core.offsets.Offset: the batch's upper WAL bound on each node, its resolved commit
timestamp (no change in a later batch gets a smaller one, see core.resolved), the snapshot cursor
after it, and the snapshot chunks it carries (see core.snapshot; each chunk is one more input
partition). On each node a batch holds what starts in [start, end) (see postgres/decode/builder.py),
read by an input partition (a Spark task) of its own. A bound is a flushed position that splits
no WAL record: a heartbeat's end, a commit's end (a change limit) or a WAL page boundary (a byte
limit, found without decoding). The driver only plans offsets and advances the slots in
`commit`; executors decode in `read` (spark/reads.py). A feed of several nodes is planned by
postgres/cut.py and core.distributed instead: every batch a cut in commit time across the nodes,
each distributed transaction whole in one batch.

Spark imports this module in every Python process it starts to plan a query (a new one each
step, one after another, at a feed's start), so the decoder and its numpy/Arrow imports are
imported by the read functions alone (spark/reads.py): ~0.1 s less in each of those processes.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psycopg
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxBytes, ReadMaxRows

from changefeed import faults
from changefeed.core import barrier as bar
from changefeed.core import change as ch
from changefeed.core import distributed as dist
from changefeed.core import followed, judge, snapshot
from changefeed.core.hlc import window_end_ts
from changefeed.core.lsn import Lsn, format_lsn
from changefeed.core.nodes import DEFAULT_NODE, classic
from changefeed.core.offsets import Offset
from changefeed.core.resolved import Frontier, resolved_ts
from changefeed.errors import SlotLost, carried, start_over_hint
from changefeed.postgres import cut as nodes_cut
from changefeed.postgres import read_ahead, slots
from changefeed.postgres import snapshot as snap_pg
from changefeed.postgres import source as src
from changefeed.postgres.connect import connect, insert_lsn, lost_connection
from changefeed.postgres.requests import SourceRequests
from changefeed.postgres.wal_reader import DEFAULT as DEFAULT_WAL_READER
from changefeed.postgres.wal_reader import WalReader, wal_reader
from changefeed.spark.boundaries_ahead import BoundariesAhead
from changefeed.spark.checkpoint import record_start, recorded_start, replay_ends
from changefeed.spark.follow import FollowPartition, Wanted, read_followed
from changefeed.spark.rates import Rates
from changefeed.spark.reads import BatchPartition, ChunkPartition, GroupPartition, WindowPartition, read_partition
from changefeed.spec.definition import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_CHUNKS_PER_BATCH,
    DEFAULT_MAX_BYTES,
    SourceNode,
    node_role,
)

try:  # SupportsTriggerAvailableNow is in pyspark >= 4.2
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
except ImportError:  # pragma: no cover
    SupportsTriggerAvailableNow = object  # type: ignore[misc,assignment]  # older pyspark: no such base


class ChangefeedSource(DataSource):
    """Options: nodes (JSON list of [name, uri, slot, publication]), feed, max_bytes_per_batch,
    max_changes_per_batch, resolved_interval_s, snapshot_tables (read first on a fresh checkpoint),
    snapshot_chunk_rows, snapshot_chunks_per_batch, snapshot_budget (the sinks', for auto:
    core.snapshot.auto_chunks), requests_dir (an older changefeed's snapshot request files,
    taken in by postgres.requests), barrier_file (see core.barrier), joining_file
    (nodes being added, see postgres/cut.py), wal_reader (peek or stream, see
    postgres/wal_reader.py), parallel_reads ("false": a batch's partitions are read by one task,
    as one GroupPartition), read_in_writer ("true": the sink's writer takes the rows as they are
    read, so a window or chunk one task reads may be read by the writer, spark.reads.resolve),
    max_clock_skew_us (see core.distributed), sinks (the names of the
    feed's sinks, by which a snapshot request for some sinks alone is taken in: spec.sinks),
    resume_offset (where a query without a checkpoint starts, see initialOffset), resume_until
    (where its first batch then ends: the furthest of several sinks, sinks.ledgers), row_filters
    (JSON: per table the predicate its snapshot reads apply, as its publication's row filter does
    to its changes: spec.row_filters), replay_file (a JSON list of batch ends a sink behind the
    others is caught up by: control.lag_budget), checkpoint (the query's checkpoint folder, which
    keeps where its first batch starts: spark.checkpoint.recorded_start), follow_s (low-latency
    mode: how long a followed batch follows the slot, core.followed), follow_end (the end file
    its sink keeps) and follow_sink (JSON: the sink writer's options, by which a followed batch's
    read asks how far the sink recorded the feed, for the slot to move as it follows)."""

    @classmethod
    def name(cls) -> str:
        return "changefeed"

    def schema(self) -> str:
        return ch.PACKED_DDL

    def streamReader(self, schema: Any) -> ChangeStreamReader:
        return ChangeStreamReader(dict(self.options))


class ChangeStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: dict[str, str]) -> None:
        self.nodes = {n[0]: SourceNode(*n) for n in json.loads(options["nodes"])}
        self.multi_node = not classic(self.nodes)  # as FeedSpec.multi_node
        self.feed = options["feed"]
        self.sinks = set((options.get("sinks") or "").split(","))
        self.row_filters: dict[str, str] = json.loads(options.get("row_filters") or "{}")
        self.column_lists: dict[str, list[str]] = json.loads(options.get("column_lists") or "{}")
        self.rates = Rates(options)
        self.max_bytes = int(options.get("max_bytes_per_batch") or 0)
        self.max_changes = int(options.get("max_changes_per_batch") or 0)
        self.rows_per_batch = int(options.get("arrow_batch_rows") or 65536)
        self.wal: WalReader = wal_reader(options.get("wal_reader") or DEFAULT_WAL_READER)
        self.parallel_reads = options.get("parallel_reads", "true") != "false"
        self.read_in_writer = options.get("read_in_writer") == "true"
        self.resolved_interval = float(options.get("resolved_interval_s") or 0)
        tables = [t for t in (options.get("snapshot_tables") or "").split(",") if t]
        self.unjudged = frozenset(t for t in (options.get("unjudged_tables") or "").split(",") if t)
        self.snapshot_entries = snapshot.entries(tables, list(self.nodes))
        self.chunk_rows = int(options.get("snapshot_chunk_rows") or DEFAULT_CHUNK_ROWS)
        self.chunks_per_batch = int(options.get("snapshot_chunks_per_batch") or DEFAULT_CHUNKS_PER_BATCH)  # 0: auto
        self.snapshot_budget = int(options.get("snapshot_budget") or 1)  # (sinks.base.Sink.snapshot_budget)
        self._row_bytes: dict[tuple[str, str], float | None] = {}  # (node, table) -> bytes per row, for auto
        first = next(iter(self.nodes))  # the feed's snapshot requests are on its first node
        self.requests = SourceRequests(lambda: self.conn(first), self.feed, options.get("requests_dir") or None)
        self.barrier_file = Path(options["barrier_file"]) if options.get("barrier_file") else None
        self.joining_file = Path(options["joining_file"]) if options.get("joining_file") else None
        self.resume = Offset.from_json(options["resume_offset"]) if options.get("resume_offset") else None
        self.resume_until = Offset.from_json(options["resume_until"]) if options.get("resume_until") else None
        self._replay = replay_ends(Path(options["replay_file"])) if options.get("replay_file") else []
        self.checkpoint = Path(options["checkpoint"]) if options.get("checkpoint") else None
        self.follow_s = float(options.get("follow_s") or 0)
        self.follow_end = Path(options["follow_end"]) if options.get("follow_end") else None
        self.follow_sink: dict[str, str] | None = json.loads(options.get("follow_sink") or "null")
        self._tables: dict[tuple[str, str], src.SourceTable] = {}
        self._ahead = BoundariesAhead(self._boundary_on, lambda n: connect(self.nodes[n].uri, self._role(n)),
                                      lambda entry: snapshot.node_of(entry, DEFAULT_NODE)[0])
        self._planned_at = float("-inf")  # monotonic time the last batch was planned
        self._conns: dict[str, Any] = {}
        self._exports: dict[str, Any] = {}  # node -> the connection holding the last batch's exported snapshot
        self._truncates = judge.Truncates()  # the storage of tables a first read judges, as noted
        self._marks: dict[str, slots.RestartMark] = {}  # per node (postgres.slots.RestartMark)
        self._released: dict[str, int] = {}  # per node: its slot is known to be at or past this LSN
        self._available_now: Readings | None = None  # an AvailableNow run's end
        self._seen: dict[str, tuple[int, bool]] = {}  # node -> (the last plan's frontier, fixed for the run)
        limits = dist.Limits(self.max_bytes, self.max_changes, int(options.get("max_clock_skew_us") or 500_000))
        self.cut = nodes_cut.Cut(self.nodes, self.conn, self._on, limits,
                                 2 * (self.max_bytes or DEFAULT_MAX_BYTES) if self.max_bytes or self.max_changes
                                 else None)

    def conn(self, node: str) -> Any:
        """The driver's connection to `node` (a ConnectionFailed names the node)."""
        conn = self._conns.get(node)
        if conn is None or conn.closed:
            conn = self._conns[node] = connect(self.nodes[node].uri, self._role(node))
        return conn

    def _role(self, node: str) -> str:
        return node_role(node, self.multi_node)

    def _on(self, node: str) -> Any:
        """Work on `node`: a connection lost meanwhile is ConnectionFailed naming the node."""
        return lost_connection(self._role(node))

    @carried("source")
    @lost_connection("source")
    def initialOffset(self) -> dict[str, Any]:
        """A new feed starts at its slots and its snapshot; a feed whose runner has no checkpoint of
        it (`resume_offset`, spark.checkpoint.resume) where its sink's last batch ended; a query
        run again before its first batch was committed where it started (spark.checkpoint.recorded_start)."""
        recorded = recorded_start(self.checkpoint) if self.checkpoint else None
        if recorded is None:
            start = self._initial()
            until = self.resume_until.to_json() if self.resume and self.resume_until else None
            if self.checkpoint:
                record_start(self.checkpoint, start, until)
        else:
            start, until = recorded
        if until is not None and Offset.from_json(until) not in self._replay:  # (the first batch ends there)
            self._replay = sorted([*self._replay, Offset.from_json(until)], key=lambda e: e.order)
        return start

    def _initial(self) -> dict[str, Any]:
        lsns = {}
        for name, node in self.nodes.items():
            with self._on(name):
                state = slots.slot_state(self.conn(name), node.slot)
            slots.check_slot_usable(state, node.slot, None, self.feed)
            assert state is not None and state.confirmed_flush is not None
            lsns[name] = state.confirmed_flush
            resumed = self.resume.lsns.get(name) if self.resume is not None else None
            if resumed is not None and resumed < state.confirmed_flush:
                raise SlotLost(f"replication slot {node.slot} is at {format_lsn(state.confirmed_flush)}, past the "
                               f"sink's last batch of feed {self.feed} at {format_lsn(resumed)}: the changes between "
                               "were released without reaching the sink (a sink restored from a backup?)",
                               start_over_hint(self.feed))
        if self.resume is not None:  # (a node the sink's last batch did not read yet: from its slot)
            return replace(self.resume, lsns={**lsns, **self.resume.lsns}).to_json()
        entries = self.snapshot_entries  # a first read each: the sinks hold nothing yet (core.judge)
        return Offset(lsns, 0, snapshot.Cursor(pending=entries, first=len(entries))).to_json()

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.max_changes:
            return ReadMaxRows(self.max_changes)
        if self.max_bytes:
            return ReadMaxBytes(self.max_bytes)
        return ReadAllAvailable()

    @carried("source")
    @lost_connection("source")
    def prepareForTriggerAvailableNow(self) -> None:
        self._note_storage(self._judged_tables([snapshot.Chunk(0, e, None, None, (), True)
                                                for e in self.snapshot_entries]))  # (before the run's end is fixed)
        self._available_now = self._readings()

    def _readings(self) -> Readings:
        """Per node: its flushed LSN (and the latest clock read with one), then (once every node
        was read) a fresh frontier."""
        certain, theta = self.cut.certain()
        return Readings(certain, theta, self._frontiers())

    def _frontiers(self) -> dict[str, Frontier]:
        """Per node: a fresh flushed LSN and the node's clock then (see core.resolved)."""
        out = {}
        for name in self.nodes:
            with self._on(name):
                mark = self._marks.get(name) or self._marks.setdefault(name, slots.RestartMark())
                mark.maybe(self.conn(name))  # (before the end)
                out[name] = Frontier(*self.wal.heartbeat(self.conn(name)))
        return out

    def _boundary_key(self, entry: str, after: snapshot.Key | None, rows: int,
                      upto: snapshot.Key | None) -> snapshot.Key | None:
        found, key = self._ahead.take(entry, after, rows, upto)
        if found:
            return key
        node, table = snapshot.node_of(entry, DEFAULT_NODE)
        with self._on(node):
            self._described(node, table)
            key = self._boundary_on(self.conn(node), entry, after, rows, upto)
        self._ahead.keep(entry, after, rows, upto, key)
        return key

    def _boundary_on(self, conn: Any, entry: str, after: snapshot.Key | None, rows: int,
                     upto: snapshot.Key | None) -> snapshot.Key | None:
        """The key ending a chunk (postgres.snapshot.chunk_boundary) on `conn`, the planner's or
        BoundariesAhead's thread's, of a table described already."""
        node, table = snapshot.node_of(entry, DEFAULT_NODE)
        return snap_pg.chunk_boundary(conn, self._tables[(node, table)], after, rows, upto,
                                      self.row_filters.get(table))

    def _last_key(self, entry: str) -> snapshot.Key | None:
        node, table = snapshot.node_of(entry, DEFAULT_NODE)
        with self._on(node):
            return snap_pg.last_key(self.conn(node), self._described(node, table))

    def _described(self, node: str, table: str) -> src.SourceTable:
        if (node, table) not in self._tables:
            with self._on(node):
                self._tables[(node, table)] = src.describe_tables(self.conn(node), [table], self.column_lists)[0]
        return self._tables[(node, table)]

    def _held_back(self, start: Offset, node: str) -> frozenset[str]:
        """Node `node`'s tables without a key whose snapshot (for every sink) is still to come at
        the batch's start: their changes wait for it (core.snapshot.held_back)."""
        return frozenset(t for t, every in start.cursor.waiting(node) if every and not self._described(node, t).key)

    def _judge(self, end: Offset, node: str) -> judge.Judge:
        """What node `node`'s window of the batch ending at `end` is judged against (core.judge)."""
        if not end.reads and not any(end.cursor.first_reads()):
            return judge.Judge({}, {})
        unjudged = [t for t, _ in end.cursor.waiting(node) if t in self.unjudged or not self._described(node, t).key]
        return judge.Judge.of(node if self.multi_node else DEFAULT_NODE, end.reads, end.cursor, unjudged)

    def _sequential(self, end: Offset) -> bool:
        """Whether the batch must be read in one task, its window before its chunks: it carries a
        table without a key, whose rows a sink told apart by their place in the batch only (a
        webhook's idempotency keys) must find where they were when the batch is read again."""
        return any(self._keyless(c.table) for c in end.chunks)

    def _requested(self, start: Offset, cursor: snapshot.Cursor) -> snapshot.Cursor:
        """`cursor` with the snapshot requests a batch from `start` takes in. A request of tables
        the sinks hold nothing of (core.requests.Request.first) is a first read unless the batch
        before was followed: that one's window was not fixed when it was planned, so it may
        have brought their changes already."""
        for r in self.requests.after(cursor.requests):
            if not r.fits(self.nodes, self.sinks):
                break  # a node or sink added since this query started: its next query takes the request in
            if not r.due(start.lsns):
                break  # a row filter changed past this batch's start: the batch after that takes it in
            cursor = cursor.request(snapshot.entries(r.tables, list(self.nodes)), r.no, r.only,
                                    r.first and not start.follow)
        return cursor

    def _plan_snapshot(self, start: Offset) -> tuple[list[snapshot.Chunk], snapshot.Cursor]:
        cursor = self._requested(start, start.cursor)
        chunks, after = cursor.plan(self._boundary_key, self.chunks_per_batch or self._auto_chunks, self.chunk_rows,
                                    self._keyless, self._last_key)
        if chunks:  # the next batch's boundaries, found while this one is applied (spark.boundaries_ahead)
            self._ahead.start(after, self._known_chunks, self.chunk_rows, self._known_keyless)
        return chunks, after

    def _auto_chunks(self, entry: str) -> int:
        """--snapshot-chunks-per-batch auto (core.snapshot.auto_chunks): a batch's chunks of the table `entry`."""
        size = None
        if self._sized():
            node, table = snapshot.node_of(entry, DEFAULT_NODE)
            if (node, table) not in self._row_bytes:
                with self._on(node):
                    self._row_bytes[(node, table)] = snap_pg.row_bytes(self.conn(node), table)
            size = self._row_bytes[(node, table)]
        return snapshot.auto_chunks(self.parallel_reads, self.max_bytes, self.chunk_rows, size, self.snapshot_budget,
                                    self.rates.rows, self.rates.bytes)

    def _known_chunks(self, entry: str) -> int | None:
        """A batch's chunks of the table `entry`, as planned, where that asks the source nothing (else None)."""
        if not self.chunks_per_batch and self._sized() and snapshot.node_of(entry, DEFAULT_NODE) not in self._row_bytes:
            return None
        return self.chunks_per_batch or self._auto_chunks(entry)

    def _sized(self) -> bool:
        """Whether auto_chunks needs a table's bytes per row: read in one task, or under a --snapshot-rate in bytes."""
        return not self.parallel_reads or bool(self.rates.bytes)

    def _known_keyless(self, entry: str) -> bool | None:
        """_keyless of a table described already (None: not yet)."""
        table = self._tables.get(snapshot.node_of(entry, DEFAULT_NODE))
        return None if table is None else not table.key

    def _keyless(self, entry: str) -> bool:
        node, table = snapshot.node_of(entry, DEFAULT_NODE)
        return not self._described(node, table).key

    def _unjudged(self, entry: str) -> bool:
        """Whether a read of `entry` is not judged (core.judge): read in a snapshot of its own (a
        table without a key), or not a sink's image of its rows (an outbox's reads send no events)."""
        return entry in self.unjudged or self._keyless(entry)

    @carried("source")
    @lost_connection("source")
    def latestOffset(self, start_json: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        # Spark plans a batch only once the previous one is committed downstream, so `start` is
        # safe to release now (Spark's own `commit(start)` comes later): the cut below then
        # decodes only the new window.
        logged = self._joined(Offset.from_json(start_json))
        start = followed.started(logged, self.follow_end)
        self._release(start)
        self._end_exports()  # (the batch that read in them is committed)
        replayed = next((e for e in self._replay if e.order > start.order), None)
        if replayed is not None:  # what a sink lacks: exactly the batches the others recorded
            return replayed.to_json()
        self.rates.refresh()
        barrier = bar.read(self.barrier_file) if self.barrier_file else None
        if barrier is not None and barrier.reached(start.lsns):
            return start_json  # a verify compares the sink at exactly here: wait for it
        if isinstance(limit, ReadAllAvailable):  # AvailableNow may take several batches: keep ours
            limit = self.getDefaultReadLimit()
        # (no snapshot chunk while a verify waits: a chunk is read later than its window's end)
        chunks, cursor = self._plan_snapshot(start) if barrier is None else ([], start.cursor)
        # Low-latency mode follows the slot in every batch but one after a followed batch that
        # recorded nothing: an idle feed's batch of heartbeats moves its resolved ts and slot.
        idle = logged.follow and start == logged
        if self.follow_s and not chunks and not start.reads and barrier is None and self._available_now is None \
                and not idle:  # (a followed batch is not judged: core.judge)
            self._planned_at = time.monotonic()
            return replace(start, cursor=cursor, chunks=(), follow=start.follow + 1).to_json()
        judged = self._judged_tables(chunks)
        self._note_storage(judged)  # (before the window's end is fixed: core.judge.Truncates)
        with self.requests.planning() if self.multi_node else nullcontext():
            end = self._planned(start, limit, barrier, cursor, chunks)
        if end is None:
            return start_json
        self._planned_at = time.monotonic()
        return self._judged(start, end, judged).to_json()

    def _planned(self, start: Offset, limit: ReadLimit, barrier: bar.Barrier | None, cursor: snapshot.Cursor,
                 chunks: Sequence[snapshot.Chunk]) -> Offset | None:
        """The batch from `start`, its window's end fixed now (None: nothing to plan). Requests
        made since the planning of `cursor` are taken in too: one made with the publication of its
        tables (control.lifecycle.add_tables) that is not seen here was made after the end, so no
        window before the one that takes it in brings a change of them."""
        readings = self._take_readings(start, bool(chunks))
        if readings is None:
            return None
        lsns = {n: f.lsn for n, f in readings.frontiers.items()}
        self._seen = {n: (lsn, not chunks and self._available_now is not None) for n, lsn in lsns.items()}
        if all(lsns[n] <= start.lsns.get(n, 0) for n in lsns):  # (never with chunks: fresh heartbeats)
            return None
        if self.multi_node:
            end = self._plan_nodes(start, readings, barrier, cursor, tuple(chunks))
        else:
            end = self._plan_one(start, readings, limit, barrier, cursor, tuple(chunks))
        return None if end is None else replace(end, cursor=self._requested(start, end.cursor))

    def _judged_tables(self, chunks: Sequence[snapshot.Chunk]) -> dict[str, list[tuple[str, str, str]]]:
        """Per node, the tables of `chunks` a first read judges (core.judge): (entry, schema, table)."""
        out: dict[str, list[tuple[str, str, str]]] = {}
        for entry in sorted({c.table for c in chunks if c.first and not c.only and not self._unjudged(c.table)}):
            node, table = snapshot.node_of(entry, DEFAULT_NODE)
            if node in self.nodes:
                t = self._described(node, table)
                out.setdefault(node, []).append((entry, t.schema, t.name))
        return out

    def _note_storage(self, tables: Mapping[str, Sequence[tuple[str, str, str]]]) -> None:
        """Note the storage of `tables` now (core.judge.Truncates)."""
        for node, named in tables.items():
            with self._on(node):
                conn = self.conn(node)
                for entry, schema, table in named:
                    stored = snap_pg.storage(conn, schema, table)  # (then the position: it held there)
                    self._truncates.note(entry, stored, insert_lsn(conn))

    def _judged(self, start: Offset, end: Offset, tables: Mapping[str, Sequence[tuple[str, str, str]]]) -> Offset:
        """`end` with the snapshot reads its windows are judged against (core.judge): those of
        earlier batches the stream has not passed, and its own chunks' (of `tables`), each node's
        read in a snapshot exported now (after the window's end is fixed) that the chunks import.
        A read of a table that may have been truncated after the window's end judges its own
        batch's window only (core.judge.Truncates)."""
        exported: dict[str, snap_pg.Exported] = {}
        if tables:
            faults.reach("snapshot_export")  # crash tests: the window's end fixed, its read not begun
        for node, named in sorted(tables.items()):
            with self._on(node):
                conn = self._exports.get(node)
                if conn is None or conn.closed:
                    conn = self._exports[node] = connect(self.nodes[node].uri, self._role(node))
                exported[node] = snap_pg.export(conn, named)
        files = {e: f for x in exported.values() for e, f in x.files.items()}
        unjudged = {c.table for c in end.chunks if self._unjudged(c.table)}
        own = judge.reads_of(end.chunks, {n: (e.snap, e.hw) for n, e in exported.items()}, DEFAULT_NODE, unjudged)
        ends = {n: end.lsns.get(n, 0) for n in tables}
        reads = judge.carried(start.reads, start.lsns, DEFAULT_NODE) + [
            r if self._truncates.steady(r.entry, files.get(r.entry, ""),
                                        ends.get(snapshot.node_of(r.entry, DEFAULT_NODE)[0], 0))
            else replace(r, hw=0) for r in own]
        return replace(end, reads=tuple(reads), exports={n: e.id for n, e in exported.items()})

    def _end_exports(self, close: bool = False) -> None:
        """End the transactions that held the last batch's exported snapshots (and with `close`
        their connections; a lost one is dropped: it holds nothing any more)."""
        for node, conn in list(self._exports.items()):
            try:
                if close:
                    conn.close()
                elif conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    conn.execute("ROLLBACK")
            except psycopg.Error:  # (a lost connection: a new one for the next export)
                self._exports.pop(node)
                conn.close()
        if close:
            self._exports.clear()

    def _take_readings(self, start: Offset, chunks: bool) -> Readings | None:
        """The readings a batch is planned from; None when there is nothing to plan."""
        if chunks:
            return self._readings()  # a fresh end, so the batch (and its chunks) is recorded on the sink
        if self._available_now is not None:
            return self._available_now
        if self.multi_node and self.cut.waiting():
            return None  # a transaction in doubt keeps every node where it is: nothing to plan yet
        certain, theta = self.cut.certain()
        moved = any(certain[n] > start.lsns.get(n, 0) for n in self.nodes)
        idle_due = 0 < self.resolved_interval <= time.monotonic() - self._planned_at
        if not moved and not idle_due:
            return None  # nothing new, and the resolved ts is fresh enough: no batch
        # Heartbeats give the batch a flushed end on every node, even an idle one, so the slots
        # (and the WAL they hold) and the resolved ts keep moving.
        return Readings(certain, theta, self._frontiers())

    def _plan_one(self, start: Offset, readings: Readings, limit: ReadLimit, barrier: bar.Barrier | None,
                  cursor: snapshot.Cursor, chunks: tuple[snapshot.Chunk, ...]) -> Offset | None:
        """A one-node feed's batch: its window cut by the read limit at a page or commit boundary,
        or after the changes --max-rate allows it now (none while that is under a tenth of a second's)."""
        allowed = self.rates.changes_allowed()
        if allowed is not None and allowed < max(1, self.rates.max_rate // 10):
            return None
        lsns = {n: max(start.lsns.get(n, Lsn(0)), self._cut(n, start.lsns.get(n, Lsn(0)), f.lsn, limit, allowed))
                for n, f in readings.frontiers.items()}
        if allowed is not None:
            self.rates.spent(self.wal.counted)  # (what the window holds: whole transactions may pass the allowance)
        if barrier is not None:
            lsns = {n: Lsn(at) for n, at in barrier.cap(start.lsns, lsns).items()}
        return Offset(lsns, resolved_ts(start.ts, readings.frontiers), cursor, chunks)

    def _plan_nodes(self, start: Offset, readings: Readings, barrier: bar.Barrier | None,
                    cursor: snapshot.Cursor, chunks: tuple[snapshot.Chunk, ...]) -> Offset | None:
        """A feed of several nodes' batch: a cut in commit time, distributed transactions whole
        (postgres/cut.py, core.distributed); None while nothing can move."""
        if self.joining_file is not None and set(_words(self.joining_file)) - set(self.nodes):
            return None  # a node is being added: plan nothing until the query that reads it (checked after
            #              the readings, so a node whose slot was made after them is waited for)
        frontiers = {n: f.lsn for n, f in readings.frontiers.items()}
        caps = {n: at for n, at in (barrier.lsns.items() if barrier else ()) if start.lsns.get(n, 0) <= at}
        plan, scans = self.cut.plan(start, readings.certain, readings.theta, frontiers, caps)
        # No batch that only moves past heartbeats and prepares while a transaction in doubt keeps
        # the commits back: it would cost a batch per poll and look like progress.
        if not chunks and (not plan.moved(scans) or plan.waits and not plan.delivers):
            self.cut.wait(plan)
            if self._available_now is not None and _left(scans, plan, readings.certain):
                raise self.cut.in_doubt(plan)
            return None
        parts = {n: tuple((p.gid, p.xid, p.commit or 0) for p in v) for n, v in plan.parts.items() if v}
        opened = {n: v for n, v in plan.open.items() if v}
        ts = window_end_ts(start.ts, plan.theta_us // 1000)
        ends = {n: Lsn(at) for n, at in plan.ends.items()}
        return Offset(ends, ts, cursor, chunks, plan.theta_us, parts, opened)

    def _joined(self, start: Offset) -> Offset:
        """`start` with a node added to the feed since (see lifecycle.add_node) at its slot's position."""
        new = [n for n in self.nodes if n not in start.lsns]
        if not new:
            return start
        lsns = dict(start.lsns)
        for n in new:
            with self._on(n):
                state = slots.slot_state(self.conn(n), self.nodes[n].slot)
            slots.check_slot_usable(state, self.nodes[n].slot, None, self.feed)
            assert state is not None and state.confirmed_flush is not None
            lsns[n] = state.confirmed_flush
        return replace(start, lsns=lsns)

    def _cut(self, node: str, start: Lsn, lsn: Lsn, limit: ReadLimit, allowed: int | None = None) -> Lsn:
        """Where node `node`'s window [start, lsn) ends under the read limit (per node), or after
        `allowed` row changes (--max-rate)."""
        max_changes = limit.max_rows if isinstance(limit, ReadMaxRows) else 0
        with self._on(node):
            return self.wal.cut(self.conn(node), self.nodes[node], start, lsn,
                                max_bytes=limit.max_bytes if isinstance(limit, ReadMaxBytes) else 0,
                                max_changes=max_changes if allowed is None else min(allowed, max_changes or allowed),
                                rows_only=allowed is not None)

    def partitions(self, start_json: dict[str, Any], end_json: dict[str, Any]) -> Sequence[InputPartition]:
        start, end = Offset.from_json(start_json), Offset.from_json(end_json)
        if end.follow:  # (a followed batch: one node, one task, from where its offset says)
            wanted = Wanted(self.feed, frozenset(self.nodes), frozenset(self.sinks),
                            str(self.barrier_file) if self.barrier_file else None)
            return [FollowPartition(self.nodes[n], end, self.follow_s, self.rows_per_batch, wanted, self.follow_sink)
                    for n in end.lsns]
        start = followed.started(start, self.follow_end, end)
        # (a batch planned before a node was removed from the feed is replayed without that node)
        parts: list[BatchPartition] = [WindowPartition(self.nodes[n], start, end, self.rows_per_batch, self.multi_node,
                                                       self.wal.name)
                                       for n in sorted(end.lsns) if end.lsns[n] > start.lsns.get(n, 0)
                                       and n in self.nodes]
        rate = self.rates.per_read(len(end.chunks), len(end.chunks) * self.chunk_rows,  # (--snapshot-rate)
                                   self.parallel_reads)
        for c in end.chunks:
            node = snapshot.node_of(c.table, DEFAULT_NODE)[0]
            if node in self.nodes:
                table = snapshot.node_of(c.table, DEFAULT_NODE)[1]
                parts.append(ChunkPartition(self.nodes[node], c, start, end, self.rows_per_batch, self.multi_node,
                                            self.row_filters.get(table), self.column_lists.get(table), rate))
        for i, part in enumerate(parts):
            part.part, part.parts = i, len(parts)
            if isinstance(part, WindowPartition):
                part.held = self._held_back(start, part.node.name)
                part.judge = self._judge(end, part.node.name)
            elif isinstance(part, ChunkPartition) and not part.chunk.only and not self._unjudged(part.chunk.table):
                part.exported = end.exports.get(part.node.name)
            seen = self._seen.get(part.node.name)
            if isinstance(part, WindowPartition) and not self.multi_node and part.wal == "peek" and seen:
                frontier, fixed = seen
                part.ahead = read_ahead.predict(part.end_lsn, frontier, 0 if self.max_changes else self.max_bytes,
                                                self.wal.block_size, fixed)
        if self.parallel_reads and not self._sequential(end) and len(parts) > 1:
            return parts  # read by a task each
        one_task = [self._by_reference(p) for p in parts]
        return one_task if len(one_task) < 2 else [GroupPartition(one_task)]

    def _by_reference(self, part: BatchPartition) -> BatchPartition:
        """`part`, read by the batch's writer task where the sink's writer takes the rows as they
        are read (spark.reads.resolve): one task reads the batch, so nothing runs in parallel."""
        if self.read_in_writer:
            part.by_reference = True
        return part

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return read_followed(partition) if isinstance(partition, FollowPartition) else read_partition(partition)

    @carried("source")
    @lost_connection("source")
    def commit(self, end: dict[str, Any]) -> None:
        """Spark has committed the batch ending at `end` downstream: release WAL before it."""
        self._release(Offset.from_json(end))

    def _release(self, end: Offset) -> None:
        """Move each node's slot as far as `end` allows; called for every poll (see
        latestOffset), so a slot is asked only when its position is new."""
        for name in end.lsns.keys() & self.nodes.keys():
            lsn = end.lsns[name]
            if lsn > self._released.get(name, 0):
                with self._on(name):
                    slots.release(self.conn(name), self.nodes[name], lsn, self.multi_node)
                self._released[name] = lsn

    def stop(self) -> None:
        self._end_exports(close=True)
        self._ahead.close()
        for conn in self._conns.values():
            conn.close()


@dataclass(frozen=True)
class Readings:
    """What a batch is planned from: per node a flushed position read first (`certain`), the
    latest server clock read right after one (`theta`, Unix µs), and the frontiers written after."""

    certain: Mapping[str, Lsn]
    theta: int
    frontiers: dict[str, Frontier]


def _left(scans: dict[str, dist.NodeScan], plan: dist.Plan, certain: Mapping[str, int]) -> bool:
    """Whether a node has a commit before its `certain` position that the plan leaves undelivered."""
    return any(plan.ends[n] <= c.start < certain[n] for n, s in scans.items() for c in dist.pair(s)[0])


def _words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []
