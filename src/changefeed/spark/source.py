"""`changefeed` PySpark streaming source: PostgreSQL logical decoding as micro-batches.

Offsets are core.offsets.Offset: the batch's upper WAL bound, its resolved commit timestamp (no
change in a later batch gets a smaller one), the snapshot cursor after it, and the snapshot chunks
it carries (see core.snapshot; each chunk is one more input partition). A batch holds what starts
in [start, end) (see postgres/changes.py). The bound is a flushed position that splits no WAL record: a heartbeat's
end, a commit's end (a change limit) or a WAL page boundary (a byte limit, found without decoding).
The driver only plans offsets and advances the slot in `commit`; executors decode in `read`.

Spark imports this module in every Python process it starts to plan a query (a new one each
step, one after another, at a feed's start), so the decoder and its numpy/Arrow imports are
imported by `read` alone: ~0.1 s less in each of those processes.
"""
from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

from pyspark import TaskContext
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxBytes, ReadMaxRows

from .. import faults
from ..config import DEFAULT_CHUNK_ROWS, DEFAULT_CHUNKS_PER_BATCH
from ..core import change as ch
from ..core import snapshot
from ..core.hlc import ceiling_of_ms, physical_ms, window_end_ts
from ..core.lsn import format_lsn
from ..core.offsets import DEFAULT_NODE, Offset
from ..core.requests import SnapshotRequests
from ..errors import carried
from ..postgres import pgoutput as po
from ..postgres import snapshot as snap_pg
from ..postgres import source as src
from ..postgres.connect import connect, lost_connection

try:  # SupportsTriggerAvailableNow is in pyspark >= 4.2
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
except ImportError:  # pragma: no cover
    SupportsTriggerAvailableNow = object  # type: ignore[misc,assignment]


class BatchPartition(InputPartition):
    """Input partition `part` of a batch's `parts`, labelled with the batch's WAL window [start, end);
    its `P` row names both, so that a sink can tell a whole batch from one cut short."""

    def __init__(self, uri: str, start: Offset, end: Offset, rows_per_batch: int) -> None:
        self.uri, self.start, self.end, self.rows_per_batch = uri, start, end, rows_per_batch
        self.part, self.parts = 0, 1


class WindowPartition(BatchPartition):
    """One node's share of a batch: what starts in WAL [start, end)."""

    def __init__(self, uri: str, slot: str, publication: str, start: Offset, end: Offset,
                 rows_per_batch: int) -> None:
        super().__init__(uri, start, end, rows_per_batch)
        self.slot, self.publication = slot, publication


class ChunkPartition(BatchPartition):
    """One snapshot chunk of a batch: existing rows of one key range."""

    def __init__(self, uri: str, chunk: snapshot.Chunk, start: Offset, end: Offset,
                 rows_per_batch: int) -> None:
        super().__init__(uri, start, end, rows_per_batch)
        self.chunk = chunk


class ChangefeedSource(DataSource):
    """Options: uri, slot, publication, feed, max_bytes_per_batch, max_changes_per_batch,
    resolved_interval_s, snapshot_tables (read first on a fresh checkpoint), snapshot_chunk_rows,
    snapshot_chunks_per_batch, requests_dir (snapshot requests, see core.requests)."""

    @classmethod
    def name(cls) -> str:
        return "changefeed"

    def schema(self) -> str:
        return ch.PACKED_DDL

    def streamReader(self, schema: Any) -> ChangeStreamReader:
        return ChangeStreamReader(dict(self.options))


class ChangeStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):  # type: ignore[misc]
    def __init__(self, options: dict[str, str]) -> None:
        self.uri = options["uri"]
        self.slot = options["slot"]
        self.publication = options["publication"]
        self.feed = options.get("feed", self.slot)
        self.max_bytes = int(options.get("max_bytes_per_batch") or 0)
        self.max_changes = int(options.get("max_changes_per_batch") or 0)
        self.rows_per_batch = int(options.get("arrow_batch_rows") or 65536)
        self.resolved_interval = float(options.get("resolved_interval_s") or 0)
        self.snapshot_tables = [t for t in (options.get("snapshot_tables") or "").split(",") if t]
        self.chunk_rows = int(options.get("snapshot_chunk_rows") or DEFAULT_CHUNK_ROWS)
        self.chunks_per_batch = int(options.get("snapshot_chunks_per_batch") or DEFAULT_CHUNKS_PER_BATCH)
        self.requests = SnapshotRequests(options["requests_dir"]) if options.get("requests_dir") else None
        self._tables: dict[str, src.SourceTable] = {}
        self._planned_at = float("-inf")  # monotonic time the last batch was planned
        self._conn: Any = None
        self._block = 0
        self._released = 0  # the slot is known to be at or past this LSN
        self._available_now: tuple[int, int] | None = None  # (LSN, ts) where an AvailableNow run ends

    @property
    def conn(self) -> Any:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.uri, "source")
        return self._conn

    @carried("source")
    @lost_connection("source")
    def initialOffset(self) -> dict[str, Any]:
        state = src.slot_state(self.conn, self.slot)
        src.check_slot_usable(state, self.slot, None, self.feed)
        assert state is not None and state.confirmed_flush is not None
        return Offset({DEFAULT_NODE: state.confirmed_flush}, 0,
                      snapshot.Cursor(pending=tuple(self.snapshot_tables))).to_json()

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.max_changes:
            return ReadMaxRows(self.max_changes)
        if self.max_bytes:
            return ReadMaxBytes(self.max_bytes)
        return ReadAllAvailable()

    @carried("source")
    @lost_connection("source")
    def prepareForTriggerAvailableNow(self) -> None:
        self._available_now = self._boundary()

    def _boundary(self) -> tuple[int, int]:
        """(A fresh flushed LSN, a timestamp no commit before it exceeds)."""
        lsn, ms = src.heartbeat(self.conn, ch.HEARTBEAT_PREFIX)
        return lsn, ceiling_of_ms(ms)

    def _boundary_key(self, table: str, after: snapshot.Key | None, rows: int) -> snapshot.Key | None:
        if table not in self._tables:
            self._tables[table] = src.describe_tables(self.conn, [table])[0]
        return snap_pg.chunk_boundary(self.conn, self._tables[table], after, rows)

    def _plan_snapshot(self, start: Offset) -> tuple[list[snapshot.Chunk], snapshot.Cursor]:
        cursor = start.cursor
        if self.requests is not None:
            for no, tables in self.requests.after(cursor.requests):
                cursor = cursor.request(tables, no)
        return cursor.plan(self._boundary_key, self.chunks_per_batch, self.chunk_rows)

    @carried("source")
    @lost_connection("source")
    def latestOffset(self, start_json: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        # Spark plans a batch only once the previous one is committed downstream, so `start` is
        # safe to release now (Spark's own `commit(start)` comes later): the cut below then
        # decodes only the new window.
        start = Offset.from_json(start_json)
        self._release(start)
        if isinstance(limit, ReadAllAvailable):  # AvailableNow may take several batches: keep ours
            limit = self.getDefaultReadLimit()
        chunks, cursor = self._plan_snapshot(start)
        if chunks:
            # A fresh end, so the batch (and its chunks) is recorded on the sink as applied.
            lsn, ts = self._boundary()
        elif self._available_now is not None:
            lsn, ts = self._available_now
        else:
            flushed, _ = src.flush_lsn(self.conn)
            idle_due = 0 < self.resolved_interval <= time.monotonic() - self._planned_at
            if flushed <= start.lsn and not idle_due:
                return start_json  # nothing new, and the resolved ts is fresh enough: no batch
            # The heartbeat gives the batch a flushed end even on an idle source, so the slot (and
            # the WAL it holds) and the resolved ts keep moving.
            lsn, ts = self._boundary()
        ts = window_end_ts(start.ts, physical_ms(ts))
        if lsn <= start.lsn:  # (never with chunks: their end is a fresh heartbeat)
            return start_json
        if isinstance(limit, ReadMaxBytes) and lsn - start.lsn > limit.max_bytes:
            self._block = self._block or src.wal_block_size(self.conn)
            lsn = min(lsn, src.page_cut(start.lsn, limit.max_bytes, self._block))
        elif isinstance(limit, ReadMaxRows):
            lsn = src.lsn_after_changes(self.conn, self.slot, self.publication, start.lsn, lsn, limit.max_rows)
        self._planned_at = time.monotonic()
        return Offset({DEFAULT_NODE: lsn}, ts, cursor, tuple(chunks)).to_json()

    def partitions(self, start_json: dict[str, Any], end_json: dict[str, Any]) -> Sequence[InputPartition]:
        start, end = Offset.from_json(start_json), Offset.from_json(end_json)
        parts: list[BatchPartition] = []
        if end.lsn > start.lsn:
            parts.append(WindowPartition(self.uri, self.slot, self.publication, start, end, self.rows_per_batch))
        parts += [ChunkPartition(self.uri, c, start, end, self.rows_per_batch) for c in end.chunks]
        for i, part in enumerate(parts):
            part.part, part.parts = i, len(parts)
        return parts

    def read(self, partition: InputPartition) -> Iterator[Any]:  # type: ignore[override]
        with carried("source"):
            if isinstance(partition, ChunkPartition):
                yield from _read_chunk(partition)
            else:
                assert isinstance(partition, WindowPartition)
                yield from _read_window(partition)

    @carried("source")
    @lost_connection("source")
    def commit(self, end: dict[str, Any]) -> None:
        """Spark has committed the batch ending at `end` downstream: release WAL before it."""
        self._release(Offset.from_json(end))

    def _release(self, end: Offset) -> None:
        """Move the slot to `end`; called for every poll (see latestOffset), so the slot is asked
        only when `end` is new."""
        if end.lsn > self._released:
            src.advance(self.conn, self.slot, end.lsn)
            self._released = end.lsn

    def stop(self) -> None:
        if self._conn is not None:
            self._conn.close()


@functools.cache
def _push_through() -> list[Any]:
    """What to yield right after a chunk so that the sink gets it at once (see ch.push_through):
    rows bigger than the worker's output buffer (`spark.buffer.size`, passed as SPARK_BUFFER_SIZE).
    Built once per worker process: every chunk yields the same rows."""
    return ch.push_through(int(os.environ.get("SPARK_BUFFER_SIZE") or 65536) + 1)


def _read_window(partition: WindowPartition) -> Iterator[Any]:
    """The batch's changes in its WAL window, peeked from the slot."""
    from ..postgres.changes import ChangeBuilder  # numpy and Arrow: executors only (see the module doc)

    conn = connect(partition.uri, "source", autocommit=False)
    try:
        with lost_connection("source"):
            # The slot is at `start` already (latestOffset released it before planning); a slot
            # behind it would re-send a message that straddles `start`. Everything before `start`
            # is committed downstream, so moving the slot there is always safe.
            start, end = partition.start, partition.end
            src.reach(conn, end.lsn, ch.HEARTBEAT_PREFIX)
            src.advance(conn, partition.slot, start.lsn)
            conn.commit()
            builder = ChangeBuilder(start.lsn, end.lsn, start.ts, end.ts, lambda rel: src.column_catalog(conn, rel),
                                    part=partition.part, parts=partition.parts)
            blocks = src.peek(conn, partition.slot, partition.publication, end.lsn)
            for rb in builder.batches(blocks, partition.rows_per_batch):
                yield ch.pack(rb)
                yield from _push_through()
                faults.reach("read")
    except po.DecodeError as e:
        e.message = (f"cannot decode the WAL of slot {partition.slot} between {format_lsn(partition.start.lsn)} "
                     f"and {format_lsn(partition.end.lsn)}: {e.message}")
        raise
    finally:
        conn.close()


def _read_chunk(part: ChunkPartition) -> Iterator[Any]:
    """A snapshot chunk's rows, then a `P` row naming the chunk (the sink records it)."""
    chunk = part.chunk
    with connect(part.uri, "source") as conn, lost_connection("source"):
        found = snap_pg.ChunkRead()
        for rb in snap_pg.read_chunk(conn, chunk.table, chunk.lo, chunk.hi, part.start.lsn, part.end.ts,
                                     found, part.rows_per_batch):
            yield ch.pack(rb)
            yield from _push_through()
    task = TaskContext.get()
    done = ch.Progress(part.end.lsn, part.end.ts, None, found.rows,
                       {"no": chunk.no, "table": chunk.table, "rows": found.rows, "read_lsn": found.read_lsn,
                        "task": task.taskAttemptId() if task else None}, part.part, part.parts)
    yield ch.pack(ch.progress_batch(done))
    faults.reach("snapshot_chunk")
