"""A followed batch's one task (low-latency mode, core.followed): the slot followed for a while.

The planner (spark/source.py) gives a followed batch one `FollowPartition`: the node, where the
batch starts (the end of the last sub-window its sink recorded), and how long to follow. Its
read follows the slot with postgres.follow.Follower and yields each sub-window as it is cut,
its `P` row naming the sub-window's end as an offset to start from, then one push-through row
more than a batch's read does: the sub-window reaches the writer task at once rather than when
the next one is yielded (bench/README.md, spark_transit.py). The writer commits it there
(sinks.replica.writer); what the task did not cut when it ends is read by the next batch.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pyspark.sql.datasource import InputPartition

from changefeed import faults
from changefeed.core import barrier
from changefeed.core import change as ch
from changefeed.core.lsn import Lsn
from changefeed.core.offsets import Offset
from changefeed.errors import carried
from changefeed.postgres import slots
from changefeed.postgres.connect import connect, lost_connection
from changefeed.postgres.requests import SourceRequests
from changefeed.sinks.base import Recorded
from changefeed.sinks.registry import sink_of
from changefeed.spark.reads import push_through
from changefeed.spec.definition import SourceNode

# A sub-window lasts at least this long: each costs the writer a transaction of its own (its
# group commit folds only what waits already), and ending one at every commit received let the
# writer fall behind the reader at 10,000 changes/s (bench/README.md, latency.py --low-latency).
EVERY_S = 0.02
POLL_S = 1.0  # how often a followed batch's read asks how far its sink recorded the feed


class FollowPartition(InputPartition):
    """Follow node `node`'s slot from `start` (its `lsns` and `ts`) for `seconds`, or until the
    planner has work a followed batch does not do (`Wanted`)."""

    def __init__(self, node: SourceNode, start: Offset, seconds: float, rows_per_batch: int,
                 wanted: "Wanted | None" = None, sink: dict[str, str] | None = None) -> None:
        self.node, self.start, self.seconds, self.rows_per_batch = node, start, seconds, rows_per_batch
        self.wanted = wanted
        self.sink = sink  # the sink writer's options: the slot moves with what the sink recorded as it follows


@dataclass(frozen=True)
class Wanted:
    """What ends a followed batch before its time: a snapshot request of feed `feed` its query
    can take in (core.requests.Request.fits its `nodes` and `sinks`, as the planner asks), on
    the first node, or a verify's barrier in `barrier_file` (readable where the driver is: a
    task on another host misses it, and the verify tries again after the batch)."""

    feed: str
    nodes: frozenset[str]
    sinks: frozenset[str]
    barrier_file: str | None

    def asker(self, conn: Any, taken: int) -> Callable[[], bool]:
        requests = SourceRequests(lambda: conn, self.feed)

        def wanted() -> bool:
            if self.barrier_file and barrier.read(Path(self.barrier_file)) is not None:
                return True
            return any(r.fits(self.nodes, self.sinks) for r in requests.after(taken))
        return wanted


def read_followed(part: FollowPartition) -> Iterator[Any]:
    """The packed rows of a followed batch: sub-window after sub-window until its time is up."""
    from changefeed.postgres.follow import Follower  # numpy and Arrow: executors only (see spark/reads.py)

    node, role = part.node, "source"
    until = time.monotonic() + part.seconds
    at = part.start.lsns[node.name]

    def offset_at(lsn: int, ts: int) -> dict[str, Any]:
        return replace(part.start, lsns={node.name: Lsn(lsn)}, ts=ts).to_json()

    with carried("source"), ExitStack() as stack:
        conn = stack.enter_context(connect(node.uri, role))
        stack.enter_context(lost_connection(role))
        recorded = None
        if part.sink is not None:  # (a slot that moved only at batch ends would make each start decode it all)
            asked = sink_of(part.sink["uri"]).recorded(part.sink)
            if asked is not None:
                recorded = stack.enter_context(closing(Polled(asked, POLL_S)))
        slots.advance(conn, node.slot, at)  # (as a window's read: a slot behind `at` would re-send from there)
        follower = Follower(conn, node, role, at, part.start.ts, every=EVERY_S, offset_at=offset_at,
                            rows_per_batch=part.rows_per_batch, flush=EVERY_S)
        pushed = [*push_through(), push_through()[0]]
        asker = part.wanted.asker(conn, part.start.cursor.requests) if part.wanted else None
        for rb in follower.windows(until, asker, recorded):
            yield ch.pack(rb)
            yield from pushed
            faults.reach("read")


class Polled:
    """`ask()` asked by a thread of its own about every `every` s, so that an ask that takes a
    while (a Kafka progress read) never holds up the follower; calling it gives the last answer
    (0 before the first). A failed ask keeps the answer before: the slot then moves later, and
    the sink's writer meets the failure itself."""

    def __init__(self, ask: Recorded, every: float) -> None:
        self._ask, self._every, self._answer = ask, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="changefeed-recorded", daemon=True)
        self._thread.start()

    def __call__(self) -> int:
        return self._answer

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._answer = max(self._answer, self._ask())
                except Exception:  # noqa: BLE001 - an optimisation only: see the class doc
                    pass
                self._stop.wait(self._every)
        finally:
            self._ask.close()

    def close(self) -> None:
        """Stop asking; an ask under way ends on its own (the batch does not wait for it)."""
        self._stop.set()
