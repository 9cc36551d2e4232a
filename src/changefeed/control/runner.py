"""The runner's loop: start the streaming query, report, check retention and the nodes, ride out
transient faults (retry) and stop cleanly on a signal.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, suppress
from typing import Any

import psycopg

from changefeed import errors, faults
from changefeed.control import lag_budget, lease_keeper, retention_check, sink_changes
from changefeed.control import standby as standby_mode
from changefeed.control.attach import Prepared, about, attach, follow_renames, lost_connections
from changefeed.control.meter import Gauges, Meter, SnapshotMeter, end_offset, start_metrics
from changefeed.control.partition_watch import PartitionWatch
from changefeed.control.retry import Retry, write_note
from changefeed.control.runner_lock import Stopped, state_lock
from changefeed.control.status import counted
from changefeed.errors import (
    ChangefeedError,
    ConfigError,
    FeedBusy,
    QueryFailed,
    TransientError,
)
from changefeed.postgres import feed_record, lease, slots
from changefeed.postgres.outbox import OutboxCleanup
from changefeed.sinks.base import task_slots
from changefeed.sinks.registry import sinks_of, validated
from changefeed.spark.checkpoint import chunks_to_read, resume, resume_until, resyncing
from changefeed.spec.definition import PARALLEL_READ_SLOTS, FeedSpec
from changefeed.spec.state import FeedState

SNAPSHOT_DONE_POLL_S = 0.1  # how often a --snapshot only run looks whether it is done


def run(spec: FeedSpec, state: FeedState, *, available_now: bool = False, master: str = "local[*]",
        report: Callable[[str], None] = print, report_every_s: float = 2.0,
        stop_event: threading.Event | None = None, handle_signals: bool = True,
        metrics_port: int | None = None, metrics_host: str = "127.0.0.1", verbose: bool = False,
        retry_max_backoff_s: float = 30.0, give_up_after_s: float | None = None,
        alongside: Callable[[threading.Event], None] | None = None, locked: bool = False,
        standby: bool = False, resuming: bool = False) -> None:
    """Run the feed until SIGINT/SIGTERM (or `stop_event`), or until caught up with `available_now`;
    with `metrics_port`, serve Prometheus metrics on http://METRICS_HOST:METRICS_PORT/metrics meanwhile.
    Spark's own output goes to the state folder's spark.log, or with `verbose` to the console.

    A transient fault (a server restarted, a connection lost, a sink down) stops the query, waits
    (retry.Retry) and carries on from the checkpoint, at the start too once the feed has a
    checkpoint (a host that reboots starts the feed before its servers); a new feed's first start
    ends at once on any fault, so a mistyped URI shows. Definite faults end the run with their
    typed error. `locked`: the caller holds the feed's state folder lock already (verify running a
    stopped feed up to its point). `alongside(stop)` starts work that lasts as long as the run
    (`run --every`'s verification), once Spark is up. `standby`: wait, with Spark started, until
    the feed's active runner is gone, then take the feed over (control.standby). `resuming`
    (`changefeed resume`): a pause made on any host is taken back once this runner holds the
    lease, so no standby takes the feed meanwhile; without it, a feed paused on the source stops
    before its first batch, as the active runner does at its next report."""
    stop = stop_event or threading.Event()
    if state.paused:
        raise ConfigError(f"feed {spec.name} is paused", "resume it with changefeed resume --name NAME")
    retry = Retry(retry_max_backoff_s, give_up_after_s)
    lag = lag_budget.Lag.load(state)
    if handle_signals and threading.current_thread() is threading.main_thread():
        stop_on_signals(stop)
    from changefeed.spark.connect import Held, is_remote
    from changefeed.spark.job import spark_session
    from changefeed.spec.secrets import executor_env

    faults.mark_feed_group()  # before Spark starts (a standby's starts while it waits): its workers inherit it
    with ExitStack() as stack:
        metrics = start_metrics(stack, spec.name, metrics_host, metrics_port, report)
        prepared: Prepared | None = None
        fault: TransientError | None = None
        spark = Held(master, lambda: spark_session(
            master, log=None if verbose else state.spark_log,
            executor_env=executor_env([n.uri for n in spec.sources] + [t.uri for t in spec.sink_targets])))
        stack.callback(spark.close)
        try:
            validated(spec)
            if standby:
                standby_mode.check_standby(spec)
            if not locked:
                try:
                    stack.enter_context(state_lock(state, stop=stop, report=report))
                except Stopped:
                    report(f"feed {spec.name}: stopped before it started")
                    return
            attempt = stack.enter_context(ExitStack())  # an attempt's connections, closed before the next one's
            while True:
                if standby:
                    try:
                        taken = _take_turn(spec, spark, stop, report)
                    except TransientError as e:  # the source (or Spark) out of reach: a standby waits it out
                        delay = retry.failed(e)
                        report(f"feed {spec.name}: standing by, {e.message.splitlines()[0]}; next look in "
                               f"{delay:.1f}s")
                        if stop.wait(delay):
                            return
                        continue
                    retry.succeeded()
                    if taken is None:
                        report(f"feed {spec.name}: stopped while standing by")
                        return
                    spec = taken
                try:
                    prepared = _attach(spec, state, attempt, report, lag, unpause=resuming)
                    retention_check.check(prepared, report)
                except FeedBusy:
                    if not standby:
                        raise
                    attempt.close()  # another standby was first: wait on
                    continue
                except TransientError as e:
                    if not state.has_checkpoint():
                        raise
                    prepared, fault = None, e
                break
        except FeedBusy:
            raise  # about this runner, not the feed
        except ChangefeedError as e:
            state.record_failure(e)  # only if the state folder exists: bad input leaves none
            raise
        state.failed_file.unlink(missing_ok=True)
        _warn_if_readable(state, report)
        stack.callback(write_note, state.retrying_file, None)
        faults.reach("startup")
        try:
            with spark.reached():
                if not stop.is_set():  # stopped while it attached: no Spark to start
                    spark.get()
        except TransientError as e:  # a Spark Connect server out of reach: like any fault at the start
            if not state.has_checkpoint():
                raise
            fault = e
        if alongside is not None:
            alongside(stop)
        meter: Meter | None = None
        term = prepared.epoch if prepared else None  # this run's lease term: another one means it was taken over
        on = f" on the Spark Connect server {master}" if is_remote(master) else ""
        report(f"feed {spec.name}: running ({'until caught up' if available_now else 'until stopped'}){on}, "
               f"checkpoint in {state.checkpoint}")
        while not stop.is_set() and (fault is None or not _wait_out(fault, retry, spec, state, attempt, metrics,
                                                                     stop, report)):
            try:
                if prepared is None:  # after a transient fault: connect and check again
                    prepared = _attach(spec, state, attempt, report, lag, term)
                    retention_check.check(prepared, report)
                term = prepared.epoch
                if meter is None:
                    meter = Meter(report, prepared.ledger)
                else:  # the sink's ledger of this attempt
                    meter.ledger = prepared.ledger
                with spark.reached():  # a Spark Connect server that went away: a new session
                    _run_query(prepared, spark.get(), meter, metrics, stop, retry, attempt, lag, report,
                               available_now=available_now, report_every_s=report_every_s)
                break
            except Redefined as e:
                before, spec, prepared, fault = spec, e.spec, None, None
                attempt.close()
                if spec.nodes != before.nodes:
                    report(f"feed {spec.name}: its nodes are now {', '.join(n.name for n in spec.sources)}: "
                           "restarting the query to read them")
                if spec.where != before.where:
                    report(f"feed {spec.name}: its row filters changed: restarting the query to follow them")
                if spec.sink_targets != before.sink_targets:
                    report(f"feed {spec.name}: its sinks are now {', '.join(t.name for t in spec.sink_targets)}: "
                           "restarting the query to write to them")
                    gone = sink_changes.gone(before, spec)
                    lag.forget({t.name for t in gone})  # (its copy dropped at attach)
                    try:
                        sink_changes.forget(gone, before, state)
                    except ChangefeedError as failed:  # the feed goes on: the leftover is bookkeeping only
                        report(f"feed {spec.name}: the removed sink's ledger was not dropped: {failed.message}")
            except lag_budget.Switch as e:  # the query reads another slot from now on
                attempt.close()
                prepared, fault = None, None
                lag_budget.switch(e, spec, lag, report)
            except TransientError as e:
                prepared, fault = None, e
                if lag_budget.fell_behind(e, spec, lag, report):  # the other sinks go on at once
                    attempt.close()
                    fault = None
            except ChangefeedError as e:
                state.record_failure(e)
                raise
        if prepared is not None and prepared.keeper is not None:  # (stopped before its query ran)
            prepared.keeper.close(release=True)
        changes, batches = (meter.changes, meter.batches) if meter else (0, 0)
        report(f"feed {spec.name}: stopped cleanly after {counted(changes, 'change')} in "
               f"{counted(batches, 'batch')}")


def _attach(spec: FeedSpec, state: FeedState, attempt: ExitStack, report: Callable[[str], None],
            lag: lag_budget.Lag, term: int | None = None, unpause: bool = False) -> Prepared:
    """attach, then take the feed's lease in a new term and claim the sink for it: from here on a
    runner of an earlier term (frozen, cut off) lands nothing in a sink that has a fence. A run
    that held term `term` before a fault stops with LeaseLost if another runner took the feed
    over meanwhile (a standby): it must not take the feed back. `unpause`: then take back a pause
    on the source. Sinks behind the others (`lag`) are left out (a copy of the slot keeps their WAL)."""
    if term is not None:
        lease_keeper.check_still_held(spec, term)
    prepared = attach(spec, state, attempt, report, behind=lag.left_out())
    with lost_connections(prepared):
        prepared.epoch = lease_keeper.take(prepared.spec, prepared.source_conn, prepared.ledger)
        prepared.keeper = lease_keeper.Keeper(prepared.spec, prepared.epoch)
        attempt.callback(prepared.keeper.close, False)
        if unpause:
            feed_record.unpause(prepared.source_conn, spec.name)
        catching = lag.catching_from()
        if catching is not None and not state.has_checkpoint():  # (each sink skips the batches it has)
            prepared.resume = catching
        else:
            prepared.resume = resume(state, prepared.ledger, report,  # after the claim: no batch lands meanwhile
                                     in_parts=any(sink.in_parts for _, _, sink in sinks_of(spec)))
            prepared.until = resume_until(state, prepared.ledger, report) if prepared.resume is not None else None
        lag_budget.settle(prepared, lag, report)
    prepared.read_from = lag.read_from(prepared.spec)
    return prepared


def _take_turn(spec: FeedSpec, spark: Any, stop: threading.Event, report: Callable[[str], None]) -> FeedSpec | None:
    """A standby: start Spark, wait for the active runner to go, then the definition it ran (stored
    on the source), None if stopped meanwhile."""
    from changefeed.spark.connect import is_remote
    from changefeed.spark.warm_up import warm_workers

    with spark.reached():
        session = spark.get()  # ready before the takeover: its start is most of a runner's
    if not is_remote(spark.master):  # (a Spark Connect server's workers are shared, and not this host's)
        warm_workers(session, spec)
    if not standby_mode.await_turn(spec, stop, report):
        return None
    ran = standby_mode.stored_definition(spec.sources[0].uri, spec.name)
    if not ran.multi_node:  # this host's way to the source
        ran = FeedSpec(**{**ran.__dict__, "source": spec.source})
    report(f"feed {spec.name}: the active runner is gone; taking the feed over")
    return ran


def stop_on_signals(stop: threading.Event) -> threading.Event:
    """SIGINT/SIGTERM stop the feed cleanly at its next step, from the start on (a runner that waits
    for a verify, connects or starts Spark finishes that step, then stops); a second one ends the
    process at once. Returns `stop`."""
    def handle(sig: int, _frame: Any) -> None:
        if stop.is_set():
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)
    return stop


def _warn_if_readable(state: FeedState, report: Callable[[str], None]) -> None:
    """A state folder other users may read or enter (made by an older changefeed, or by hand)."""
    from changefeed.spec.secrets import loose

    mode = loose(state.dir)
    if mode:
        report(f"warning: the state folder {state.dir} is open to other users ({mode}): its checkpoint and logs "
               f"are the feed's; chmod -R go-rwx {state.dir}")


class Redefined(Exception):
    """The feed's stored nodes or sinks differ from the running query's: start again with `spec`."""

    def __init__(self, spec: FeedSpec) -> None:
        super().__init__(f"nodes {[n.name for n in spec.sources]}, sinks {[t.name for t in spec.sink_targets]}")
        self.spec = spec


def _wait_out(fault: TransientError, retry: Retry, spec: FeedSpec, state: FeedState, attempt: ExitStack,
              metrics: Any, stop: threading.Event, report: Callable[[str], None]) -> bool:
    """After a transient fault: close the attempt's connections, note the fault (status, metrics,
    the console) and wait before the next attempt. True when stopped meanwhile; raises the fault
    once retrying gives up or past the retention budget."""
    attempt.close()  # this attempt's connections (and the source's lock) and outbox cleanup
    try:
        delay = retry.failed(fault)
    except TransientError:
        state.record_failure(fault)
        raise
    assert retry.current is not None
    retention_check.meanwhile(spec, state, retry.current)
    write_note(state.retrying_file, retry.current)
    if metrics is not None:
        metrics.update(state="retrying", reason=retry.current.reason, component=retry.current.component)
    report(f"feed {spec.name}: {retry.current.describe()}; next attempt in {delay:.1f}s")
    return stop.wait(delay)


def _run_query(prepared: Prepared, spark: Any, meter: Meter, metrics: Any, stop: threading.Event, retry: Retry,
               attempt: ExitStack, lag: lag_budget.Lag, report: Callable[[str], None], *, available_now: bool,
               report_every_s: float) -> None:
    """One attempt: start the query, report, check and clean up until it stops, is stopped or fails;
    a failure is raised as its typed error (a lost connection as ConnectionFailed)."""
    from pyspark.errors import StreamingQueryException

    from changefeed.spark.job import start_query
    from changefeed.spark.warm_up import warm_commit

    spec, state = prepared.spec, prepared.state
    meter.snapshot = SnapshotMeter(report, prepared.source_conn, prepared.ledger)
    meter.gauges = Gauges(metrics, prepared) if metrics else None
    cleanup = _outbox_cleanup(prepared, attempt)
    state.set_joining([n for n in state.joining() if n not in {s.name for s in spec.sources}])  # read from now on
    with lost_connections(prepared):  # (requests and pause are read on the source's connection)
        partitions = PartitionWatch(prepared)
        partitions.look(report)  # (before resyncing: a partition that joined while stopped is a request)
        parallel, resync = _parallel_reads(prepared, spark), resyncing(state, prepared.requests)
        who = _paused(prepared)
    keeper = prepared.keeper
    assert prepared.epoch is not None and keeper is not None, "taken by _attach"
    keeper.check()  # lost while Spark started
    if who is not None:  # on another host: no batch runs
        report(f"feed {spec.name}: paused (by {who}); its slot keeps the WAL until changefeed resume")
        return
    warm_commit(spark, spec, state.warm_up)
    query = start_query(spark, spec, state, available_now=available_now, parallel_reads=parallel, resync=resync,
                        epoch=prepared.epoch, resume=prepared.resume, until=prepared.until,
                        read_from=prepared.read_from)
    batches_at_start, clean, published = meter.batches, False, prepared.definition
    try:
        with lost_connections(prepared):
            while query.isActive and not stop.is_set():
                keeper.check()  # another runner took the feed over: stop writing
                with suppress(StreamingQueryException):  # a failed query is handled below
                    _await(query, report_every_s, spec.snapshot == "only")
                meter.update(query)
                lag_budget.tick(prepared, lag, report)
                if retry.current is not None and meter.batches > batches_at_start:
                    report(f"feed {spec.name}: the {retry.current.component} is back; carrying on")
                    retry.succeeded()
                    write_note(state.retrying_file, None)
                _clean_outbox(cleanup, prepared, report)
                if spec.snapshot == "only" and _snapshot_done(query):
                    report(f"feed {spec.name}: snapshot complete (--snapshot only)")
                    break
                retention_check.check(prepared, report)
                partitions.look(report)
                if (who := _paused(prepared)) is not None:
                    report(f"feed {spec.name}: paused (by {who}); its slot keeps the WAL until changefeed resume")
                    break
                stored = state.load()
                defined = prepared.definition
                if stored is not None and (stored.nodes, stored.sink_targets, stored.where) != \
                        (defined.nodes, defined.sink_targets, defined.where):
                    raise Redefined(stored)  # changefeed alter --add-node, --add-sink, --where, ...
                if stored is not None and stored != published:  # altered: what a standby would run
                    feed_record.store(prepared.source_conn, spec.name, stored.to_json(), lease.me())
                    published = stored
                if spec.capture_ddl:  # tables renamed meanwhile: status, verify, snapshot use the new names
                    follow_renames(stored or spec, state, conns=prepared.sources)
                # a snapshot request taken in: its tables follow only what they can
                wanted = (_parallel_reads(prepared, spark), resyncing(state, prepared.requests))
                if query.isActive and (parallel, resync) != wanted:
                    if parallel != wanted[0]:
                        report(f"feed {spec.name}: " + ("snapshot chunks to read: restarting the query to read "
                                                        "them in parallel tasks" if wanted[0] else
                                                        "snapshot read: restarting the query without the shuffle"))
                    parallel, resync = wanted
                    _stop(query, state)
                    if query.exception() is not None:  # it failed before it stopped: a failure like any other
                        break
                    query = start_query(spark, spec, state, available_now=available_now, parallel_reads=parallel,
                                        resync=resync, epoch=prepared.epoch, resume=prepared.resume,
                                        until=prepared.until, read_from=prepared.read_from)
            if query.exception() is not None:
                retention_check.check(prepared, report)  # a lost slot fails the reads: name it properly
                raise _query_error(query.exception(), state)
            _release_wal(prepared, query)
            _clean_outbox(cleanup, prepared, report)
            clean = True
    finally:
        if query.isActive:
            report(f"feed {spec.name}: stopping")
            _stop(query, state)
        keeper.close(release=clean)  # a clean stop ends the lease: a standby need not wait it out
        with suppress(ChangefeedError, psycopg.Error):  # counts only: a server gone must not mask the error
            meter.update(query)


def _paused(prepared: Prepared) -> str | None:
    """Who paused the feed: this host (its state folder), or any host (on the source); None if none."""
    if prepared.state.paused:
        return "this host"
    return feed_record.paused_by(prepared.source_conn, prepared.spec.name)


def _stop(query: Any, state: FeedState) -> None:
    """Stop the query. A stop that Spark gives up on (a task that would not end within
    spark.sql.streaming.stopTimeout) is QueryFailed: the next attempt starts over."""
    try:
        query.stop()
    except Exception as e:  # noqa: BLE001 - py4j and pyspark raise their own kinds here
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise QueryFailed(f"the streaming query did not stop: {first}",
                          f"Spark's log is {state.spark_log}; the feed restarts from its checkpoint",
                          component="query") from None




def _outbox_cleanup(prepared: Prepared, stack: ExitStack) -> OutboxCleanup | None:
    outbox = prepared.spec.outbox_spec
    if outbox is None or not outbox.ttl_s:
        return None
    cleanup = OutboxCleanup(prepared.spec.sources[0].uri, outbox, prepared.state.outbox_marks)
    stack.callback(cleanup.close)
    return cleanup


def _clean_outbox(cleanup: OutboxCleanup | None, prepared: Prepared, report: Callable[[str], None]) -> None:
    """Delete delivered outbox rows past their TTL; not while a snapshot is read (its rows are not
    delivered yet, whatever the checkpoint says). A failed cleanup is reported, not fatal: the
    rows stay, the feed goes on, the next tick tries again."""
    if cleanup is None or chunks_to_read(prepared.spec, prepared.state, prepared.requests):
        return
    try:
        checkpoint = prepared.ledger.checkpoint()
        deleted = cleanup.tick(None if checkpoint is None else checkpoint[prepared.spec.sources[0].name])
    except ChangefeedError as e:
        report(f"feed {prepared.spec.name}: outbox cleanup failed, rows kept: {e}")
        return
    if deleted:
        report(f"feed {prepared.spec.name}: outbox cleanup deleted {deleted} delivered rows of {cleanup.spec.table}")


def _await(query: Any, seconds: float, snapshot_only: bool) -> None:
    """Wait up to `seconds` for the query to end. With --snapshot only, look every
    SNAPSHOT_DONE_POLL_S whether the snapshot is done, which ends the run: the query would go on
    with batches of heartbeats until the next look (on average half a report's interval more)."""
    if not snapshot_only:
        query.awaitTermination(seconds)
        return
    deadline = time.monotonic() + seconds
    # (Spark takes whole milliseconds, and refuses 0)
    while (left := deadline - time.monotonic()) >= 0.001 and \
            not query.awaitTermination(min(left, SNAPSHOT_DONE_POLL_S)):
        if _snapshot_done(query):
            return


def _snapshot_done(query: Any) -> bool:
    """The last completed batch left no table to snapshot."""
    end = end_offset(query.lastProgress)
    return end is not None and not end.cursor.pending


def _parallel_reads(prepared: Prepared, spark: Any) -> bool:
    """Whether the query should read a batch's partitions in parallel tasks: always on a feed of
    several nodes (see spark.job.start_query); else while there are snapshot chunks to read, if
    the sink allows it (see sinks.registry) and `--snapshot-reads` asks for it (auto: Spark has
    PARALLEL_READ_SLOTS task slots, asked each time, as a cluster's executors may come later)."""
    spec = prepared.spec
    if spec.multi_node:
        return True
    if spec.snapshot_reads == "sequential" or not (all(sink.parallel_reads for _, _, sink in sinks_of(spec))
                                                   and chunks_to_read(spec, prepared.state, prepared.requests)):
        return False
    return spec.snapshot_reads == "parallel" or task_slots(spark) >= PARALLEL_READ_SLOTS


def _release_wal(prepared: Prepared, query: Any) -> None:
    """Advance each node's slot past the last batch the sink committed.

    Spark commits a batch to the source only when it plans the next one, so without this the slots
    would hold one batch of WAL more than needed after an AvailableNow run or a stop.
    """
    for p in reversed(query.recentProgress):
        end = end_offset(p)
        if end:
            for node in prepared.spec.sources:
                if node.name in end.lsns:
                    with about(prepared.spec, node):
                        slots.release(prepared.sources[node.name], node, end.lsns[node.name],
                                      prepared.spec.multi_node)
            return


def _query_error(exc: Any, state: FeedState) -> ChangefeedError:
    """A query failure as the typed error it carries (errors.carried); any other failure (Spark's
    own, a Python worker that crashed) as QueryFailed."""
    text = str(exc)
    return errors.carried_in(text) or QueryFailed(
        f"the streaming query failed: {text.splitlines()[0] if text else exc!r}",
        f"Spark's log is {state.spark_log} (or run with --verbose); the feed restarts from its checkpoint",
        component="query")
