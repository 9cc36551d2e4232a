"""The change record: one row change (or control row) as it flows from source to sinks.

Rows travel as Arrow record batches with `arrow_schema()`. Through Spark they travel packed: one
Spark row (`PACKED_DDL`) per record batch of changes, in Arrow IPC form, so that the JVM moves a
few large values instead of converting every change field by field (measured: that conversion
cost more CPU than decoding). `pack` and `unpack` convert. Data rows have op c (insert), u (update),
d (delete), t (truncate), r (snapshot read) or m (logical decoding message). Two control rows
keep the stream self-describing for sinks: `R` describes a table's columns (meta = JSON) before
that table's first change in a partition, and `P` closes each partition with its progress
(meta = JSON with end LSN, resolved ts, last commit time, and which of the batch's partitions it
closes: a sink commits a batch only with a `P` row from every one, see `BatchProgress.of`).

`lsn` is the start LSN of the transaction's commit record (its final LSN): unique per transaction,
increasing in commit order, and what decides the batch window it belongs to. A non-transactional
message's `lsn` is its end LSN, the only one pgoutput gives. `seq` orders rows within it.

Values are COPY text lines in the table's column order (see core.copytext): `after` is the new
row, `before` the old row (deletes; updates when the source sends it), `old_key` the old primary
key when an update changed it. `unchanged` lists (as a PostgreSQL int array literal) the 0-based
columns whose TOASTed value the update left unchanged; they hold NULL in `after`.
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from changefeed.core.nodes import DEFAULT_NODE
from changefeed.errors import IncompleteBatch

FIELDS: tuple[tuple[str, str], ...] = (
    ("op", "string"), ("schema", "string"), ("table", "string"), ("lsn", "bigint"), ("seq", "int"),
    ("xid", "bigint"), ("commit_time", "bigint"), ("commit_ts", "bigint"), ("after", "binary"),
    ("before", "binary"), ("old_key", "binary"), ("unchanged", "string"), ("meta", "string"),
)
NAMES = tuple(n for n, _ in FIELDS)

PACKED_DDL = "`rows` int, `changes` binary"

DATA_OPS = frozenset("cudtrm")
RELATION = "R"
PROGRESS = "P"
MESSAGE = "m"  # a logical decoding message (its prefix in meta, its content in after)
# A logical message with this prefix ends a batch window: the source emits it, the decoder knows it.
HEARTBEAT_PREFIX = "changefeed.heartbeat"


def arrow_schema() -> Any:
    import pyarrow as pa

    types = {"string": pa.string(), "bigint": pa.int64(), "int": pa.int32(), "binary": pa.binary()}
    return pa.schema([pa.field(n, types[t]) for n, t in FIELDS])


def pack(batch: Any) -> Any:
    """A record batch of changes -> a one-row record batch with `PACKED_DDL`'s columns."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    payload = sink.getvalue()
    changes = pa.Array.from_buffers(pa.binary(), 1, [None, pa.array([0, payload.size], pa.int32()).buffers()[1],
                                                     payload])
    return pa.RecordBatch.from_arrays([pa.array([batch.num_rows], pa.int32()), changes], names=["rows", "changes"])


def push_through(size: int) -> list[Any]:
    """Two packed rows with no changes (`rows` 0, `size` zero bytes each), which `unpack` skips.

    A Python data source's worker writes its output through a buffer of `spark.buffer.size` bytes
    that it does not flush between batches, and the JVM hands a batch on only once it has read
    the next one whole. So a chunk would reach the sink only after the next chunk or two were
    decoded. Yielded right after a chunk, these rows (each bigger than that buffer) push it, and
    the first of them, out at once: the second's write flushes what the first left in the buffer.
    """
    import pyarrow as pa

    row = pa.RecordBatch.from_arrays([pa.array([0], pa.int32()), pa.array([bytes(size)], pa.binary())],
                                     names=["rows", "changes"])
    return [row, row]


def record_batch(columns: dict[str, list[Any]]) -> Any:
    """A record batch of change rows from one equally long list per field."""
    import pyarrow as pa

    schema = arrow_schema()
    return pa.RecordBatch.from_arrays([pa.array(columns[f.name], type=f.type) for f in schema], schema=schema)


def progress_batch(progress: "Progress") -> Any:
    """A record batch holding just the `P` row for `progress`."""
    row: dict[str, Any] = {n: None for n in NAMES}
    row.update(op=PROGRESS, lsn=progress.end_lsn, seq=0, xid=0, commit_time=progress.last_commit_time,
               commit_ts=progress.resolved_ts, meta=progress.to_meta())
    return record_batch({n: [v] for n, v in row.items()})


def unpack(packed: Any) -> Iterator[Any]:
    """The record batches of changes inside a record batch of packed rows (zero-copy)."""
    import pyarrow as pa

    changes, rows = packed.column("changes"), packed.column("rows").to_pylist()
    for i in range(len(changes)):
        if rows[i]:
            yield from pa.ipc.open_stream(changes[i].as_buffer())


@dataclass(frozen=True)
class TableShape:
    """What an `R` row says about a table: column names, SQL types, key columns.

    `missing` holds, per column, the value rows written before the column was added read as
    (PostgreSQL's `attmissingval`, from ADD COLUMN ... DEFAULT): such rows have no WAL of it.
    """

    schema: str
    table: str
    columns: tuple[str, ...]
    types: tuple[str, ...]
    key: tuple[str, ...]
    replica_identity: str
    missing: tuple[str | None, ...] = ()
    filled: tuple[bool, ...] = ()  # per column: it has a default but no missing value (see core.schema_change)
    ahead: bool = False  # the table's shape when a snapshot read it, maybe ahead of the stream's

    def to_meta(self) -> str:
        return json.dumps({"columns": self.columns, "types": self.types, "key": self.key,
                           "identity": self.replica_identity, "missing": self.missing, "filled": self.filled,
                           "ahead": self.ahead})

    @classmethod
    def from_meta(cls, schema: str, table: str, meta: str) -> "TableShape":
        d = json.loads(meta)
        return cls(schema, table, tuple(d["columns"]), tuple(d["types"]), tuple(d["key"]), d["identity"],
                   tuple(d.get("missing") or ()), tuple(d.get("filled") or ()), bool(d.get("ahead")))


@dataclass(frozen=True)
class Progress:
    """What a `P` row says: this partition delivered every commit of node `node` up to `end_lsn`,
    or (with `chunk`) the snapshot chunk it names: {"no", "table", "rows", "read_lsn", "task"}
    (the Spark task attempt that read it). It is partition `part` of the batch's `parts`;
    `positions` (a feed of several nodes) is the batch's end position on every node; `read` says
    which task read it, and when; `gids` the distributed (prepared) transactions whose parts on
    the node it delivered ([gid, xid] each), `pending` the gids still prepared (or committed past
    its end) on the node: never one it delivered elsewhere in the batch (see sinks/batch_input)."""

    end_lsn: int
    resolved_ts: int
    last_commit_time: int | None  # Unix µs of the last delivered commit, None if none
    changes: int
    chunk: dict[str, Any] | None = None
    part: int = 0
    parts: int = 1
    node: str = DEFAULT_NODE
    positions: Mapping[str, int] | None = None
    read: dict[str, Any] | None = None  # who read it: {"task" (attempt id), "pid", "began", "ended" (Unix s)}
    gids: list[list[Any]] | None = None  # prepared parts it delivered: [gid, xid]
    pending: list[str] | None = None  # gids with a part prepared on the node, undecided at its end
    offset: dict[str, Any] | None = None  # the batch's end offset (core.offsets), the same in every partition

    def to_meta(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_meta(cls, meta: str) -> "Progress":
        return cls(**json.loads(meta))


@dataclass(frozen=True)
class BatchProgress:
    """A whole micro-batch's progress, from the `P` rows of all its partitions (its WAL windows and
    its snapshot chunks): what a sink records with the batch.

    `end_lsn` is the key sinks record batches by, which grows with every batch: a one-node feed's
    end LSN; for a feed of several nodes, whose LSNs are not comparable, the batch's resolved ts
    (which strictly grows too, see core.hlc.window_end_ts). `positions` holds each node's end
    LSN (None: the one node's is `end_lsn`)."""

    end_lsn: int
    resolved_ts: int
    last_commit_time: int | None
    changes: int
    chunks: tuple[dict[str, Any], ...]
    positions: Mapping[str, int] | None = None
    reads: tuple[dict[str, Any], ...] = ()  # per input partition read: {"node", "part", **Progress.read,
    #                                         "gids" and "pending" where it has them}
    offset: dict[str, Any] | None = None  # the batch's end offset: where the next batch starts (a sink
    #                                       that records it lets a lost checkpoint be rebuilt from it)

    @property
    def nodes(self) -> dict[str, int]:
        """Each node's end LSN."""
        return dict(self.positions) if self.positions else {DEFAULT_NODE: self.end_lsn}

    @classmethod
    def from_json(cls, p: dict[str, Any]) -> "BatchProgress":
        """From its `__dict__` as JSON (what the file and Kafka ledgers store)."""
        return cls(p["end_lsn"], p["resolved_ts"], p["last_commit_time"], p["changes"], tuple(p["chunks"]),
                   p.get("positions"), tuple(p.get("reads") or ()), p.get("offset"))

    @classmethod
    def of(cls, parts: "list[Progress]") -> "BatchProgress":
        """The batch's progress from its partitions' `P` rows; `IncompleteBatch` unless there is
        exactly one from each partition. A cancelled Spark task can end the writer's input
        cleanly between two partitions (the JVM closes it at a message boundary), so a sink
        must not take the end of its input for the end of the batch."""
        n = max((p.parts for p in parts), default=0)
        got = sorted(p.part for p in parts)
        if not parts or got != list(range(n)) or any(p.parts != n for p in parts):
            closed = f"the progress rows of partitions {got} of its {n}" if parts else "no progress row"
            raise IncompleteBatch(f"the batch's input ended with {closed}: it was cut short (its Spark task was "
                                  "cancelled or killed), so nothing of it is committed",
                                  "none: the batch is read again when the query runs next; if this repeats, report it")
        times = [p.last_commit_time for p in parts if p.last_commit_time is not None]
        resolved, chunks = max(p.resolved_ts for p in parts), tuple(p.chunk for p in parts if p.chunk)
        positions, offset = parts[0].positions, parts[0].offset
        reads = tuple({"node": p.node, "part": p.part, **p.read, **({"gids": p.gids} if p.gids else {}),
                       **({"pending": p.pending} if p.pending else {})}
                      for p in sorted(parts, key=lambda p: p.part) if p.read)
        if positions is None:
            return cls(max(p.end_lsn for p in parts), resolved, max(times) if times else None,
                       sum(p.changes for p in parts), chunks, None, reads, offset)
        return cls(resolved, resolved, max(times) if times else None, sum(p.changes for p in parts), chunks,
                   dict(positions), reads, offset)
