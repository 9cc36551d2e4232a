"""PostgreSQL text output -> JSON-ready Python values, by SQL type name (as `format_type` prints it).

Change rows keep values in PostgreSQL's text form; envelopes for Kafka and webhooks want them
typed: integers as numbers, floats as numbers (NaN and infinities, which JSON lacks, as strings),
numeric as its exact text (a JSON number would be read as a double and lose digits), booleans,
json/jsonb inline, bytea as base64, timestamps and dates in ISO 8601, arrays as JSON arrays.
Anything else (text, varchar, uuid, time, interval, enums, domains, ...) stays its text.

Assumes the server's default output settings, which the walsender decoding for a feed uses:
DateStyle ISO and bytea_output hex (escape is also read). A value in any other form is kept as
text rather than guessed at. jsonb numbers become JSON numbers as parsed by Python: beyond a
double's precision they are rounded (RFC 8259 §6 warns consumers that they may be anyway), and
a json value `null` reads like SQL NULL. bigint stays exact in the JSON text; consumers that
read numbers as doubles (JavaScript) lose digits past 2^53, as with Debezium's int64.
"""
from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

Convert = Callable[[str], Any]

_TYPMOD = re.compile(r"\(\d+(?:,\d+)?\)")

UNQUOTED_TYPES = frozenset(  # the types test_decoding (the text format) prints without quotes
    ("smallint", "integer", "bigint", "oid", "real", "double precision", "numeric"))


def base_name(type_name: str) -> str:
    """`type_name` without its modifiers, as `format_type_be` prints it: "numeric(12,2)" ->
    "numeric", "timestamp(3) with time zone" -> "timestamp with time zone", "interval day to
    second" -> "interval"; an array keeps its "[]"."""
    name = _TYPMOD.sub("", type_name)
    if name.startswith("interval"):
        return "interval[]" if name.endswith("[]") else "interval"
    return name


def _float(text: str) -> float | str:
    value = float(text)
    return value if math.isfinite(value) else text


_BYTEA_ESCAPE = re.compile(rb"\\(\\|[0-7]{3})")


def _bytea(text: str) -> str:
    """hex form ("\\x00ff") or the older escape form -> base64."""
    if text.startswith("\\x"):
        raw = bytes.fromhex(text[2:])
    else:
        raw = _BYTEA_ESCAPE.sub(lambda m: b"\\" if m.group(1) == b"\\" else bytes([int(m.group(1), 8)]),
                                text.encode("latin-1"))
    return base64.b64encode(raw).decode("ascii")


_DATE = r"(\d{4,})-(\d\d-\d\d)"
_TIMESTAMP = re.compile(_DATE + r" (\d\d:\d\d:\d\d(?:\.\d+)?)([+-]\d\d(?::\d\d){0,2})?( BC)?")
_DATE_ONLY = re.compile(_DATE + r"( BC)?")


def _iso_year(digits: str, bc: str | None) -> str:
    """ISO 8601 year: astronomical numbering for BC (1 BC is 0000, 2 BC is -0001), and the
    expanded form (a sign) beyond 9999."""
    if not bc and len(digits) == 4:
        return digits  # the common case: 0001-9999 AD, as it is
    year = 1 - int(digits) if bc else int(digits)
    if year < 0:
        return f"-{-year:04d}"
    return f"+{year}" if year > 9999 else f"{year:04d}"


def _timestamp(text: str) -> str:
    """'2024-01-02 03:04:05.5+00' -> '2024-01-02T03:04:05.5Z'; other offsets are kept, as
    '+05:30' (whole hours get ':00'). 'infinity' and unexpected forms stay as they are."""
    m = _TIMESTAMP.fullmatch(text)
    if m is None:
        return text
    year, month_day, time, offset, bc = m.groups()
    if offset is None:
        zone = ""
    elif offset == "+00":
        zone = "Z"
    else:
        zone = offset + ":00" if len(offset) == 3 else offset
    return f"{_iso_year(year, bc)}-{month_day}T{time}{zone}"


def _date(text: str) -> str:
    m = _DATE_ONLY.fullmatch(text)
    return text if m is None else f"{_iso_year(m.group(1), m.group(3))}-{m.group(2)}"


def _text(text: str) -> str:
    return text


_SCALARS: dict[str, Convert] = {
    "smallint": int, "integer": int, "bigint": int, "oid": int,
    "real": _float, "double precision": _float,
    "boolean": lambda text: text == "t",
    "json": json.loads, "jsonb": json.loads,
    "bytea": _bytea,
    "timestamp with time zone": _timestamp, "timestamp without time zone": _timestamp,
    "date": _date,
}
_DELIMITERS = {"box": ";"}  # the one built-in type whose arrays are not comma-separated


@lru_cache(maxsize=1024)
def converter(type_name: str) -> Convert:
    """The function turning a value of `type_name` (text form) into its JSON-ready value."""
    name = base_name(type_name)
    if name.endswith("[]"):
        element, delim = converter(name[:-2]), _DELIMITERS.get(name[:-2], ",")
        return lambda text: parse_array(text, element, delim)
    return _SCALARS.get(name, _text)


def to_json(value: bytes | None, type_name: str) -> Any:
    """One value as change rows hold it (UTF-8 text form, None for NULL) -> JSON-ready value."""
    return None if value is None else converter(type_name)(value.decode("utf-8"))


# -- arrays ---------------------------------------------------------------------------------
_ESCAPED = re.compile(r"\\(.)", re.DOTALL)


@lru_cache(maxsize=8)
def _element(delim: str) -> re.Pattern[str]:
    """One element: quoted (group 1, backslash escapes inside) or bare (group 2)."""
    return re.compile(rf'"((?:[^"\\]|\\.)*)"|([^{re.escape(delim)}{{}}"]+)', re.DOTALL)


def parse_array(text: str, element: Convert = _text, delim: str = ",") -> list[Any]:
    """A PostgreSQL array literal as `array_out` writes it -> nested lists, each element passed
    through `element` (NULL -> None).

    Understands quoted elements with backslash escapes, unquoted NULL (a quoted "NULL" is the
    string), nesting for multi-dimensional arrays, and the "[1:2]=" prefix of non-default lower
    bounds, which is dropped: JSON arrays start at 0 whatever the bounds.
    """
    start = text.index("=") + 1 if text.startswith("[") else 0
    items, end = _parse_items(text, start, element, delim)
    if end != len(text):
        raise ValueError(f"unexpected text after the array at {end}: {text!r}")
    return items


def _parse_items(text: str, pos: int, element: Convert, delim: str) -> tuple[list[Any], int]:
    """The braced list at `pos` -> (its items, the position after its closing brace)."""
    if text[pos:pos + 1] != "{":
        raise ValueError(f"expected '{{' at {pos}: {text!r}")
    items: list[Any] = []
    pos += 1
    if text[pos:pos + 1] == "}":
        return items, pos + 1
    pattern = _element(delim)
    item: Any
    while True:
        if text[pos:pos + 1] == "{":
            item, pos = _parse_items(text, pos, element, delim)
        elif (m := pattern.match(text, pos)) is not None:
            quoted, bare = m.groups()
            if quoted is not None:
                item = element(_ESCAPED.sub(r"\1", quoted))
            else:
                item = None if bare.upper() == "NULL" else element(bare)
            pos = m.end()
        else:
            raise ValueError(f"expected an array element at {pos}: {text!r}")
        items.append(item)
        sep = text[pos:pos + 1]
        pos += 1
        if sep == "}":
            return items, pos
        if sep != delim:
            raise ValueError(f"expected {delim!r} or '}}' at {pos - 1}: {text!r}")
