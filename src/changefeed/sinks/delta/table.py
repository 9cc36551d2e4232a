"""Delta tables as the sink writes them: data files from the tasks, one commit from the driver.

A writer task writes Parquet files into the table's folder and describes them (`Files`: the
files it added, those it replaces); it never commits. The driver commits each table's files of a
batch in ONE Delta transaction (`commit`) stamped (`Stamp`) with the feed's application
transaction, whose version is the batch's end position: a batch replayed after a crash, also
one planned anew by another runner from the ledger, finds what the table holds already there
(the writer tasks leave out rows before it, as a replica does) and commits nothing twice. The
stamp also carries the runner's lease term (a second application transaction): a commit finds
the term the table was last claimed or written in and is refused if it is later than its own,
and as commits do not retry on a version another commit took, a claim landing between the
check and the commit makes the commit fail, never land. Files of a batch that never committed
stay unreferenced; `vacuum` removes them. The commit info records the feed's batch, resolved ts
and end position.

A table is created on its first commit, partitioned by `_bucket` in mirror and history mode. A
column the source added is added to the Delta schema first (its own metadata commit; adding it
twice is a no-op); a column whose type changed stops the feed (UnfollowableChange).
"""
from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from changefeed import faults
from changefeed.errors import LeaseLost, TransientError, UnfollowableChange
from changefeed.sinks.delta.rows import BUCKET

T = TypeVar("T")
COMMIT_ATTEMPTS = 20  # a commit that met another one (compaction, a claim) is checked and tried again


@dataclass
class Files:
    """What one task wrote to one table (sent to the driver, pickled)."""

    uri: str
    schema: pa.Schema  # of the rows written (without the partition column)
    partitioned: bool  # by BUCKET (mirror, history)
    adds: list[dict[str, Any]] = field(default_factory=list)
    removes: list[dict[str, Any]] = field(default_factory=list)
    read_version: int | None = None  # the table version the replaced files were read from
    fills: dict[str, Any] = field(default_factory=dict)  # columns added with a default: what older rows hold
    key: tuple[str, ...] = ()
    departed: dict[Any, dict[str, Any]] = field(default_factory=dict)  # rows moved out, by Move (delta.mirror)
    pending: list[tuple[str, list[Any]]] = field(default_factory=list)  # (file, values it lacks, delta.mirror)
    shapes: list[tuple[tuple[int, int], Any]] = field(default_factory=list)  # the source shapes seen, by position


def open_table(uri: str, storage: dict[str, str]) -> Any:
    """The Delta table at `uri`, None if there is none yet."""
    from deltalake import DeltaTable

    return DeltaTable(uri, storage_options=storage or None) if DeltaTable.is_deltatable(uri, storage or None) \
        else None


def applied_upto(table: Any, app: str) -> int:
    """The end position of the last batch of application transaction `app` in `table`, 0 if none."""
    done = table.transaction_version(app) if table is not None else None
    return int(done) if done is not None else 0


def term_app(feed: str) -> str:
    """The application transaction whose version is the lease term of the feed's runner that
    last claimed or wrote the table (control.lease_keeper)."""
    return f"changefeed-{feed}-term"


@dataclass(frozen=True)
class Stamp:
    """What a commit of the feed carries: application transaction `app` at `version` (a batch's
    end position; a claim's is 0 and sets none) and the runner's lease term `epoch` (None: a run
    that holds no lease)."""

    feed: str
    app: str
    version: int
    epoch: int | None

    def done(self, table: Any) -> bool:
        """Whether `table` holds this batch, or a later one, already."""
        return self.version > 0 and applied_upto(table, self.app) >= self.version

    def check(self, table: Any) -> None:
        """LeaseLost if a later term claimed or wrote `table`."""
        held = table.transaction_version(term_app(self.feed)) if table is not None else None
        if self.epoch is not None and held is not None and held > self.epoch:
            raise LeaseLost(f"feed {self.feed}: this runner's lease (term {self.epoch}) was taken over by term "
                            f"{held}, which claimed the Delta table {table.table_uri}; nothing of this batch "
                            "was committed there", "another runner took the feed over; this one stops",
                            component="sink")

    def properties(self, info: dict[str, str]) -> Any:
        """The commit's properties: no retry by the library on a version another commit took (the
        caller checks the table again and tries once more, `attempts`)."""
        from deltalake import CommitProperties, Transaction

        txns = [Transaction(self.app, self.version)] if self.version > 0 else []
        txns += [Transaction(term_app(self.feed), self.epoch)] if self.epoch is not None else []
        term = {"changefeed.term": str(self.epoch)} if self.epoch is not None else {}
        return CommitProperties(custom_metadata={**info, **term} or None, max_commit_retries=0, app_transactions=txns)


def checked(uri: str, commit: Callable[[], T]) -> T:
    """Run `commit` (which loads the table, checks it and commits once) until no other commit took
    its version first; TransientError after COMMIT_ATTEMPTS."""
    from deltalake.exceptions import CommitFailedError

    for _ in range(COMMIT_ATTEMPTS):
        try:
            return commit()
        except CommitFailedError:
            continue  # checked again on the table as it is now
    raise TransientError(f"the Delta table {uri} kept changing while the batch was committed (another writer?)",
                         "nothing of the batch was committed there; it is committed again")


def write_file(uri: str, rows: pa.Table, batch_id: int, bucket: int | None) -> dict[str, Any]:
    """Write `rows` as one new Parquet file of the table at `uri` (a local folder); its add action."""
    folder = f"{BUCKET}={bucket}" if bucket is not None else ""
    name = f"part-{batch_id:010d}-{uuid.uuid4().hex}.snappy.parquet"
    path = f"{folder}/{name}" if folder else name
    full = os.path.join(uri, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    pq.write_table(rows, full, compression="snappy")
    st = os.stat(full)
    return {"path": path, "size": st.st_size, "partition_values": {BUCKET: str(bucket)} if folder else {},
            "modification_time": int(st.st_mtime * 1000), "rows": rows.num_rows}


def bucket_rows(table: Any, bucket: int, fills: dict[str, Any]) -> tuple[pa.Table | None, list[dict[str, Any]]]:
    """A bucket's current rows and its files (to be replaced), from the table's loaded version; a
    column a file lacks holds its `fills` value (else null)."""
    actions = pa.table(table.get_add_actions(flatten=True))
    if not len(actions):
        return None, []
    part = f"partition.{BUCKET}"
    mine = [a for a in actions.select(["path", "size_bytes", part]).to_pylist() if a[part] == bucket]
    if not mine:
        return None, []
    root = table.table_uri.removeprefix("file://")
    data_schema = pa.schema([f for f in pa.schema(table.schema().to_arrow()) if f.name != BUCKET])
    parts = [pq.read_table(os.path.join(root, a["path"])) for a in mine]
    rows = pa.concat_tables([_conform(p, data_schema, fills) for p in parts], promote_options="default")
    return rows, [{"path": a["path"], "size": a["size_bytes"], "partition_values": {BUCKET: str(bucket)}}
                  for a in mine]


def _conform(rows: pa.Table, schema: pa.Schema, fills: dict[str, Any]) -> pa.Table:
    """A file's rows with every column of the table's schema (one added after the file was written:
    its `fills` value, else null) and any the file has beyond it (written before the schema took it)."""
    for f in schema:
        if f.name not in rows.column_names:
            value = fills.get(f.name)
            rows = rows.append_column(f, pa.nulls(len(rows), f.type) if value is None
                                      else pa.array([value] * len(rows), f.type))
    return rows


def commit(files: list[Files], stamp: Stamp, info: dict[str, str], storage: dict[str, str]) -> bool:
    """Commit one table's files of a batch (from every task) in one transaction, then add the
    columns it brought to the table's schema; False if the table already held the batch.

    The data commits before the schema grows: readers ignore a file's columns the schema lacks,
    and a column added with a default (`fills`) must already be in every file when it appears,
    so files written before it are rewritten with it in the same commit (only while the schema
    lacks it: a crash between the two commits leaves a state that this completes)."""
    from deltalake import DeltaTable
    from deltalake.transaction import AddAction, RemoveAction

    uri, partitioned = files[0].uri, files[0].partitioned
    full = _merged([f.schema for f in files])
    full = pa.schema([*full, pa.field(BUCKET, pa.int32())]) if partitioned else full
    fill_moved(files)

    def once() -> bool:
        table = open_table(uri, storage)
        if table is None:
            table = DeltaTable.create(uri, full, partition_by=[BUCKET] if partitioned else None, mode="ignore",
                                      storage_options=storage or None)
        elif stamp.done(table):
            _evolve(table, full)
            return False
        stamp.check(table)
        faults.reach("delta_term_checked")
        read = {f.read_version for f in files if f.read_version is not None}
        if read and read != {table.version()}:
            raise TransientError(f"the Delta table {uri} changed while the batch was written (another writer?)",
                                 "nothing of the batch was committed; it is written again")
        new = _new_columns(table, full)
        fills = {c: v for f in files for c, v in f.fills.items() if c in new}
        removes = [r for f in files for r in f.removes]
        adds = [a for f in files for a in f.adds]
        if fills:
            more_removes, more_adds = _fill_older_files(table, full, fills, {r["path"] for r in removes},
                                                         stamp.version)
            removes, adds = removes + more_removes, adds + more_adds
        now = int(time.time() * 1000)
        actions: list[Any] = [RemoveAction(r["path"], True, now, r["size"], r["partition_values"]) for r in removes]
        actions += [AddAction(a["path"], a["size"], a["partition_values"], a["modification_time"], True,
                              f'{{"numRecords":{a["rows"]}}}') for a in adds]
        table.create_write_transaction(actions, "append", table.schema(),
                                       partition_by=[BUCKET] if partitioned else None,
                                       commit_properties=stamp.properties(info))
        _evolve(open_table(uri, storage), full)
        return True

    return checked(uri, once)


def claim(uri: str, stamp: Stamp, info: dict[str, str], storage: dict[str, str]) -> None:
    """Raise the table's lease term to the stamp's (a commit of no data): from then on a commit of
    an earlier term is refused, and one it was about to make fails (LeaseLost if a later term
    claimed it already)."""
    def once() -> None:
        table = open_table(uri, storage)
        if table is None:
            return
        stamp.check(table)
        if table.transaction_version(term_app(stamp.feed)) != stamp.epoch:
            table.create_write_transaction([], "append", table.schema(), commit_properties=stamp.properties(info))

    checked(uri, once)


def fill_moved(files: list[Files]) -> None:
    """Complete the files holding rows whose key changed across buckets (delta.mirror): each
    unchanged TOASTed value is the old row's, which the old key's bucket reported as departed
    (by the move, so two moves of one key in a batch each find their own row).
    A patched file is written anew in place of the first one (never committed, so just deleted)."""
    from changefeed.sinks.delta.mirror import Move

    departed = {m: v for f in files for m, v in f.departed.items()}

    def value(move: Move, column: str, hops: int = 0) -> Any:
        v = departed.get(move, {}).get(column)
        return value(v, column, hops + 1) if isinstance(v, Move) and hops < len(departed) else v

    for f in files:
        for path, pending in f.pending:
            full = os.path.join(f.uri, path)
            rows = pq.read_table(full)
            at = {k: i for i, k in enumerate(zip(*(rows.column(c).to_pylist() for c in f.key)))}
            patched = {c: rows.column(c).to_pylist() for c in {c for _, c, _ in pending}}
            for new_key, column, move in pending:
                patched[column][at[new_key]] = value(move, column)
            for c, values in patched.items():
                rows = rows.set_column(rows.schema.get_field_index(c), rows.schema.field(c),
                                       pa.array(values, rows.schema.field(c).type))
            pq.write_table(rows, full, compression="snappy")
            add = next(a for a in f.adds if a["path"] == path)
            add["size"] = os.stat(full).st_size
        f.pending = []


def _new_columns(table: Any, wanted: pa.Schema) -> set[str]:
    have = pa.schema(table.schema().to_arrow()).names
    return {f.name for f in wanted if f.name not in have}


def _fill_older_files(table: Any, schema: pa.Schema, fills: dict[str, Any], replaced: set[str],
                      batch_id: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rewrite the table's files that lack a column of `fills` (and are not replaced anyway) with it."""
    root = table.table_uri.removeprefix("file://")
    actions = pa.table(table.get_add_actions(flatten=True)).to_pylist()
    removes, adds = [], []
    for a in actions:
        if a["path"] in replaced:
            continue
        path = os.path.join(root, a["path"])
        names = pq.read_schema(path).names
        if all(c in names for c in fills):
            continue
        rows = pq.read_table(path)
        for c, v in fills.items():
            if c not in rows.column_names:
                rows = rows.append_column(schema.field(c), pa.array([v] * len(rows), schema.field(c).type))
        bucket = a.get(f"partition.{BUCKET}")
        removes.append({"path": a["path"], "size": a["size_bytes"],
                        "partition_values": {BUCKET: str(bucket)} if bucket is not None else {}})
        adds.append(write_file(root, rows, batch_id, bucket))
    return removes, adds


def _merged(schemas: list[pa.Schema]) -> pa.Schema:
    try:
        return pa.unify_schemas(schemas)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise UnfollowableChange(f"a column changed its type within a batch ({e})", _RESNAPSHOT,
                                 component="sink") from None


_RESNAPSHOT = ("move the Delta table away and take a new snapshot of the table (changefeed snapshot --tables "
               "SCHEMA.TABLE); changefeed stopped before the change")


def _evolve(table: Any, wanted: pa.Schema) -> None:
    """Add the columns of `wanted` the table lacks; a column of another type stops the feed."""
    from deltalake import Field

    have = pa.schema(table.schema().to_arrow())
    new = []
    for f in wanted:
        if f.name not in have.names:
            new.append(Field.from_arrow(f))
        elif not _same_type(have.field(f.name).type, f.type):
            raise UnfollowableChange(f"column {f.name} of the Delta table {table.table_uri} is "
                                     f"{have.field(f.name).type}, the source's is now {f.type}", _RESNAPSHOT,
                                     component="sink")
    if new:
        table.alter.add_columns(new)


def _same_type(a: pa.DataType, b: pa.DataType) -> bool:
    """Equal as Delta stores them (Delta reads every string/binary width and list flavour alike)."""
    plain = {pa.large_string(): pa.string(), pa.string_view(): pa.string(), pa.large_binary(): pa.binary(),
             pa.binary_view(): pa.binary()}
    if pa.types.is_list(a) or pa.types.is_large_list(a) or pa.types.is_list_view(a):
        return (pa.types.is_list(b) or pa.types.is_large_list(b) or pa.types.is_list_view(b)) and \
            _same_type(a.value_type, b.value_type)
    if pa.types.is_timestamp(a) and pa.types.is_timestamp(b):
        return (a.tz is None) == (b.tz is None)
    return bool(plain.get(a, a) == plain.get(b, b))
