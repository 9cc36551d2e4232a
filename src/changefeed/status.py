"""What `changefeed status` reports: checkpoint, lags, slot, rates and snapshot progress.

Read from the source (slot, flush position, clock) and the sink's bookkeeping; creates nothing.
"""
from __future__ import annotations

import time
from contextlib import closing
from dataclasses import dataclass, field

from .config import FeedSpec, FeedState, SourceNode
from .core.hlc import physical_ms
from .core.lsn import format_lsn
from .postgres import source as src
from .postgres import twophase
from .errors import ConnectionFailed
from .postgres.connect import connect, lost_connection
from .runner_lock import run_state
from .sinks.registry import open_ledger


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
    changes_per_second_last_minute: float | None  # applied (recorded by the sink) over the last minute
    last_batch_apply_seconds: float | None  # the last batch's sink transaction, begin to progress row
    batches: int | None
    snapshot: dict[str, dict[str, int]]  # per table (NODE:table on several nodes): chunks and rows applied
    nodes: dict[str, dict[str, object]] = field(default_factory=dict)  # a feed of several nodes: per node,
    # slot, slot_state, slot_retained_wal_bytes, checkpoint_lsn, lag_bytes (the top level sums them), and
    # prepared_transactions (undecided ones: their distributed transactions wait)
    verified: dict[str, object] | None = None  # the last verify: at (Unix time), equal, mismatched_rows, lsns

    def lines(self) -> list[str]:
        out = [f"{k.replace('_', ' ')}: {'-' if v is None else v}" for k, v in self.__dict__.items()
               if k not in ("snapshot", "nodes", "verified")]
        if self.verified:
            v = self.verified
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(v["at"])))  # type: ignore[arg-type]
            out.append(f"verified: {when}, " + ("equal" if v["equal"] else f"{v['mismatched_rows']} rows differ"))
        out += [f"node {n}: " + ", ".join(f"{k.replace('_', ' ')} {'-' if v is None else v}" for k, v in d.items())
                for n, d in self.nodes.items()]
        return out + [f"snapshot {t}: {counted(s['rows'], 'row')} in {counted(s['chunks'], 'chunk')}"
                      for t, s in self.snapshot.items()]


def status(spec: FeedSpec, feed_state: FeedState) -> FeedStatus:
    """The feed's status; for a running feed whose source or sink cannot be reached now (it is
    retrying), or a failed one (maybe for that reason), what the state folder knows, and the rest
    unknown."""
    state = run_state(feed_state)
    try:
        with lost_connection("source or sink"):
            found = _measured(spec, feed_state, state)
        found.verified = verified(feed_state)
        return found
    except ConnectionFailed as e:
        if not state.startswith(("running", "failed")):
            raise
        return FeedStatus(spec.name, state, spec.slot, f"unknown ({e.message.splitlines()[0]})", None, None, None,
                          None, None, None, None, None, None, {})


def verified(feed_state: FeedState) -> dict[str, object] | None:
    """The last verification's time, outcome and position (see verify), None if never verified."""
    from .verify import last

    found = last(feed_state)
    return None if found is None else {k: found[k] for k in ("at", "equal", "mismatched_rows", "lsns")}


@dataclass
class _NodeReading:
    slot: src.SlotState | None
    current: int  # the node's WAL flush position
    now_ms: int  # its clock
    position: int | None  # where the sink's checkpoint has it
    caught_up: bool
    waiting: list[tuple[str, float]]  # prepared transactions not decided yet: (gid, seconds since PREPARE)

    @property
    def lag_bytes(self) -> int:
        """WAL past the checkpoint that may hold changes; 0 when caught up."""
        return 0 if self.caught_up else self.current - (self.position or 0)


def _measured(spec: FeedSpec, feed_state: FeedState, state: str) -> FeedStatus:
    with closing(open_ledger(spec, feed_state)) as ledger:
        last = ledger.last_batch()
        checkpoint = ledger.checkpoint() or {}
        rate = ledger.recent_rate() if last else None
        snapshot = {t: {"chunks": c, "rows": r} for t, (c, r) in ledger.snapshot_totals().items()}
    readings = {n.name: _read_node(spec, n, checkpoint.get(n.name), state) for n in spec.sources}
    lag_bytes: int | None = None
    lag_s = resolved_lag = None
    if last:
        lag_bytes = sum(r.lag_bytes for r in readings.values())
        now_ms = max(r.now_ms for r in readings.values())
        lag_s = 0.0 if all(r.caught_up for r in readings.values()) else resolved_lag_s(now_ms, last.resolved_ts)
        resolved_lag = resolved_lag_s(now_ms, last.resolved_ts)
    else:
        behind = [r.current - r.slot.confirmed_flush for r in readings.values() if r.slot and r.slot.confirmed_flush]
        lag_bytes = max(0, sum(behind)) if behind else None
    nodes = {} if not spec.multi_node else {n.name: {
        "slot": n.slot, "slot_state": _slot_text(readings[n.name].slot),
        "slot_retained_wal_bytes": retained_bytes(readings[n.name].slot, readings[n.name].current),
        "checkpoint_lsn": format_lsn(readings[n.name].position) if readings[n.name].position else None,
        "lag_bytes": readings[n.name].lag_bytes if last else None,
        "prepared_transactions": _waiting_text(readings[n.name].waiting)} for n in spec.sources}
    one = readings[spec.sources[0].name]
    retained = [retained_bytes(r.slot, r.current) for r in readings.values()]
    return FeedStatus(
        name=spec.name, state=state, slot=spec.slot if not spec.multi_node else f"one per node ({len(nodes)})",
        slot_state=_slot_text(one.slot) if not spec.multi_node else _nodes_text(readings),
        slot_retained_wal_bytes=sum(r for r in retained if r) if any(r is not None for r in retained) else None,
        checkpoint_lsn=format_lsn(last.end_lsn) if last and not spec.multi_node else None,
        checkpoint_commit_time=last.commit_time if last else None, lag_bytes=lag_bytes, lag_seconds=lag_s,
        resolved_lag_seconds=resolved_lag, changes_per_second_last_minute=rate,
        last_batch_apply_seconds=last.seconds if last else None, batches=last.batches if last else 0,
        snapshot=snapshot, nodes=nodes)


def _read_node(spec: FeedSpec, node: SourceNode, position: int | None, state: str) -> _NodeReading:
    """A node's slot, flush position and clock, and whether the checkpoint is caught up with it: a
    stopped feed whose slot holds no change of a captured table past the checkpoint is caught up,
    whatever other WAL came since (other tables, PostgreSQL's own records)."""
    role = spec.role(node.name)
    with connect(node.uri, role) as conn, lost_connection(role):
        slot = src.slot_state(conn, node.slot)
        current, now_ms = src.flush_lsn(conn)
        caught_up = position is not None and (current <= position or (
            not state.startswith("running") and src.captured_change_after(
                conn, node.slot, node.publication, position) is False))
        waiting = twophase.waiting(conn) if spec.multi_node else []
    return _NodeReading(slot, current, now_ms, position, caught_up, waiting)


def _waiting_text(waiting: list[tuple[str, float]]) -> str:
    """`none`, or how many prepared transactions wait for their outcome and the oldest: once a
    distributed transaction is committed on one node, everything committed after it on every
    node waits until its parts here are decided (core.distributed)."""
    if not waiting:
        return "none"
    gid, age = waiting[0]
    return f"{len(waiting)}, oldest {gid!r} prepared {age:.0f}s ago"


def _nodes_text(readings: dict[str, _NodeReading]) -> str:
    states = [("missing" if r.slot is None else "invalidated" if r.slot.wal_status == "lost" or r.slot.invalidation
               else "active" if r.slot.active_pid else "inactive") for r in readings.values()]
    return ", ".join(f"{n} {st}" for n, st in zip(readings, states))


def counted(n: int, noun: str) -> str:
    """`1 batch`, `2 batches`, `1,000 changes`."""
    return f"{n:,} {noun}" + ("" if n == 1 else "es" if noun.endswith("ch") else "s")


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
