"""The `text` format's lines for a run of plain changes of one keyed table, built by columns,
byte for byte what TextFormat writes per change (a property test holds the two together):
inserts, snapshot reads and updates without an old row as ` INSERT:` / ` UPDATE:` with every
column, deletes as ` DELETE:` with the old row's columns that are not NULL. An update that carries
its old row (old-key / new-tuple) goes row by row. Pure: Arrow only.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from changefeed.core.change import TableShape
from changefeed.core.envelope_columns import columns, fragments, json_keys
from changefeed.core.pgvalue import UNQUOTED_TYPES, base_name


def text_records(rows: pa.RecordBatch, shape: TableShape, dumps: Callable[[Any], bytes], header: str,
                 labels: list[str], *, deleted: bool = False) -> tuple[list[bytes], list[bytes]] | None:
    """(keys, lines) of the text format for `rows` (deletes if `deleted`): `header` is the line's
    `table NAME:`, `labels` each column's ` name[type]:`. None when the run goes row by row."""
    if not deleted and pc.any(pc.is_valid(rows.column("before"))).as_py():
        return None
    values = columns(rows.column("before" if deleted else "after"), shape)
    if values is None:
        return None
    by_name = dict(zip(shape.columns, values))
    types = dict(zip(shape.columns, shape.types))
    keys = json_keys({k: fragments(by_name[k], types[k], dumps) for k in shape.key}, shape)
    pieces: list[Any] = []
    for label, value, type_name in zip(labels, values, shape.types):
        piece = pc.binary_join_element_wise(label, _literal(value, base_name(type_name)), "")
        pieces.append(pc.fill_null(piece, "" if deleted else label + "null"))  # a delete leaves NULLs out
    verb: Any = " DELETE:" if deleted else pc.if_else(pc.equal(rows.column("op"), "u"), " UPDATE:", " INSERT:")
    lines = pc.binary_join_element_wise(header, verb, *pieces, "")
    return keys.cast(pa.binary()).to_pylist(), lines.cast(pa.binary()).to_pylist()


def _literal(texts: pa.Array, type_name: str) -> pa.Array:
    """As test_decoding's print_literal() (envelope._literal), by column."""
    if type_name in UNQUOTED_TYPES:
        return texts
    if type_name == "boolean":
        return pc.if_else(pc.equal(texts, "t"), "true", "false")
    if type_name in ("bit", "bit varying"):
        return pc.binary_join_element_wise("B'", texts, "'", "")
    return pc.binary_join_element_wise("'", pc.replace_substring(texts, "'", "''"), "'", "")
