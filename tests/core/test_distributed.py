"""core.distributed: one consistent cut in time per batch, distributed transactions whole."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.core import distributed as dist
from changefeed.core.distributed import (
    COMMIT,
    COMMIT_PREPARED,
    PREPARE,
    ROLLBACK_PREPARED,
    Event,
    Limits,
    NodeScan,
    Part,
)


def commit(start: int, t: int, changes: int = 1) -> Event:
    return Event(COMMIT, start, t, changes=changes)


def prep(gid: str, start: int, t: int, changes: int = 1) -> Event:
    return Event(PREPARE, start, t, gid, xid=start, changes=changes)


def cp(gid: str, start: int, t: int) -> Event:
    return Event(COMMIT_PREPARED, start, t, gid)


def rb(gid: str, start: int, t: int) -> Event:
    return Event(ROLLBACK_PREPARED, start, t, gid)


def test_windows_end_at_the_first_commit_later_than_the_cut_time() -> None:
    scans = {"a": NodeScan(0, 100, 200, (commit(10, 5), commit(20, 7), commit(150, 30), commit(170, 12))),
             "b": NodeScan(0, 100, 200, (commit(40, 6),))}
    p = dist.plan(scans, theta_prev=0, theta_read=20)
    assert p.theta_us == 20 and p.ends == {"a": 150, "b": 200}  # 170 (t=12) waits behind 150 (t=30)


def test_a_part_committed_on_one_node_only_waits_and_so_does_everything_later() -> None:
    scans = {"a": NodeScan(0, 100, 100, (prep("g", 10, 1), cp("g", 50, 5), commit(60, 6))),
             "b": NodeScan(0, 100, 100, (prep("g", 20, 2), commit(30, 7)))}
    p = dist.plan(scans, theta_prev=0, theta_read=50)
    assert p.ends == {"a": 50, "b": 30} and p.theta_us == 4 and p.waits == {"a": ("g",)}
    assert p.open == {"a": (Part("g", 10, 10, 1),), "b": (Part("g", 20, 20, 1),)}
    # decided on b later: the next plan (from the open parts) delivers both parts at once
    later = {"a": NodeScan(50, 100, 100, (cp("g", 50, 5), commit(60, 6)), open=p.open["a"]),
             "b": NodeScan(30, 100, 120, (commit(30, 7), cp("g", 90, 8)), open=p.open["b"])}
    q = dist.plan(later, theta_prev=p.theta_us, theta_read=60)
    assert q.ends == {"a": 100, "b": 120} and {n: [x.gid for x in v] for n, v in q.parts.items()} == \
        {"a": ["g"], "b": ["g"]} and not q.open["a"] and not q.open["b"]


def test_a_commit_past_the_certain_position_waits_a_batch() -> None:
    scans = {"a": NodeScan(0, 40, 100, (prep("g", 10, 1), cp("g", 50, 5))),
             "b": NodeScan(0, 100, 100, (prep("g", 20, 2), cp("g", 30, 3)))}
    p = dist.plan(scans, theta_prev=0, theta_read=50)
    assert p.ends == {"a": 50, "b": 30} and not any(p.parts.values())


def test_a_reused_gid_is_told_apart_by_its_prepare() -> None:
    # g was rolled back on both nodes, then prepared again: the old rollback decides nothing new
    scans = {"a": NodeScan(0, 100, 100, (prep("g", 10, 1), rb("g", 20, 2), prep("g", 30, 3), cp("g", 40, 5))),
             "b": NodeScan(0, 100, 100, (prep("g", 10, 1), rb("g", 20, 2), prep("g", 30, 4)))}
    p = dist.plan(scans, theta_prev=0, theta_read=50)
    assert p.ends["a"] == 40 and not any(p.parts.values()) and p.open["b"] == (Part("g", 30, 30, 1),)
    with pytest.raises(dist.DistributedError, match="second PREPARE"):
        dist.plan({"a": NodeScan(0, 9, 9, (prep("g", 1, 1), prep("g", 2, 1)))}, 0, 10)


def test_a_part_prepared_past_its_nodes_end_still_holds_its_gid_back() -> None:
    # k waits for c, so b ends before k's commit (late: below the previous cut time, so by position);
    # g's part on b is prepared after that end, and g's commit on a must wait for it too
    scans = {"a": NodeScan(0, 100, 100, (prep("g", 5, 80), cp("g", 30, 90))),
             "b": NodeScan(0, 100, 100, (prep("k", 2, 40), cp("k", 10, 50), prep("g", 20, 85), cp("g", 40, 95))),
             "c": NodeScan(0, 100, 100, (prep("k", 3, 45),))}
    p = dist.plan(scans, theta_prev=100, theta_read=200)
    assert p.ends == {"a": 30, "b": 10, "c": 100} and not any(p.parts.values())


def test_a_short_scan_vouches_for_parts_only_beyond_the_clock_skew() -> None:
    # b's scan stops at 30; its last commit there says 150 by b's clock. g committed on a at 100 by
    # a's clock: if the clocks may disagree by 60, g's PREPARE on b may lie past b's scan
    scans = {"a": NodeScan(0, 100, 100, (prep("g", 10, 90), cp("g", 20, 100))),
             "b": NodeScan(0, 10**6, 10**6, (commit(10, 30), commit(20, 150)), scanned=30)}
    waits = dist.plan(scans, 0, 1000, Limits(skew_us=60))
    assert waits.ends["a"] == 20 and waits.waits == {"a": ("g",)}
    trusts = dist.plan(scans, 0, 1000, Limits(skew_us=10))
    assert trusts.ends["a"] == 100 and [p.gid for p in trusts.parts["a"]] == ["g"]


def test_the_stall_of_opposite_orders_under_a_byte_limit_gives_way() -> None:
    # X commits g on a, then stalls; h commits on b then a; b writes a lot; X commits g on b
    scans = {"a": NodeScan(0, 1000, 1000, (prep("g", 1, 1), prep("h", 2, 1), cp("g", 3, 10), cp("h", 5, 12))),
             "b": NodeScan(0, 10**6, 10**6, (prep("g", 1, 1), prep("h", 2, 2), cp("h", 3, 11),
                                             *(commit(100 * i, 12 + i) for i in range(1, 5000)),
                                             cp("g", 600_000, 6000)))}
    theta, delivered = 0, {"a": [], "b": []}
    for _ in range(4):  # windows move (to the first commits), then the limit gives way
        p = dist.plan(scans, theta_prev=theta, theta_read=7000, limits=Limits(max_bytes=1000))
        assert p.moved(scans)
        for n, parts in p.parts.items():
            delivered[n] += [x.gid for x in parts]
        theta = p.theta_us
        scans = {n: NodeScan(p.ends[n], s.certain, s.frontier, s.events, open=p.open[n]) for n, s in scans.items()}
        if delivered["a"]:
            break
    assert {n: sorted(v) for n, v in delivered.items()} == {"a": ["g", "h"], "b": ["g", "h"]}


def test_a_scan_cut_short_vouches_only_for_what_it_saw() -> None:
    scans = {"a": NodeScan(0, 100, 100, (prep("g", 10, 1), cp("g", 20, 50))),
             "b": NodeScan(0, 10**6, 10**6, (prep("g", 5, 2), commit(10, 30), commit(20, 60)), scanned=30)}
    p = dist.plan(scans, 0, 100, Limits(skew_us=5))
    assert p.theta_us == 49 and p.ends == {"a": 20, "b": 20}  # b's g part is not committed in the scan
    assert dist.plan({"b": NodeScan(0, 10**6, 10**6, (commit(10, 30),), scanned=30)}, 0, 100).short == ("b",)


# -- the property: a simulated cluster, planned batch by batch --------------------------------------

@dataclass
class Txn:
    node: str
    commit_time: int  # by its node's clock
    changes: int
    gid: str = ""  # a part of a distributed transaction (instance `instance`)
    instance: int = 0
    deps: list[Txn] = field(default_factory=list)  # transactions on other nodes it read
    start: int = -1  # its commit record's start, once written
    batch: int = -1  # the batch that delivered it
    real: int = 0  # when it took its commit time, by the one true clock
    visible: int = 0  # when its commit record was written (a reader sees it from then on)

    def __hash__(self) -> int:
        return id(self)


@dataclass
class Node:
    lsn: int = 0
    records: list[tuple[int, Event, Txn | None]] = field(default_factory=list)

    def write(self, rng: random.Random, event: Event, txn: Txn | None = None) -> int:
        start = self.lsn
        self.lsn += rng.choice((8, 16, 24, 200, 3000))  # records of all sizes: scan bounds fall inside some
        self.records.append((start, Event(event.kind, start, event.time_us, event.gid, start, event.changes), txn))
        if txn is not None:
            txn.start = start
        return start


class Cluster:
    def __init__(self, rng: random.Random, nodes: tuple[str, ...]) -> None:
        self.rng, self.now = rng, 1000
        self.skew = 0
        self.offset = {n: 0 for n in nodes}  # each node's clock is off by this much
        self.nodes = {n: Node() for n in nodes}
        self.delayed: list[Txn] = []  # commit time taken, record not written yet
        self.visible: dict[str, list[Txn]] = {n: [] for n in nodes}
        self.txns: list[Txn] = []
        self.coordinators: list[dict[str, object]] = []
        self.instances: dict[int, list[Txn]] = {}
        self.gids = 0
        self.two_pc = list(nodes)  # the nodes coordinators write to (a node joins the feed first)

    def clock(self, node: str) -> int:
        return self.now + self.offset[node]

    def tick(self) -> None:
        self.now += self.rng.randrange(1, 40)

    def step(self) -> None:
        rng = self.rng
        self.tick()
        r = rng.random()
        if r < 0.3:  # a local transaction, maybe reading what another node shows
            n = rng.choice(list(self.nodes))
            others = [t for m, v in self.visible.items() if m != n for t in v[-3:]]
            deps = [rng.choice(others)] if others and rng.random() < 0.5 else []
            txn = Txn(n, self.clock(n), rng.randrange(1, 5), deps=deps, real=self.now)
            self.txns.append(txn)
            if rng.random() < 0.2:
                self.delayed.append(txn)  # its record comes a little later (others may pass it)
            else:
                self._write_commit(txn)
        elif r < 0.4 and self.delayed:
            self._write_commit(self.delayed.pop(rng.randrange(len(self.delayed))))
        elif r < 0.55:
            self._new_coordinator()
        elif r < 0.9 and self.coordinators:
            self._advance(rng.choice(self.coordinators))

    def _write_commit(self, txn: Txn) -> None:
        txn.visible = self.now
        self.nodes[txn.node].write(self.rng, Event(COMMIT, 0, txn.commit_time, changes=txn.changes), txn)
        self.visible[txn.node].append(txn)

    def _new_coordinator(self, gid: str | None = None) -> None:
        rng = self.rng
        if gid is None:
            self.gids += 1
            gid = f"g{self.gids % 7}" if rng.random() < 0.3 else f"u{self.gids}"  # some gids reused later
            if any(c["gid"] == gid for c in self.coordinators):
                return
        parts = rng.sample(self.two_pc, rng.randrange(1, len(self.two_pc) + 1))
        instance = len(self.instances)
        self.instances[instance] = []
        self.coordinators.append({"gid": gid, "parts": parts, "prepared": [], "decided": [], "instance": instance,
                                  "outcome": None})

    def _advance(self, c: dict[str, object]) -> None:
        rng = self.rng
        parts, prepared, decided = c["parts"], c["prepared"], c["decided"]
        assert isinstance(parts, list) and isinstance(prepared, list) and isinstance(decided, list)
        gid, instance = str(c["gid"]), int(c["instance"])  # type: ignore[call-overload]
        todo = [n for n in parts if n not in prepared]
        if todo and c["outcome"] is None:
            if rng.random() < 0.08:  # a PREPARE failed: roll back what was prepared
                c["outcome"] = ROLLBACK_PREPARED
                c["parts"] = parts = list(prepared)
            else:
                n = todo[0]
                changes = 0 if rng.random() < 0.1 else rng.randrange(1, 4)
                txn = Txn(n, 0, changes, gid, instance)
                self.nodes[n].write(rng, Event(PREPARE, 0, self.clock(n), gid, changes=changes))
                c.setdefault("txns", {})[n] = txn  # type: ignore[union-attr]
                prepared.append(n)
                return
        if c["outcome"] is None:
            c["outcome"] = COMMIT_PREPARED if rng.random() < 0.85 else ROLLBACK_PREPARED
        left = [n for n in parts if n not in decided]
        if not left:
            self.coordinators.remove(c)
            if c["outcome"] == ROLLBACK_PREPARED and rng.random() < 0.5:
                self._new_coordinator(gid)  # a transaction manager retries under the same gid
            return
        n = rng.choice(left)  # parts decided in any order, the coordinator stalling between them
        decided.append(n)
        txn = c["txns"][n]  # type: ignore[index]
        if c["outcome"] == COMMIT_PREPARED:
            txn.commit_time, txn.real, txn.visible = self.clock(n), self.now, self.now
            self.nodes[n].write(rng, Event(COMMIT_PREPARED, 0, txn.commit_time, gid), txn if txn.changes else None)
            if txn.changes:
                self.txns.append(txn)
                self.instances[instance].append(txn)
                self.visible[n].append(txn)
        else:
            self.nodes[n].write(rng, Event(ROLLBACK_PREPARED, 0, self.clock(n), gid))

    def finish(self) -> None:
        while self.delayed:
            self._write_commit(self.delayed.pop())
        guard = 0
        while self.coordinators:
            self._advance(self.coordinators[0])
            guard += 1
            assert guard < 10_000

    def scan(self, n: str, start: int, upto: int) -> tuple[Event, ...]:
        return tuple(e for s, e, _ in self.nodes[n].records if start <= s < upto and e.kind != "heartbeat")


def simulate(seed: int, limits: Limits, plans: int, join: str = "", skew: int = 0) -> None:
    """Plan a random workload batch by batch and check every delivery rule. With `join`, node c
    joins the feed at a random plan: its slot is made, coordinators may write to it from then on,
    and the feed reads it from its next plan (`join="late"`: one plan later, as a running query
    that planned on without it would: that is what lifecycle.add_node's marker prevents). With
    `skew`, the nodes' clocks are off by up to half of it each (and `limits` allows for it)."""
    rng = random.Random(seed)
    cluster = Cluster(rng, ("a", "b", "c"))
    cluster.offset = {n: rng.randrange(-skew // 2, skew // 2 + 1) for n in cluster.nodes}
    nodes = ["a", "b"] if join else list(cluster.nodes)
    if join:
        cluster.two_pc = ["a", "b"]
    joins_at = rng.randrange(1, plans) if join else -1
    start = {n: 0 for n in cluster.nodes}
    opened: dict[str, tuple[Part, ...]] = {n: () for n in cluster.nodes}
    before_join: set[int] = set()  # transactions of c before its slot: its snapshot has them
    theta_prev, batch = 0, 0

    def plan_once(final: bool) -> bool:
        nonlocal theta_prev, batch
        certain, clocks = {}, []
        for n in rng.sample(nodes, len(nodes)):  # readings one node after another, work going on
            if not final:
                for _ in range(rng.randrange(0, 3)):
                    cluster.step()
            cluster.tick()
            certain[n] = cluster.nodes[n].lsn
            clocks.append(cluster.clock(n))
        theta_read = max(clocks)
        frontier = {}
        for n in rng.sample(nodes, len(nodes)):
            if not final:
                for _ in range(rng.randrange(0, 6)):
                    cluster.step()
            cluster.tick()
            cluster.nodes[n].write(rng, Event("heartbeat", 0, cluster.clock(n)))
            frontier[n] = cluster.nodes[n].lsn
        bound = rng.choice((None, None, 400, 3000))
        while True:
            scans = {}
            for n in nodes:
                upto = frontier[n] if bound is None else min(frontier[n], start[n] + bound)
                scans[n] = NodeScan(start[n], certain[n], frontier[n], cluster.scan(n, start[n], upto),
                                    None if upto >= frontier[n] else upto, opened[n])
            p = dist.plan(scans, theta_prev, theta_read, limits)
            if p.delivers or not p.short:
                break
            bound = bound * 2  # the planner's I/O: scan further and plan again
        moved = p.moved(scans)
        assert p.theta_us >= theta_prev
        for n in nodes:
            end = p.ends[n]
            assert start[n] <= end
            for s, e, txn in cluster.nodes[n].records:
                if start[n] <= s < end and txn is not None:
                    assert txn.batch == -1, "delivered twice"
                    assert txn.commit_time <= p.theta_us, "a commit later than the cut time"
                    txn.batch = batch
            assert {x.commit for x in p.parts[n]} == {s for s, e, t in cluster.nodes[n].records
                                                   if start[n] <= s < end and e.kind == COMMIT_PREPARED and t}
            start[n], opened[n] = end, p.open[n]
        theta_prev = p.theta_us
        batch += 1
        return moved

    for i in range(plans):
        for _ in range(rng.randrange(0, 12)):
            cluster.step()
        if i == joins_at:
            start["c"] = cluster.nodes["c"].lsn  # its slot: no transaction prepared on c yet
            before_join.update(id(t) for t in cluster.txns if t.node == "c")
            cluster.two_pc.append("c")
            if join == "late":
                for _ in range(rng.randrange(0, 30)):  # coordinators write to c meanwhile
                    cluster.step()
                plan_once(final=False)
            nodes.append("c")
        plan_once(final=False)
    cluster.finish()
    for _ in range(200):
        if all(t.batch >= 0 for t in cluster.txns):
            break
        plan_once(final=True)
    lost = [t for t in cluster.txns if t.batch < 0 and id(t) not in before_join]
    assert not lost, f"never delivered: {lost[:3]}"
    for txns in cluster.instances.values():  # every committed part of a distributed transaction in one batch
        assert len({t.batch for t in txns}) <= 1, f"torn: {[(t.node, t.gid, t.batch) for t in txns]}"
    running: dict[int, int] = {}  # a transaction's place in its batch: the running max of its node's commit times
    for n in nodes:
        top = 0
        for _, e, txn in cluster.nodes[n].records:
            if txn is not None:
                top = max(top, txn.commit_time)
                running[id(txn)] = top
    for t in cluster.txns:  # causal order: a transaction comes after every one it read (more than the skew before)
        for d in t.deps:
            if not {id(d), id(t)} & before_join and t.real - d.visible > skew:
                assert (d.batch, running[id(d)]) < (t.batch, running[id(t)]), (d, t)


@settings(max_examples=250, deadline=None)
@given(st.integers(0, 2**32))
def test_every_transaction_once_distributed_ones_whole_causes_first(seed: int) -> None:
    simulate(seed, Limits(skew_us=0), plans=25)


@settings(max_examples=250, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([(300, 0), (2000, 0), (0, 3), (0, 20), (500, 5)]))
def test_the_same_under_read_limits(seed: int, limit: tuple[int, int]) -> None:
    simulate(seed, Limits(max_bytes=limit[0], max_changes=limit[1], skew_us=0), plans=25)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([(0, 0), (500, 0), (0, 5)]))
def test_the_same_with_a_node_that_joins_while_transactions_span_it(seed: int, limit: tuple[int, int]) -> None:
    simulate(seed, Limits(max_bytes=limit[0], max_changes=limit[1], skew_us=0), plans=25, join="now")


def test_a_query_that_planned_on_without_the_new_node_would_tear_a_transaction() -> None:
    def tears(seed: int) -> bool:
        try:
            simulate(seed, Limits(skew_us=0), plans=25, join="late")
        except AssertionError as e:
            return "torn" in str(e)
        return False

    assert any(tears(seed) for seed in range(300))  # the rule postgres/cut.py and lifecycle.add_node follow


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([(0, 0), (300, 0), (2000, 0)]))
def test_the_same_with_clocks_that_disagree(seed: int, limit: tuple[int, int]) -> None:
    skew = 200  # (ticks are 1-40)
    simulate(seed, Limits(max_bytes=limit[0], max_changes=limit[1], skew_us=skew), plans=25, skew=skew)
