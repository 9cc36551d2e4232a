"""A feed's life on one runner: check, create what is missing, run the query, report status.

Everything that can fail on bad input is checked before anything is created or advanced.
"""
from __future__ import annotations

import fcntl
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from . import faults, retention
from .config import FeedSpec, FeedState
from .core.requests import SnapshotRequests
from .core.hlc import physical_ms
from .core.lsn import format_lsn
from .errors import ChangefeedError, ConfigError, FeedBusy, SinkError
from .postgres import source as src
from .postgres.connect import connect
from .sinks import postgres_replica as replica


@contextmanager
def state_lock(state: FeedState) -> Iterator[None]:
    """An exclusive lock on the feed's state folder for this process's lifetime."""
    state.dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FeedBusy(f"feed {state.dir.name} is already running: held by {_holder_of(fd)}",
                           "stop the other runner first, or use another --name or --state") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield
    finally:
        os.close(fd)


def _holder_of(fd: int) -> str:
    """What the runner holding the lock file wrote into it."""
    return os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"


def holder(state: FeedState) -> str | None:
    """Who runs the feed now (from the state folder's lock), None if nobody does."""
    if not state.lock_file.exists():
        return None
    fd = os.open(state.lock_file, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return _holder_of(fd)
    finally:
        os.close(fd)


def run_state(state: FeedState) -> str:
    """running (holder), paused, failed: reason (of the last run), or stopped."""
    who = holder(state)
    return f"running ({who})" if who else "paused" if state.paused else state.failure() or "stopped"


@dataclass
class Prepared:
    spec: FeedSpec
    state: FeedState
    source_conn: Any  # holds the feed's advisory lock while the feed runs
    sink_conn: Any


def prepare(spec: FeedSpec, state: FeedState, stack: ExitStack) -> Prepared:
    """Check everything, then create publication, slot and target tables if missing."""
    spec.validate()
    stack.enter_context(state_lock(state))
    source = stack.enter_context(connect(spec.source, "source"))
    src.check_wal_level(source)
    tables = src.describe_tables(source, list(spec.tables))
    src.lock_feed(source, spec.name)
    sink = stack.enter_context(connect(spec.sink, "sink"))
    slot = src.slot_state(source, spec.slot)
    if state.has_checkpoint() or slot is not None:
        src.check_slot_usable(slot, spec.slot, replica.checkpoint_lsn(sink, spec.name), spec.name)
    # -- nothing was created up to here --
    src.ensure_publication(source, spec.publication, tables)
    created = slot is None
    if created:
        src.create_slot(source, spec.slot)
    try:
        replica.ensure_meta(sink)
        replica.ensure_tables(sink, tables)
    except Exception:
        if created:  # leave nothing half-made behind: the next run starts clean
            source.execute("SELECT pg_drop_replication_slot(%s)", (spec.slot,))
        raise
    state.save(spec)
    return Prepared(spec, state, source, sink)


def add_tables(spec: FeedSpec, state: FeedState, tables: tuple[str, ...], *, snapshot: bool = True) -> FeedSpec:
    """Bring `tables` into the feed, running or not: target tables, publication, then a request
    for their existing rows (the stream carries their changes from the publication change on)."""
    new = tuple(t for t in tables if t not in spec.tables)
    if not new:
        raise ConfigError(f"feed {spec.name} already captures {', '.join(tables)}", "name tables it does not capture")
    grown = FeedSpec(**{**spec.__dict__, "tables": spec.tables + new}).validate()
    with connect(spec.source, "source") as source, connect(spec.sink, "sink") as sink:
        described = src.describe_tables(source, list(grown.tables))
        replica.ensure_meta(sink)
        replica.ensure_tables(sink, described[len(spec.tables):])  # before the publication: changes need a target
        src.ensure_publication(source, spec.publication, described)
    state.save(grown)
    if snapshot:
        SnapshotRequests(state.requests).add(new)
    return grown


def request_snapshot(spec: FeedSpec, state: FeedState, tables: tuple[str, ...]) -> int:
    """Ask the feed to read `tables`' existing rows again (while it keeps streaming)."""
    unknown = [t for t in tables if t not in spec.tables]
    if unknown:
        raise ConfigError(f"feed {spec.name} does not capture {', '.join(unknown)}",
                          "add them first with changefeed alter --add-tables")
    return SnapshotRequests(state.requests).add(tables)


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
    lag_seconds: float | None
    batches: int
    snapshot: dict[str, dict[str, int]]  # per table: chunks and rows applied

    def lines(self) -> list[str]:
        out = [f"{k.replace('_', ' ')}: {'-' if v is None else v}" for k, v in self.__dict__.items()
               if k != "snapshot"]
        return out + [f"snapshot {t}: {s['rows']:,} rows in {s['chunks']} chunks" for t, s in self.snapshot.items()]


def status(spec: FeedSpec, feed_state: FeedState) -> FeedStatus:
    with connect(spec.source, "source") as source, connect(spec.sink, "sink") as sink:
        slot = src.slot_state(source, spec.slot)
        current = src.flush_lsn(source)
        row = None
        if replica.has_meta(sink, "progress"):
            row = sink.execute(
                "SELECT end_lsn::text, commit_time::text, resolved_ts, end_lsn - '0/0'::pg_lsn, "
                "(SELECT count(*) FROM changefeed.progress WHERE feed = %s) "
                "FROM changefeed.progress WHERE feed = %s ORDER BY end_lsn DESC LIMIT 1",
                (spec.name, spec.name)).fetchone()
        snapshot = {t: {"chunks": c, "rows": r} for t, (c, r) in replica.snapshot_totals(sink, spec.name).items()}
    if slot is None:
        state = "missing"
    elif slot.wal_status == "lost" or slot.invalidation:
        state = f"invalidated ({slot.invalidation or 'WAL removed'})"
    else:
        state = f"{'active' if slot.active_pid else 'inactive'}, wal {slot.wal_status}, " \
                f"confirmed {format_lsn(slot.confirmed_flush or 0)}"
    lag_bytes = lag_s = None
    if row:
        applied = int(row[3])
        lag_bytes = max(0, current[0] - applied)
        lag_s = 0.0 if lag_bytes == 0 else max(0.0, (current[1] - physical_ms(int(row[2]))) / 1000)
    elif slot and slot.confirmed_flush:
        lag_bytes = max(0, current[0] - slot.confirmed_flush)
    retained = max(0, current[0] - slot.restart_lsn) if slot and slot.restart_lsn else None
    return FeedStatus(spec.name, run_state(feed_state), spec.slot, state, retained, row[0] if row else None,
                      row[1] if row else None, lag_bytes, lag_s, int(row[4]) if row else 0, snapshot)


def run(spec: FeedSpec, state: FeedState, *, available_now: bool = False, master: str = "local[*]",
        report: Callable[[str], None] = print, report_every_s: float = 2.0,
        stop_event: threading.Event | None = None, handle_signals: bool = True) -> None:
    """Run the feed until SIGINT/SIGTERM (or `stop_event`), or until caught up with `available_now`."""
    from .spark.job import spark_session, start_query

    stop = stop_event or threading.Event()
    if state.paused:
        raise ConfigError(f"feed {spec.name} is paused", "resume it with changefeed resume --name NAME")
    with ExitStack() as stack:
        try:
            prepared = prepare(spec, state, stack)
        except FeedBusy:
            raise  # about this runner, not the feed
        except ChangefeedError as e:
            state.record_failure(e)  # only if the state folder exists: bad input leaves none
            raise
        state.failed_file.unlink(missing_ok=True)
        _check_retention(prepared, report)
        faults.mark_feed_group()
        faults.reach("startup")
        if handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
        spark = spark_session(master)
        query = start_query(spark, spec, state, available_now=available_now)
        report(f"feed {spec.name}: running ({'until caught up' if available_now else 'until stopped'}), "
               f"checkpoint in {state.checkpoint}")
        meter = _Meter(report, lambda: replica.totals(prepared.sink_conn, spec.name),
                       _SnapshotMeter(report, prepared.source_conn, prepared.sink_conn, spec.name))
        try:
            while query.isActive and not stop.is_set():
                query.awaitTermination(report_every_s)
                meter.update(query)
                if spec.snapshot == "only" and _snapshot_done(query):
                    report(f"feed {spec.name}: snapshot complete (--snapshot only)")
                    break
                _check_retention(prepared, report)
                if state.paused:
                    report(f"feed {spec.name}: paused; its slot keeps the WAL until changefeed resume")
                    break
            if query.exception() is not None:
                _check_retention(prepared, report)  # a lost slot fails the reads: name it properly
                error = _query_error(query.exception())
                state.record_failure(error)
                raise error
            _release_wal(prepared, query)
        finally:
            if query.isActive:
                report(f"feed {spec.name}: stopping")
                query.stop()
            meter.update(query)
        report(f"feed {spec.name}: stopped cleanly after {meter.changes} changes in {meter.batches} batches")


def _check_retention(prepared: Prepared, report: Callable[[str], None]) -> None:
    """Stop (typed error, recorded) when PostgreSQL invalidated the slot or past the retention
    budget; warn near the budget."""
    spec = prepared.spec
    slot = src.slot_state(prepared.source_conn, spec.slot)
    try:
        src.check_slot_usable(slot, spec.slot, replica.checkpoint_lsn(prepared.sink_conn, spec.name), spec.name)
        assert slot is not None
        if slot.restart_lsn is None:
            return
        current, now_ms = src.flush_lsn(prepared.source_conn)
        resolved = replica.last_resolved_ts(prepared.sink_conn, spec.name)
        held = retention.Holding(spec.slot, slot.restart_lsn, max(0, current - slot.restart_lsn),
                                 None if resolved is None else max(0.0, (now_ms - physical_ms(resolved)) / 1000))
        warning = retention.check(held, spec.name, spec.retention_s, spec.max_retained_wal)
    except ChangefeedError as e:
        prepared.state.record_failure(e)
        raise
    if warning:
        report(warning)


def _end_offset(progress: dict[str, Any] | None) -> dict[str, Any]:
    """The end offset of a progress report's (only) source, as a dict."""
    import json

    end = ((progress or {}).get("sources") or [{}])[0].get("endOffset") or {}
    return json.loads(end) if isinstance(end, str) else end  # type: ignore[no-any-return]


def _snapshot_done(query: Any) -> bool:
    """The last completed batch left no table to snapshot."""
    end = _end_offset(query.lastProgress)
    return bool(end) and not (end.get("snap") or {}).get("pending")


def _release_wal(prepared: Prepared, query: Any) -> None:
    """Advance the slot past the last batch the sink committed.

    Spark commits a batch to the source only when it plans the next one, so without this the slot
    would hold one batch of WAL more than needed after an AvailableNow run or a stop.
    """
    for p in reversed(query.recentProgress):
        end = _end_offset(p)
        if end:
            src.advance(prepared.source_conn, prepared.spec.slot, int(end["lsn"]))
            return


def _query_error(exc: Any) -> ChangefeedError:
    """Re-raise a query failure as the typed error it carries, if any."""
    text = str(exc)
    import re

    from . import errors

    for name in ("SlotLost", "SinkError", "SourceNotReady", "ConnectionFailed", "AuthenticationFailed",
                 "TransientError", "FeedBusy", "ConfigError"):
        m = re.search(rf"changefeed\.errors\.{name}: (.*)", text)
        if m:
            return getattr(errors, name)(m.group(1).strip())  # type: ignore[no-any-return]
    return SinkError(f"the streaming query failed: {text.splitlines()[0] if text else exc!r}",
                     "see the log above; the feed resumes from its checkpoint when run again")


class _Meter:
    """One human line every few seconds: what the sink recorded since start, and Spark's last batch.

    Changes are counted at the sink: Spark's row counts are packed chunks, not changes.
    """

    def __init__(self, report: Callable[[str], None], totals: Callable[[], tuple[int, int]],
                 snapshot: "_SnapshotMeter | None" = None) -> None:
        self.report, self.totals, self.snapshot = report, totals, snapshot
        self._base = totals()
        self.batches = self.changes = 0
        self._t0 = time.monotonic()

    def update(self, query: Any) -> None:
        batches, changes = self.totals()
        self.batches, self.changes = batches - self._base[0], changes - self._base[1]
        last = query.lastProgress
        if not last:
            return
        dur = last.get("durationMs", {}).get("triggerExecution", 0) / 1000
        end = _end_offset(last)
        lag = ""
        if end.get("ts"):
            lag = f", resolved lag {max(0.0, time.time() - physical_ms(int(end['ts'])) / 1000):.1f}s"
        elapsed = time.monotonic() - self._t0
        self.report(f"  {self.changes} changes in {self.batches} batches, "
                    f"{self.changes / max(elapsed, 1e-9):,.0f} changes/s overall, last batch {dur:.2f}s{lag}")
        if self.snapshot is not None:
            self.snapshot.update(tuple((end.get("snap") or {}).get("pending", ())))


class _SnapshotMeter:
    """Per table being snapshotted: rows applied of the estimated total, rate and ETA."""

    def __init__(self, report: Callable[[str], None], source: Any, sink: Any, feed: str) -> None:
        self.report, self.source, self.sink, self.feed = report, source, sink, feed
        self._seen: dict[str, tuple[float, int]] = {}  # table -> (when first seen pending, rows then)
        self._last: dict[str, int] = {}  # rows applied per table at the last report

    def update(self, pending: tuple[str, ...]) -> None:
        from .postgres.snapshot import estimated_rows

        applied = {t: rows for t, (_, rows) in replica.snapshot_totals(self.sink, self.feed).items()}
        moved = {t for t, rows in applied.items() if rows != self._last.get(t)}
        for table in sorted(set(pending) | moved):
            rows = applied.get(table, 0)
            if table not in pending:
                self.report(f"  snapshot {table}: done, {rows:,} rows")
                self._seen.pop(table, None)
                continue
            t0, rows0 = self._seen.setdefault(table, (time.monotonic(), self._last.get(table, 0)))
            rate = (rows - rows0) / max(time.monotonic() - t0, 1e-9)
            total = estimated_rows(self.source, table)
            line = f"  snapshot {table}: {rows:,} rows"
            if total:
                line += f" of ~{total:,} ({min(rows / total, 1):.0%})"
            line += f", {rate:,.0f} rows/s"
            if total and rate > 0:
                line += f", ETA {max(total - rows, 0) / rate:.0f}s"
            self.report(line)
        self._last = applied
