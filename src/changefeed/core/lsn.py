"""PostgreSQL log sequence numbers: 64-bit WAL positions, written as `X/Y` in hex.

`Lsn` is an `int` (it orders, subtracts and pickles like one, and prints as one, so SQL, JSON
and Spark's offsets see the number they always saw), with a type of its own so that mypy tells a
WAL position from a byte count or a row count where a signature asks for one. Arithmetic gives
back a plain `int`: a position plus a size is wrapped again on purpose (`Lsn(end + n)`).
"""
from __future__ import annotations

import re

_LSN = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")
_MAX = 1 << 64


class Lsn(int):
    """A WAL position. `Lsn.parse('16/B374D848')`, `lsn.text` -> `'16/B374D848'`."""

    __slots__ = ()

    def __new__(cls, value: int = 0) -> Lsn:
        if not 0 <= value < _MAX:
            raise ValueError(f"LSN out of range: {value}")
        return super().__new__(cls, value)

    @classmethod
    def parse(cls, text: str) -> Lsn:
        """`'16/B374D848'` -> Lsn. Raises ValueError on anything else."""
        m = _LSN.match(text.strip())
        if not m:
            raise ValueError(f"not an LSN: {text!r} (expected hex 'X/Y', e.g. '0/16B3748')")
        return cls((int(m.group(1), 16) << 32) | int(m.group(2), 16))

    @property
    def text(self) -> str:
        """The form PostgreSQL prints and accepts (`pg_lsn`)."""
        return f"{self >> 32:X}/{self & 0xFFFFFFFF:X}"

    def __repr__(self) -> str:
        return f"Lsn({self.text})"

    def __str__(self) -> str:  # int's str is object's, which would call the __repr__ above
        return int.__repr__(self)


def parse_lsn(text: str) -> Lsn:
    """`'16/B374D848'` -> Lsn. Raises ValueError on anything else."""
    return Lsn.parse(text)


def format_lsn(value: int) -> str:
    """int -> `'X/Y'`, the form PostgreSQL prints and accepts."""
    return Lsn(value).text
