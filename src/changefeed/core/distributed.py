"""The windows of a batch read from several nodes: one cut in time, distributed transactions whole.

A feed of several nodes reads each node's WAL by LSN, but the nodes' LSNs say nothing about each
other. The planner therefore cuts every batch at one moment, the batch's cut time `theta` (Unix
µs): each node's window [start, end) ends at its first commit later than theta, so a batch holds,
on every node, the transactions committed up to one instant and none after it. Three facts make
that a consistent cut:

* A commit's time is taken before its record is written, and WAL records are written in LSN
  order. So everything at or after a commit record was written after that commit's time, and a
  window may end at the start of any commit later than theta: nothing after it was visible
  before theta.
* theta is at least every node's clock as read when its `certain` position was read (every commit
  before `certain` is earlier than theta), and every node's `frontier` (a heartbeat) is written
  after theta was read: a window may also end at the frontier.
* A transaction that read another's effect committed after that one became visible. With the
  nodes' clocks in agreement, a batch holding it holds its cause too, and orders it after.

Distributed transactions. A transaction written to several nodes with two-phase commit has a part
on each: `PREPARE TRANSACTION 'gid'`, then `COMMIT PREPARED` (or `ROLLBACK PREPARED`). The reader
sees a part's rows at its COMMIT PREPARED, a commit like any other; the planner's scan (of a
two-phase slot, see postgres/twophase.py) tells which commits are parts of which gid. A part is
told from a later use of the same gid by its PREPARE's position: on a node, an outcome belongs to
the latest PREPARE of its gid before it. A batch delivers the committed parts of a gid only if

* no part of that gid on any node is still prepared, or committed past its node's window end
  (`pending`), and
* each delivered commit is certain to follow every PREPARE of its transaction: two-phase commit
  issues the first COMMIT PREPARED only after every PREPARE succeeded, so a commit before its
  node's `certain` position proves that every PREPARE was flushed before every node's frontier,
  which the scans reach. A scan cut short (a node far behind, see `NodeScan.scanned`) proves less:
  there the commit must also be earlier, by more than the allowed clock skew, than the last
  commit the short scan saw.

Otherwise those commits move out of the batch: their nodes' windows end before them, and theta
drops below their time, so that the whole cut stays consistent. Cutting can leave another gid
incomplete, so the rules are applied until nothing changes. A read limit (bytes or changes of a
window) lowers theta too; when the limits alone keep every commit out of the batch, they give
way (doubled until one is in), and a scan cut short is taken further (`Plan.short`), so a plan
always delivers something while any node has a commit it may deliver. Pure.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

COMMIT, PREPARE, COMMIT_PREPARED, ROLLBACK_PREPARED = "commit", "prepare", "commit_prepared", "rollback_prepared"
GIVE_WAY = 24  # doublings of the read limits before they are dropped


@dataclass(frozen=True)
class Event:
    """A record the planner's scan saw on a node: a commit, or a PREPARE / COMMIT PREPARED /
    ROLLBACK PREPARED of `gid`. `start` is where its record starts (for a rollback, whose start
    the scan does not show, its end - 1): an event belongs to the window holding that position."""

    kind: str
    start: int
    time_us: int  # commit, prepare or rollback time (Unix µs)
    gid: str = ""
    xid: int = 0
    changes: int = 0  # captured messages it carries (a commit, a PREPARE); 0: nothing to deliver


@dataclass(frozen=True)
class Part:
    """A prepared part of `gid` on a node: its PREPARE (start, xid, changes) and, once decided,
    the start and time of its COMMIT PREPARED (None while undecided or rolled back)."""

    gid: str
    prepare: int
    xid: int
    changes: int
    commit: int | None = None
    commit_time_us: int = 0
    rolled_back: bool = False

    def to_json(self) -> list[object]:
        return [self.gid, self.prepare, self.xid, self.changes]

    @classmethod
    def from_json(cls, data: list[Any]) -> Part:
        gid, prepare, xid, changes = data
        return cls(str(gid), int(prepare), int(xid), int(changes))


@dataclass(frozen=True)
class NodeScan:
    """One node's share of the batch being planned.

    `start` is where its window starts; `certain` a flushed position read before theta was
    taken; `frontier` a heartbeat written after; `events` what the scan saw from `start` up to
    `scanned` (records starting before it; `scanned` == `frontier` unless the scan was cut short
    because the node is far behind); `open` the parts prepared before `start` and undecided
    there (the previous plan's `Plan.open`); `cap` a position the window must not pass (a verify's
    barrier: there the cut is the node's position, not a time)."""

    start: int
    certain: int
    frontier: int
    events: tuple[Event, ...] = ()
    scanned: int | None = None  # None: the whole way to the frontier
    open: tuple[Part, ...] = ()
    cap: int | None = None

    @property
    def complete(self) -> bool:
        return self.scanned is None or self.scanned >= self.frontier


@dataclass(frozen=True)
class Limits:
    max_bytes: int = 0  # most WAL bytes of a window (0: none)
    max_changes: int = 0  # most captured messages of a window (0: none)
    skew_us: int = 500_000  # how far the nodes' clocks may disagree (only for scans cut short)

    def relaxed(self, factor: int) -> Limits:
        return replace(self, max_bytes=self.max_bytes * factor, max_changes=self.max_changes * factor)


@dataclass(frozen=True)
class Plan:
    ends: dict[str, int]  # per node, where its window ends
    theta_us: int  # the batch's cut time
    parts: dict[str, tuple[Part, ...]]  # per node, the prepared parts the window delivers (at their commit)
    open: dict[str, tuple[Part, ...]]  # per node, parts prepared before its end and undecided there
    waits: dict[str, tuple[str, ...]] = field(default_factory=dict)  # per node, gids whose commit there waits
    short: tuple[str, ...] = ()  # nodes whose scan was cut short: scanned further when nothing is delivered
    delivers: bool = False  # whether some window holds a commit

    def moved(self, scans: Mapping[str, NodeScan]) -> bool:
        """Whether some node's window is not empty (a cut time that moved alone is no batch)."""
        return any(self.ends[n] > s.start for n, s in scans.items())


@dataclass(frozen=True)
class Commit:
    """A point where a window may deliver something: a commit with captured changes."""

    start: int
    time_us: int
    changes: int
    part: Part | None = None  # set for a COMMIT PREPARED


class DistributedError(ValueError):
    """The scanned events contradict each other (a second PREPARE of a gid still prepared on the
    node, a COMMIT PREPARED whose PREPARE is unknown): what the planner must not guess about."""


def pair(scan: NodeScan) -> tuple[list[Commit], list[Part]]:
    """The node's delivery points in its scanned range, in WAL order, and every part known on it
    (the open ones first); each outcome belongs to its gid's open PREPARE before it."""
    parts: dict[str, Part] = {p.gid: p for p in scan.open}
    done: list[Part] = []
    commits: list[Commit] = []
    for e in scan.events:
        if e.start < scan.start:
            continue  # before the window: seen by an earlier plan (its open parts came in `open`)
        if e.kind == COMMIT:
            commits.append(Commit(e.start, e.time_us, e.changes))
        elif e.kind == PREPARE:
            if e.gid in parts:
                raise DistributedError(f"a second PREPARE of gid {e.gid!r} at {e.start} while one is still prepared")
            parts[e.gid] = Part(e.gid, e.start, e.xid, e.changes)
        elif e.kind == COMMIT_PREPARED:
            part = parts.pop(e.gid, None)
            if part is None:
                raise DistributedError(f"COMMIT PREPARED of gid {e.gid!r} at {e.start}, but its PREPARE is unknown")
            part = replace(part, commit=e.start, commit_time_us=e.time_us)
            done.append(part)
            if part.changes:
                commits.append(Commit(e.start, e.time_us, part.changes, part))
        elif e.kind == ROLLBACK_PREPARED:
            part = parts.pop(e.gid, None)
            if part is not None:
                done.append(replace(part, rolled_back=True))
    return commits, [*done, *parts.values()]


def plan(scans: Mapping[str, NodeScan], theta_prev: int, theta_read: int, limits: Limits = Limits()) -> Plan:
    """The batch's windows (see the module doc); `theta_prev` is the previous batch's cut time,
    `theta_read` the latest clock reading taken with the `certain` positions."""
    paired = {n: pair(s) for n, s in scans.items()}
    commits = {n: c for n, (c, _) in paired.items()}
    parts = {n: p for n, (_, p) in paired.items()}
    result = _plan(scans, commits, parts, theta_prev, theta_read, limits)
    if result.delivers or not (limits.max_bytes or limits.max_changes):
        return result
    unlimited = _plan(scans, commits, parts, theta_prev, theta_read, Limits(skew_us=limits.skew_us))
    if not unlimited.delivers:
        return result  # (the limits are not what keeps the commits out)
    for doubling in range(1, GIVE_WAY):
        result = _plan(scans, commits, parts, theta_prev, theta_read, limits.relaxed(1 << doubling))
        if result.delivers:
            return result
    return unlimited


def _plan(scans: Mapping[str, NodeScan], commits: Mapping[str, list[Commit]], parts: Mapping[str, list[Part]],
          theta_prev: int, theta_read: int, limits: Limits) -> Plan:
    theta = theta_read
    for n, s in scans.items():
        theta = min(theta, _limit_theta(s, commits[n], limits))
    theta = max(theta_prev, theta)
    caps = {n: s.cap for n, s in scans.items() if s.cap is not None}
    waits: dict[str, set[str]] = {n: set() for n in scans}
    while True:
        ends = {n: _end(s, commits[n], theta, caps.get(n)) for n, s in scans.items()}
        blocked = _blocked(scans, commits, parts, ends, limits)
        changed = False
        for n, s in scans.items():
            for c in commits[n]:
                if c.part is not None and c.part.gid in blocked and s.start <= c.start < ends[n]:
                    caps[n] = min(caps.get(n, c.start), c.start)
                    theta = max(theta_prev, min(theta, c.time_us - 1))
                    waits[n].add(c.part.gid)
                    changed = True
        if not changed:
            break
    delivered = {n: tuple(c.part for c in commits[n] if c.part is not None and s.start <= c.start < ends[n])
                 for n, s in scans.items()}
    still = {n: tuple(_reopened(p) for p in parts[n] if _undecided_at(p, ends[n])) for n in scans}
    short = tuple(n for n, s in scans.items() if not s.complete)
    delivers = any(s.start <= c.start < ends[n] for n, s in scans.items() for c in commits[n])
    return Plan(ends, theta, delivered, still, {n: tuple(sorted(w)) for n, w in waits.items() if w}, short, delivers)


def _limit_theta(scan: NodeScan, commits: list[Commit], limits: Limits) -> int:
    """The highest theta that keeps the node's window within the read limits (and within what a
    scan cut short can vouch for: its last commit stays out). Every window may take its first
    commit, however large."""
    bound = scan.start + limits.max_bytes if limits.max_bytes else None
    total = 0
    for i, c in enumerate(commits):
        total += c.changes
        over = (bound is not None and c.start >= bound) or (limits.max_changes and total > limits.max_changes)
        if over and i > 0:
            return c.time_us - 1
    if not scan.complete:
        return commits[-1].time_us - 1 if commits else -1
    return 1 << 62


def _end(scan: NodeScan, commits: list[Commit], theta: int, cap: int | None) -> int:
    """Where the node's window ends at cut time `theta`: its first commit later than theta, else
    its frontier (for a scan cut short, its start: what lies past the scan is unknown); never
    past `cap`."""
    end = next((c.start for c in commits if c.time_us > theta), scan.frontier if scan.complete else scan.start)
    return max(scan.start, end if cap is None else min(end, cap))


def _blocked(scans: Mapping[str, NodeScan], commits: Mapping[str, list[Commit]],
             parts: Mapping[str, list[Part]], ends: Mapping[str, int], limits: Limits) -> set[str]:
    """gids whose committed parts must not be delivered with these ends: one of their parts is
    still undecided at its node's end, or a commit in a window is not certain to follow every
    PREPARE of its transaction."""
    blocked = {p.gid for n in scans for p in parts[n] if p.changes and _pending_at(p, ends[n])}
    short = [commits[n][-1].time_us if commits[n] else -1 for n, s in scans.items() if not s.complete]
    for n, s in scans.items():
        for c in commits[n]:
            if c.part is None or not s.start <= c.start < ends[n]:
                continue
            certain = c.start < s.certain and all(c.time_us + limits.skew_us < last for last in short)
            if not certain:
                blocked.add(c.part.gid)
    return blocked


def _pending_at(part: Part, end: int) -> bool:
    """Whether a part (prepared anywhere in the scan) is not committed before `end`: its gid's
    other parts must wait for it (it may be theirs, or a later use of the gid: either way)."""
    return not part.rolled_back and (part.commit is None or part.commit >= end)


def _undecided_at(part: Part, end: int) -> bool:
    """Whether a part prepared before `end` has no outcome before it (a rolled-back one never counts)."""
    return not part.rolled_back and part.prepare < end and (part.commit is None or part.commit >= end)


def _reopened(part: Part) -> Part:
    """`part` as the next plan gets it: its outcome, past the window, is scanned again."""
    return Part(part.gid, part.prepare, part.xid, part.changes)


def pending_gids(open_parts: Iterable[Part]) -> list[str]:
    """The gids of open parts that carry changes (what a `P` row names as pending)."""
    return sorted({p.gid for p in open_parts if p.changes})
