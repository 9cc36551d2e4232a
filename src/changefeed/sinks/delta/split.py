"""Split a batch's change rows for the Delta sink's parallel writer tasks (the stage before the shuffle).

Spark reads a batch as packed chunks of changes in any mix of tables (core.change). The Delta
sink writes a table's files from several tasks at once, so each chunk is cut into groups that
one task can write alone: per table and bucket, each group packed with the table's `R` row ahead
of it (its `seq` set to the bucket), keyed by `part` for the shuffle (`part` -1: the `P` rows, which the driver needs).

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

from ...core import change as ch

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


def _groups(rb: Any, described: dict[tuple[str, str], Any], mode: str, buckets: int) -> Iterator[tuple[int, Any]]:
    ops = np.asarray(rb.column("op").to_pylist(), dtype=object)
    relations = np.flatnonzero(ops == ch.RELATION).tolist()
    progress = np.flatnonzero(ops == ch.PROGRESS)
    if len(progress):
        yield PROGRESS_PART, rb.take(pa.array(progress))
    bounds = sorted({0, *relations, len(ops)})
    for lo, hi in zip(bounds, bounds[1:]):
        if ops[lo] == ch.RELATION:
            r = rb.slice(lo, 1)
            described[(r.column("schema")[0].as_py(), r.column("table")[0].as_py())] = r
        seg = np.arange(lo, hi)
        data = seg[np.isin(ops[lo:hi], list("cudrt"))]
        if not len(data):
            continue
        names = pc.binary_join_element_wise(rb.column("schema").take(pa.array(data)),
                                            rb.column("table").take(pa.array(data)), "\x00").to_pylist()
        for name in dict.fromkeys(names):
            schema, table = name.split("\x00")
            rows = data[np.asarray([n == name for n in names])]
            relation = described.get((schema, table))
            if relation is None:
                raise ValueError(f"change for {schema}.{table} before its R row")
            sub = rb.take(pa.array(rows))
            if mode == "changelog":
                for i in range(0, len(rows), RUN_ROWS):
                    piece = sub.slice(i, RUN_ROWS)
                    bucket = (i // RUN_ROWS) % buckets
                    yield part_of(schema, table, bucket), pa.concat_batches([_labelled(relation, bucket), piece])
            else:
                shape = ch.TableShape.from_meta(schema, table, relation.column("meta")[0].as_py())
                for bucket, piece in by_bucket(sub, shape, buckets):
                    yield part_of(schema, table, bucket), pa.concat_batches([_labelled(relation, bucket), piece])


def _labelled(relation: Any, bucket: int) -> Any:
    """The group's `R` row carries its bucket in `seq` (unused in `R` rows)."""
    return relation.set_column(relation.schema.get_field_index("seq"), "seq", pa.array([bucket], pa.int32()))


def key_columns(shape: ch.TableShape) -> list[int]:
    return [shape.columns.index(k) for k in shape.key]


def key_texts(lines: list[bytes | None], keys: list[int]) -> list[bytes]:
    """Each full-width COPY line's key fields, as one text (fields joined by TAB)."""
    out = []
    for line in lines:
        fields = (line or b"").split(b"\t")
        out.append(b"\t".join(fields[k] for k in keys) if len(fields) > max(keys) else b"")
    return out


def bucket_of(key_text: bytes, buckets: int) -> int:
    return zlib.crc32(key_text) % buckets


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
    ops = rows.column("op").to_pylist()
    moved = [i for i, v in enumerate(rows.column("old_key").is_valid().to_pylist()) if v and ops[i] == "u"]
    if moved:
        n = len(moved)
        deletes = with_columns(rows.take(pa.array(moved)), op=pa.array(["d"] * n), after=pa.nulls(n, pa.binary()),
                               old_key=pa.nulls(n, pa.binary()), unchanged=pa.nulls(n, pa.string()),
                               meta=pa.array([MOVED] * n))
        rows = pa.concat_batches([deletes, rows])  # the writer orders by (commit, seq, op): delete first
        ops = rows.column("op").to_pylist()
    lines = pc.if_else(pc.equal(rows.column("op"), "d"), rows.column("before"), rows.column("after")).to_pylist()
    texts = key_texts(lines, keys)
    out: dict[int, list[int]] = {}
    truncates = []
    for i, (op, text) in enumerate(zip(ops, texts)):
        if op == "t":
            truncates.append(i)
        else:
            out.setdefault(bucket_of(text, buckets), []).append(i)
    for b in range(buckets) if truncates else ():
        out.setdefault(b, [])
    for bucket, idx in sorted(out.items()):
        yield bucket, rows.take(pa.array(sorted(idx + truncates), pa.int64()))
