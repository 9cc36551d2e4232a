"""PostgreSQL log sequence numbers: 64-bit WAL positions, written as `X/Y` in hex."""
from __future__ import annotations

import re

_LSN = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")


def parse_lsn(text: str) -> int:
    """`'16/B374D848'` -> int. Raises ValueError on anything else."""
    m = _LSN.match(text.strip())
    if not m:
        raise ValueError(f"not an LSN: {text!r} (expected hex 'X/Y', e.g. '0/16B3748')")
    return (int(m.group(1), 16) << 32) | int(m.group(2), 16)


def format_lsn(value: int) -> str:
    """int -> `'X/Y'`, the form PostgreSQL prints and accepts."""
    if not 0 <= value < 1 << 64:
        raise ValueError(f"LSN out of range: {value}")
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"
