"""Which transactions a snapshot read saw, decided as PostgreSQL decides it.

A snapshot chunk is read in an MVCC snapshot; a change the WAL brings for a key the chunk holds
was either seen by that read (its row image is in the chunk already) or not. LSN order cannot
tell: a transaction can commit, and so be seen, before one that wrote its commit record
earlier becomes visible. The snapshot itself can: `pg_current_snapshot()` is `xmin:xmax:xip`,
and a committed transaction is seen by it when its id is below `xmin`, or below `xmax` and not
in the in-progress list `xip` (PostgreSQL's XidInMVCCSnapshot).

pgoutput names a transaction by its 32-bit xid; the snapshot's ids are 64-bit (with the epoch).
A transaction that a window decodes is never more than 2^31 ids away from a snapshot taken near
it (the server stops assigning ids long before wraparound), so the 64-bit id is the one nearest
`xmax` with the same low 32 bits.
"""
from __future__ import annotations

from dataclasses import dataclass

_LOW = (1 << 32) - 1
_HALF = 1 << 31


class SnapshotTextError(ValueError):
    """A snapshot text that is not pg_current_snapshot()'s `xmin:xmax:xip1,xip2,...`."""


@dataclass(frozen=True)
class Snap:
    """An MVCC snapshot, as `pg_current_snapshot()` (type pg_snapshot) shows it."""

    xmin: int
    xmax: int
    xip: frozenset[int] = frozenset()

    @classmethod
    def parse(cls, text: str) -> Snap:
        try:
            xmin, xmax, xip = text.strip().split(":")
            snap = cls(int(xmin), int(xmax), frozenset(int(x) for x in xip.split(",") if x))
        except ValueError:
            raise SnapshotTextError(f"not a snapshot (xmin:xmax:xip): {text!r}") from None
        if not 0 < snap.xmin <= snap.xmax or any(not snap.xmin <= x < snap.xmax for x in snap.xip):
            raise SnapshotTextError(f"not a snapshot (xmin <= xip < xmax): {text!r}")
        return snap

    def to_text(self) -> str:
        return f"{self.xmin}:{self.xmax}:{','.join(map(str, sorted(self.xip)))}"

    def full(self, xid: int) -> int:
        """The 64-bit id of the transaction whose 32-bit xid (pgoutput's) is `xid`: the one
        nearest `xmax` with those low bits (an id of the epoch before or after, where near)."""
        full = (self.xmax & ~_LOW) | (xid & _LOW)
        if full - self.xmax >= _HALF:
            full -= 1 << 32
        elif self.xmax - full > _HALF:
            full += 1 << 32
        return full

    def sees(self, xid: int) -> bool:
        """Whether a read in this snapshot saw the (committed) transaction with 32-bit xid `xid`."""
        full = self.full(xid)
        return full < self.xmin or (full < self.xmax and full not in self.xip)
