"""COPY text lines of TupleData, one tuple at a time: the builder's per-message path, and the
reference that tuple_block's lines for whole blocks must equal.
"""
from __future__ import annotations

import struct

from changefeed.core.copytext import NULL, join_line
from changefeed.postgres.decode.pgoutput import DecodeError, Value, decode_tuple

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_COPY_SPECIAL = b"\t\n\r\\"


def copy_tuple(buf: bytes, pos: int) -> tuple[bytes, list[int] | None, int]:
    """TupleData at `pos` -> (COPY text line, unchanged-TOAST column indexes, position after it).

    The hot path of capture: same result as `copytext.join_line` over `decode_tuple`, with NULL
    for unchanged columns, but without building a value list. Escaping is needed only if a value
    holds a tab, newline, carriage return or backslash; one count over the joined line tells.
    """
    start = pos
    try:
        (n,) = _I16.unpack_from(buf, pos)
        pos += 2
        parts: list[bytes] = []
        append = parts.append
        specials = n - 1  # the tabs between values, plus a backslash per NULL marker
        unchanged: list[int] | None = None
        for i in range(n):
            kind = buf[pos]
            if kind == 0x74 or kind == 0x62:  # 't' text, 'b' binary
                (length,) = _I32.unpack_from(buf, pos + 1)
                if length < 0:
                    raise DecodeError(f"negative column value length at byte {pos + 1}")
                value_start = pos + 5
                pos = value_start + length
                append(buf[value_start:pos])
            elif kind == 0x6E or kind == 0x75:  # 'n' NULL, 'u' unchanged TOAST: NULL in the line
                append(NULL)
                pos += 1
                specials += 1
                if kind == 0x75:
                    if unchanged is None:
                        unchanged = [i]
                    else:
                        unchanged.append(i)
            else:
                raise DecodeError(f"unknown tuple column kind {chr(kind)!r} at byte {pos}")
    except (IndexError, struct.error):
        raise DecodeError(f"tuple data at byte {start} runs past the message end") from None
    if pos > len(buf):
        raise DecodeError(f"column value runs past the message end ({pos} > {len(buf)} bytes)")
    line = b"\t".join(parts)
    if len(line) - len(line.translate(None, _COPY_SPECIAL)) != specials:  # some value needs escaping
        line = copy_line(decode_tuple(buf, start)[0])
    return line, unchanged, pos


def last_tuple(data: bytes, pos: int, what: str) -> tuple[bytes, list[int] | None]:
    """The tuple at `pos` of message `data` (`what`), which must end it: (COPY line, unchanged columns)."""
    line, unchanged, end = copy_tuple(data, pos)
    if end != len(data):
        raise DecodeError(f"{what}: {len(data) - end} bytes after its tuple")
    return line, unchanged


def copy_line(values: list[Value]) -> bytes:
    """Values -> COPY text line; an unchanged TOAST value is NULL there."""
    return join_line(v if isinstance(v, bytes) else None for v in values)
