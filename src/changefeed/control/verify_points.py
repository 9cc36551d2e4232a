"""Where `changefeed verify` compares: one point both sides are held at, running feed or not.

On each node a snapshot exported at a WAL position X (postgres/consistent_point.py). The sink has
to be at exactly X too:

* **A running feed** is stopped there for a moment: a barrier (core.barrier) makes it end a batch
  at X and wait; once the replica's ledger says X, a read-only transaction on the replica exports
  its snapshot (a Kafka sink: each table topic's high watermarks are noted) and the barrier goes.
* **A feed that is not running** (stopped, killed, paused or failed) is held by verify the way a
  runner holds it (the state folder's lock, then each node's advisory lock), so that no `run`
  starts meanwhile. When no change of a captured table was committed past its checkpoint (the
  probe `status` uses), the sink already holds what the source holds at X. Otherwise verify runs
  the feed itself, as `--available-now` would, first to catch up, then up to the barrier at X;
  a paused feed is not moved: verify says how far behind it is and how to go on.

Both snapshots then stay open while the tables are compared; `Point.sink_at` is where the sink's
ledger stood when its side was taken (what a repair checks before it writes).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg

from changefeed.control.runner_lock import VERIFY, holder, state_lock
from changefeed.core import barrier as bar
from changefeed.core.lsn import format_lsn
from changefeed.errors import DefiniteError, FeedBusy, TransientError
from changefeed.postgres import checksum as cs
from changefeed.postgres import consistent_point
from changefeed.postgres import source as src
from changefeed.postgres.connect import connect, lost_connection, one_row
from changefeed.postgres.requests import on_source
from changefeed.sinks.base import ledger_path
from changefeed.sinks.ledger import FileLedger
from changefeed.sinks.registry import open_ledger, sink_of
from changefeed.sinks.replica.ledger import META_SCHEMA, ReplicaLedger, has_meta
from changefeed.spec.definition import FeedSpec, node_role
from changefeed.spec.state import FeedState

ATTEMPTS = 5  # points met in a row that the feed had already passed (or could not reach)
STALL_S = 10.0


class VerifyError(DefiniteError):
    """A verification that cannot be done as asked."""


@dataclass
class Point:
    """Both sides held at one position: each node's exported snapshot, and the replica's (or, for
    Kafka, each table topic's partitions' high watermarks then)."""

    lsns: dict[str, int]
    sources: dict[str, consistent_point.ConsistentPoint]
    sink_conn: psycopg.Connection[Any] | None
    sink_snapshot: str = ""
    marks: dict[str, dict[int, int]] = field(default_factory=dict)
    sink_at: dict[str, int] = field(default_factory=dict)  # the sink's checkpoint then (`lsns` if it met them)
    locks: list[Any] = field(default_factory=list)  # connections holding a stopped feed's advisory locks

    def close(self) -> None:
        for p in self.sources.values():
            p.close()
        for conn in [self.sink_conn, *self.locks]:
            if conn is not None:
                conn.close()


@dataclass
class Held:
    """How verify reaches the feed: `stopped` when verify holds it (runs it itself if need be);
    `sink`, the feed as the sink verified sees it (FeedSpec.for_sink), where it has several."""

    spec: FeedSpec
    state: FeedState
    stopped: bool
    master: str = "local[*]"
    report: Callable[[str], None] = print
    sink: FeedSpec | None = None

    @property
    def view(self) -> FeedSpec:
        return self.sink or self.spec

    def meet(self, wait_s: float, *, hold: bool = False, tables: Sequence[str] = ()) -> Point:
        return (_meet_stopped(self, wait_s, tables) if self.stopped
                else _meet(self.view, self.state, wait_s, hold=hold, report=self.report, tables=tables))


@contextmanager
def held(spec: FeedSpec, state: FeedState, master: str, report: Callable[[str], None],
         sink: FeedSpec | None = None) -> Iterator[Held]:
    """The feed as verify works with it: a running one as it runs, one that is not running held by
    verify (no runner may start until verify ends)."""
    if holder(state) is not None:
        yield Held(spec, state, False, master, report, sink)
        return
    with ExitStack() as stack:
        try:
            stack.enter_context(state_lock(state, by=VERIFY))
        except FeedBusy:  # a runner started just now: verify it as it runs
            yield Held(spec, state, False, master, report, sink)
            return
        yield Held(spec, state, True, master, report, sink)


def _meet(spec: FeedSpec, state: FeedState, wait_s: float, *, hold: bool, report: Callable[[str], None],
          tables: Sequence[str] = ()) -> Point:
    """A running feed's point: export a snapshot on each node at a position X, have the feed's
    sink reach exactly X and take the sink's side there. With `hold` the barrier stays (the caller
    removes it)."""
    for _ in range(ATTEMPTS):
        with ExitStack() as undo:
            sources = _take_points(spec, undo)
            lsns = {n: p.lsn for n, p in sources.items()}
            bar.write(state.barrier_file, bar.Barrier(lsns, time.time() + wait_s + 60))
            undo.callback(bar.remove, state.barrier_file)
            position = _position_reader(spec, state, undo)
            if not _reached(spec, state, position, lsns, wait_s):
                report(f"verify: the feed passed {where(lsns)} or cannot reach it; taking a new point")
                continue
            point = _sink_side(spec, state, lsns, sources, tables, undo)
            if point is None:
                continue  # moved on, or a snapshot chunk read later: not a consistent cut at X
            undo.pop_all()  # the point's connections stay open, and with `hold` the barrier
            if not hold:
                bar.remove(state.barrier_file)
            return point
    raise TransientError(f"feed {spec.name} moved past {ATTEMPTS} verification points in a row",
                         "verify again; if it keeps happening, see status for what the feed does")


def _meet_stopped(held: Held, wait_s: float, tables: Sequence[str]) -> Point:
    """A stopped feed's point (see the module doc)."""
    from changefeed.spark.checkpoint import chunks_to_read

    spec, state, view = held.spec, held.state, held.view
    for attempt in range(ATTEMPTS):
        with on_source(spec, state) as requests:
            reading = chunks_to_read(spec, state, requests)
        if reading or _behind(spec, state):
            _catch_up(held, "catching up first (as --available-now would)")
        with ExitStack() as undo:
            locks = [_advisory_lock(spec, node, undo) for node in spec.sources]
            sources = _take_points(spec, undo)
            lsns = {n: p.lsn for n, p in sources.items()}
            at = _checkpoint(view, state) or {}
            if not _behind(spec, state, locks):  # (nothing past the checkpoint: a chunk read later read the same)
                point = _sink_side(view, state, at, sources, tables, undo, chunks_read_later=True)
                if point is not None:
                    point.lsns, point.locks = lsns, [conn for _, conn in locks]
                    undo.pop_all()
                    return point
                continue
            for _, conn in locks:  # the run takes the nodes' locks itself
                conn.close()
            bar.write(state.barrier_file, bar.Barrier(lsns, time.time() + wait_s + 60))
            undo.callback(bar.remove, state.barrier_file)
            _catch_up(held, f"running it up to {where(lsns)}")
            if _checkpoint(view, state) != lsns:
                held.report(f"verify: the feed stopped short of {where(lsns)}; taking a new point")
                continue
            point = _sink_side(view, state, lsns, sources, tables, undo)
            if point is not None:
                undo.pop_all()
                bar.remove(state.barrier_file)
                return point
    raise TransientError(f"feed {spec.name} could not be brought to a verification point in {ATTEMPTS} attempts",
                         "verify again; if it keeps happening, see status for what the feed does")


def _catch_up(held: Held, what: str) -> None:
    """Run the stopped feed (in this process, under verify's lock) until it stops by itself."""
    from changefeed.control.runner import run

    spec, state = held.spec, held.state
    if state.paused:
        raise VerifyError(f"feed {spec.name} is paused, and its source has changes past its checkpoint "
                          f"({_lag_text(spec, state)}): verify does not move a paused feed",
                          f"changefeed resume --name {spec.name}, or run it once with --available-now, "
                          "then verify again")
    held.report(f"verify: feed {spec.name} is not running: {what}")
    run(spec, state, available_now=True, master=held.master, report=held.report, handle_signals=False,
        locked=True)


def _behind(spec: FeedSpec, state: FeedState, locks: list[tuple[str, Any]] | None = None) -> bool:
    """Whether some node's slot holds a change of a captured table committed past the sink's
    checkpoint (or that cannot be told quickly)."""
    at = _checkpoint(spec, state)
    if at is None:
        return True
    conns = dict(locks or [])
    with ExitStack() as stack:
        for node in spec.sources:
            role = node_role(node.name, spec.multi_node)
            conn = conns.get(node.name) or stack.enter_context(connect(node.uri, role))
            with lost_connection(role):
                if src.captured_change_after(conn, node.slot, node.publication, at.get(node.name, 0)) is not False:
                    return True
    return False


def _lag_text(spec: FeedSpec, state: FeedState) -> str:
    at = _checkpoint(spec, state) or {}
    parts = []
    for node in spec.sources:
        role = node_role(node.name, spec.multi_node)
        with connect(node.uri, role) as conn, lost_connection(role):
            current = src.flush_lsn(conn)[0]
        behind = max(0, current - at.get(node.name, 0))
        parts.append(f"{role} {behind:,} bytes of WAL past {format_lsn(at.get(node.name, 0))}")
    return "; ".join(parts)


def _advisory_lock(spec: FeedSpec, node: Any, undo: ExitStack) -> tuple[str, Any]:
    """A connection holding the feed's advisory lock on `node` (as a runner's does)."""
    role = node_role(node.name, spec.multi_node)
    conn = undo.enter_context(connect(node.uri, role))
    with lost_connection(role):
        src.lock_feed(conn, spec.name, by="changefeed verify")
    return node.name, conn


def _take_points(spec: FeedSpec, undo: ExitStack) -> dict[str, consistent_point.ConsistentPoint]:
    sources: dict[str, consistent_point.ConsistentPoint] = {}

    def close_all() -> None:
        for p in sources.values():
            p.close()

    undo.callback(close_all)
    for node in spec.sources:
        sources[node.name] = consistent_point.take(node.uri, node_role(node.name, spec.multi_node))
    return sources


def _checkpoint(spec: FeedSpec, state: FeedState) -> dict[str, int] | None:
    with lost_connection("sink"):
        ledger = open_ledger(spec, state)
        try:
            return ledger.checkpoint()
        finally:
            ledger.close()


def _position_reader(spec: FeedSpec, state: FeedState, undo: ExitStack) -> Callable[[], dict[str, int] | None]:
    if sink_of(spec.sink).name == "kafka":
        return FileLedger(ledger_path(spec, state)).checkpoint
    sink = undo.enter_context(connect(spec.sink, "sink"))
    return lambda: _position(sink, spec.key)


def _sink_side(spec: FeedSpec, state: FeedState, at: dict[str, int], sources: dict[str, Any],
               tables: Sequence[str], undo: ExitStack, chunks_read_later: bool = False) -> Point | None:
    """The sink's side of the point while its ledger says `at`; None if it moved meanwhile or a
    snapshot chunk was read past it (the replica is no consistent cut there), unless
    `chunks_read_later` may be ignored."""
    if sink_of(spec.sink).name == "kafka":
        from changefeed.control.verify_messages import high_marks_of

        ledger = FileLedger(ledger_path(spec, state))
        marks = high_marks_of(spec, tables)
        return Point(dict(at), sources, None, marks=marks, sink_at=dict(at)) if ledger.checkpoint() == at else None
    sink = undo.enter_context(connect(spec.sink, "sink"))
    with lost_connection("sink"):
        cs.session(sink)
        sink.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        if (_position(sink, spec.key) or {}) != at or not chunks_read_later and _chunk_read_past(sink, spec.key, at):
            return None
        snapshot = one_row(sink.execute("SELECT pg_export_snapshot()"))[0]
    return Point(dict(at), sources, sink, snapshot, sink_at=dict(at))


def where(lsns: dict[str, int]) -> str:
    return ", ".join(f"{n} {format_lsn(x)}" for n, x in sorted(lsns.items()))


def _position(conn: psycopg.Connection[Any], feed: str) -> dict[str, int] | None:
    return ReplicaLedger(conn, feed).checkpoint()


def position(conn: psycopg.Connection[Any], feed: str) -> dict[str, int] | None:
    """The replica's checkpoint on `conn`."""
    return _position(conn, feed)


def _chunk_read_past(conn: psycopg.Connection[Any], feed: str, lsns: dict[str, int]) -> bool:
    if not has_meta(conn, "snapshot_chunks"):
        return False
    row = conn.execute(f"SELECT max(read_lsn) - '0/0'::pg_lsn FROM {META_SCHEMA}.snapshot_chunks WHERE feed = %s",
                       (feed,)).fetchone()
    return row is not None and row[0] is not None and len(lsns) == 1 and int(row[0]) > max(lsns.values())


def _reached(spec: FeedSpec, state: FeedState, position: Callable[[], dict[str, int] | None],
             lsns: dict[str, int], wait_s: float) -> bool:
    """Wait until the sink is at `lsns` (True) or past one of them (False). On a feed of several
    nodes, a point can split a distributed transaction (committed on one node before its position,
    on another after it): the feed cannot deliver it whole before the point, so it stops short of
    it; a sink that stays short for STALL_S gives False too (a new point is taken)."""
    deadline = time.monotonic() + wait_s
    seen, since = None, time.monotonic()
    while True:
        with lost_connection("sink"):
            at = position() or {}
        if any(at.get(n, 0) > x for n, x in lsns.items()):
            return False
        if all(at.get(n, 0) == x for n, x in lsns.items()):
            return True
        if at != seen:
            seen, since = at, time.monotonic()
        elif spec.multi_node and time.monotonic() - since > STALL_S and any(at.get(n) == x for n, x in lsns.items()):
            return False
        if holder(state) is None:
            raise VerifyError(f"feed {spec.name} stopped while verify waited for it to reach {where(lsns)}",
                              "start it again and verify again")
        if time.monotonic() > deadline:
            raise TransientError(f"feed {spec.name} did not reach {where(lsns)} within {wait_s:.0f}s (the replica "
                                 f"is at {where(at) or 'nothing yet'})",
                                 "see changefeed status: the feed may be retrying a fault or far behind")
        time.sleep(0.1)
