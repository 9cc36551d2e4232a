"""The change builder's rows taken as an Arrow record batch of change rows (see builder.py).

The builder keeps its rows compact: op bytes and table ids per row (with the lines), the columns
that are mostly NULL (old_key, unchanged, meta) as sparse dicts, and the per-transaction columns
once per transaction. Here they become the columns of core.change's schema.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from changefeed.core import change as ch
from changefeed.postgres.decode.rows import Chunk

# A transaction's closed rows, or a part's (a large transaction goes out in parts): how many rows,
# lsn, xid, commit_time, commit ts, seq of its first row
Txn = tuple[int, int, int, int | None, int, int]


def record_batch(rows: Chunk, tables: list[tuple[str | None, str | None]], txns: list[Txn],
                 sparse: dict[str, dict[int, Any]]) -> pa.RecordBatch:
    """`rows`, the first rows not taken yet, as a record batch: their transactions are `txns`, in
    order, their table ids index `tables` (schema, name), and `sparse` holds by row index the values of
    the columns that are mostly NULL (from row 0 on; those past `rows` are left out)."""
    n = len(rows)
    schema = ch.arrow_schema()
    cols = {"op": _letters(rows.op), "after": rows.after, "before": rows.before, **_per_txn(txns, n)}
    for i, name in enumerate(("schema", "table")):
        cols[name] = _names([t[i] for t in tables], rows.table)
    for name, d in sparse.items():
        cols[name] = _sparse(d, n, schema.field(name).type)
    return pa.RecordBatch.from_arrays([cols[f.name] for f in schema], schema=schema)


def _letters(op: np.ndarray) -> pa.Array:
    """A string column of one-letter values, from their bytes."""
    return pa.Array.from_buffers(pa.string(), len(op), [None, pa.py_buffer(np.arange(len(op) + 1, dtype=np.int32)),
                                                        pa.py_buffer(op)])


def _names(names: list[str | None], ids: np.ndarray) -> pa.Array:
    """A string column of names[id] per id (a batch often holds one table's rows only)."""
    if len(ids) and ids.min() == ids.max():
        return pa.repeat(pa.scalar(names[ids[0]], pa.string()), len(ids))
    return pa.array(names, pa.string()).take(pa.array(ids))


def _per_txn(txns: list[Txn], n: int) -> dict[str, pa.Array]:
    """The per-transaction columns of `n` rows, from (rows, lsn, xid, commit_time, ts, first seq) per
    transaction or part of one."""
    rows = np.array([t[0] for t in txns], np.int64)

    def each(field: int) -> np.ndarray:
        return np.repeat(np.array([t[field] or 0 for t in txns], np.int64), rows)

    seq = np.arange(n) - np.repeat(np.cumsum(rows) - rows - np.array([t[5] for t in txns], np.int64), rows)
    no_commit_time = np.repeat(np.array([t[3] is None for t in txns], bool), rows)
    return {"lsn": pa.array(each(1)), "seq": pa.array(seq.astype(np.int32)), "xid": pa.array(each(2)),
            "commit_time": pa.array(each(3), mask=no_commit_time), "commit_ts": pa.array(each(4))}


def _sparse(values: dict[int, Any], n: int, type_: pa.DataType) -> pa.Array:
    """A column of `n` rows that is NULL but at the indexes in `values`."""
    at = [i for i in values if i < n]
    if not at:
        return pa.nulls(n, type_)
    index = np.zeros(n, np.int32)
    index[at] = np.arange(len(at), dtype=np.int32)
    missing = np.ones(n, bool)
    missing[at] = False
    return pa.array([values[i] for i in at], type_).take(pa.array(index, mask=missing))
