"""The feed's retention budget: how much WAL, and how old a checkpoint, the source may keep for it.

The slot is the feed's GC safe point: the source keeps WAL back to it. A feed that falls too far
behind (stopped, paused, or slower than the writes) would fill the source's disk, so `--retention`
(checkpoint age) and `--max-retained-wal` (bytes) bound it. From `WARN_AT` of a budget on the
feed warns; past it, it stops with `RetentionExceeded`. It never skips WAL and never re-creates
its slot: the way back is an explicit re-snapshot.
"""
from __future__ import annotations

from dataclasses import dataclass

from changefeed.core.lsn import format_lsn
from changefeed.errors import DefiniteError, start_over_hint

WARN_AT = 0.8


class RetentionExceeded(DefiniteError):
    """The feed fell behind by more than its retention budget allows."""


@dataclass(frozen=True)
class Holding:
    """What the slot holds now: bytes of WAL from its restart LSN, and the checkpoint's age."""

    slot: str
    restart_lsn: int
    retained_bytes: int
    checkpoint_age_s: float | None  # None: nothing applied yet
    node: str = ""  # the source node holding it, on a feed of several nodes

    @property
    def where(self) -> str:
        return f"replication slot {self.slot}" + (f" on source node {self.node}" if self.node else "")


def check(h: Holding, feed: str, retention_s: float, max_bytes: int) -> str | None:
    """Raise past a budget; a warning line when near one; None when well inside (0 = no budget)."""
    over = []
    if max_bytes and h.retained_bytes > max_bytes:
        over.append(f"holds {h.retained_bytes:,} bytes of WAL, more than --max-retained-wal {max_bytes:,}")
    if retention_s and h.checkpoint_age_s is not None and h.checkpoint_age_s > retention_s:
        over.append(f"its checkpoint is {h.checkpoint_age_s:,.0f}s old, more than --retention {retention_s:,.0f}s")
    if over:
        raise RetentionExceeded(
            f"feed {feed} is past its retention budget: {h.where}"
            + (f" at {format_lsn(h.restart_lsn)} " if h.restart_lsn else " ") + " and ".join(over),
            "either raise the budget (run with a larger --max-retained-wal / --retention) and let it catch up, or "
            f"give the WAL back and start over: {start_over_hint(feed)}")
    near = []
    if max_bytes and h.retained_bytes >= WARN_AT * max_bytes:
        near.append(f"{h.retained_bytes / max_bytes:.0%} of --max-retained-wal")
    if retention_s and h.checkpoint_age_s is not None and h.checkpoint_age_s >= WARN_AT * retention_s:
        near.append(f"{h.checkpoint_age_s / retention_s:.0%} of --retention")
    where = f" ({h.where})" if h.node else ""
    return f"warning: feed {feed} is near its retention budget{where}: {', '.join(near)}" if near else None
