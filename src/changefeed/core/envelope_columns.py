"""Envelopes built by columns: the `json` format's messages for a run of plain changes of one table
(inserts, snapshot reads, updates; no TOAST value left unchanged, no key changed; deletes), made
from the batch's Arrow columns with Arrow compute instead of a Python dict per change. The pieces
here (a line's values, their JSON text, keys, objects) serve the other formats' builders too
(core.debezium_columns, core.text_columns).

The bytes are exactly those core.envelope writes for each change (a property test holds the two
together): every value becomes its JSON text by column (PostgreSQL's integer text is already a
JSON number; numeric is quoted; text needs escaping only where it holds a quote, a backslash or
a control character; timestamps of the common form are rewritten by one regular expression), and
a value no fast rule covers is converted as envelope does it, one by one. The pieces are then
joined row-wise. Pure: Arrow only.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from changefeed.core.change import TableShape
from changefeed.core.copytext import unescape
from changefeed.core.pgvalue import base_name, converter

_INTEGERS = frozenset({"smallint", "integer", "bigint", "oid"})
_TIMESTAMPS = frozenset({"timestamp with time zone", "timestamp without time zone"})
_NEEDS_JSON_ESCAPE = r'[\x00-\x1f"\\]'
_TS = r"^(\d{4})-(\d\d-\d\d) (\d\d:\d\d:\d\d(?:\.\d+)?)"
_COLUMNAR_OPS = ("c", "r", "u")


def fragments(texts: pa.Array, type_name: str, dumps: Callable[[Any], bytes]) -> pa.Array:
    """Each value of `texts` (PostgreSQL text form, null for SQL NULL) as its JSON text, as
    `dumps(converter(type_name)(text))` writes it; `null` for NULL."""
    name = base_name(type_name)
    conv = converter(type_name)
    fast: pa.Array | None = None
    ok: pa.Array | None = None  # where `fast` holds (else: one by one)
    if name in _INTEGERS:
        fast = texts
    elif name == "numeric":  # digits, '.', '-', NaN, Infinity: nothing to escape
        fast = _quoted(texts)
    elif name == "boolean":
        fast = pc.if_else(pc.equal(texts, "t"), "true", "false")
    elif name in _TIMESTAMPS:
        fast, ok = _timestamps(texts, name == "timestamp with time zone")
    elif name == "date":
        ok = pc.match_substring_regex(texts, r"^\d{4}-\d\d-\d\d$")
        fast = _quoted(texts)
    elif not name.endswith("[]") and conv is converter("text"):  # kept as its text
        ok = pc.invert(pc.match_substring_regex(texts, _NEEDS_JSON_ESCAPE))
        fast = _quoted(texts)
    if fast is None:
        return pa.array([b"null" if t is None else dumps(conv(t)) for t in texts.to_pylist()], pa.binary()
                        ).cast(pa.string())
    if ok is not None:
        ok = pc.fill_null(ok, True)  # (NULLs are handled below)
        slow = pc.invert(ok)
        if pc.any(slow).as_py():
            values = [dumps(conv(t)).decode("utf-8") for t in pc.filter(texts, slow).to_pylist()]
            fast = pc.replace_with_mask(fast, slow, pa.array(values, pa.string()))
    return pc.fill_null(fast, "null")


_UTC = (_TS + r"\+00$", r'"\1-\2T\3Z"')
_PLAIN = (_TS + "$", r'"\1-\2T\3"')


def _timestamps(texts: pa.Array, zoned: bool) -> tuple[pa.Array, pa.Array | None]:
    """(JSON texts, where they hold) for timestamps: when every value has the type's common form
    (UTC for timestamptz, the session's zone being UTC), one match and one rewrite; else both forms."""
    common = _UTC if zoned else _PLAIN
    matched = pc.match_substring_regex(texts, common[0])
    if pc.all(matched).as_py():  # (nulls skipped)
        return pc.replace_substring_regex(texts, *common), None
    other = _PLAIN if zoned else _UTC
    rewritten = pc.if_else(matched, pc.replace_substring_regex(texts, *common),
                           pc.replace_substring_regex(texts, *other))
    return rewritten, pc.or_(matched, pc.match_substring_regex(texts, other[0]))


def _quoted(texts: pa.Array) -> pa.Array:
    return pc.binary_join_element_wise('"', texts, '"', "")


def columns(lines: pa.Array, shape: TableShape) -> list[pa.Array] | None:
    """The values of COPY text `lines` (all of `shape`'s columns), one string array per column
    (null for NULL); None when a line does not hold them all."""
    try:
        texts = lines.cast(pa.string())
    except pa.ArrowInvalid:  # not UTF-8 (a SQL_ASCII database): as the per-change path takes it
        return None
    parts = pc.split_pattern(texts, "\t")
    if not pc.all(pc.equal(pc.list_value_length(parts), len(shape.columns))).as_py():
        return None
    out = []
    for i in range(len(shape.columns)):
        col = pc.list_element(parts, i)
        escaped = pc.match_substring(col, "\\")
        if pc.any(escaped).as_py():  # \N (NULL) and escapes: as core.copytext reads them, one by one
            values = [None if (v := unescape(t.encode("utf-8"))) is None else v.decode("utf-8")
                      for t in pc.filter(col, escaped).to_pylist()]
            col = pc.replace_with_mask(col, escaped, pa.array(values, pa.string()))
        out.append(col)
    return out


def json_records(rows: pa.RecordBatch, shape: TableShape, dumps: Callable[[Any], bytes], *, deleted: bool = False
                 ) -> tuple[list[bytes], list[bytes]] | None:
    """(keys, values) of the json format (no `diff`) for `rows`, plain changes of a keyed table
    (see the module doc), deletes if `deleted`; None when they cannot be built by columns (the
    caller goes row by row)."""
    frags = values_by_column(rows, shape, dumps, shape.key if deleted else shape.columns, deleted=deleted)
    if frags is None:
        return None
    key_text = json_keys(frags, shape)
    after: list[Any] = ['{"after":null']
    if not deleted:
        after = ['{"after":', *object_pieces(frags, shape.columns, dumps)]
    op = rows.column("op").cast(pa.string())
    updated = rows.column("commit_ts").cast(pa.string())
    table = dumps(f"{shape.schema}.{shape.table}").decode("utf-8")
    value = pc.binary_join_element_wise(*after, ',"key":', key_text, ',"op":"', op, '","updated":"', updated,
                                        '","table":' + table + "}", "")
    return (key_text.cast(pa.binary()).to_pylist(), value.cast(pa.binary()).to_pylist())


def values_by_column(rows: pa.RecordBatch, shape: TableShape, dumps: Callable[[Any], bytes], wanted: Iterable[str],
                     *, deleted: bool) -> dict[str, pa.Array] | None:
    """The JSON text of the `wanted` columns' values of `rows` (their old rows if `deleted`), by
    column name; None when a line does not hold every column."""
    values = columns(rows.column("before" if deleted else "after"), shape)
    if values is None:
        return None
    wanted = set(wanted)
    return {c: fragments(v, t, dumps) for c, v, t in zip(shape.columns, values, shape.types) if c in wanted}


def json_keys(frags: dict[str, pa.Array], shape: TableShape) -> pa.Array:
    """The json format's keys: the key columns' values as a JSON array."""
    pieces: list[Any] = ["["]
    for i, k in enumerate(shape.key):
        pieces += [","] * bool(i) + [frags[k]]
    return pc.binary_join_element_wise(*pieces, "]", "")


def object_pieces(frags: dict[str, pa.Array], names: Iterable[str], dumps: Callable[[Any], bytes]) -> list[Any]:
    """The pieces of a JSON object of these columns, in this order, for binary_join_element_wise."""
    pieces: list[Any] = ["{"]
    for i, c in enumerate(names):
        pieces += [("," if i else "") + dumps(c).decode("utf-8") + ":", frags[c]]
    pieces.append("}")
    return pieces


def kinds(rows: pa.RecordBatch) -> Any:
    """Per row (a numpy array): PLAIN for a change json_records builds, DELETE for a delete it
    builds, OTHER for a row that goes row by row."""
    op = rows.column("op")
    simple = pc.and_(pc.is_null(rows.column("old_key")), pc.is_null(rows.column("unchanged")))
    plain = pc.and_(pc.is_in(op, pa.array(_COLUMNAR_OPS)), simple)
    deleted = pc.and_(pc.equal(op, "d"), pc.is_valid(rows.column("before")))
    kind = pc.if_else(pc.fill_null(plain, False), PLAIN, pc.if_else(pc.fill_null(deleted, False), DELETE, OTHER))
    return kind.to_numpy(zero_copy_only=False)


OTHER, PLAIN, DELETE = 0, 1, 2
