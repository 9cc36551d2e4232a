"""A table's change rows as the rows of its Delta table, per mode. Pure Arrow: no I/O.

Input: the table's change rows of one batch (core.change record batches), each with the table
shape (`R` row) it was written under. The source's columns become typed columns (columns.decode),
in the order of the table's latest shape; a column added later reads as null in earlier rows.

* `changelog`: one row per change, the after image (a delete: its key, or the whole old row
  under REPLICA IDENTITY FULL; a truncate: no columns), with `_op`, `_commit_ts`, `_commit_time`,
  `_lsn`, `_xid`, `_seq`, `_batch`, and `_unchanged` (the columns whose TOASTed value the update
  left unchanged: null in the row, never a placeholder). A key change is two rows: the delete of
  the old key, then the update (`_seq` orders the rows of a transaction: 2 × the change's
  position, +1 for the second half). With `diff`, `_before` holds the old row where sent (for a
  table without a key always: rows.with_before).
* `mirror`: a bucket's rows after the batch (`apply_mirror`): each key's last change wins, a
  delete deletes, a truncate empties, snapshot rows (`r`, read at or after the window's end)
  come after the window's changes, an unchanged TOASTed value is kept from the row before.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from changefeed.core import change as ch
from changefeed.errors import UnfollowableChange
from changefeed.sinks.delta.columns import Unrepresentable, arrow_type, decode
from changefeed.sinks.delta.split import with_columns

CHANGELOG_META = pa.schema([("_op", pa.string()), ("_commit_ts", pa.int64()),
                            ("_commit_time", pa.timestamp("us", tz="UTC")), ("_lsn", pa.int64()),
                            ("_xid", pa.int64()), ("_seq", pa.int64()), ("_batch", pa.int64()),
                            ("_unchanged", pa.list_(pa.string()))])
VALIDITY = pa.schema([("_valid_from", pa.timestamp("us", tz="UTC")), ("_valid_to", pa.timestamp("us", tz="UTC")),
                      ("_current", pa.bool_()), ("_commit_ts", pa.int64())])  # a history table's own columns
BUCKET = "_bucket"
DATA_OPS = ("c", "u", "d", "r", "t")


def delta_type(pg_type: str) -> pa.DataType:
    """The column's type in Delta: its Arrow type, but time of day as its text (Delta has no time type)."""
    t = arrow_type(pg_type)
    return pa.string() if pa.types.is_time(t) else t


def source_schema(shape: ch.TableShape) -> pa.Schema:
    return pa.schema([(c, delta_type(t)) for c, t in zip(shape.columns, shape.types)])


def table_schema(mode: str, shape: ch.TableShape, diff: bool = False) -> pa.Schema:
    """The Delta table's schema in `mode` for a source table of `shape` (partition column included)."""
    source = source_schema(shape)
    if mode == "changelog":
        before = [pa.field("_before", pa.struct(list(source)))] if with_before(shape, diff) else []
        return pa.schema([*source, *CHANGELOG_META, *before])

    return pa.schema([*source, *(VALIDITY if mode == "history" else []), pa.field(BUCKET, pa.int32())])


def with_before(shape: ch.TableShape, diff: bool) -> bool:
    """Whether a change log has `_before`: with `diff`, and always for a table without a key,
    whose update says which row it replaced only by its old row (as the JSON envelope's `before`)."""
    return diff or not shape.key


def fills(shape: ch.TableShape) -> dict[str, Any]:
    """The value each column added with a default reads as in rows written before it (PostgreSQL's
    missing value; core.change.TableShape.missing), typed: a Delta file that predates the column
    must hold it too, or readers would see null."""
    from changefeed.core.copytext import join_line

    given = [(i, v) for i, v in enumerate(shape.missing) if v is not None]
    if not given:
        return {}
    line = join_line([v.encode() if v is not None else None for v in shape.missing] +
                     [None] * (len(shape.columns) - len(shape.missing)))
    values = typed(pa.array([line], pa.binary()), shape)
    return {shape.columns[i]: values[i][0].as_py() for i, _ in given}


def typed(lines: Any, shape: ch.TableShape) -> list[Any]:
    try:
        arrays = decode(lines, shape.types)
    except Unrepresentable as e:
        column = shape.columns[e.column]
        raise UnfollowableChange(
            f"{shape.schema}.{shape.table}.{column} ({e.type_name}) holds {e.value!r}, which a Delta column of "
            f"type {arrow_type(e.type_name)} cannot hold", "change the value on the source, or leave the table "
            "out of this feed; the feed stopped before the change", component="sink") from None
    return [a.cast(pa.string()) if pa.types.is_time(a.type) else a for a in arrays]


def unchanged_names(texts: list[str | None], columns: Sequence[str]) -> Any:
    """`unchanged` int array literals ("{1,3}") -> lists of column names (null where none)."""
    return pa.array([None if not t else [columns[int(i)] for i in t.strip("{}").split(",") if i] for t in texts],
                    pa.list_(pa.string()))


def _key_changes_split(rows: pa.Table) -> tuple[pa.Table, Any]:
    """Rows with each key change as two: its delete (the old row in `before`), then itself.
    Returns the rows and each row's `_seq` (2 × seq, +1 for a key change's second half)."""
    moved = pc.and_(pc.equal(rows.column("op"), "u"), rows.column("old_key").is_valid())
    if pc.any(moved).as_py():
        idx = np.flatnonzero(moved.to_numpy(zero_copy_only=False))
        n = len(idx)
        deletes = with_columns(rows.take(pa.array(idx)), op=pa.array(["d"] * n), old_key=pa.nulls(n, pa.binary()),
                               unchanged=pa.nulls(n, pa.string()))
        order = np.argsort(np.concatenate([np.arange(len(rows)) * 2 + 1, idx * 2]), kind="stable")
        rows = pa.concat_tables([rows, deletes]).take(pa.array(order))
    second = pc.and_(pc.equal(rows.column("op"), "u"), rows.column("old_key").is_valid())
    return rows, pc.add(pc.multiply(rows.column("seq").cast(pa.int64()), 2), pc.cast(second, pa.int64()))


def data_rows(batch: Any) -> pa.Table:
    """A record batch (or table) of change rows as a table of its data rows (no `R`/`P`/`m` rows)."""
    rows = pa.Table.from_batches([batch]) if isinstance(batch, pa.RecordBatch) else batch
    return rows.filter(pc.is_in(rows.column("op"), pa.array(DATA_OPS)))


def changelog(parts: Sequence[tuple[ch.TableShape, Any]], batch_id: int, diff: bool) -> pa.Table:
    """The rows a batch appends to a table's change log; `parts`: (shape, change rows) pairs."""
    tables = []
    for shape, batch in parts:
        rows = data_rows(batch)
        if not len(rows):
            continue
        rows, seq = _key_changes_split(rows)
        lines = pc.if_else(pc.equal(rows.column("op"), "d"), rows.column("before"), rows.column("after"))
        n = len(rows)
        meta = [rows.column("op"), rows.column("commit_ts"), pc.cast(rows.column("commit_time"), pa.int64()).cast(
                    pa.timestamp("us", tz="UTC")), rows.column("lsn"), rows.column("xid"), seq,
                pa.array(np.full(n, batch_id, dtype=np.int64)),
                unchanged_names(rows.column("unchanged").to_pylist(), shape.columns)]
        arrays = [*typed(lines, shape), *meta]
        names = [*shape.columns, *CHANGELOG_META.names]
        if with_before(shape, diff):
            before = typed(rows.column("before"), shape)
            arrays.append(pa.StructArray.from_arrays(before, names=list(shape.columns),
                                                     mask=rows.column("before").is_null().combine_chunks()))
            names.append("_before")
        tables.append(pa.Table.from_arrays(arrays, names=names))
    return unify(tables)


def unify(tables: list[pa.Table]) -> pa.Table:
    """One table from tables of several shapes of one source table (a column added: null before)."""
    if not tables:
        return pa.table({})
    try:
        return pa.concat_tables(tables, promote_options="default")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise UnfollowableChange(f"a column changed its type within a batch ({e})",
                                 "take a new snapshot of the table into a new Delta table (changefeed snapshot "
                                 "--tables T after moving the old table away)", component="sink") from None
