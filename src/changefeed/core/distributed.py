"""Distributed transactions: which WAL windows of a batch of several nodes deliver them whole.

A distributed transaction writes to several nodes with two-phase commit: `PREPARE TRANSACTION
'gid'` on each (its part there), then `COMMIT PREPARED 'gid'` (or `ROLLBACK PREPARED`) on each.
Slots with two-phase decoding (postgres/twophase.py) show a part's rows at its PREPARE and its
outcome at a later record. The planner reads those events from every node's WAL (a scan that
returns no row data) and decides here, before a batch is read:

* **Hold.** A part whose outcome is not before the window's start keeps its node's slot at or
  before its PREPARE (`hold`), so that its rows are read again with the window that holds its
  outcome: a two-phase slot moved past a PREPARE never sends its rows again.
* **Complete.** A distributed transaction is complete in a batch when every node on which it was
  prepared has its outcome inside that node's window, and one of those outcomes is at or below
  its node's `certain` position: a flushed position read on every node before any node's window
  end was taken. Two-phase commit issues the first COMMIT PREPARED only after every PREPARE
  succeeded, so an outcome at or below `certain` proves every part's PREPARE is flushed below
  every node's frontier (taken after every `certain`), and the events are read up to there: no
  node can hide a part the batch does not know of.
* **Cut.** A COMMIT PREPARED of a transaction that is not complete is moved to a later batch
  together with everything after it on its node: that node's window ends where the record
  starts (a record boundary). Cutting can leave another transaction incomplete, so the cuts are
  repeated until nothing changes.

Every delivered transaction is thereby whole in one batch (all its committed parts), and every
node's order is kept (a window is only ever shortened). A part rolled back delivers nothing. A
transaction left prepared on one node while committed on another holds the other's window
before that commit until it is decided: the feed waits rather than deliver half of it. Pure.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

PREPARE, COMMIT, ROLLBACK = "prepare", "commit", "rollback"


@dataclass(frozen=True)
class Event:
    """A PREPARE, COMMIT PREPARED or ROLLBACK PREPARED record of transaction `gid` on a node."""

    kind: str
    gid: str
    start: int  # where the record starts (for a rollback, which pgoutput gives no start: end - 1)
    end: int  # where it ends: in a window [s, e) iff s < end <= e (windows end at record boundaries)
    time_us: int  # its prepare, commit or rollback time (Unix µs)


@dataclass(frozen=True)
class NodeWindow:
    """One node's share of the batch being planned: the slot's position `slot`, the window
    [start, end) as planned without distributed transactions, `certain` (see the module doc),
    and the two-phase events from `slot` up to the node's frontier (its fresh flushed end, which
    is past `end` where a read limit cut the window: a part prepared between the two still
    counts, or its transaction could pass as complete without it)."""

    slot: int
    start: int
    end: int
    certain: int
    events: tuple[Event, ...] = field(default=())


@dataclass(frozen=True)
class Decision:
    hold: int  # where the node's slot stays while the batch is read (<= start)
    end: int  # where its window ends (<= the planned end)
    waits: tuple[str, ...] = ()  # gids whose commit here was cut for being incomplete
    cut_time_us: int | None = None  # commit time of the first record cut (None: not cut)


def hold(window: NodeWindow) -> int:
    """The least PREPARE start among parts still undecided at the window's start, else the start."""
    decided = {e.gid for e in window.events if e.kind != PREPARE and e.end <= window.start}
    pending = [e.start for e in window.events
               if e.kind == PREPARE and e.end <= window.start and e.gid not in decided]
    return min(pending, default=window.start)


def decide(windows: Mapping[str, NodeWindow]) -> dict[str, Decision]:
    """Per node: its hold and its (possibly shortened) window end (see the module doc)."""
    ends = {n: w.end for n, w in windows.items()}
    prepared: dict[str, set[str]] = defaultdict(set)  # gid -> nodes it was prepared on
    outcomes: dict[str, dict[str, Event]] = defaultdict(dict)  # gid -> node -> its outcome
    for n, w in windows.items():
        for e in w.events:
            if e.kind == PREPARE:
                prepared[e.gid].add(n)
            else:
                outcomes[e.gid][n] = e
    waits: dict[str, list[str]] = defaultdict(list)
    first_cut: dict[str, Event] = {}
    changed = True
    while changed:
        changed = False
        for gid, by_node in outcomes.items():
            known = {n: e for n, e in by_node.items() if e.end <= ends[n]}  # decided by the window's end
            inside = {n: e for n, e in known.items() if e.kind == COMMIT and windows[n].start < e.end}
            if not inside or _complete(prepared.get(gid, set()), known, windows):
                continue
            for n, e in inside.items():
                ends[n] = e.start
                waits[n].append(gid)
                if n not in first_cut or e.start < first_cut[n].start:
                    first_cut[n] = e
                changed = True
    out = {}
    for n, w in windows.items():
        cut = first_cut.get(n)
        out[n] = Decision(hold(w), ends[n], tuple(sorted(set(waits[n]))), cut.time_us if cut else None)
    return out


def _complete(prepared_on: set[str], known: Mapping[str, Event], windows: Mapping[str, NodeWindow]) -> bool:
    """Every node it was prepared on has its outcome, one of them at or below `certain`."""
    return prepared_on <= set(known) and any(e.end <= windows[n].certain for n, e in known.items())

