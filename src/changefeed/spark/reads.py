"""What a Spark task of a changefeed batch reads (its input partition) and how, on executors.

A batch's input partitions (planned by spark/source.py on the driver) are one node's WAL window
each (`WindowPartition`) and one snapshot chunk each (`ChunkPartition`), or all of them read by
one task one after the other (`GroupPartition`). A window is read from the node's slot, or from
the spool file a read-ahead left (postgres/read_ahead.py), into packed Arrow batches of change
rows; a chunk is read in pieces of SNAPSHOT_PIECE_BYTES and ends with a `P` row naming it.

Spark imports this module with the planner, in processes that never read: the decoder and its
numpy/Arrow imports are imported by the read functions alone.
"""
from __future__ import annotations

import functools
import os
import pickle
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any

import psycopg
from pyspark import TaskContext
from pyspark.sql.datasource import InputPartition

from changefeed import faults
from changefeed.core import change as ch
from changefeed.core import distributed as dist
from changefeed.core import sink_scope, snapshot
from changefeed.core.judge import Judge
from changefeed.core.lsn import Lsn, format_lsn
from changefeed.core.offsets import Offset
from changefeed.errors import carried
from changefeed.postgres import read_ahead, slots
from changefeed.postgres import snapshot as snap_pg
from changefeed.postgres import source as src
from changefeed.postgres.connect import connect, lost_connection
from changefeed.postgres.decode import pgoutput as po
from changefeed.postgres.key_ranges import Judging
from changefeed.postgres.wal_reader import DEFAULT as DEFAULT_WAL_READER
from changefeed.postgres.wal_reader import wal_reader
from changefeed.spec.definition import SourceNode, node_role

# A snapshot chunk travels in pieces of about this size, so that the sink applies one while the
# next is being read (the replica streams a chunk's pieces into one COPY: sinks.replica.insert_run).
SNAPSHOT_PIECE_BYTES = 2 << 20
# The `rows` of a packed row that stands for a window or chunk its writer task reads (`resolve`).
REFERENCE = -1


class BatchPartition(InputPartition):
    """Input partition `part` of a batch's `parts`, labelled with the batch's offsets [start, end);
    its `P` row names both, so that a sink can tell a whole batch from one cut short. It reads
    node `node`; `positions` (a feed of several nodes) is the batch's end on every node."""

    def __init__(self, node: SourceNode, start: Offset, end: Offset, rows_per_batch: int, multi_node: bool,
                 wal: str = DEFAULT_WAL_READER) -> None:
        self.node, self.start, self.end, self.rows_per_batch, self.wal = node, start, end, rows_per_batch, wal
        # the prepared parts the plan put in the window (commit LSN -> gid, xid), the gids still open
        self.prepared = {lsn: (gid, xid) for gid, xid, lsn in end.parts.get(node.name, ())}
        self.pending = dist.pending_gids(end.open.get(node.name, ()))
        self.ahead: int | None = None  # where the next window will end, if certain (postgres/read_ahead.py)
        self.positions = dict(end.lsns) if multi_node else None
        self.part, self.parts = 0, 1
        self.by_reference = False  # read by the writer task where its reference arrives (resolve)

    @property
    def start_lsn(self) -> Lsn:
        return self.start.lsns.get(self.node.name, Lsn(0))

    @property
    def end_lsn(self) -> Lsn:
        return self.end.lsns[self.node.name]


class WindowPartition(BatchPartition):
    """One node's share of a batch: what starts in its WAL [start, end), but the changes to
    `held` (core.snapshot.held_back) and those snapshot reads hold already (`judge`, core.judge)."""

    held: frozenset[str] = frozenset()
    judge: Judge = Judge({}, {})


class ChunkPartition(BatchPartition):
    """One snapshot chunk of a batch: existing rows of one key range of a table on one node."""

    def __init__(self, node: SourceNode, chunk: snapshot.Chunk, start: Offset, end: Offset, rows_per_batch: int,
                 multi_node: bool, where: str | None = None, columns: list[str] | None = None,
                 rate: tuple[float, float, float] = (0, 0, 0)) -> None:
        super().__init__(node, start, end, rows_per_batch, multi_node)
        self.chunk = chunk
        self.exported: str | None = None  # the planner's snapshot to read it in (postgres.snapshot.export)
        self.rate = rate  # its share of --snapshot-rate: (rows, bytes) per second (0 = no limit), rows at once
        self.where = where  # the table's row filter (spec.row_filters)
        self.columns = columns  # its column list (spec.column_lists)


class GroupPartition(InputPartition):
    """A batch's partitions read one after the other by one task, when the query reads them
    sequentially: Spark starts a Python read of its own for each input partition, which costs
    more than a small chunk's rows (see bench/README.md, snapshot_throughput.py)."""

    def __init__(self, parts: list[BatchPartition]) -> None:
        self.parts = parts


class Sources:
    """The source connections that the snapshot chunks one task reads, one after the other, share
    (each chunk in a transaction of its own): a connection per chunk costs a server backend and an
    authentication, about a quarter of a 50,000-row chunk's read (bench/README.md). Closed with
    the task's read."""

    def __init__(self) -> None:
        self._conns: dict[tuple[str, str], Any] = {}

    def __enter__(self) -> "Sources":
        return self

    def __exit__(self, *exc: object) -> None:
        for conn in self._conns.values():
            conn.close()

    def conn(self, uri: str, role: str) -> Any:
        """An autocommit connection to `uri`, idle: the one the last chunk used, or a new one."""
        conn = self._conns.get((uri, role))
        if conn is None or conn.closed or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            if conn is not None:
                conn.close()
            conn = self._conns[(uri, role)] = connect(uri, role)
        return conn


def read_partition(partition: InputPartition) -> Iterator[Any]:
    """The packed rows of a batch's input partition (ChangeStreamReader.read)."""
    with carried("source"), Sources() as sources:
        for part in partition.parts if isinstance(partition, GroupPartition) else [partition]:
            assert isinstance(part, BatchPartition)
            if part.by_reference:
                yield _reference(part)
                yield from push_through()
            else:
                yield from _read(part, sources)


def _read(part: BatchPartition, sources: Sources) -> Iterator[Any]:
    """The packed rows of a window or a chunk."""
    if isinstance(part, ChunkPartition):
        return _read_chunk(part, sources)
    assert isinstance(part, WindowPartition)
    return _read_window(part)


@functools.cache
def push_through() -> list[Any]:
    """What to yield right after a chunk so that the sink gets it at once (see ch.push_through):
    rows bigger than the worker's output buffer (`spark.buffer.size`, passed as SPARK_BUFFER_SIZE).
    Built once per worker process: every chunk yields the same rows."""
    return ch.push_through(int(os.environ.get("SPARK_BUFFER_SIZE") or 65536) + 1)


def reader(began: float) -> dict[str, Any]:
    """Which Spark task reads a partition (its attempt id; the Python worker's host, pid and
    working directory, which on a cluster is its executor's own), from when."""
    task = TaskContext.get()
    return {"task": task.taskAttemptId() if task else None, "host": socket.gethostname(), "pid": os.getpid(),
            "cwd": os.getcwd(), "began": began}


def _read_window(partition: WindowPartition) -> Iterator[Any]:
    """A node's changes in its WAL window of the batch, read from its slot."""
    from changefeed.postgres.decode.builder import ChangeBuilder  # numpy and Arrow: executors only (see the module doc)

    node, began = partition.node, time.time()
    role = node_role(node.name, partition.positions is not None)
    conn = connect(node.uri, role, autocommit=False)
    judging = Judging(partition.judge, lambda: connect(node.uri, role))
    try:
        with lost_connection(role):
            # The slot is at `start` already (latestOffset released it before planning); a slot
            # behind it would re-send a message that straddles `start`. Everything before `start`
            # is committed downstream, so moving the slot there is always safe.
            start, end = partition.start_lsn, partition.end_lsn
            src.reach(conn, end, ch.HEARTBEAT_PREFIX)
            slots.advance(conn, node.slot, start)
            conn.commit()
            spooled = read_ahead.take(node, start, end)
            builder = ChangeBuilder(start, end, partition.start.ts, partition.end.ts,
                                    lambda rel: src.column_catalog(conn, rel), part=partition.part,
                                    parts=partition.parts, node=node.name, positions=partition.positions,
                                    read={**reader(began), "ahead": spooled is not None},
                                    prepared=partition.prepared, undecided=partition.pending,
                                    offset=partition.end.to_json(), publication=node.publication)
            blocks = spooled or wal_reader(partition.wal).window(conn, node, role, start, end)
            ahead = partition.ahead
            if ahead is not None and _outlives_task():  # the next window, once the server answered this one
                blocks = _then(blocks, lambda: read_ahead.begin(node, role, end, ahead))
            with closing(blocks):  # type: ignore[type-var]  # a generator, typed as the Iterator it is used as
                for rb in builder.batches(blocks, partition.rows_per_batch):
                    yield ch.pack(judging.apply(snapshot.held_back(rb, partition.held)))
                    yield from push_through()
                    faults.reach("read")
            if builder.undecided:
                faults.reach("pending")  # crash tests: a prepared part on the node waits for its outcome
    except po.DecodeError as e:
        e.message = (f"cannot decode the WAL of slot {node.slot} between {format_lsn(partition.start_lsn)} "
                     f"and {format_lsn(partition.end_lsn)}: {e.message}")
        raise
    finally:
        judging.close()
        conn.close()


def _outlives_task() -> bool:
    """Whether this Python worker stays for later tasks (`spark.python.worker.reuse`, Spark's
    default): a read-ahead thread in a worker that exits with its task would die unfinished."""
    return bool(os.environ.get("SPARK_REUSE_WORKER"))


def _then(blocks: Iterator[list[bytes]], begin: Callable[[], object]) -> Iterator[list[bytes]]:
    """`blocks`, calling `begin` when the first one is there (or there are none)."""
    begun = False
    with closing(blocks):  # type: ignore[type-var]  # a generator, typed as the Iterator it is used as
        for block in blocks:
            if not begun:
                begin()
                begun = True
            yield block
    if not begun:
        begin()


def _reference(part: BatchPartition) -> Any:
    """A packed row that stands for the window or chunk `part`, for its writer task to read (resolve)."""
    import pyarrow as pa

    return pa.RecordBatch.from_arrays([pa.array([REFERENCE], pa.int32()),
                                       pa.array([pickle.dumps(part)], pa.binary())], names=["rows", "changes"])


def resolve(packed: Iterator[Any]) -> Iterator[Any]:
    """A writer task's packed input with each reference replaced by the packed rows of the window
    or chunk it stands for, read here, where the reference arrived.

    Where one task reads a batch's partitions and writes it (sequential reads), rows read by the
    reader's Python worker cross into the JVM and out again to the writer's, packed and copied on
    the way, and the two workers and the JVM share the cores with both servers. Read in the
    writer, they cross nothing, as in a plain COPY between the servers (bench/README.md). It is
    as correct: a window is the same WAL however late it is read (the slot holds it until the
    sink commits), a chunk may be read at any time after its batch was planned
    (postgres.snapshot), the rows take the reference's place among the batch's rows, and a task
    tried again reads them again, as a reader task would."""
    import numpy as np

    with Sources() as sources:
        for batch in packed:
            at = 0
            for i in np.flatnonzero(batch.column("rows").to_numpy() == REFERENCE).tolist():
                if i > at:
                    yield batch.slice(at, i - at)
                with carried("source"):
                    yield from _read(pickle.loads(batch.column("changes")[i].as_py()), sources)
                at = i + 1
            if at < batch.num_rows:
                yield batch.slice(at) if at else batch


def _read_chunk(part: ChunkPartition, sources: Sources) -> Iterator[Any]:
    """A snapshot chunk's rows, then a `P` row naming the chunk (the sink records it)."""
    chunk, node, began = part.chunk, part.node, time.time()
    role = node_role(node.name, part.positions is not None)
    table = snapshot.node_of(chunk.table, node.name)[1]
    cut = snap_pg.Cut((node.slot, node.lag_slot), node.publication, part.end_lsn)
    with lost_connection(role):
        conn = sources.conn(node.uri, role)
        found = snap_pg.ChunkRead()
        # In pieces of SNAPSHOT_PIECE_BYTES: the sink applies one while the next is being read.
        for rb in snap_pg.read_chunk(conn, table, chunk.lo, chunk.hi, part.start_lsn, part.end.ts, found,
                                     part.rows_per_batch, SNAPSHOT_PIECE_BYTES, part.where, part.columns,
                                     part.rate, cut, part.exported):
            yield ch.pack(sink_scope.mark(rb, chunk.only))
        yield from push_through()
    read = {**reader(began), "ended": time.time()}
    named = {"no": chunk.no, "table": chunk.table, "rows": found.rows, "read_lsn": found.read_lsn,
             "snap": found.snap, "imported": found.imported, "task": read["task"],
             **({"only": list(chunk.only)} if chunk.only else {})}
    done = ch.Progress(part.end_lsn, part.end.ts, None, found.rows, named, part.part, part.parts, node.name,
                       part.positions, read, offset=part.end.to_json())
    yield ch.pack(ch.progress_batch(done))
    faults.reach("snapshot_chunk")
