"""The `debezium` format's events for a run of plain changes of one keyed table, built by columns
(core.envelope_columns does the values), byte for byte what DebeziumFormat writes per change (a
property test holds the two together).

Covered: inserts, snapshot reads and updates without an old row, and deletes (their old row: the
identity's columns, or every column under REPLICA IDENTITY FULL). An update that carries its old
row goes row by row, as does a run whose commit times lie before 1970 (the per-change path
floors them to milliseconds, Arrow's division would not). Pure: Arrow only.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from changefeed.core.change import TableShape
from changefeed.core.envelope_columns import object_pieces, values_by_column
from changefeed.core.hlc import LOGICAL_BITS


def debezium_records(rows: pa.RecordBatch, shape: TableShape, dumps: Callable[[Any], bytes],
                     source: tuple[str, str, str], *, deleted: bool = False
                     ) -> tuple[list[bytes], list[bytes]] | None:
    """(keys, values) of the debezium format for `rows` (deletes if `deleted`; the format's
    tombstone after each is the caller's); `source` = (version, feed name, database). None when
    the run goes row by row (see the module doc)."""
    if not deleted and pc.any(pc.is_valid(rows.column("before"))).as_py():
        return None
    commit_ts = rows.column("commit_ts")
    micros = pc.coalesce(rows.column("commit_time"),
                         pc.multiply(pc.shift_right(commit_ts, LOGICAL_BITS), pa.scalar(1000, pa.int64())))
    if pc.any(pc.less(micros, 0)).as_py():
        return None
    full = shape.replica_identity == "f"
    old_row = shape.columns if full else tuple(c for c in shape.columns if c in shape.key)
    frags = values_by_column(rows, shape, dumps, old_row if deleted else shape.columns, deleted=deleted)
    if frags is None:
        return None

    def text(v: str) -> str:
        return dumps(v).decode("utf-8")

    key = pc.binary_join_element_wise(*object_pieces(frags, shape.key, dumps), "")
    if deleted:
        changed = ['{"before":', *object_pieces(frags, old_row, dumps), ',"after":null']
        op: Any = "d"
    else:
        changed = ['{"before":null,"after":', *object_pieces(frags, shape.columns, dumps)]
        op = rows.column("op").cast(pa.string())
    ms = pc.shift_right(commit_ts, LOGICAL_BITS)
    xid = rows.column("xid")
    tx = pc.if_else(pc.equal(xid, 0), pa.scalar(None, pa.string()), xid.cast(pa.string()))
    snapshot = pc.if_else(pc.equal(rows.column("op"), "r"), "true", "false") if not deleted else "false"
    version, feed, database = source
    value = pc.binary_join_element_wise(
        *changed,
        ',"source":{"version":' + text(version) + ',"connector":"postgresql","name":' + text(feed) + ',"ts_ms":',
        _text(pc.divide(micros, 1000)), ',"ts_us":', _text(micros), ',"ts_ns":', _text(pc.multiply(micros, 1000)),
        ',"snapshot":"', snapshot, '","db":' + text(database) + ',"schema":' + text(shape.schema) + ',"table":'
        + text(shape.table) + ',"txId":', pc.fill_null(tx, "null"), ',"lsn":', _text(rows.column("lsn")),
        ',"xmin":null},"op":"', op, '","ts_ms":', _text(ms), ',"ts_us":', _text(pc.multiply(ms, 1000)),
        ',"ts_ns":', _text(pc.multiply(ms, 1_000_000)), ',"transaction":null}', "")
    return key.cast(pa.binary()).to_pylist(), value.cast(pa.binary()).to_pylist()


def _text(numbers: Any) -> Any:
    return numbers.cast(pa.int64()).cast(pa.string())
