"""PostgreSQL COPY text format: how values become lines that COPY takes as they are.

Values arrive from pgoutput in PostgreSQL text form; COPY's text format only needs backslash,
tab, newline and carriage return escaped, and NULL written as `\\N`.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

NULL = b"\\N"
_SPECIAL = re.compile(rb"[\\\t\n\r]")


def escape(value: bytes) -> bytes:
    """Escape one text value for COPY text format."""
    if _SPECIAL.search(value) is None:
        return value
    return (value.replace(b"\\", b"\\\\").replace(b"\t", b"\\t")
            .replace(b"\n", b"\\n").replace(b"\r", b"\\r"))


_UNESCAPE = re.compile(rb"\\(.)", re.S)
_UNESCAPES = {b"\\": b"\\", b"t": b"\t", b"n": b"\n", b"r": b"\r", b"b": b"\b", b"f": b"\f", b"v": b"\v"}


def unescape(field: bytes) -> bytes | None:
    """Inverse of `escape` for one field; `\\N` is NULL."""
    if field == NULL:
        return None
    if b"\\" not in field:
        return field
    return _UNESCAPE.sub(lambda m: _UNESCAPES.get(m.group(1), m.group(1)), field)


def split_line(line: bytes) -> list[bytes | None]:
    """One COPY text line (no trailing newline) -> its values."""
    return [unescape(f) for f in line.split(b"\t")]


def join_line(values: Iterable[bytes | None]) -> bytes:
    """Values (None for NULL) -> one COPY text line without the trailing newline."""
    return b"\t".join(NULL if v is None else escape(v) for v in values)
