"""`changefeed` PySpark streaming source: PostgreSQL logical decoding as micro-batches.

Offsets are core.offsets.Offset: the batch's upper WAL bound on each node, its resolved commit
timestamp (no change in a later batch gets a smaller one, see core.resolved), the snapshot cursor
after it, and the snapshot chunks it carries (see core.snapshot; each chunk is one more input
partition). On each node a batch holds what starts in [start, end) (see postgres/changes.py),
read by an input partition (a Spark task) of its own. A bound is a flushed position that splits
no WAL record: a heartbeat's end, a commit's end (a change limit) or a WAL page boundary (a byte
limit, found without decoding). The driver only plans offsets and advances the slots in
`commit`; executors decode in `read` (spark/reads.py). On nodes with two-phase slots the planner also scans the
prepared transactions' events and lets core.distributed hold and cut windows so that a
distributed transaction is delivered whole, in one batch.

Spark imports this module in every Python process it starts to plan a query (a new one each
step, one after another, at a feed's start), so the decoder and its numpy/Arrow imports are
imported by the read functions alone (spark/reads.py): ~0.1 s less in each of those processes.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxBytes, ReadMaxRows

from ..config import DEFAULT_CHUNK_ROWS, DEFAULT_CHUNKS_PER_BATCH, SourceNode, node_role
from ..core import barrier as bar
from ..core import change as ch
from ..core import distributed as dist
from ..core import snapshot
from ..core.nodes import DEFAULT_NODE, classic
from ..core.offsets import Offset
from ..core.resolved import Frontier, resolved_ts
from ..core.requests import SnapshotRequests
from ..errors import carried
from ..postgres import read_ahead
from ..postgres import snapshot as snap_pg
from ..postgres import source as src
from ..postgres import twophase
from ..postgres.wal_reader import DEFAULT as DEFAULT_WAL_READER
from ..postgres.wal_reader import WalReader, wal_reader
from ..postgres.connect import connect, lost_connection
from .reads import BatchPartition, ChunkPartition, GroupPartition, WindowPartition, read_partition

try:  # SupportsTriggerAvailableNow is in pyspark >= 4.2
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
except ImportError:  # pragma: no cover
    SupportsTriggerAvailableNow = object  # type: ignore[misc,assignment]


class ChangefeedSource(DataSource):
    """Options: nodes (JSON list of [name, uri, slot, publication]), feed, max_bytes_per_batch,
    max_changes_per_batch, resolved_interval_s, snapshot_tables (read first on a fresh checkpoint),
    snapshot_chunk_rows, snapshot_chunks_per_batch, requests_dir (snapshot requests, see
    core.requests), barrier_file (see core.barrier), wal_reader (peek or stream, see
    postgres/wal_reader.py), parallel_reads ("false": a batch's partitions are read by one task,
    as one GroupPartition)."""

    @classmethod
    def name(cls) -> str:
        return "changefeed"

    def schema(self) -> str:
        return ch.PACKED_DDL

    def streamReader(self, schema: Any) -> ChangeStreamReader:
        return ChangeStreamReader(dict(self.options))


class ChangeStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):  # type: ignore[misc]
    def __init__(self, options: dict[str, str]) -> None:
        self.nodes = {n[0]: SourceNode(*n) for n in json.loads(options["nodes"])}
        self.multi_node = not classic(self.nodes)  # as FeedSpec.multi_node
        self.feed = options["feed"]
        self.max_bytes = int(options.get("max_bytes_per_batch") or 0)
        self.max_changes = int(options.get("max_changes_per_batch") or 0)
        self.rows_per_batch = int(options.get("arrow_batch_rows") or 65536)
        self.wal: WalReader = wal_reader(options.get("wal_reader") or DEFAULT_WAL_READER)
        self.parallel_reads = options.get("parallel_reads", "true") != "false"
        self.resolved_interval = float(options.get("resolved_interval_s") or 0)
        tables = [t for t in (options.get("snapshot_tables") or "").split(",") if t]
        self.snapshot_entries = snapshot.entries(tables, list(self.nodes))
        self.chunk_rows = int(options.get("snapshot_chunk_rows") or DEFAULT_CHUNK_ROWS)
        self.chunks_per_batch = int(options.get("snapshot_chunks_per_batch") or DEFAULT_CHUNKS_PER_BATCH)
        self.requests = SnapshotRequests(options["requests_dir"]) if options.get("requests_dir") else None
        self.barrier_file = Path(options["barrier_file"]) if options.get("barrier_file") else None
        self._tables: dict[tuple[str, str], src.SourceTable] = {}
        self._planned_at = float("-inf")  # monotonic time the last batch was planned
        self._conns: dict[str, Any] = {}
        self._released: dict[str, int] = {}  # per node: its slot is known to be at or past this LSN
        self._available_now: tuple[dict[str, int], dict[str, Frontier]] | None = None  # an AvailableNow run's end
        self._two_phase: dict[str, tuple[int, bool, bool]] = {}  # node -> (its connection's id, slot, scanned)
        self._seen: dict[str, tuple[int, bool]] = {}  # node -> (the last plan's frontier, fixed for the run)

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
        lsns = {}
        for name, node in self.nodes.items():
            with self._on(name):
                state = src.slot_state(self.conn(name), node.slot)
            src.check_slot_usable(state, node.slot, None, self.feed)
            assert state is not None and state.confirmed_flush is not None
            lsns[name] = state.confirmed_flush
        holds = {n: lsn for n, lsn in lsns.items() if self._two_phase_of(n)[0]}
        return Offset(lsns, 0, snapshot.Cursor(pending=self.snapshot_entries), holds=holds).to_json()

    def _two_phase_of(self, node: str) -> tuple[bool, bool]:
        """(Whether node `node`'s slot decodes two-phase, whether the node can prepare transactions
        at all, so that its WAL must be scanned); read again on each new connection, as a restart
        may have changed max_prepared_transactions."""
        conn = self.conn(node)
        known = self._two_phase.get(node)
        if known is None or known[0] != id(conn):
            with self._on(node):
                state = src.slot_state(conn, self.nodes[node].slot)
                slot = bool(state and state.two_phase)
                known = self._two_phase[node] = (id(conn), slot, slot and twophase.capable(conn))
        return known[1], known[2]

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.max_changes:
            return ReadMaxRows(self.max_changes)
        if self.max_bytes:
            return ReadMaxBytes(self.max_bytes)
        return ReadAllAvailable()

    @carried("source")
    @lost_connection("source")
    def prepareForTriggerAvailableNow(self) -> None:
        self._available_now = self._readings()

    def _readings(self) -> tuple[dict[str, int], dict[str, Frontier]]:
        """Per node: its flushed LSN, then (once every node was read) a fresh frontier."""
        certain = {n: self._flushed(n) for n in self.nodes}
        return certain, self._frontiers()

    def _frontiers(self) -> dict[str, Frontier]:
        """Per node: a fresh flushed LSN and the node's clock then (see core.resolved)."""
        out = {}
        for name in self.nodes:
            with self._on(name):
                out[name] = Frontier(*self.wal.heartbeat(self.conn(name)))
        return out

    def _boundary_key(self, entry: str, after: snapshot.Key | None, rows: int) -> snapshot.Key | None:
        node, table = snapshot.node_of(entry, DEFAULT_NODE)
        with self._on(node):
            if (node, table) not in self._tables:
                self._tables[(node, table)] = src.describe_tables(self.conn(node), [table])[0]
            return snap_pg.chunk_boundary(self.conn(node), self._tables[(node, table)], after, rows)

    def _plan_snapshot(self, start: Offset) -> tuple[list[snapshot.Chunk], snapshot.Cursor]:
        cursor = start.cursor
        if self.requests is not None:
            for no, tables in self.requests.after(cursor.requests):
                if any(snapshot.node_of(t, DEFAULT_NODE)[0] not in self.nodes for t in tables):
                    break  # a node added since this query started: its next query takes the request in
                cursor = cursor.request(snapshot.entries(tables, list(self.nodes)), no)
        return cursor.plan(self._boundary_key, self.chunks_per_batch, self.chunk_rows)

    @carried("source")
    @lost_connection("source")
    def latestOffset(self, start_json: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        # Spark plans a batch only once the previous one is committed downstream, so `start` is
        # safe to release now (Spark's own `commit(start)` comes later): the cut below then
        # decodes only the new window.
        start = self._joined(Offset.from_json(start_json))
        self._release(start)
        barrier = bar.read(self.barrier_file) if self.barrier_file else None
        if barrier is not None and barrier.reached(start.lsns):
            return start_json  # a verify compares the sink at exactly here: wait for it
        if isinstance(limit, ReadAllAvailable):  # AvailableNow may take several batches: keep ours
            limit = self.getDefaultReadLimit()
        # (no snapshot chunk while a verify waits: a chunk is read later than its window's end)
        chunks, cursor = self._plan_snapshot(start) if barrier is None else ([], start.cursor)
        if chunks:
            # A fresh end, so the batch (and its chunks) is recorded on the sink as applied.
            certain, frontiers = self._readings()
        elif self._available_now is not None:
            certain, frontiers = self._available_now
        else:
            certain = {n: self._flushed(n) for n in self.nodes}
            moved = any(certain[n] > start.lsns.get(n, 0) for n in self.nodes)
            idle_due = 0 < self.resolved_interval <= time.monotonic() - self._planned_at
            if not moved and not idle_due:
                return start_json  # nothing new, and the resolved ts is fresh enough: no batch
            # Heartbeats give the batch a flushed end on every node, even an idle one, so the
            # slots (and the WAL they hold) and the resolved ts keep moving.
            frontiers = self._frontiers()
        lsns = {n: f.lsn for n, f in frontiers.items()}
        fixed = not chunks and self._available_now is not None
        self._seen = {n: (lsn, fixed) for n, lsn in lsns.items()}
        if all(lsns[n] <= start.lsns.get(n, 0) for n in lsns):  # (never with chunks: fresh heartbeats)
            return start_json
        for n, lsn in lsns.items():
            lsns[n] = max(start.lsns.get(n, 0), self._cut(n, start.lsns.get(n, 0), lsn, limit))
        if barrier is not None:
            lsns = barrier.cap(start.lsns, lsns)
        frontiers = dict(frontiers)  # (an AvailableNow run plans all its batches from the same ones)
        holds = self._distributed(start, lsns, certain, frontiers)
        if not chunks and all(lsns[n] <= start.lsns.get(n, 0) for n in lsns):
            return start_json  # every new commit waits for a distributed transaction's other parts
        self._planned_at = time.monotonic()
        return Offset(lsns, resolved_ts(start.ts, frontiers), cursor, tuple(chunks), holds).to_json()

    def _joined(self, start: Offset) -> Offset:
        """`start` with a node added to the feed since (see lifecycle.add_node) at its slot's position."""
        new = [n for n in self.nodes if n not in start.lsns]
        if not new:
            return start
        lsns, holds = dict(start.lsns), dict(start.holds)
        for n in new:
            with self._on(n):
                state = src.slot_state(self.conn(n), self.nodes[n].slot)
            src.check_slot_usable(state, self.nodes[n].slot, None, self.feed)
            assert state is not None and state.confirmed_flush is not None
            lsns[n] = state.confirmed_flush
            if self._two_phase_of(n)[0]:
                holds[n] = state.confirmed_flush
        return replace(start, lsns=lsns, holds=holds)

    def _distributed(self, start: Offset, lsns: dict[str, int], certain: dict[str, int],
                     frontiers: dict[str, Frontier]) -> dict[str, int]:
        """Hold and cut the windows of two-phase nodes (see core.distributed); returns the holds.
        Moves `lsns` and `frontiers` of a node whose window was cut."""
        windows, holds = {}, {}
        for n in self.nodes:
            slot, scanned = self._two_phase_of(n)
            if not slot:
                continue
            holds[n] = start.lsns.get(n, 0)
            if scanned:
                at, node = start.release(n), self.nodes[n]
                with self._on(n):
                    upto = max(lsns[n], frontiers[n].lsn)  # past a window cut by a read limit
                    events = twophase.events(self.conn(n), node.slot, node.publication, upto) if upto > at else ()
                windows[n] = dist.NodeWindow(at, start.lsns.get(n, 0), lsns[n], certain[n], events)
        for n, d in dist.decide(windows).items():
            holds[n], lsns[n] = d.hold, d.end
            if d.cut_time_us is not None:  # the window now ends before a commit at that time
                frontiers[n] = Frontier(d.end, min(frontiers[n].clock_ms, d.cut_time_us // 1000 - 1))
        return holds

    def _flushed(self, node: str) -> int:
        with self._on(node):
            return src.flush_lsn(self.conn(node))[0]

    def _cut(self, node: str, start: int, lsn: int, limit: ReadLimit) -> int:
        """Where node `node`'s window [start, lsn) ends under the read limit (per node)."""
        with self._on(node):
            return self.wal.cut(self.conn(node), self.nodes[node], start, lsn,
                                max_bytes=limit.max_bytes if isinstance(limit, ReadMaxBytes) else 0,
                                max_changes=limit.max_rows if isinstance(limit, ReadMaxRows) else 0)

    def partitions(self, start_json: dict[str, Any], end_json: dict[str, Any]) -> Sequence[InputPartition]:
        start, end = Offset.from_json(start_json), Offset.from_json(end_json)
        # (a batch planned before a node was removed from the feed is replayed without that node)
        parts: list[BatchPartition] = [WindowPartition(self.nodes[n], start, end, self.rows_per_batch, self.multi_node,
                                                       self.wal.name)
                                       for n in sorted(end.lsns) if end.lsns[n] > start.lsns.get(n, 0)
                                       and n in self.nodes]
        for c in end.chunks:
            node = snapshot.node_of(c.table, DEFAULT_NODE)[0]
            if node in self.nodes:
                parts.append(ChunkPartition(self.nodes[node], c, start, end, self.rows_per_batch, self.multi_node))
        for i, part in enumerate(parts):
            part.part, part.parts = i, len(parts)
            seen = self._seen.get(part.node.name)
            if isinstance(part, WindowPartition) and part.hold is None and part.wal == "peek" and seen:
                frontier, fixed = seen
                part.ahead = read_ahead.predict(part.end_lsn, frontier, 0 if self.max_changes else self.max_bytes,
                                                self.wal.block_size, fixed)
        return parts if self.parallel_reads or len(parts) < 2 else [GroupPartition(parts)]

    def read(self, partition: InputPartition) -> Iterator[Any]:  # type: ignore[override]
        return read_partition(partition)

    @carried("source")
    @lost_connection("source")
    def commit(self, end: dict[str, Any]) -> None:
        """Spark has committed the batch ending at `end` downstream: release WAL before it."""
        self._release(Offset.from_json(end))

    def _release(self, end: Offset) -> None:
        """Move each node's slot as far as `end` allows; called for every poll (see
        latestOffset), so a slot is asked only when its position is new."""
        for name in end.lsns.keys() & self.nodes.keys():
            lsn = end.release(name)
            if lsn > self._released.get(name, 0):
                with self._on(name):
                    src.advance(self.conn(name), self.nodes[name].slot, lsn)
                self._released[name] = lsn

    def stop(self) -> None:
        for conn in self._conns.values():
            conn.close()
