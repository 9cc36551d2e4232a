"""PostgreSQL text output -> JSON-ready values. Every literal input below is how PostgreSQL 18
prints that value (checked on a real server); the array renderer follows array_out's rules."""
from __future__ import annotations

import base64
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.core.pgvalue import base_name, converter, parse_array, to_json


@pytest.mark.parametrize("type_name, base", [
    ("numeric(12,2)", "numeric"), ("character varying(20)", "character varying"), ("integer", "integer"),
    ("timestamp(3) with time zone", "timestamp with time zone"),
    ("time(2) without time zone", "time without time zone"),
    ("character(5)", "character"), ("bit(8)", "bit"), ("interval day to second(3)", "interval"),
    ("character varying(20)[]", "character varying[]"), ("interval year to month[]", "interval[]"),
])
def test_base_name_is_what_format_type_be_prints(type_name: str, base: str) -> None:
    assert base_name(type_name) == base


@pytest.mark.parametrize("type_name, text, value", [
    ("integer", "-2147483648", -2147483648), ("bigint", "9007199254740993", 9007199254740993),
    ("smallint", "32767", 32767), ("oid", "16384", 16384),
    ("double precision", "3.141592653589793", 3.141592653589793), ("real", "0.1", 0.1),
    ("double precision", "1e+30", 1e30), ("double precision", "NaN", "NaN"), ("real", "Infinity", "Infinity"),
    ("double precision", "-Infinity", "-Infinity"),
    ("numeric(12,2)", "1234567890.10", "1234567890.10"),
    ("numeric", "0.00000000000000000001", "0.00000000000000000001"),
    ("numeric", "NaN", "NaN"),
    ("boolean", "t", True), ("boolean", "f", False),
    ("jsonb", '{"a": 1, "b": [true, null, "x"], "c": {"d": 1.50}}', {"a": 1, "b": [True, None, "x"], "c": {"d": 1.5}}),
    ("json", '{"z": 1,  "a": [1, 2]}', {"z": 1, "a": [1, 2]}), ("jsonb", '"text"', "text"),
    ("uuid", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
    ("text", "it's", "it's"), ("character varying(20)", "héllo", "héllo"), ("character(5)", "ab   ", "ab   "),
    ("interval", "1 year 2 mons 3 days 04:05:06.789", "1 year 2 mons 3 days 04:05:06.789"),
    ("time without time zone", "03:04:05.5", "03:04:05.5"), ("time with time zone", "03:04:05+05:30", "03:04:05+05:30"),
    ("money", "$1,000.00", "$1,000.00"), ("public.mood", "happy", "happy"), ("oid:12345", "x", "x"),
])
def test_scalars(type_name: str, text: str, value: Any) -> None:
    assert to_json(text.encode(), type_name) == value


@pytest.mark.parametrize("type_name, text, iso", [
    ("timestamp with time zone", "2024-01-02 03:04:05.123456+00", "2024-01-02T03:04:05.123456Z"),
    ("timestamp with time zone", "2024-01-02 08:34:05.123456+05:30", "2024-01-02T08:34:05.123456+05:30"),
    ("timestamp with time zone", "2024-01-01 22:04:05-05", "2024-01-01T22:04:05-05:00"),
    ("timestamp with time zone", "0044-03-15 07:03:58-04:56:02 BC", "-0043-03-15T07:03:58-04:56:02"),
    ("timestamp with time zone", "0044-03-15 12:00:00+00 BC", "-0043-03-15T12:00:00Z"),
    ("timestamp with time zone", "0001-01-01 00:00:00+00 BC", "0000-01-01T00:00:00Z"),
    ("timestamp with time zone", "12345-01-01 00:00:00+00", "+12345-01-01T00:00:00Z"),
    ("timestamp(3) with time zone", "infinity", "infinity"),
    ("timestamp with time zone", "-infinity", "-infinity"),
    ("timestamp without time zone", "2024-01-02 03:04:05", "2024-01-02T03:04:05"),
    ("timestamp without time zone", "2024-01-02 03:04:05.5", "2024-01-02T03:04:05.5"),
    ("timestamp without time zone", "-infinity", "-infinity"),
    ("date", "2024-02-29", "2024-02-29"), ("date", "0044-03-15 BC", "-0043-03-15"),
    ("date", "12345-01-01", "+12345-01-01"),
    ("date", "infinity", "infinity"),
    ("date", "02/29/2024", "02/29/2024"),  # DateStyle not ISO: kept as it is
])
def test_timestamps_become_iso_8601(type_name: str, text: str, iso: str) -> None:
    assert to_json(text.encode(), type_name) == iso


@pytest.mark.parametrize("text, raw", [
    (rb"\x00ff0010", b"\x00\xff\x00\x10"), (rb"\x", b""),
    (rb"a\000b\\\377", b"a\x00b\\\xff"),  # bytea_output = escape
])
def test_bytea_becomes_base64(text: bytes, raw: bytes) -> None:
    assert base64.b64decode(to_json(text, "bytea")) == raw


def test_null_and_utf8() -> None:
    assert to_json(None, "integer") is None and to_json(None, "integer[]") is None
    assert to_json("héllo wörld".encode(), "text") == "héllo wörld"


@pytest.mark.parametrize("type_name, text, value", [
    ("text[]", r'{plain,"with space","quo\"te","back\\slash","comma,here","{brace}",NULL,"NULL","","null"}',
     ["plain", "with space", 'quo"te', "back\\slash", "comma,here", "{brace}", None, "NULL", "", "null"]),
    ("text[]", '{"tab\tx",héllo}', ["tab\tx", "héllo"]),
    ("integer[]", "{1,NULL,3}", [1, None, 3]), ("integer[]", "{{1,2},{3,NULL}}", [[1, 2], [3, None]]),
    ("integer[]", "{}", []), ("integer[]", "[0:1]={7,8}", [7, 8]),
    ("integer[]", "[0:1][1:2]={{1,2},{3,4}}", [[1, 2], [3, 4]]),
    ("numeric[]", "{1.50,NaN}", ["1.50", "NaN"]), ("boolean[]", "{t,f}", [True, False]),
    ("jsonb[]", r'{"{\"a\": 1}","[1, \"x\"]"}', [{"a": 1}, [1, "x"]]),
    ("bytea[]", r'{"\\x00ff"}', ["AP8="]),
    ("timestamp with time zone[]", '{infinity,"0044-03-15 12:00:00+00 BC",NULL}',
     ["infinity", "-0043-03-15T12:00:00Z", None]),
    ("character varying(3)[]", "{a}", ["a"]),
    ("box[]", "{(1,2),(0,0);(3,4),(1,1)}", ["(1,2),(0,0)", "(3,4),(1,1)"]),
])
def test_arrays(type_name: str, text: str, value: list[Any]) -> None:
    assert to_json(text.encode(), type_name) == value


@pytest.mark.parametrize("text", ["", "x", "{a,", '{"a}', "{a}x", "{,}", "{a,,b}", "{{a}", '{"a"b}', "{a}}"])
def test_malformed_arrays_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_array(text)


def test_converter_is_shared_per_type() -> None:
    assert converter("integer[]") is converter("integer[]")


# -- property: render arrays the way array_out does, parse them back ---------------------------
ARRAY_SPACE = " \t\n\r\v\f"


def render(value: Any, delim: str = ",") -> str:
    """array_out: NULL bare; an element quoted (backslash before `"` and `\\`) when empty, equal
    to NULL in any case, or holding `"`, `\\`, braces, the delimiter or whitespace."""
    if value is None:
        return "NULL"
    if isinstance(value, list):
        return "{" + delim.join(render(v, delim) for v in value) + "}"
    if value == "" or value.upper() == "NULL" or any(c in value for c in '"\\{}' + delim + ARRAY_SPACE):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value


TRICKY = st.lists(st.sampled_from(['"', "\\", ",", ";", "{", "}", " ", "\t", "\n", "NULL", "null", "a", "é", "[1:2]=",
                                   "\\N", "'"]), max_size=5).map("".join)
ELEMENT = st.one_of(st.none(), st.just("NULL"), TRICKY, st.text(max_size=8).filter(lambda s: "\x00" not in s))


@st.composite
def nested(draw: st.DrawFn, element: st.SearchStrategy[Any]) -> list[Any]:
    """A multi-dimensional array as PostgreSQL holds them: rectangular, every dimension >= 1."""
    dims = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))

    def build(rest: list[int]) -> Any:
        return [build(rest[1:]) for _ in range(rest[0])] if rest else draw(element)

    return build(dims)


@given(nested(ELEMENT))
def test_text_arrays_round_trip(value: list[Any]) -> None:
    assert parse_array(render(value)) == value


@given(nested(ELEMENT))
def test_arrays_with_another_delimiter_round_trip(value: list[Any]) -> None:
    assert parse_array(render(value, ";"), delim=";") == value


@given(nested(st.one_of(st.none(), st.integers(-2**63, 2**63 - 1))), st.integers(-5, 5))
def test_typed_arrays_with_bounds_round_trip(value: list[Any], lower: int) -> None:
    dims, level = [], value
    while isinstance(level, list):
        dims.append(len(level))
        level = level[0]
    bounds = "".join(f"[{lower}:{lower + n - 1}]" for n in dims) + "="
    text = render(_str(value))
    assert to_json((bounds + text).encode(), "bigint[]") == value
    assert to_json(text.encode(), "bigint[]") == value


def _str(value: Any) -> Any:
    return [_str(v) for v in value] if isinstance(value, list) else (None if value is None else str(value))
