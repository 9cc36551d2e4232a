"""Split a batch's change rows for the Delta sink's parallel writer tasks (the stage before the shuffle).

Spark reads a batch as packed chunks of changes in any mix of tables (core.change). The Delta
sink writes a table's files from several tasks at once, so each chunk is cut into groups that
one task can write alone: per table and bucket, each group packed with the table's `R` row ahead
of it (its `xid` set to the bucket), keyed by `part` for the shuffle (`part` -1: the `P` rows, which the driver needs).

In `changelog` mode any split works (rows carry their order): a table's rows are dealt out in
runs of RUN_ROWS. In `mirror` and `history` mode a bucket is a partition of the Delta table that
one task rewrites, so a row goes to the bucket of its key's hash (crc32 of the key's COPY text,
which the source prints the same for the same value every time): every change of a key lands in
the same task. A key change is split into a delete of the old key (its own bucket) and an upsert
of the new one; a truncate goes to every bucket of its table.
"""
from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from changefeed.core import change as ch

SPLIT_DDL = "`part` bigint, `rows` int, `changes` binary"
RUN_ROWS = 8192  # changelog: a table's rows go to one group per run of this many
PROGRESS_PART = -1
MOVED = "moved"  # the `meta` of a key change's delete half


def part_of(schema: str, table: str, bucket: int) -> int:
    """The shuffle key of a table's bucket: spread over Spark's hash partitioning."""
    return zlib.crc32(f"{schema}.{table}/{bucket}".encode())


def split(packed: Iterator[Any], mode: str, buckets: int) -> Iterator[Any]:
    """mapInArrow's function: record batches of packed rows -> record batches of `SPLIT_DDL`."""
    described: dict[tuple[str, str], Any] = {}  # table -> its latest R row (a one-row record batch)
    for batch in packed:
        for rb in ch.unpack(batch):
            for part, rows in _groups(rb, described, mode, buckets):
                out = ch.pack(rows)
                yield pa.RecordBatch.from_arrays([pa.array([part], pa.int64()), out.column(0), out.column(1)],
                                                 names=["part", "rows", "changes"])


def _flags(ops: Any, *values: str) -> Any:
    """A numpy bool mask of the rows whose op is one of `values`."""
    return pc.is_in(ops, pa.array(values)).to_numpy(zero_copy_only=False)


def _groups(rb: Any, described: dict[tuple[str, str], Any], mode: str, buckets: int) -> Iterator[tuple[int, Any]]:
    ops = rb.column("op")
    relations = np.flatnonzero(_flags(ops, ch.RELATION)).tolist()
    progress = np.flatnonzero(_flags(ops, ch.PROGRESS))
    if len(progress):
        yield PROGRESS_PART, rb.take(pa.array(progress))
    is_data = _flags(ops, *"cudrt")
    bounds = sorted({0, *relations, len(rb)})
    for lo, hi in zip(bounds, bounds[1:]):
        if lo in relations:
            r = rb.slice(lo, 1)
            described[(r.column("schema")[0].as_py(), r.column("table")[0].as_py())] = r
        data = lo + np.flatnonzero(is_data[lo:hi])
        if not len(data):
            continue
        taken = pa.array(data)
        names = pc.binary_join_element_wise(rb.column("schema").take(taken), rb.column("table").take(taken),
                                            "\x00").dictionary_encode()
        codes = names.indices.to_numpy(zero_copy_only=False)
        for code, name in enumerate(names.dictionary.to_pylist()):
            schema, table = name.split("\x00")
            relation = described.get((schema, table))
            if relation is None:
                raise ValueError(f"change for {schema}.{table} before its R row")
            sub = rb.take(pa.array(data[codes == code]))
            if mode == "changelog":
                for i in range(0, len(sub), RUN_ROWS):
                    bucket = (i // RUN_ROWS) % buckets
                    yield part_of(schema, table, bucket), pa.concat_batches([_labelled(relation, bucket),
                                                                             sub.slice(i, RUN_ROWS)])
            else:
                shape = ch.TableShape.from_meta(schema, table, relation.column("meta")[0].as_py())
                for bucket, piece in by_bucket(sub, shape, buckets):
                    yield part_of(schema, table, bucket), pa.concat_batches([_labelled(relation, bucket), piece])


def _labelled(relation: Any, bucket: int) -> Any:
    """The group's `R` row carries its bucket in `xid` (its `lsn` and `seq` keep its place in the stream)."""
    return relation.set_column(relation.schema.get_field_index("xid"), "xid", pa.array([bucket], pa.int64()))


def key_columns(shape: ch.TableShape) -> list[int]:
    return [shape.columns.index(k) for k in shape.key]


def key_texts(lines: Any, keys: list[int]) -> list[bytes]:
    """Each full-width COPY line's key fields, as one text (fields joined by TAB); b"" for none."""
    fields = pc.split_pattern(pc.fill_null(lines.cast(pa.binary()), b""), b"\t")
    short = pc.less_equal(pc.list_value_length(fields), max(keys))
    fields = pc.if_else(short, pa.scalar([b""] * (max(keys) + 1), fields.type), fields)
    parts = [pc.list_element(fields, k) for k in keys]
    joined = parts[0] if len(parts) == 1 else pc.binary_join_element_wise(*parts, b"\t")
    texts: list[bytes] = joined.to_pylist()
    return texts



def with_columns(rb: Any, **columns: Any) -> Any:
    """`rb` with the named columns replaced."""
    for name, values in columns.items():
        rb = rb.set_column(rb.schema.get_field_index(name), name, values)
    return rb


def by_bucket(rows: Any, shape: ch.TableShape, buckets: int) -> Iterator[tuple[int, Any]]:
    """A table's change rows in groups by the bucket of their key. A key change becomes a delete
    of the old key (op `d`, its `before`, `meta` MOVED) and an upsert of the new row (which keeps
    its `old_key`: an unchanged TOASTed value is the old row's); a truncate goes to every bucket."""
    keys = key_columns(shape)
    moved = np.flatnonzero(pc.and_(pc.equal(rows.column("op"), "u"), rows.column("old_key").is_valid())
                           .to_numpy(zero_copy_only=False))
    if len(moved):
        n = len(moved)
        deletes = with_columns(rows.take(pa.array(moved)), op=pa.array(["d"] * n), after=pa.nulls(n, pa.binary()),
                               old_key=pa.nulls(n, pa.binary()), unchanged=pa.nulls(n, pa.string()),
                               meta=pa.array([MOVED] * n))
        rows = pa.concat_batches([deletes, rows])  # the writer orders by (commit, seq, op): delete first
    lines = pc.if_else(pc.equal(rows.column("op"), "d"), rows.column("before"), rows.column("after"))
    texts = key_texts(lines, keys)
    of = np.fromiter((zlib.crc32(t) % buckets for t in texts), dtype=np.int64, count=len(texts))
    truncates = np.flatnonzero(_flags(rows.column("op"), "t"))
    of[truncates] = -1
    for bucket in range(buckets):
        idx = np.flatnonzero(of == bucket)
        if len(idx) or len(truncates):
            yield bucket, rows.take(pa.array(np.union1d(idx, truncates)))
