"""A feed's other sinks going on without one that fails (--sink-lag-budget), and catching it up.

By default every sink of a feed waits for a failing one: the feed retries (control.retry) and
nothing moves. With a budget, a transient failure of one sink of several (its error names it,
sinks.fan_out.named) leaves it behind instead: the runner notes where it stands at most (the end
of the last batch Spark logged as committed, which every sink of that query had), copies the
feed's slot there (SourceNode.lag_slot: the copy keeps the WAL from there, the slot goes on) and
restarts the query without the sink. While it is behind, the runner copies the ends of the batches
the others take from Spark's offset log into the state folder's replay file, and looks at the sink
(its ledger's check) with a growing pause. Once it answers, the checkpoint is moved aside and a
query of every sink reads the copy from where the sink stands; each batch ends exactly where one
the others recorded ended (spark.source reads the replay file), so they skip it and the sink
behind gets the same batches, with the same timestamps, exactly once. Past the last of those ends
it is caught up: the query goes back to the feed's slot and the copy is dropped.

The budget is how long a sink may stay behind (a duration) or how much WAL the copy may keep for
it (a size); past it, with the sink still failing, the feed stops (SinkLagExceeded, naming the
sink). A sink that is slow but does not fail sets the pace of all. One-node feeds only.
"""
from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from changefeed.core.offsets import Offset
from changefeed.errors import ChangefeedError, SinkLagExceeded, TransientError
from changefeed.postgres import source as src
from changefeed.spark.checkpoint import committed_end, planned_ends, replay_ends
from changefeed.spec.definition import FeedSpec
from changefeed.spec.state import FeedState

if TYPE_CHECKING:
    from changefeed.control.attach import Prepared

PROBE_FIRST_S = 1.0  # the first look at a sink behind; each failed look doubles the pause
PROBE_MAX_S = 15.0


@dataclass
class Behind:
    """One sink the others went on without."""

    since: float  # Unix seconds: its first failure
    at: dict[str, Any]  # an offset (core.offsets) it has every batch up to, at least: the slot stays there
    reason: str
    catching_up: bool = False
    looks: int = 0  # failed looks in a row
    next_look: float = 0.0  # Unix seconds


@dataclass
class Lag:
    """The sinks of a feed that are behind (the state folder's behind file)."""

    state: FeedState
    sinks: dict[str, Behind] = field(default_factory=dict)

    @classmethod
    def load(cls, state: FeedState) -> Lag:
        try:
            found = json.loads(state.behind_file.read_text())
        except FileNotFoundError:
            return cls(state)
        return cls(state, {name: Behind(**b) for name, b in found.items()})

    def save(self) -> None:
        if not self.sinks:
            self.state.behind_file.unlink(missing_ok=True)
            self.state.replay_file.unlink(missing_ok=True)
            return
        tmp = self.state.behind_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({name: asdict(b) for name, b in self.sinks.items()}))
        tmp.replace(self.state.behind_file)

    def left_out(self) -> frozenset[str]:
        """The sinks the query runs without: behind and not being caught up."""
        return frozenset(name for name, b in self.sinks.items() if not b.catching_up)

    def read_from(self, spec: FeedSpec) -> dict[str, str] | None:
        """Per node, the slot a query that catches sinks up reads (the copy); None when none is caught up."""
        return {n.name: n.lag_slot for n in spec.sources} if any(b.catching_up for b in self.sinks.values()) \
            else None

    def describe(self, name: str) -> str:
        """Sink `name`'s line in status: no, or since when it is behind and why."""
        b = self.sinks.get(name)
        if b is None:
            return "no"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b.since))
        doing = "being caught up" if b.catching_up else f"the others go on without it, its WAL kept from {_where(b.at)}"
        return f"since {since} ({b.reason}); {doing}"

    def catching_from(self) -> Offset | None:
        """Where a query that catches sinks up starts: the least far of them; None if none is."""
        starts = [Offset.from_json(b.at) for b in self.sinks.values() if b.catching_up]
        return min(starts, key=lambda o: o.order) if starts else None

    def forget(self, names: set[str]) -> None:
        """Sinks removed from the feed: nothing to wait for or catch up."""
        if names & self.sinks.keys():
            self.sinks = {n: b for n, b in self.sinks.items() if n not in names}
            self.save()

    # -- the replay file: the batch ends the others took since the first sink fell behind --
    def replay(self) -> list[Offset]:
        return replay_ends(self.state.replay_file)

    def record_ends(self) -> None:
        """Append the ends in Spark's offset log past the last one recorded (or past where the first
        sink behind stands)."""
        ends = self.replay()
        after = ends[-1] if ends else min((Offset.from_json(b.at) for b in self.sinks.values()),
                                          key=lambda o: o.order)
        new = planned_ends(self.state, after)
        if new:
            self.write_replay(ends + new)

    def write_replay(self, ends: list[Offset]) -> None:
        tmp = self.state.replay_file.with_suffix(".tmp")
        tmp.write_text(json.dumps([e.to_json() for e in ends]))
        tmp.replace(self.state.replay_file)


def fell_behind(error: TransientError, spec: FeedSpec, lag: Lag, report: Callable[[str], None]) -> bool:
    """With a budget: `error`, a failure of one sink of several, leaves that sink behind (noted,
    True) if another sink goes on; False when the feed waits it out as usual (no budget, not one
    sink's failure, no other sink left, no committed batch to say where the sink stands, or the
    source out of reach to copy the slot). A failure while sinks are caught up leaves them all
    behind again, each where that query took it."""
    name = error.component.removeprefix("sink ") if error.component.startswith("sink ") else ""
    if not spec.sink_lag_budget or name not in {t.name for t in spec.sink_targets}:
        return False
    end, known = committed_end(lag.state), lag.sinks.get(name)
    at = known.at if known is not None else end.to_json() if end is not None else None
    if at is None or not {t.name for t in spec.sink_targets} - lag.sinks.keys() - {name}:
        return False
    now = time.time()
    if not lag.sinks:
        try:
            _copy_slot(spec, end)
        except ChangefeedError as e:
            report(f"feed {spec.name}: sink {name} failed, and the slot could not be copied to keep its WAL "
                   f"({e.message.splitlines()[0]}): every sink waits for it")
            return False
    looks = known.looks + 1 if known is not None else 0
    for b in lag.sinks.values():  # (a failure while being caught up: where that query took them, and the
        if b.catching_up and end is not None and end.order > Offset.from_json(b.at).order:  # next look later)
            b.at = end.to_json()
        b.catching_up, b.next_look = False, max(b.next_look, now + _pause(looks))
    lag.sinks[name] = Behind(known.since if known else now, known.at if known else at, error.message.splitlines()[0],
                             False, looks, now + _pause(looks))
    lag.save()
    lag.record_ends()
    report(f"feed {spec.name}: sink {name} failed ({lag.sinks[name].reason}); the other sinks go on without it "
           f"(--sink-lag-budget {budget_text(spec)}), slot {spec.sources[0].lag_slot} keeps its WAL from "
           f"{_where(lag.sinks[name].at)}; it is caught up once it answers")
    return True


class Switch(Exception):
    """Restart the query on another slot: the copy, to catch the sinks behind up (`catch_up`), or
    the feed's own, once they are."""

    def __init__(self, catch_up: bool) -> None:
        super().__init__("catch up" if catch_up else "caught up")
        self.catch_up = catch_up


def tick(prepared: Prepared, lag: Lag, report: Callable[[str], None]) -> None:
    """At each report: Switch once the sinks being caught up are (back to the feed's slot); while
    sinks are left out, record the batch ends the others take, look at each one when due (Switch
    to catch them up once one answers), and stop past the budget."""
    if not lag.sinks:
        return
    if lag.read_from(prepared.spec) is not None:
        end, ends = committed_end(lag.state), lag.replay()
        if end is not None and (not ends or end.order >= ends[-1].order):
            raise Switch(catch_up=False)
        return
    lag.record_ends()
    now = time.time()
    for name in sorted(lag.left_out()):
        b = lag.sinks[name]
        if now < b.next_look:
            continue
        failure = look(prepared.definition, name, lag.state)
        if failure is None:
            report(f"feed {prepared.spec.name}: sink {name} answers again; catching "
                   f"{', '.join(sorted(lag.sinks))} up from slot {prepared.spec.sources[0].lag_slot}")
            raise Switch(catch_up=True)
        b.looks, b.next_look, b.reason = b.looks + 1, now + _pause(b.looks + 1), failure
        lag.save()
        _check_budget(prepared, name, b, now)


def switch(to: Switch, spec: FeedSpec, lag: Lag, report: Callable[[str], None]) -> None:
    """After the query stopped: catch up (the checkpoint moved aside, its query went on without
    the sinks behind: the next one starts where they stand, spark.checkpoint.resume), or, caught
    up, forget them and drop the copy."""
    if not to.catch_up:
        for name, b in sorted(lag.sinks.items()):
            report(f"feed {spec.name}: sink {name} caught up (behind for {time.time() - b.since:.0f}s)")
        lag.sinks.clear()
        lag.save()  # (the copy is dropped as the next query is attached: settle)
        return
    lag.record_ends()
    checkpoint = lag.state.checkpoint
    if checkpoint.exists():  # first: a query of that checkpoint must never read the copy (it is further)
        aside = checkpoint.with_name("checkpoint.replaced")
        shutil.rmtree(aside, ignore_errors=True)
        checkpoint.rename(aside)
        report(f"feed {spec.name}: the checkpoint of the query without {', '.join(sorted(lag.sinks))} moved aside "
               f"to {aside}")
    for b in lag.sinks.values():
        b.catching_up = True
    lag.save()


def settle(prepared: Prepared, lag: Lag, report: Callable[[str], None]) -> None:
    """With no sink known to be behind, the slot's copy is dropped (after the switch back, or left
    by a runner that ended in between), unless this runner has no checkpoint and starts from a sink
    whose WAL only the copy still has (a standby or a new host took the feed over while the sink
    was behind): then those sinks are caught up from the copy first, by the batches the others'
    ledgers recorded."""
    from changefeed.postgres import slots

    if lag.sinks or prepared.spec.multi_node:
        return
    node, conn = prepared.spec.sources[0], prepared.source_conn
    copy = slots.slot_state(conn, node.lag_slot)
    if copy is None:
        return
    own = slots.slot_state(conn, node.slot)
    lag.sinks = _behind_the_slot(prepared, copy.confirmed_flush, own.confirmed_flush if own else None)
    if not lag.sinks:
        slots.drop(conn, node.lag_slot)
        return
    assert prepared.resume is not None  # (where they stand: _behind_the_slot)
    lag.write_replay(prepared.ledger.batch_ends(prepared.resume))  # the others' batches: their timestamps
    lag.save()
    report(f"feed {prepared.spec.name}: sinks {', '.join(sorted(lag.sinks))} lack WAL the feed's slot gave up; "
           f"catching them up from slot {node.lag_slot}")


def _behind_the_slot(prepared: Prepared, copy: int | None, own: int | None) -> dict[str, Behind]:
    """The sinks a query without a checkpoint starts from that lack WAL the feed's slot (at `own`)
    gave up and its copy (at `copy`) kept: each to be caught up from where it stands."""
    from changefeed.sinks.ledgers import SinkLedgers

    node = prepared.spec.sources[0].name
    start = prepared.resume.lsns.get(node) if prepared.resume is not None else None
    if start is None or copy is None or own is None or not copy <= start < own or \
            not isinstance(prepared.ledger, SinkLedgers):
        return {}
    found = "behind the others when this runner took the feed"
    return {name: Behind(time.time(), at.to_json(), found, catching_up=True)
            for name, at in prepared.ledger.offsets() if at.lsns.get(node, 0) < own}


def _copy_slot(spec: FeedSpec, at: Offset | None) -> None:
    """Copy the feed's slot; it must not be past `at`. A copy there already that is not past it
    either is kept (it keeps at least that WAL: a runner that ended before it noted the sink)."""
    from changefeed.postgres import slots
    from changefeed.postgres.connect import first_node

    node = spec.sources[0]
    with first_node(spec) as conn:
        found = slots.slot_state(conn, node.lag_slot)
        if found is not None and found.confirmed_flush is not None and \
                (at is None or found.confirmed_flush <= at.lsns[node.name]):
            return
        if found is not None:
            slots.drop(conn, node.lag_slot)
        slots.copy(conn, node.slot, node.lag_slot)
        made = slots.slot_state(conn, node.lag_slot)
        assert made is not None and made.confirmed_flush is not None
        if at is not None and made.confirmed_flush > at.lsns[node.name]:
            slots.drop(conn, node.lag_slot)
            raise ChangefeedError(f"slot {node.slot} is past the last batch every sink has")


def look(spec: FeedSpec, name: str, state: FeedState) -> str | None:
    """Whether sink `name` answers (its ledger's check): None if it does, else what failed."""
    from changefeed.sinks.registry import sinks_of

    [(_, one, sink)] = [s for s in sinks_of(spec) if s[0].name == name]
    try:
        ledger = sink.open_ledger(one, state)
        try:
            ledger.check()
        finally:
            ledger.close()
    except ChangefeedError as e:
        return e.message.splitlines()[0]
    return None


def _check_budget(prepared: Prepared, name: str, b: Behind, now: float) -> None:
    spec = prepared.spec
    over = ""
    if spec.sink_lag_budget_s and now - b.since > spec.sink_lag_budget_s:
        over = f"it has been behind for {now - b.since:.0f}s"
    elif spec.sink_lag_budget_bytes:
        at = Offset.from_json(b.at).lsns
        kept = max((src.flush_lsn(conn)[0] - at[node] for node, conn in prepared.sources.items() if node in at),
                   default=0)
        if kept > spec.sink_lag_budget_bytes:
            over = f"the slot keeps {kept} bytes of WAL for it"
    if over:
        raise SinkLagExceeded(
            f"feed {spec.name}: sink {name} is past --sink-lag-budget {budget_text(spec)}: {over}, and it still "
            f"fails ({b.reason}); the feed stopped, its slot keeps the WAL from {_where(b.at)}",
            f"bring sink {name} back and run the feed again (it is caught up first), raise --sink-lag-budget, or "
            f"remove it: changefeed alter --name {spec.name} --remove-sink {name}", component=f"sink {name}")


def budget_text(spec: FeedSpec) -> str:
    return f"{spec.sink_lag_budget_s:g}s" if spec.sink_lag_budget_s else f"{spec.sink_lag_budget_bytes}B"


def _pause(looks: int) -> float:
    return float(min(PROBE_MAX_S, PROBE_FIRST_S * 2 ** looks))


def _where(at: dict[str, Any]) -> str:
    from changefeed.core.lsn import format_lsn

    return ", ".join(f"{node} {format_lsn(lsn)}" for node, lsn in sorted(Offset.from_json(at).lsns.items()))
