"""A batch's cut over the nodes of a feed of several nodes: what the planner asks the servers.

core.distributed decides the windows from what this module gathers on every node: a `certain`
flushed position with the server's clock read right after it (theta, the batch's cut time, is
the latest of those clocks), the heartbeats that end the windows (written after), and a scan of
the node's prepare slot (postgres/twophase.py) from its window's start. On a node far behind,
the scan stops `bound` bytes past the start, and goes further when the plan cannot move without
it, so a plan costs about a window per node, not the whole backlog.

While a plan waits for prepared parts to be decided, `waiting` asks the servers only whether they
still are (pg_prepared_xacts): a feed kept waiting by a transaction in doubt costs one small
query per node and poll, no heartbeat, no scan and no batch.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from changefeed.core import distributed as dist
from changefeed.core.lsn import Lsn
from changefeed.core.offsets import Offset
from changefeed.errors import TornTransaction, TransactionInDoubt
from changefeed.postgres import source as src
from changefeed.postgres import twophase
from changefeed.spec.definition import SourceNode

On = Callable[[str], AbstractContextManager[Any]]


class Cut:
    """Plans the windows of a feed of several nodes, batch after batch (one per query)."""

    def __init__(self, nodes: Mapping[str, SourceNode], conn: Callable[[str], Any], on: On, limits: dist.Limits,
                 bound: int | None) -> None:
        self.nodes, self.conn, self.on, self.limits, self.bound = nodes, conn, on, limits, bound
        self._blockers: dict[str, set[str]] = {}  # node -> gids still prepared there that the last plan waited for

    def certain(self) -> tuple[dict[str, Lsn], int]:
        """Per node its flushed position, and the latest clock read right after one (theta)."""
        certain, clocks = {}, []
        for name in self.nodes:
            with self.on(name):
                certain[name], clock = src.flush_point(self.conn(name))
            clocks.append(clock)
        return certain, max(clocks)

    def waiting(self) -> bool:
        """Whether the last plan could not move for parts that are all still prepared."""
        if not self._blockers:
            return False
        for name, gids in self._blockers.items():
            with self.on(name):
                if twophase.still_prepared(self.conn(name), sorted(gids)) != gids:
                    self._blockers = {}
                    return False
        return True

    def plan(self, start: Offset, certain: Mapping[str, int], theta_read: int, frontiers: Mapping[str, int],
             caps: Mapping[str, int] | None = None) -> tuple[dist.Plan, dict[str, dist.NodeScan]]:
        """The batch's plan from `start` (scanning further while it delivers nothing and a scan was
        cut short)."""
        bounds = {n: self.bound for n in self.nodes}
        scans: dict[str, dist.NodeScan] = {}
        todo = set(self.nodes)
        while True:
            for n in todo:
                scans[n] = self._scan(n, start, certain[n], frontiers[n], bounds[n], (caps or {}).get(n))
            try:
                plan = dist.plan(scans, start.theta, theta_read, self.limits)
            except dist.DistributedError as e:
                raise TornTransaction(f"the two-phase records of the feed's nodes contradict each other: {e}",
                                      "nothing more is delivered; check the nodes' prepared transactions "
                                      "(pg_prepared_xacts) and report it") from None
            if plan.delivers or not plan.short:
                break
            todo = set(plan.short)  # (a short scan has a bound)
            for n in todo:
                bounds[n] = 4 * (bounds[n] or 0)
        self._blockers = {}
        return plan, scans

    def wait(self, plan: dist.Plan) -> None:
        """No batch from `plan`: until one of the prepared parts it waited for is decided, `waiting`
        says so without planning again."""
        self._blockers = self._undecided(plan)

    def _scan(self, name: str, start: Offset, certain: int, frontier: int, bound: int | None,
              cap: int | None) -> dist.NodeScan:
        at = start.lsns.get(name, 0)
        upto = frontier if bound is None else min(frontier, at + bound)
        node = self.nodes[name]
        with self.on(name):
            events = twophase.scan(self.conn(name), node.prepare_slot, node.publication, at, upto) if upto > at else ()
        return dist.NodeScan(at, certain, frontier, events, None if upto >= frontier else upto,
                             start.open.get(name, ()), cap)

    def _undecided(self, plan: dist.Plan) -> dict[str, set[str]]:
        """Per node, the gids the plan waited for whose parts there are still prepared."""
        waited = {g for gids in plan.waits.values() for g in gids}
        out: dict[str, set[str]] = {}
        for name, parts in plan.open.items():
            gids = {p.gid for p in parts if p.changes and p.gid in waited}
            with self.on(name):
                still = twophase.still_prepared(self.conn(name), sorted(gids)) if gids else set()
            if still:
                out[name] = still
        return out

    def in_doubt(self, plan: dist.Plan) -> TransactionInDoubt:
        """What an `--available-now` run says when it cannot finish: the transactions it waits for."""
        committed = {g: n for n, gids in plan.waits.items() for g in gids}
        prepared = {g: n for n, gids in self._blockers.items() for g in gids}
        about = "; ".join(f"{g!r} committed on node {committed[g]}" +
                          (f", still prepared on node {prepared[g]}" if g in prepared else "")
                          for g in sorted(committed)[:5])
        return TransactionInDoubt(
            f"changes committed before this run started wait for distributed transaction(s) in doubt: {about}",
            "commit or roll back the prepared transaction(s) on their nodes (pg_prepared_xacts); the run goes on "
            "once they are decided (bound the wait with --give-up-after)")

