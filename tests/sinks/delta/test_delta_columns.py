"""COPY text lines -> typed Arrow columns (sinks.delta.columns). Rows of typed Python values are
rendered the way PostgreSQL prints them (DateStyle ISO, bytea hex, array_out quoting, COPY text
escapes) and must decode back to the same values."""
from __future__ import annotations

import json
import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from changefeed.core import copytext
from changefeed.sinks.delta.columns import Unrepresentable, arrow_type, decode

UTC = timezone.utc


@pytest.mark.parametrize("pg_type, arrow", [
    ("smallint", pa.int16()), ("integer", pa.int32()), ("bigint", pa.int64()),
    ("real", pa.float32()), ("double precision", pa.float64()),
    ("numeric(12,2)", pa.decimal128(12, 2)), ("numeric(38,0)", pa.decimal128(38, 0)),
    ("numeric(39,4)", pa.decimal256(39, 4)), ("numeric(76,10)", pa.decimal256(76, 10)), ("numeric(77,0)", pa.string()),
    ("numeric(5,-2)", pa.decimal128(7, 0)), ("numeric(2,5)", pa.decimal128(5, 5)), ("numeric", pa.string()),
    ("boolean", pa.bool_()), ("text", pa.string()), ("character varying(20)", pa.string()),
    ("character varying", pa.string()), ("character(3)", pa.string()), ("character", pa.string()),
    ("name", pa.string()), ("citext", pa.string()), ("bytea", pa.binary()), ("date", pa.date32()),
    ("timestamp without time zone", pa.timestamp("us")), ("timestamp(3) without time zone", pa.timestamp("us")),
    ("timestamp with time zone", pa.timestamp("us", tz="UTC")),
    ("timestamp(3) with time zone", pa.timestamp("us", tz="UTC")),
    ("time without time zone", pa.time64("us")), ("time(2) without time zone", pa.time64("us")),
    ("time with time zone", pa.string()), ("uuid", pa.string()), ("json", pa.string()), ("jsonb", pa.string()),
    ("interval", pa.string()), ("interval day to second(3)", pa.string()), ("money", pa.string()),
    ("inet", pa.string()), ("my_enum", pa.string()), ("my_domain", pa.string()), ("public.mood", pa.string()),
    ("integer[]", pa.list_(pa.int32())), ("text[]", pa.list_(pa.string())),
    ("numeric(5,1)[]", pa.list_(pa.decimal128(5, 1))), ("numeric[]", pa.list_(pa.string())),
    ("timestamp(3) with time zone[]", pa.list_(pa.timestamp("us", tz="UTC"))), ("bytea[]", pa.list_(pa.binary())),
    ("integer[][]", pa.list_(pa.int32())),  # PostgreSQL has one array type per element type
])
def test_arrow_type(pg_type: str, arrow: pa.DataType) -> None:
    assert arrow_type(pg_type) == arrow


# -- how PostgreSQL prints values ------------------------------------------------------------------
def copy_escape(text: str) -> str:
    """COPY TO's text format (CopyAttributeOutText): backslash and \\b \\f \\n \\r \\t \\v escaped."""
    return text.translate({0x5C: "\\\\", 8: "\\b", 12: "\\f", 10: "\\n", 13: "\\r", 9: "\\t", 11: "\\v"})


def changefeed_escape(text: str) -> str:
    """How the feed writes its lines (core.copytext): only backslash, tab, newline, CR escaped."""
    return copytext.escape(text.encode()).decode()


def _float(value: float, shortest: Callable[[float], str] = repr) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return shortest(value).removesuffix(".0")


def _fraction(microsecond: int) -> str:
    return f".{microsecond:06d}".rstrip("0") if microsecond else ""


def _date(d: date) -> str:
    return f"{d.year:04d}-{d.month:02d}-{d.day:02d}"


def _time(t: time | datetime) -> str:
    return f"{t.hour:02d}:{t.minute:02d}:{t.second:02d}{_fraction(t.microsecond)}"


def _timestamp(dt: datetime) -> str:
    return f"{_date(dt)} {_time(dt)}"


def _offset(seconds: int) -> str:
    """+HH, +HH:MM or +HH:MM:SS, as timestamptz_out prints the session zone's offset."""
    hours, rest = divmod(abs(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return ("-" if seconds < 0 else "+") + f"{hours:02d}" + (f":{minutes:02d}" if rest else "") + (
        f":{secs:02d}" if secs else "")


def _timestamptz(value: tuple[datetime, int]) -> str:
    utc, offset = value
    return _timestamp(utc + timedelta(seconds=offset)) + _offset(offset)


def _bytea_escape(raw: bytes) -> str:
    """bytea_output = escape: printable ASCII as is, backslash doubled, other bytes \\ooo."""
    return "".join("\\\\" if b == 0x5C else chr(b) if 0x20 <= b < 0x7F else f"\\{b:03o}" for b in raw)


ARRAY_SPACE = " \t\n\r\v\f"


def _element(text: str) -> str:
    """array_out: an element is quoted (backslash before `"` and `\\`) when empty, NULL in any case,
    or holding `"`, `\\`, braces, the delimiter or whitespace."""
    if text == "" or text.upper() == "NULL" or any(c in text for c in '"\\{},' + ARRAY_SPACE):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def _array(render: Callable[[Any], str]) -> Callable[[list[Any]], str]:
    return lambda items: "{" + ",".join("NULL" if v is None else _element(render(v)) for v in items) + "}"


# -- column types: values, how PostgreSQL prints them, what the decoded column holds --------------
@dataclass(frozen=True)
class Column:
    type_name: str
    values: st.SearchStrategy[Any]
    render: Callable[[Any], str]
    expected: Callable[[Any], Any] = lambda v: v

    def __repr__(self) -> str:
        return self.type_name


TRICKY = st.lists(st.sampled_from(["\t", "\n", "\r", "\\", "\\N", "N", "\b", "\f", "\v", "\\t", '"', "{", ",", " ",
                                   "NULL", "é", "💥", "a"]), max_size=6).map("".join)
TEXT = st.one_of(TRICKY, st.text(st.characters(exclude_characters="\x00", exclude_categories=["Cs"]), max_size=12))
UTC_TIMES = st.datetimes(datetime(1, 1, 2), datetime(9999, 12, 30, 23, 59, 59, 999999))
OFFSETS = st.one_of(st.sampled_from([0, 19800, -10800, -12615, 3600, -34200, 20700, 50400, -4 * 3600 - 56 * 60 - 2]),
                    st.integers(-(15 * 3600 + 59 * 60 + 59), 15 * 3600 + 59 * 60 + 59))
TIMESTAMPTZ = st.tuples(UTC_TIMES, OFFSETS)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | TEXT, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=6)


def _decimals(precision: int, scale: int) -> st.SearchStrategy[Decimal]:
    nines = "9" * (precision - scale) + "." + "9" * scale  # as text: Decimal arithmetic rounds to 28 digits
    return st.decimals(Decimal("-" + nines), Decimal(nines), places=scale)


def _utc(value: tuple[datetime, int]) -> datetime:
    return value[0].replace(tzinfo=UTC)


COLUMNS = [
    Column("smallint", st.integers(-2**15, 2**15 - 1), str),
    Column("integer", st.integers(-2**31, 2**31 - 1), str),
    Column("bigint", st.integers(-2**63, 2**63 - 1), str),
    Column("real", st.floats(width=32), lambda v: _float(v, lambda f: str(np.float32(f)))),
    Column("double precision", st.floats(), _float),
    Column("numeric(12,2)", _decimals(12, 2), lambda d: f"{d:.2f}"),
    Column("numeric(40,5)", _decimals(40, 5), lambda d: f"{d:.5f}"),
    Column("numeric", st.one_of(st.decimals(allow_nan=False, allow_infinity=False).map(lambda d: format(d, "f")),
                                st.sampled_from(["NaN", "Infinity", "-Infinity"])), str),
    Column("boolean", st.booleans(), lambda b: "t" if b else "f"),
    Column("text", TEXT, str),
    Column("character varying(20)", TEXT, str),
    Column("character(3)", st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=3, max_size=3),
           str),
    Column("bytea", st.binary(max_size=12), lambda b: "\\x" + b.hex()),
    Column("bytea", st.binary(max_size=12), _bytea_escape),
    Column("date", st.dates(), _date),
    Column("timestamp without time zone", st.datetimes(), _timestamp),
    Column("timestamp with time zone", TIMESTAMPTZ, _timestamptz, _utc),
    Column("time without time zone", st.times(), _time),
    Column("time with time zone", st.sampled_from(["03:04:05+05:30", "23:59:59.999999-03", "00:00:00+00"]), str),
    Column("uuid", st.uuids().map(str), str),
    Column("jsonb", JSON.map(json.dumps), str),
    Column("interval", st.sampled_from(["1 year 2 mons 3 days 04:05:06.789", "-00:00:01", "00:00:00"]), str),
    Column("my_enum", st.sampled_from(["happy", "sad", "with space", "NULL", ""]), str),
    Column("integer[]", st.lists(st.none() | st.integers(-2**31, 2**31 - 1), max_size=4), _array(str)),
    Column("text[]", st.lists(st.none() | TEXT, max_size=4), _array(str)),
    Column("numeric(5,1)[]", st.lists(st.none() | _decimals(5, 1), max_size=4), _array(lambda d: f"{d:.1f}")),
    Column("timestamp with time zone[]", st.lists(st.none() | TIMESTAMPTZ, max_size=3), _array(_timestamptz),
           lambda items: [None if v is None else _utc(v) for v in items]),
    Column("bytea[]", st.lists(st.none() | st.binary(max_size=4), max_size=3), _array(lambda b: "\\x" + b.hex())),
]


def same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN, lists element by element."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return type(a) is type(b) and a == b


@st.composite
def tables(draw: st.DrawFn) -> tuple[list[Column], list[tuple[Any, ...] | None]]:
    columns = draw(st.lists(st.sampled_from(COLUMNS), min_size=1, max_size=6))
    row = st.tuples(*[st.none() | c.values for c in columns])
    return columns, draw(st.lists(st.none() | row, max_size=12))


def render_lines(columns: list[Column], rows: list[tuple[Any, ...] | None], escape: Callable[[str], str]
                 ) -> list[bytes | None]:
    return [None if row is None else "\t".join("\\N" if v is None else escape(c.render(v))
                                               for c, v in zip(columns, row)).encode() for row in rows]


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(tables(), st.sampled_from([copy_escape, changefeed_escape]),
       st.sampled_from([pa.binary(), pa.large_binary(), pa.binary_view()]))
def test_decodes_what_postgresql_prints(table: tuple[list[Column], list[Any]], escape: Callable[[str], str],
                                        line_type: pa.DataType) -> None:
    columns, rows = table
    lines = pa.array(render_lines(columns, rows, escape), line_type)
    decoded = decode(lines, [c.type_name for c in columns])
    assert len(decoded) == len(columns)
    for i, (column, array) in enumerate(zip(columns, decoded)):
        assert array.type == arrow_type(column.type_name)
        expected = [None if row is None or row[i] is None else column.expected(row[i]) for row in rows]
        assert same(array.to_pylist(), expected), (column, array.to_pylist(), expected)


@settings(deadline=None, max_examples=50)
@given(tables(), st.data())
def test_some_columns(table: tuple[list[Column], list[Any]], data: st.DataObject) -> None:
    columns, rows = table
    lines = pa.array(render_lines(columns, rows, copy_escape), pa.binary())
    types = [c.type_name for c in columns]
    wanted = data.draw(st.lists(st.integers(0, len(columns) - 1), max_size=3))
    everything = decode(lines, types)
    assert same([a.to_pylist() for a in decode(lines, types, wanted)], [everything[i].to_pylist() for i in wanted])


def test_null_lines_and_empty_batches() -> None:
    types = ["integer", "text", "integer[]"]
    lines = pa.array([None, b"1\t\\N\t{}", None], pa.binary_view())
    assert [a.to_pylist() for a in decode(lines, types)] == [[None, 1, None], [None, None, None], [None, [], None]]
    assert [a.to_pylist() for a in decode(lines.slice(1, 1), types)] == [[1], [None], [[]]]
    empty = decode(pa.array([], pa.binary()), types)
    assert [a.type for a in empty] == [arrow_type(t) for t in types] and all(len(a) == 0 for a in empty)
    chunked = pa.chunked_array([pa.array([b"2\tx\t{1}"]), pa.array([None], pa.binary())])
    assert [a.to_pylist() for a in decode(chunked, types)] == [[2, None], ["x", None], [[1], None]]


def test_a_line_with_other_field_counts_is_refused() -> None:
    with pytest.raises(ValueError, match="fields") as refused:
        decode(pa.array([b"1\t2", b"1\t2\t3"]), ["integer", "integer"])
    assert not isinstance(refused.value, Unrepresentable)


def test_seconds_offsets_among_common_ones() -> None:
    """Historic zones print offsets with seconds (LMT); only those rows are read per value."""
    texts = ["2024-01-02 03:04:05.5+05:30", "1880-01-01 00:00:00-04:56:02", None, "2024-06-01 12:00:00-07"]
    lines = pa.array([None if t is None else t.encode() for t in texts])
    assert decode(lines, ["timestamp with time zone"])[0].to_pylist() == [
        datetime(2024, 1, 1, 21, 34, 5, 500000, UTC), datetime(1880, 1, 1, 4, 56, 2, tzinfo=UTC), None,
        datetime(2024, 6, 1, 19, tzinfo=UTC)]


@pytest.mark.parametrize("type_name, text, reported", [
    ("numeric(10,2)", "NaN", None), ("numeric(10,2)", "Infinity", None), ("numeric(10,2)", "-Infinity", None),
    ("numeric(10,2)", "1.234", None), ("numeric(3,0)", "1234", None), ("numeric(40,2)", "NaN", None),
    ("timestamp with time zone", "infinity", None), ("timestamp without time zone", "-infinity", None),
    ("timestamp with time zone", "0044-03-15 12:00:00+00 BC", None),
    ("timestamp without time zone", "0044-03-15 12:00:00 BC", None),
    ("timestamp with time zone", "12345-01-01 00:00:00+00", None),
    ("timestamp with time zone", "9999-12-31 23:00:00-05", None),  # year 10000 in UTC
    ("timestamp with time zone", "0001-01-01 00:30:00+01", None),  # year 0 in UTC
    ("timestamp with time zone", "0001-01-01 00:30:00+01:00:01", None),
    ("date", "0044-03-15 BC", None), ("date", "infinity", None), ("date", "12345-01-01", None),
    ("time without time zone", "24:00:00", None), ("boolean", "yes", None), ("integer", "2147483648", None),
    ("integer[]", "{{1,2},{3,4}}", None), ("integer[]", "{1,", None),
    ("numeric(5,1)[]", "{1.5,NaN}", "NaN"), ("date[]", '{2024-01-02,"0044-03-15 BC"}', "0044-03-15 BC"),
])
def test_unrepresentable(type_name: str, text: str, reported: str | None) -> None:
    """Reported with the column, its type and the value (an array's element that does not fit)."""
    good = {"numeric(10,2)": "1.50", "numeric(3,0)": "1", "numeric(40,2)": "1.00", "timestamp with time zone":
            "2024-01-02 03:04:05+00", "timestamp without time zone": "2024-01-02 03:04:05", "date": "2024-01-02",
            "time without time zone": "03:04:05", "boolean": "t", "integer": "1", "integer[]": "{1}",
            "numeric(5,1)[]": "{1.5}", "date[]": "{2024-01-02}"}[type_name]
    lines = pa.array([f"{i}\t{good}".encode() for i in range(5)] + [f"5\t{text}".encode(), b"6\t\\N"])
    with pytest.raises(Unrepresentable) as refused:
        decode(lines, ["integer", type_name])
    error = refused.value
    assert (error.column, error.type_name, error.value) == (1, type_name, reported or text)
    assert repr(error.value) in str(error)
    again = pickle.loads(pickle.dumps(error))
    assert (again.column, again.type_name, again.value, str(again)) == (1, error.type_name, error.value, str(error))
