"""What `changefeed status` reports: checkpoint, lags, slot, rates and snapshot progress.

Read from the source (slot, flush position, clock) and the sink's bookkeeping; creates nothing.
"""
from __future__ import annotations

import time
from contextlib import closing, suppress
from dataclasses import dataclass, field
from typing import Any

from changefeed.control.lag_budget import Lag
from changefeed.control.retry import Retrying, read_note
from changefeed.control.runner_lock import run_state
from changefeed.core.hlc import physical_ms
from changefeed.core.lsn import format_lsn
from changefeed.errors import ConnectionFailed
from changefeed.postgres import feed_record, lease, slots, twophase
from changefeed.postgres import source as src
from changefeed.postgres.connect import connect, first_node, lost_connection
from changefeed.sinks.fan_out import named
from changefeed.sinks.ledgers import SinkLedgers
from changefeed.sinks.registry import open_ledger
from changefeed.spec.definition import FeedSpec, SourceNode
from changefeed.spec.state import FeedState


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
    verified: dict[str, Any] | None = None  # the last verify: at (Unix time), equal, mismatched_rows, lsns
    unreachable: dict[str, str] = field(default_factory=dict)  # what could not be asked now (sink, source [node
    #                                                           NAME]) and why: the fields it would give are unknown
    active: str | None = None  # the runner holding the feed's lease, on any host (postgres.lease), and its term
    standbys: list[str] = field(default_factory=list)  # runners waiting to take the feed over (run --standby)
    sinks: dict[str, dict[str, object]] = field(default_factory=dict)  # a feed of several sinks: per sink,
    # checkpoint_lsn, checkpoint_commit_time, lag_bytes, resolved_lag_seconds, batches,
    # changes_per_second_last_minute, last_batch_apply_seconds, retrying (the top level is the least far sink's)

    def lines(self) -> list[str]:
        out = [f"{k.replace('_', ' ')}: {'-' if v is None else v}" for k, v in self.__dict__.items()
               if k not in ("snapshot", "nodes", "verified", "unreachable", "standbys", "sinks")]
        out += [f"standby: {who}" for who in self.standbys]
        out += [f"unknown: the {what} cannot be reached now ({why}); what it would tell is shown as -"
                for what, why in self.unreachable.items()]
        if self.verified:
            v = self.verified
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(v["at"])))
            out.append(f"verified: {when}, " + ("equal" if v["equal"] else f"{v['mismatched_rows']} rows differ"))
        for what, parts in (("node", self.nodes), ("sink", self.sinks)):
            out += [f"{what} {n}: " + ", ".join(f"{k.replace('_', ' ')} {'-' if v is None else v}"
                                                for k, v in d.items()) for n, d in parts.items()]
        return out + [f"snapshot {t}: {counted(s['rows'], 'row')} in {counted(s['chunks'], 'chunk')}"
                      for t, s in self.snapshot.items()]


def status(spec: FeedSpec, feed_state: FeedState) -> FeedStatus:
    """The feed's status, running or not. A server that cannot be reached now (the sink, a source
    node: down, or the feed retrying) is named in `unreachable` with the reason, and what it would
    tell is unknown; the rest comes from wherever it still can (the sink's ledger, the nodes that
    answer, the state folder)."""
    state = run_state(feed_state)
    unreachable: dict[str, str] = {}
    sink: _SinkReading | None = None
    try:
        with lost_connection("sink"):
            sink = _read_sink(spec, feed_state)
    except ConnectionFailed as e:
        unreachable["sink"] = e.message.splitlines()[0]
    readings: dict[str, _NodeReading] = {}
    for node in spec.sources:
        try:
            readings[node.name] = _read_node(spec, node, sink.checkpoint.get(node.name) if sink else None, state)
        except ConnectionFailed as e:
            unreachable[spec.role(node.name)] = e.message.splitlines()[0]
    found = _measured(spec, state, sink, readings, unreachable)
    if sink is not None and sink.each:
        behind = Lag.load(feed_state)
        found.sinks = {name: {**_sink_fields(spec, last, rate, readings, read_note(feed_state.retrying_file), name),
                              "behind": behind.describe(name)}
                       for name, (last, rate) in sink.each.items()}
    found.verified = verified(feed_state)
    if spec.sources[0].name in readings:
        with suppress(ConnectionFailed):
            held, found.standbys, by = runners(spec)
            found.active = holding(held)
            found.state = paused_elsewhere(found.state, by)
    return found


def runners(spec: FeedSpec) -> tuple[lease.Lease | None, list[str], str | None]:
    """The feed's lease (who holds it, until when), who stands by and who paused it (None: nobody),
    as the first node has them."""
    with first_node(spec, connect_timeout=3) as conn:
        return lease.current(conn, spec.name), feed_record.standbys(conn, spec.name), \
            feed_record.paused_by(conn, spec.name)


def paused_elsewhere(state: str, by: str | None) -> str:
    """The feed's state in words, with a pause made on another host (on the source)."""
    return f"paused (by {by})" if by and not state.startswith(("running", "paused")) else state


def holding(held: lease.Lease | None) -> str:
    """The lease in words, for status and list."""
    if held is None:
        return "none"
    if held.free:
        how = "released" if held.released else "ended"
        return f"none (term {held.epoch} of {held.holder} {how} {-held.remaining_s:.1f}s ago)"
    return f"{held.holder} (term {held.epoch}, lease renewed within {held.lease_s:g}s; {held.remaining_s:.1f}s left)"


def verified(feed_state: FeedState) -> dict[str, Any] | None:
    """The last verification's time, outcome and position (see verify), None if never verified."""
    found = feed_state.last_verified()
    return None if found is None else {k: found[k] for k in ("at", "equal", "mismatched_rows", "lsns")}


@dataclass
class _NodeReading:
    slot: slots.SlotState | None
    current: int  # the node's WAL flush position
    now_ms: int  # its clock
    position: int | None  # where the sink's checkpoint has it
    caught_up: bool
    waiting: list[tuple[str, float]]  # prepared transactions not decided yet: (gid, seconds since PREPARE)

    @property
    def lag_bytes(self) -> int:
        """WAL past the checkpoint that may hold changes; 0 when caught up."""
        return 0 if self.caught_up else self.current - (self.position or 0)


@dataclass
class _SinkReading:
    """What the sink's ledger says of the feed."""

    last: Any  # sinks.ledger.LastBatch | None
    checkpoint: dict[str, int]
    rate: float | None
    snapshot: dict[str, dict[str, int]]
    each: dict[str, tuple[Any, float | None]] = field(default_factory=dict)  # several sinks: (last, rate) of each


def _read_sink(spec: FeedSpec, feed_state: FeedState) -> _SinkReading:
    with closing(open_ledger(spec, feed_state)) as ledger:
        last = ledger.last_batch()
        each = {}
        if isinstance(ledger, SinkLedgers):
            for name, one in ledger.each:
                with named(name):
                    mine = one.last_batch()
                    each[name] = (mine, one.recent_rate() if mine else None)
        return _SinkReading(last, ledger.checkpoint() or {}, ledger.recent_rate() if last else None,
                            {t: {"chunks": c, "rows": r} for t, (c, r) in ledger.snapshot_totals().items()}, each)


def _sink_fields(spec: FeedSpec, last: Any, rate: float | None, readings: dict[str, _NodeReading],
                 retrying: Retrying | None, name: str) -> dict[str, object]:
    """A sink's line of a feed of several sinks: how far it is (its lag in bytes on a one-node feed)."""
    now_ms = max((r.now_ms for r in readings.values()), default=int(time.time() * 1000))
    one = readings.get(spec.sources[0].name)
    lag = None
    if last is not None and one is not None and not spec.multi_node:
        lag = 0 if one.caught_up and one.position == last.end_lsn else max(0, one.current - last.end_lsn)
    return {"checkpoint_lsn": format_lsn(last.end_lsn) if last and not spec.multi_node else None,
            "checkpoint_commit_time": last.commit_time if last else None, "lag_bytes": lag,
            "resolved_lag_seconds": resolved_lag_s(now_ms, last.resolved_ts) if last else None,
            "batches": last.batches if last else 0, "changes_per_second_last_minute": rate,
            "last_batch_apply_seconds": last.seconds if last else None,
            "retrying": retrying.reason if retrying and retrying.component == f"sink {name}" else "no"}


def _measured(spec: FeedSpec, state: str, sink: _SinkReading | None, readings: dict[str, _NodeReading],
              unreachable: dict[str, str]) -> FeedStatus:
    """The status from what could be read (`sink`, the nodes in `readings`)."""
    last = sink.last if sink else None
    every_node = len(readings) == len(spec.sources)
    lag_bytes: int | None = None
    lag_s = resolved_lag = None
    if last:
        now_ms = max((r.now_ms for r in readings.values()), default=int(time.time() * 1000))
        resolved_lag = resolved_lag_s(now_ms, last.resolved_ts)
        if every_node:
            lag_bytes = sum(r.lag_bytes for r in readings.values())
            lag_s = 0.0 if all(r.caught_up for r in readings.values()) else resolved_lag
    elif sink and every_node:
        behind = [r.current - r.slot.confirmed_flush for r in readings.values() if r.slot and r.slot.confirmed_flush]
        lag_bytes = max(0, sum(behind)) if behind else None
    nodes = {} if not spec.multi_node else {n.name: _node_fields(n, readings.get(n.name), last is not None,
                                                                 unreachable.get(spec.role(n.name)))
                                            for n in spec.sources}
    one = readings.get(spec.sources[0].name)
    retained = [retained_bytes(r.slot, r.current) for r in readings.values()]
    lost = unreachable.get(spec.role(spec.sources[0].name))
    return FeedStatus(
        name=spec.name, state=state, slot=spec.slot if not spec.multi_node else f"one per node ({len(nodes)})",
        slot_state=(f"unknown ({lost})" if one is None else _slot_text(one.slot)) if not spec.multi_node
        else _nodes_text(spec, readings),
        slot_retained_wal_bytes=sum(r for r in retained if r) if any(r is not None for r in retained) else None,
        checkpoint_lsn=format_lsn(last.end_lsn) if last and not spec.multi_node else None,
        checkpoint_commit_time=last.commit_time if last else None, lag_bytes=lag_bytes, lag_seconds=lag_s,
        resolved_lag_seconds=resolved_lag, changes_per_second_last_minute=sink.rate if sink else None,
        last_batch_apply_seconds=last.seconds if last else None,
        batches=(last.batches if last else 0) if sink else None,
        snapshot=sink.snapshot if sink else {}, nodes=nodes, unreachable=unreachable)


def _node_fields(node: SourceNode, r: _NodeReading | None, applied: bool, lost: str | None) -> dict[str, object]:
    """A node's line of a feed of several nodes (unknown where the node cannot be reached)."""
    if r is None:
        return {"slot": node.slot, "slot_state": f"unknown ({lost})", "slot_retained_wal_bytes": None,
                "checkpoint_lsn": None, "lag_bytes": None, "prepared_transactions": "unknown"}
    return {"slot": node.slot, "slot_state": _slot_text(r.slot),
            "slot_retained_wal_bytes": retained_bytes(r.slot, r.current),
            "checkpoint_lsn": format_lsn(r.position) if r.position else None,
            "lag_bytes": r.lag_bytes if applied else None,
            "prepared_transactions": _waiting_text(r.waiting)}


def _read_node(spec: FeedSpec, node: SourceNode, position: int | None, state: str) -> _NodeReading:
    """A node's slot, flush position and clock, and whether the checkpoint is caught up with it: a
    stopped feed whose slot holds no change of a captured table past the checkpoint is caught up,
    whatever other WAL came since (other tables, PostgreSQL's own records)."""
    role = spec.role(node.name)
    with connect(node.uri, role) as conn, lost_connection(role):
        slot = slots.slot_state(conn, node.slot)
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


def _nodes_text(spec: FeedSpec, readings: dict[str, _NodeReading]) -> str:
    def text(r: _NodeReading | None) -> str:
        if r is None:
            return "unknown"
        if r.slot is None:
            return "missing"
        if r.slot.wal_status == "lost" or r.slot.invalidation:
            return "invalidated"
        return "active" if r.slot.active_pid else "inactive"
    return ", ".join(f"{n.name} {text(readings.get(n.name))}" for n in spec.sources)


def counted(n: int, noun: str) -> str:
    """`1 batch`, `2 batches`, `1,000 changes`."""
    return f"{n:,} {noun}" + ("" if n == 1 else "es" if noun.endswith("ch") else "s")


def _slot_text(slot: slots.SlotState | None) -> str:
    if slot is None:
        return "missing"
    if slot.wal_status == "lost" or slot.invalidation:
        return f"invalidated ({slot.invalidation or 'WAL removed'})"
    return f"{'active' if slot.active_pid else 'inactive'}, wal {slot.wal_status}, " \
           f"confirmed {format_lsn(slot.confirmed_flush or 0)}"


def retained_bytes(slot: slots.SlotState | None, current_lsn: int) -> int | None:
    """WAL the source keeps for the slot: from its restart LSN to the current flush position."""
    return max(0, current_lsn - slot.restart_lsn) if slot and slot.restart_lsn else None


def resolved_lag_s(now_ms: int, resolved_ts: int) -> float:
    """Source clock now minus the physical part of `resolved_ts`: how old the replica's cut is."""
    return max(0.0, (now_ms - physical_ms(resolved_ts)) / 1000)




def checkpoint_lag_s(current_lsn: int, now_ms: int, applied_lsn: int, resolved_ts: int) -> float:
    """The RPO: 0 when the replica has applied all WAL there is, else how old its resolved cut is."""
    return 0.0 if current_lsn <= applied_lsn else resolved_lag_s(now_ms, resolved_ts)
