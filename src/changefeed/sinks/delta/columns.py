"""COPY text lines -> typed Arrow arrays, one per column, for writing Delta Lake tables.

Change rows hold each row image as one COPY text line (see core.copytext); a Delta table wants
typed columns. This runs on every changed row of a feed, so the work is vectorized first: one
`split_pattern` splits a whole batch of lines into fields, a column is one strided `take` of
them, `\\N` is found by one comparison, one byte count tells whether any field has an escape,
and Arrow's own casts parse integers, floats (NaN and infinities too), decimals, dates, times and
timestamps (offsets converted to UTC) over a whole column at once. Python runs per value only
where Arrow cannot: fields holding a backslash escape (rare outside bytea), bytea, arrays,
timestamps whose offset has seconds (historic zones), and, when a cast fails, to find and report
the value at fault; there psycopg's text loaders read each value (no connection needed).

Values are read as the walsender prints them (DateStyle ISO, bytea_output hex; the escape form is
read too; see core.pgvalue). A value the column's Arrow type cannot hold raises `Unrepresentable`
rather than being guessed at or nulled: numeric NaN or infinities in a decimal column, infinite,
BC or after-9999 dates and timestamps (Delta and Spark hold years 1 to 9999, in UTC for
timestamptz), time 24:00:00, multi-dimensional array values.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from functools import lru_cache
from typing import Any

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg.adapt import Transformer
from psycopg.pq import Format

from changefeed.core.copytext import NULL, unescape
from changefeed.core.pgvalue import base_name, parse_array

_SCALARS: dict[str, pa.DataType] = {
    "smallint": pa.int16(), "integer": pa.int32(), "bigint": pa.int64(),
    "real": pa.float32(), "double precision": pa.float64(), "boolean": pa.bool_(), "bytea": pa.binary(),
    "date": pa.date32(), "timestamp without time zone": pa.timestamp("us"),
    "timestamp with time zone": pa.timestamp("us", tz="UTC"), "time without time zone": pa.time64("us"),
}  # every other type (text-like, uuid, json, interval, enums, domains, timetz, money, ...) is its text
_NUMERIC = re.compile(r"numeric\((\d+)(?:,(-?\d+))?\)")
_ARRAY = re.compile(r"(?:\[\])+$")


@lru_cache(maxsize=1024)
def arrow_type(pg_type: str) -> pa.DataType:
    """The Arrow type of a column of SQL type `pg_type` (as `format_type` prints it).

    An array type is a list of its element type, whatever its declared dimensions (PostgreSQL
    has one array type per element type; "integer[][]" is "integer[]"). numeric(p,s) is a
    decimal (decimal256 beyond 38 digits; beyond 76, or numeric without precision, its text);
    PostgreSQL 15's scales outside 0..p become the decimal that holds the same values.
    """
    name = pg_type.strip()
    if _ARRAY.search(name):
        return pa.list_(arrow_type(_ARRAY.sub("", name)))
    if (m := _NUMERIC.fullmatch(name)) is not None:
        precision, scale = int(m[1]), int(m[2] or 0)
        precision, scale = (precision - scale, 0) if scale < 0 else (max(precision, scale), scale)
        if precision <= 38:
            return pa.decimal128(precision, scale)
        return pa.decimal256(precision, scale) if precision <= 76 else pa.string()
    return _SCALARS.get(base_name(name), pa.string())


class Unrepresentable(ValueError):
    """A value the column's Arrow type cannot hold (numeric NaN/Infinity in a decimal column, a timestamp
    'infinity' or BC or beyond year 9999, a date out of range ...)."""

    def __init__(self, column: int, type_name: str, value: str) -> None:
        shown = value if len(value) <= 80 else value[:77] + "..."
        super().__init__(f"column {column} ({type_name}): {shown!r} does not fit its Arrow type")
        self.column, self.type_name, self.value = column, type_name, value

    def __reduce__(self) -> tuple[Any, ...]:  # picklable (Spark sends worker errors back)
        return type(self), (self.column, self.type_name, self.value)


def decode(lines: pa.Array, types: Sequence[str], columns: Sequence[int] | None = None) -> list[pa.Array]:
    """COPY text lines (binary, large_binary or binary_view; a null line is no row image, all
    its columns null) -> one array of type `arrow_type(types[i])` per column index in `columns`
    (default: all), each as long as `lines`.

    Raises ValueError when a line's field count is not `len(types)`, `Unrepresentable` (with
    the column and value) when a value does not fit its column's type.
    """
    wanted = range(len(types)) if columns is None else columns
    if not wanted:
        return []
    if isinstance(lines, pa.ChunkedArray):
        lines = lines.combine_chunks()
    lines = lines.cast(pa.large_binary())
    if lines.null_count:
        lines = lines.fill_null(pa.scalar(b"\t".join([NULL] * len(types)), pa.large_binary()))
    parts = pc.split_pattern(lines, b"\t")
    counts = pc.min_max(pc.list_value_length(parts)).as_py()
    if len(lines) and counts != {"min": len(types), "max": len(types)}:
        raise ValueError(f"lines have {counts['min']} to {counts['max']} fields, the table {len(types)} columns")
    fields = parts.flatten()  # row r's column i is fields[r * len(types) + i]
    return [_convert(_field(fields.take(np.arange(i, len(fields), len(types)))), types[i], i) for i in wanted]


def _field(raw: pa.Array) -> pa.Array:
    """One column's COPY text fields -> its values (large_binary): `\\N` null, escapes undone."""
    values = pc.if_else(pc.equal(raw, NULL), pa.scalar(None, raw.type), raw)
    offsets = np.frombuffer(raw.buffers()[1], np.int64)[raw.offset:raw.offset + len(raw) + 1]
    data = np.frombuffer(raw.buffers()[2] or b"", np.uint8)[offsets[0]:offsets[-1]]
    if np.count_nonzero(data == 0x5C) == values.null_count:  # each `\\N` holds one: no escapes
        return values
    escaped = pc.match_substring(values, "\\").fill_null(False)
    texts = [unescape(v) for v in values.filter(escaped).to_pylist()]
    return pc.replace_with_mask(values, escaped, pa.array(texts, raw.type))


def _convert(values: pa.Array, type_name: str, column: int) -> pa.Array:
    """Text values (large_binary or large_string, nulls) of SQL type `type_name` -> an array of `arrow_type`."""
    typ = arrow_type(type_name)
    if pa.types.is_list(typ):
        return _array(values.cast(pa.large_string()), type_name, typ, column)
    if pa.types.is_string(typ):
        return values.cast(typ)  # checks UTF-8
    values = values.view(pa.large_string())  # what does not parse fails anyway
    vector = _bool if pa.types.is_boolean(typ) else _time if pa.types.is_time(typ) else _cast
    if not pa.types.is_binary(typ):
        try:
            return vector(values, typ)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
    if pa.types.is_timestamp(typ) and typ.tz is not None:  # offsets with seconds: only those per value
        odd = pc.match_substring_regex(values, r"[+-]\d\d:\d\d:\d\d$").fill_null(False)
        if pc.any(odd).as_py():
            try:
                common = vector(pc.if_else(odd, pa.scalar(None, values.type), values), typ)
            except pa.ArrowInvalid:
                pass
            else:
                return pc.replace_with_mask(common, odd, _python(values.filter(odd), typ, type_name, column))
    return _python(values, typ, type_name, column)


_DAY_ONE = datetime(1, 1, 1, tzinfo=timezone.utc)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_TIMESTAMP_RANGE = ((_DAY_ONE - _EPOCH) // timedelta(microseconds=1),
                    (datetime(9999, 12, 31, 23, 59, 59, 999999, timezone.utc) - _EPOCH) // timedelta(microseconds=1))


def _cast(values: pa.Array, typ: pa.DataType) -> pa.Array:
    """Arrow's cast; a timestamptz must also stay within years 1..9999 once in UTC."""
    out = pc.cast(values, typ)
    if pa.types.is_timestamp(typ) and typ.tz is not None and out.null_count < len(out):
        low, high = pc.min_max(out.cast(pa.int64())).as_py().values()
        if low < _TIMESTAMP_RANGE[0] or high > _TIMESTAMP_RANGE[1]:
            raise pa.ArrowInvalid("a timestamp beyond years 1 to 9999 in UTC")
    return out


def _bool(values: pa.Array, typ: pa.DataType) -> pa.Array:
    true = pc.equal(values, "t")
    if not pc.all(pc.or_(true, pc.equal(values, "f"))).as_py():
        raise pa.ArrowInvalid("a boolean other than t or f")
    return true


_START = pa.scalar("1970-01-01", pa.large_string())
_SPACE = pa.scalar(" ", pa.large_string())


def _time(values: pa.Array, typ: pa.DataType) -> pa.Array:
    """Arrow casts no text to time: read it as a time on 1970-01-01 (which refuses 24:00:00)."""
    stamps = pc.cast(pc.binary_join_element_wise(_START, values, _SPACE), pa.timestamp("us"))
    return stamps.cast(pa.int64()).cast(typ)


def _array(values: pa.Array, type_name: str, typ: pa.DataType, column: int) -> pa.Array:
    """Array literals -> a list array; the elements of all rows are converted as one column."""
    element = _ARRAY.sub("", type_name.strip())
    delim = ";" if base_name(element) == "box" else ","  # the one built-in type not using commas
    offsets, items = [0], []
    for text in values.to_pylist():
        if text is not None:
            try:
                parsed = parse_array(text, delim=delim)
            except ValueError as e:
                raise Unrepresentable(column, type_name, text) from e
            if any(isinstance(item, list) for item in parsed):
                raise Unrepresentable(column, type_name, text)  # multi-dimensional
            items += parsed
        offsets.append(len(items))
    try:
        elements = _convert(pa.array(items, pa.large_string()), element, column)
    except Unrepresentable as e:  # reported with the column's type
        raise Unrepresentable(column, type_name, e.value) from e
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), elements, type=typ, mask=values.is_null())


# -- per value, for what the vectorized casts refuse ----------------------------------------------
# psycopg's own text loaders, without a connection: they read the server's default output (ISO
# dates, hex or escape bytea) and refuse what Python cannot hold (BC, after 9999, infinity,
# 24:00:00) with a DataError, which is what Unrepresentable needs.
_LOADERS = Transformer()
_OIDS: list[tuple[Callable[[pa.DataType], bool], int]] = [
    (pa.types.is_int16, 21), (pa.types.is_int32, 23), (pa.types.is_integer, 20), (pa.types.is_float32, 700),
    (pa.types.is_floating, 701), (pa.types.is_decimal, 1700), (pa.types.is_binary, 17),
    (pa.types.is_date, 1082), (pa.types.is_time, 1083),
    (lambda t: pa.types.is_timestamp(t) and t.tz is None, 1114), (pa.types.is_timestamp, 1184)]


def _parser(typ: pa.DataType) -> Callable[[str], Any]:
    if pa.types.is_boolean(typ):
        return {"t": True, "f": False}.__getitem__  # psycopg reads anything but "t" as false
    oid = next(oid for check, oid in _OIDS if check(typ))
    load = _LOADERS.get_loader(oid, Format.TEXT).load

    def parse(text: str) -> Any:
        value = load(text.encode())
        if isinstance(value, Decimal) and not value.is_finite():
            raise ValueError(text)  # numeric NaN or infinity: no decimal holds it
        if isinstance(value, datetime) and value.tzinfo is not None:
            return value.astimezone(timezone.utc)  # OverflowError before year 1
        return value
    return parse


def _python(values: pa.Array, typ: pa.DataType, type_name: str, column: int) -> pa.Array:
    """Per value; the first value that does not parse or fit raises `Unrepresentable`."""
    parse, texts, out = _parser(typ), values.cast(pa.large_string()).to_pylist(), []
    for text in texts:
        try:
            out.append(None if text is None else parse(text))
        except (ValueError, ArithmeticError, KeyError, psycopg.DataError) as e:
            raise Unrepresentable(column, type_name, text) from e
    try:
        return pa.array(out, typ)
    except (pa.ArrowException, OverflowError):
        for text, value in zip(texts, out):  # which one? (precision, scale, integer range)
            try:
                pa.scalar(value, typ)
            except (pa.ArrowException, OverflowError) as e:
                raise Unrepresentable(column, type_name, text) from e
        raise
