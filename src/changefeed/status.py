"""What `changefeed status` reports: checkpoint, lags, slot, rates and snapshot progress.

Read from the source (slot, flush position, clock) and the sink's bookkeeping; creates nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import FeedSpec, FeedState
from .core.hlc import physical_ms
from .core.lsn import format_lsn
from .postgres import source as src
from .postgres.connect import connect
from .runner_lock import run_state
from .sinks import postgres_replica as replica


@dataclass
class FeedStatus:
    name: str
    state: str  # running (holder), paused, failed: reason, stopped
    slot: str
    slot_state: str
    slot_retained_wal_bytes: int | None  # WAL the source keeps for the slot
    checkpoint_lsn: str | None
    checkpoint_commit_time: str | None
    lag_bytes: int | None
    lag_seconds: float | None  # checkpoint lag (RPO): 0 when all WAL is applied
    resolved_lag_seconds: float | None  # source clock now - the last applied resolved ts, also when caught up
    changes_per_second: float | None  # applied over the last minute
    last_batch_seconds: float | None  # the last batch's sink transaction, begin to progress row
    batches: int
    snapshot: dict[str, dict[str, int]]  # per table: chunks and rows applied

    def lines(self) -> list[str]:
        out = [f"{k.replace('_', ' ')}: {'-' if v is None else v}" for k, v in self.__dict__.items()
               if k != "snapshot"]
        return out + [f"snapshot {t}: {s['rows']:,} rows in {s['chunks']} chunks" for t, s in self.snapshot.items()]


RATE_WINDOW_S = 60

# progress rows with their began_at as b.began (NULL on a sink made before the column)
_PROGRESS_BEGAN = ("changefeed.progress p CROSS JOIN LATERAL "
                   "(SELECT (to_jsonb(p) ->> 'began_at')::timestamptz AS began) b")


def status(spec: FeedSpec, feed_state: FeedState) -> FeedStatus:
    with connect(spec.source, "source") as source, connect(spec.sink, "sink") as sink:
        slot = src.slot_state(source, spec.slot)
        current, now_ms = src.flush_lsn(source)
        row = rate = None
        if replica.has_meta(sink, "progress"):
            row = _last_progress(sink, spec.name)
            rate = _recent_rate(sink, spec.name) if row else None
        snapshot = {t: {"chunks": c, "rows": r} for t, (c, r) in replica.snapshot_totals(sink, spec.name).items()}
    lag_bytes = lag_s = resolved_lag = None
    if row:
        lag_bytes = max(0, current - int(row[3]))
        lag_s = checkpoint_lag_s(current, now_ms, int(row[3]), int(row[2]))
        resolved_lag = resolved_lag_s(now_ms, int(row[2]))
    elif slot and slot.confirmed_flush:
        lag_bytes = max(0, current - slot.confirmed_flush)
    return FeedStatus(
        name=spec.name, state=run_state(feed_state), slot=spec.slot, slot_state=_slot_text(slot),
        slot_retained_wal_bytes=retained_bytes(slot, current), checkpoint_lsn=row[0] if row else None,
        checkpoint_commit_time=row[1] if row else None, lag_bytes=lag_bytes, lag_seconds=lag_s,
        resolved_lag_seconds=resolved_lag, changes_per_second=rate,
        last_batch_seconds=None if not row or row[5] is None else round(float(row[5]), 3),
        batches=int(row[4]) if row else 0, snapshot=snapshot)


def _last_progress(sink: Any, feed: str) -> tuple[Any, ...] | None:
    """The last applied batch: end LSN, commit time, resolved ts, end LSN as int, batch count, duration.

    began_at is read through to_jsonb: a sink made before it existed has no such column until its
    feed runs again, and status creates nothing. Rows older than the column have no duration.
    """
    return sink.execute(  # type: ignore[no-any-return]
        "SELECT end_lsn::text, commit_time::text, resolved_ts, end_lsn - '0/0'::pg_lsn, "
        "(SELECT count(*) FROM changefeed.progress WHERE feed = %s), "
        "extract(epoch FROM applied_at - b.began) "
        f"FROM {_PROGRESS_BEGAN} WHERE feed = %s ORDER BY end_lsn DESC LIMIT 1", (feed, feed)).fetchone()


def _recent_rate(sink: Any, feed: str) -> float:
    """Changes per second applied over the last RATE_WINDOW_S, or since the first batch in it began
    if that is later (a feed started 10 s ago is not averaged over a minute)."""
    row = sink.execute(
        "SELECT coalesce(sum(changes), 0), extract(epoch FROM now() - greatest(now() - make_interval(secs => %s), "
        f"min(least(b.began, applied_at)))) FROM {_PROGRESS_BEGAN} "
        "WHERE feed = %s AND applied_at > now() - make_interval(secs => %s)",
        (RATE_WINDOW_S, feed, RATE_WINDOW_S)).fetchone()
    return round(int(row[0]) / max(float(row[1]), 1.0), 1)


def _slot_text(slot: src.SlotState | None) -> str:
    if slot is None:
        return "missing"
    if slot.wal_status == "lost" or slot.invalidation:
        return f"invalidated ({slot.invalidation or 'WAL removed'})"
    return f"{'active' if slot.active_pid else 'inactive'}, wal {slot.wal_status}, " \
           f"confirmed {format_lsn(slot.confirmed_flush or 0)}"


def retained_bytes(slot: src.SlotState | None, current_lsn: int) -> int | None:
    """WAL the source keeps for the slot: from its restart LSN to the current flush position."""
    return max(0, current_lsn - slot.restart_lsn) if slot and slot.restart_lsn else None


def resolved_lag_s(now_ms: int, resolved_ts: int) -> float:
    """Source clock now minus the physical part of `resolved_ts`: how old the replica's cut is."""
    return max(0.0, (now_ms - physical_ms(resolved_ts)) / 1000)


def checkpoint_lag_s(current_lsn: int, now_ms: int, applied_lsn: int, resolved_ts: int) -> float:
    """The RPO: 0 when the replica has applied all WAL there is, else how old its resolved cut is."""
    return 0.0 if current_lsn <= applied_lsn else resolved_lag_s(now_ms, resolved_ts)
