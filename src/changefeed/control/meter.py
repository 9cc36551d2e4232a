"""What a running feed tells while it runs: a progress line every few seconds, per-table
snapshot progress, and the gauges of its metrics endpoint."""
from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack, suppress
from typing import TYPE_CHECKING, Any

import psycopg

from changefeed.control.lag_budget import Lag
from changefeed.control.metrics import FeedMetrics, NodeValues, SinkValues, TableSnapshot
from changefeed.control.metrics import serve as serve_metrics
from changefeed.control.retry import read_note
from changefeed.control.status import checkpoint_lag_s, counted, resolved_lag_s, retained_bytes
from changefeed.core.hlc import physical_ms
from changefeed.core.offsets import Offset
from changefeed.postgres import slots, twophase
from changefeed.postgres import source as src
from changefeed.sinks.ledgers import SinkLedgers
from changefeed.spec.state import FeedState

if TYPE_CHECKING:
    from changefeed.control.attach import Prepared
    from changefeed.sinks.ledger import Ledger


class Meter:
    """One human line every few seconds: what the sink recorded since start, and Spark's last batch.

    Changes are counted at the sink: Spark's row counts are packed chunks, not changes.
    """

    def __init__(self, report: Callable[[str], None], ledger: "Ledger",
                 snapshot: "SnapshotMeter | None" = None, gauges: "Gauges | None" = None) -> None:
        self.report, self.ledger, self.snapshot, self.gauges = report, ledger, snapshot, gauges
        self._base = ledger.totals()
        self.batches = self.changes = 0
        self._t0 = time.monotonic()
        self._previous = (0, self._t0)  # changes and time at the last update: the interval's rate
        self._shown: tuple[int, int] | None = None  # (batches, changes) of the last line reported

    def line(self, batch_s: float | None, resolved_ts: int | None, elapsed: float) -> str:
        """Since this runner started: changes and batches the sink recorded, their rate; Spark's
        time for the last batch (planning to commit), and how old the last resolved timestamp is."""
        lag = "" if resolved_ts is None else \
            f", resolved lag {max(0.0, time.time() - physical_ms(resolved_ts) / 1000):.1f}s"
        took = "" if batch_s is None else f", last batch took {batch_s:.2f}s"
        return (f"  {counted(self.changes, 'change')} in {counted(self.batches, 'batch')} since start, "
                f"{self.changes / max(elapsed, 1e-9):,.0f} changes/s{took}{lag}")

    def update(self, query: Any) -> None:
        batches, changes = self.ledger.totals()
        self.batches, self.changes = batches - self._base[0], changes - self._base[1]
        now = time.monotonic()
        rate = (self.changes - self._previous[0]) / max(now - self._previous[1], 1e-9)
        self._previous = (self.changes, now)
        last = query.lastProgress
        dur = last.get("durationMs", {}).get("triggerExecution", 0) / 1000 if last else None
        end = end_offset(last)
        pending = end.cursor.pending if end else ()
        if self.gauges is not None:
            self.gauges.update(query, pending, changes_total=self.changes, batches_total=self.batches,
                               changes_per_second=rate, batch_duration_seconds=dur)
        if not last:
            return
        if (self.batches, self.changes) != self._shown:  # a line only when something was delivered
            self._shown = (self.batches, self.changes)
            # (the sink's last resolved ts is ahead of Spark's last batch while a batch in
            # low-latency mode commits sub-windows, core.followed)
            known = [ts for ts in (end.ts if end else None, self.ledger.last_resolved_ts()) if ts]
            self.report(self.line(dur, max(known) if known else None, now - self._t0))
        if self.snapshot is not None:
            self.snapshot.update(pending)


def start_metrics(stack: ExitStack, feed: str, host: str, port: int | None,
                  report: Callable[[str], None]) -> FeedMetrics | None:
    """Serve the feed's metrics until `stack` closes. Called before prepare: a port that is taken
    fails the run before anything is created."""
    if port is None:
        return None
    metrics = FeedMetrics(feed)
    server = serve_metrics(metrics, host, port)
    stack.callback(server.close)
    report(f"feed {feed}: metrics on {server.url}")
    return metrics


class Gauges:
    """Fills the metrics endpoint at every report: the meter's numbers, lags by status()'s
    definitions, retained WAL, snapshot progress and the run's state."""

    def __init__(self, metrics: FeedMetrics, prepared: Prepared) -> None:
        self.metrics, self.prepared = metrics, prepared

    def update(self, query: Any, pending: tuple[str, ...], **meter: Any) -> None:
        """A meter value that is None (no batch done since a query (re)start) keeps the last one."""
        state, reason, component = _phase(self.prepared.state, query)
        self.metrics.update(state=state, reason=reason, component=component,
                            **{k: v for k, v in meter.items() if v is not None})
        with suppress(psycopg.Error):  # a server gone away must not mask why the feed stops
            self.metrics.update(**self._read(pending))

    def _read(self, pending: tuple[str, ...]) -> dict[str, Any]:
        spec, ledger = self.prepared.spec, self.prepared.ledger
        resolved, checkpoint = ledger.last_resolved_ts(), ledger.checkpoint() or {}
        retained: list[int] = []
        lags: list[float] = []
        nodes = {}
        for node in spec.sources:  # a feed of several nodes: WAL held on all of them, the worst lag
            source = self.prepared.sources[node.name]
            current, now_ms = src.flush_lsn(source)
            slot = slots.slot_state(source, node.slot)
            retained.append(retained_bytes(slot, current) or 0)
            position = checkpoint.get(node.name, 0)
            lag = checkpoint_lag_s(current, now_ms, position, resolved) if resolved is not None else 0.0
            if resolved is not None:
                lags.append(lag)
            if spec.multi_node:
                nodes[node.name] = NodeValues(position, max(0, current - position) if position else 0, lag,
                                              retained[-1], bool(slot and slot.active_pid),
                                              len(twophase.waiting(source)))
        out: dict[str, Any] = {"slot_retained_wal_bytes": sum(retained), "nodes": nodes}
        if resolved is not None:
            out["checkpoint_lag_seconds"] = max(lags)
            out["resolved_lag_seconds"] = resolved_lag_s(now_ms, resolved)
        verified = self.prepared.state.last_verified()
        if verified is not None:
            out["verify_mismatched_rows"] = int(verified["mismatched_rows"])
            out["verify_last_timestamp_seconds"] = float(verified["at"])
        if isinstance(ledger, SinkLedgers):
            out["sinks"] = self._sinks(ledger, current, now_ms)
        applied = ledger.snapshot_totals()
        out["snapshot"] = {t: TableSnapshot(*applied.get(t, (0, 0)), pending=t in pending)
                           for t in sorted(set(applied) | set(pending))}
        return out


    def _sinks(self, ledgers: SinkLedgers, current: int, now_ms: int) -> dict[str, SinkValues]:
        """Each sink's lags by its own ledger (a feed of one node: lag by `current`, its flush LSN)."""
        retrying = read_note(self.prepared.state.retrying_file)
        behind = Lag.load(self.prepared.state).sinks
        out = {name: SinkValues(time.time() - b.since, time.time() - b.since, behind=True)  # (left out: no ledger)
               for name, b in behind.items()}
        for name, ledger in ledgers.each:
            last = ledger.last_batch()
            position = (ledger.checkpoint() or {}).get(self.prepared.spec.sources[0].name, 0)
            lag = resolved = 0.0
            if last is not None:
                resolved = resolved_lag_s(now_ms, last.resolved_ts)
                lag = resolved if self.prepared.spec.multi_node else \
                    checkpoint_lag_s(current, now_ms, position, last.resolved_ts)
            out[name] = SinkValues(lag, resolved, last.batches if last else 0, ledger.recent_rate(),
                                   retrying is not None and retrying.component == f"sink {name}", name in behind)
        return out


def _phase(state: FeedState, query: Any) -> tuple[str, str, str]:
    """(state, reason, component) of this run for the metrics: failed wins, then retrying (until a
    batch is recorded after the fault), paused, running, stopped."""
    failure = state.failure()
    if failure:
        return "failed", failure.removeprefix("failed: "), ""
    retrying = read_note(state.retrying_file)
    if retrying is not None:
        return "retrying", retrying.reason, retrying.component
    return ("paused" if state.paused else "running" if query.isActive else "stopped"), "", ""


class SnapshotMeter:
    """Per table being snapshotted: rows applied of the estimated total, rate and ETA."""

    def __init__(self, report: Callable[[str], None], source: Any, ledger: "Ledger") -> None:
        self.report, self.source, self.ledger = report, source, ledger
        self._seen: dict[str, tuple[float, int]] = {}  # table -> (when first seen pending, rows then)
        # rows applied per table at the last report; at the start, what earlier runs applied
        self._last: dict[str, int] = {t: rows for t, (_, rows) in ledger.snapshot_totals().items()}
        self._last_at = time.monotonic()  # when that was

    def update(self, pending: tuple[str, ...]) -> None:
        from changefeed.postgres.snapshot import estimated_rows

        now = time.monotonic()
        applied = {t: rows for t, (_, rows) in self.ledger.snapshot_totals().items()}
        moved = {t for t, rows in applied.items() if rows != self._last.get(t)}
        # done: a table seen pending that is no longer, also when its last rows were counted while
        # the query's last progress still named it pending (the sink records a batch before Spark
        # reports it), and one that moved without being seen pending
        for table in sorted(set(pending) | moved | set(self._seen)):
            rows = applied.get(table, 0)
            if table not in pending:
                self.report(f"  snapshot {table}: done, {rows:,} rows")
                self._seen.pop(table, None)
                continue
            t0, rows0 = self._seen.setdefault(table, (self._last_at, self._last.get(table, 0)))
            rate = (rows - rows0) / max(now - t0, 1e-9)
            total = estimated_rows(self.source, table)
            line = f"  snapshot {table}: {rows:,} rows"
            if total:
                line += f" of ~{total:,} ({min(rows / total, 1):.0%})"
            line += f", {rate:,.0f} rows/s"
            if total and rate > 0:
                line += f", ETA {max(total - rows, 0) / rate:.0f}s"
            self.report(line)
        self._last, self._last_at = applied, now


def end_offset(progress: dict[str, Any] | None) -> Offset | None:
    """The end offset of a progress report's (only) source; None before the first batch."""
    end = ((progress or {}).get("sources") or [{}])[0].get("endOffset")
    return Offset.from_json(end) if end else None
