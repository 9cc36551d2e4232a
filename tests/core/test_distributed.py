"""core.distributed: holds and cuts that deliver every distributed transaction whole, in one batch."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.core import distributed as dist
from changefeed.core.distributed import COMMIT, PREPARE, ROLLBACK, Event, NodeWindow

NODES = ("a", "b", "c")


def ev(kind: str, gid: str, start: int) -> Event:
    return Event(kind, gid, start, start + 10, start)


def test_a_transaction_committed_on_one_node_only_waits_there() -> None:
    windows = {"a": NodeWindow(0, 0, 100, 100, (ev(PREPARE, "g", 10), ev(COMMIT, "g", 50))),
               "b": NodeWindow(0, 0, 100, 100, (ev(PREPARE, "g", 20),))}
    d = dist.decide(windows)
    assert d["a"].end == 50 and d["a"].waits == ("g",)  # cut right before its COMMIT PREPARED
    assert d["b"].end == 100 and d["a"].cut_time_us == 50
    assert d["a"].hold == 0 and d["b"].hold == 0


def test_a_complete_transaction_passes_and_a_rolled_back_one_needs_nothing() -> None:
    windows = {"a": NodeWindow(0, 0, 100, 100, (ev(PREPARE, "g", 10), ev(COMMIT, "g", 50), ev(PREPARE, "r", 60),
                                                 ev(ROLLBACK, "r", 70))),
               "b": NodeWindow(0, 0, 100, 100, (ev(PREPARE, "g", 20), ev(COMMIT, "g", 80)))}
    d = dist.decide(windows)
    assert (d["a"].end, d["b"].end) == (100, 100) and not d["a"].waits


def test_outcomes_past_the_certain_position_wait_a_batch() -> None:
    # both commits came after the positions read before the windows' ends: a third part may hide
    windows = {"a": NodeWindow(0, 0, 100, 40, (ev(PREPARE, "g", 10), ev(COMMIT, "g", 50))),
               "b": NodeWindow(0, 0, 100, 40, (ev(PREPARE, "g", 20), ev(COMMIT, "g", 80)))}
    d = dist.decide(windows)
    assert (d["a"].end, d["b"].end) == (50, 80)


def test_a_part_undecided_at_the_start_holds_the_slot_at_its_prepare() -> None:
    w = NodeWindow(0, 60, 100, 100, (ev(PREPARE, "g", 10), ev(PREPARE, "h", 20), ev(COMMIT, "h", 30)))
    assert dist.hold(w) == 10
    assert dist.hold(NodeWindow(0, 60, 100, 100, (ev(PREPARE, "h", 20), ev(COMMIT, "h", 30)))) == 60


def test_cuts_cascade() -> None:
    # g is incomplete (c undecided): cutting b before g's commit also cuts h's commit on b, so h waits on a
    windows = {"a": NodeWindow(0, 0, 200, 200, (ev(PREPARE, "h", 5), ev(COMMIT, "h", 150))),
               "b": NodeWindow(0, 0, 200, 200, (ev(PREPARE, "g", 10), ev(PREPARE, "h", 20), ev(COMMIT, "g", 60),
                                                 ev(COMMIT, "h", 90))),
               "c": NodeWindow(0, 0, 200, 200, (ev(PREPARE, "g", 30),))}
    d = dist.decide(windows)
    assert d["b"].end == 60 and d["a"].end == 150 and set(d["b"].waits) == {"g"} and d["a"].waits == ("h",)


# -- property: a simulated two-phase workload over three nodes, planned batch by batch -----------

class Node:
    """One node's WAL: records of (start, end, time, kind, gid)."""

    def __init__(self) -> None:
        self.lsn = 0
        self.records: list[tuple[int, int, int, str, str]] = []

    def write(self, t: int, kind: str, gid: str = "") -> None:
        self.records.append((self.lsn, self.lsn + 8, t, kind, gid))
        self.lsn += 8

    def events(self, lo: int, hi: int) -> tuple[Event, ...]:
        return tuple(Event(k, g, s, e, t) for s, e, t, k, g in self.records
                     if k != "local" and lo <= s and e <= hi)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32))
def test_every_distributed_transaction_is_delivered_whole_once(seed: int) -> None:
    rng = random.Random(seed)
    wal = {n: Node() for n in NODES}
    t = 0
    # Random steps: local commits, and distributed transactions whose prepares all come before
    # their first outcome (two-phase commit), interleaved with each other and with planning.
    open_txns: list[tuple[str, list[str], list[str]]] = []  # (gid, prepares left, outcomes left)
    outcome: dict[str, str] = {}
    plans: list[tuple[dict[str, int], dict[str, int]]] = []

    def step() -> None:
        nonlocal open_txns
        r = rng.random()
        if r < 0.25 or not open_txns and r < 0.6:
            gid = f"g{len(outcome)}"
            parts = rng.sample(NODES, rng.randrange(1, 4))
            outcome[gid] = COMMIT if rng.random() < 0.8 else ROLLBACK
            open_txns.append((gid, list(parts), list(parts)))
        elif r < 0.6:
            gid, prepares, outcomes = rng.choice(open_txns)
            if prepares:
                wal[prepares.pop(rng.randrange(len(prepares)))].write(t, PREPARE, gid)
            elif outcomes:
                wal[outcomes.pop(rng.randrange(len(outcomes)))].write(t, outcome[gid], gid)
            if not outcomes:
                open_txns = [o for o in open_txns if o[0] != gid]
        else:
            wal[rng.choice(NODES)].write(t, "local")

    for _ in range(rng.randrange(10, 80)):
        t += 1
        if rng.random() < 0.8:
            step()
            continue
        certain = {n: w.lsn for n, w in wal.items()}  # read on every node first
        ends = {}
        for n in rng.sample(NODES, 3):  # then each node's end, one after the other, work going on
            for _ in range(rng.randrange(0, 3)):
                step()
            ends[n] = wal[n].lsn
        plans.append((certain, ends))
    for gid, prepares, outcomes in open_txns:  # finish them all, then plan until quiet
        for n in prepares:
            wal[n].write(t, PREPARE, gid)
        for n in outcomes:
            wal[n].write(t, outcome[gid], gid)
    final = {n: w.lsn for n, w in wal.items()}
    plans += [(final, final)] * 4

    start = {n: 0 for n in NODES}
    slot = {n: 0 for n in NODES}
    delivered: dict[str, list[tuple[int, str]]] = {}  # gid -> (batch, node)
    for batch, (certain, ends) in enumerate(plans):
        windows = {}
        for n in NODES:
            frontier = max(start[n], ends[n])
            # a read limit may end the window at any record boundary before the frontier
            end = rng.choice([frontier, frontier] + [e for _, e, *_ in wal[n].records if start[n] < e < frontier]) \
                if batch < len(plans) - 4 else frontier  # (the last plans read everything)
            windows[n] = NodeWindow(slot[n], start[n], end, certain[n], wal[n].events(slot[n], frontier))
        for n, d in dist.decide(windows).items():
            assert slot[n] <= d.hold <= start[n] <= d.end <= windows[n].end
            for s, e, _, kind, gid in wal[n].records:
                if kind == COMMIT and start[n] < e <= d.end:
                    prepare = next(r for r in wal[n].records if r[3] == PREPARE and r[4] == gid)
                    assert prepare[0] >= d.hold, "a delivered part's rows were behind the slot"
                    delivered.setdefault(gid, []).append((batch, n))
            slot[n], start[n] = d.hold, d.end
    for gid, how in outcome.items():
        committed = sorted(n for n in NODES for r in wal[n].records if r[3] == COMMIT and r[4] == gid)
        got = delivered.get(gid, [])
        assert sorted(n for _, n in got) == committed, (gid, got)  # every committed part, once
        assert len({b for b, _ in got}) <= 1, (gid, got)  # all in one batch
