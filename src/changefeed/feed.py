"""A feed's life on one runner: check, create what is missing, run the query until stopped.

Everything that can fail on bad input is checked before anything is created or advanced.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import psycopg
from psycopg import sql

from . import errors, faults, retention
from .config import PARALLEL_READ_SLOTS, FeedSpec, FeedState, SourceNode
from .core import snapshot
from .core.hlc import physical_ms
from .core.offsets import Offset
from .core.requests import SnapshotRequests
from .errors import (ChangefeedError, ConfigError, DefiniteError, FeedBusy, QueryFailed, SlotLost, SourceNotReady,
                     TransientError, start_over_hint)
from .meter import Gauges, Meter, SnapshotMeter, end_offset, start_metrics
from .postgres import ddl_capture
from .postgres import source as src
from .postgres import twophase
from .postgres.connect import connect, lost_connection
from .postgres.outbox import OutboxCleanup, check_outbox_table
from .retry import Retry, Retrying, write_note
from .runner_lock import Stopped, state_lock
from .sinks.ledger import Ledger
from .sinks.registry import open_ledger, sink_of
from .status import counted


@dataclass
class Prepared:
    spec: FeedSpec
    state: FeedState
    sources: dict[str, Any]  # per source node, a connection that holds the feed's advisory lock there
    ledger: Ledger

    @property
    def source_conn(self) -> Any:
        """The first node's connection (a one-node feed's only one)."""
        return self.sources[self.spec.sources[0].name]


def prepare(spec: FeedSpec, state: FeedState, stack: ExitStack, report: Callable[[str], None] = print) -> Prepared:
    """Check everything, then create publication, slot and target tables if missing."""
    spec.validate()
    stack.enter_context(state_lock(state))
    return attach(spec, state, stack, report)


@dataclass
class _Checked:
    """What the checks found on one source node."""

    node: SourceNode
    conn: Any
    tables: list[src.SourceTable]
    slot: src.SlotState | None


def attach(spec: FeedSpec, state: FeedState, stack: ExitStack, report: Callable[[str], None] = print) -> Prepared:
    """Connect to every source node and the sink, check them all, then create what is missing on
    each node (each step leaves what exists as it is, so a runner that lost its servers calls
    this again to carry on). Nothing is created anywhere before every check passed; a slot or
    publication created on one node is dropped again when a later step fails."""
    spec.check_secrets()
    if spec.capture_ddl:
        spec = follow_renames(spec, state, stack)
    checked = [_check_node(spec, node, stack, report) for node in spec.sources]
    _check_same_tables(spec, checked)
    with told_if_slow(f"the sink {_endpoint(spec.sink)} to answer", report), lost_connection("sink"):
        ledger = open_ledger(spec, state)
        stack.callback(ledger.close)
        checkpoint = ledger.checkpoint() or {}
        for c in checked:
            if state.has_checkpoint() or c.slot is not None:
                with _about(spec, c.node):
                    src.check_slot_usable(c.slot, c.node.slot, checkpoint.get(c.node.name), spec.name)
                    if spec.multi_node:
                        _check_prepare_slot(spec, c)
        ledger.check()
    # -- nothing was created up to here --
    created: list[tuple[_Checked, bool, list[str]]] = []  # (node, publication created, slots created)
    try:
        _create(spec, checked, created)
        with lost_connection("sink"):
            ledger.prepare(checked[0].tables)
    except Exception:
        _undo(spec, created)  # leave nothing half-made behind: the next run starts clean
        raise
    state.save(spec)
    return Prepared(spec, state, {c.node.name: c.conn for c in checked}, ledger)


def follow_renames(spec: FeedSpec, state: FeedState, stack: ExitStack | None = None,
                   conns: dict[str, Any] | None = None) -> FeedSpec:
    """The feed capturing its tables under the names the DDL capture saw them renamed to (stored)."""
    tables = list(spec.tables)
    with ExitStack() as own:
        for node in spec.sources:
            conn = (conns or {}).get(node.name) or (stack or own).enter_context(connect(node.uri, spec.role(node.name)))
            for old, new in ddl_capture.renames(conn, spec.name):
                if old in tables and new not in tables:
                    tables[tables.index(old)] = new
    if tuple(tables) == spec.tables:
        return spec
    renamed = FeedSpec(**{**spec.__dict__, "tables": tuple(tables)}).validate()
    state.save(renamed)
    return renamed


def _check_node(spec: FeedSpec, node: SourceNode, stack: ExitStack, report: Callable[[str], None]) -> _Checked:
    """Connect to `node`, check it (wal_level, tables and keys, outbox), take the feed's lock there."""
    role = spec.role(node.name)
    with told_if_slow(f"the {role} {_endpoint(node.uri)} to answer", report), _about(spec, node):
        conn = stack.enter_context(connect(node.uri, role))
    with _about(spec, node):
        src.check_wal_level(conn)
        tables = src.describe_tables(conn, list(spec.tables))
        if spec.outbox_spec is not None:
            check_outbox_table(conn, spec.outbox_spec)
        slot = src.slot_state(conn, node.slot)
        if slot is None:
            src.check_rights(conn, node.publication, tables)
            if spec.multi_node:
                twophase.check(conn)
        src.lock_feed(conn, spec.name)
        return _Checked(node, conn, tables, slot)


def add_source(spec: FeedSpec, node: SourceNode, report: Callable[[str], None] = print) -> None:
    """Check node `node` of `spec` (the grown feed) as `attach` checks every node, its tables'
    keys against the feed's first node, then create its publication and slot (both dropped again
    if the slot fails). Works while the feed runs: its runner holds the other nodes."""
    with ExitStack() as stack:
        checked = _check_node(spec, node, stack, report)
        first = spec.sources[0]
        with _about(spec, first):
            conn = stack.enter_context(connect(first.uri, spec.role(first.name)))
            _check_same_tables(spec, [_Checked(first, conn, src.describe_tables(conn, list(spec.tables)), None),
                                      checked])
        created: list[tuple[_Checked, bool, list[str]]] = []
        try:
            _create(spec, [checked], created)
        except Exception:
            _undo(spec, created)
            raise


def _create(spec: FeedSpec, checked: list[_Checked], created: list[tuple[_Checked, bool, list[str]]]) -> None:
    """Create what is missing on each checked node, noting in `created` what was (for _undo). A
    node of a feed of several nodes gets its prepare slot first (postgres/twophase.py), so that
    it has seen everything the node's slot will deliver."""
    for c in checked:
        with _about(spec, c.node):
            publication = src.ensure_publication(c.conn, c.node.publication, c.tables)
            slots: list[str] = []
            created.append((c, publication, slots))
            if c.slot is None:
                if spec.multi_node and src.slot_state(c.conn, c.node.prepare_slot) is None:  # (a run that died
                    src.create_slot(c.conn, c.node.prepare_slot, two_phase=True)            # may have left it)
                    slots.append(c.node.prepare_slot)
                src.create_slot(c.conn, c.node.slot)
                slots.append(c.node.slot)
            if spec.capture_ddl:
                ddl_capture.install(c.conn, spec.name, c.node.publication)
            faults.reach("node_created")


def _check_prepare_slot(spec: FeedSpec, c: _Checked) -> None:
    """A node of a feed of several nodes reads its slot without two-phase decoding and needs its
    prepare slot beside it (postgres/twophase.py)."""
    assert c.slot is not None
    if c.slot.two_phase:
        raise SlotLost(f"replication slot {c.node.slot} decodes prepared transactions at their PREPARE: it was "
                       "created by an older changefeed, which read distributed transactions another way",
                       start_over_hint(spec.name))
    state = src.slot_state(c.conn, c.node.prepare_slot)
    if state is None:
        raise SlotLost(f"replication slot {c.node.prepare_slot} is missing: without it the feed cannot tell which "
                       "commits are parts of one distributed transaction", start_over_hint(spec.name))
    src.check_slot_usable(state, c.node.prepare_slot, None, spec.name)


def _check_same_tables(spec: FeedSpec, checked: list[_Checked]) -> None:
    """Every node must have the same key columns for each table: their rows go to one target."""
    first = checked[0]
    for c in checked[1:]:
        for a, b in zip(first.tables, c.tables):
            if a.key != b.key:
                raise SourceNotReady(
                    f"table {a.qualified} has key ({', '.join(a.key)}) on source node {first.node.name} but "
                    f"({', '.join(b.key)}) on source node {c.node.name}: their rows cannot go to one target table",
                    "give the table the same primary key on every node")


@contextmanager
def _about(spec: FeedSpec, node: SourceNode) -> Iterator[None]:
    """Work on one source node: a lost connection is ConnectionFailed naming it, and on a feed of
    several nodes every error says which node it is about."""
    role = spec.role(node.name)
    try:
        with lost_connection(role):
            yield
    except ChangefeedError as e:
        if spec.multi_node and f"node {node.name}" not in e.message:
            e.message = f"source node {node.name}: {e.message}"
        raise


def _undo(spec: FeedSpec, created: list[tuple[_Checked, bool, list[str]]]) -> None:
    """Drop the slots and publications this attempt created (best effort: a node that is gone
    now keeps its slot, and the next run's checks find it again)."""
    for c, publication, slots in created:
        with suppress(psycopg.Error):
            for slot in slots:
                c.conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            if publication:
                c.conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(c.node.publication)))


@contextmanager
def told_if_slow(what: str, report: Callable[[str], None], after_s: float = 1.0) -> Iterator[None]:
    """Say what the feed waits for when a step takes longer than `after_s`: an unreachable server
    may take its whole timeout to give its answer, and silence meanwhile looks like a hang."""
    timer = threading.Timer(after_s, lambda: report(f"waiting for {what} ..."))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _endpoint(uri: str) -> str:
    """scheme://host:port of a URI, for messages: no credentials, no query (Kafka's may hold secrets)."""
    parts = urlsplit(uri)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"


def run(spec: FeedSpec, state: FeedState, *, available_now: bool = False, master: str = "local[*]",
        report: Callable[[str], None] = print, report_every_s: float = 2.0,
        stop_event: threading.Event | None = None, handle_signals: bool = True,
        metrics_port: int | None = None, metrics_host: str = "127.0.0.1", verbose: bool = False,
        retry_max_backoff_s: float = 30.0, give_up_after_s: float | None = None,
        verify_every_s: float | None = None, locked: bool = False) -> None:
    """Run the feed until SIGINT/SIGTERM (or `stop_event`), or until caught up with `available_now`;
    with `metrics_port`, serve Prometheus metrics on http://METRICS_HOST:METRICS_PORT/metrics meanwhile.
    Spark's own output goes to the state folder's spark.log, or with `verbose` to the console.

    A transient fault (a server restarted, a connection lost, a sink down) stops the query, waits
    (retry.Retry) and carries on from the checkpoint, at the start too once the feed has a
    checkpoint (a host that reboots starts the feed before its servers); a new feed's first start
    ends at once on any fault, so a mistyped URI shows. Definite faults end the run with their
    typed error. `locked`: the caller holds the feed's state folder lock already (verify running a
    stopped feed up to its point)."""
    stop = stop_event or threading.Event()
    if state.paused:
        raise ConfigError(f"feed {spec.name} is paused", "resume it with changefeed resume --name NAME")
    retry = Retry(retry_max_backoff_s, give_up_after_s)
    if handle_signals and threading.current_thread() is threading.main_thread():
        _stop_on_signals(stop)
    with ExitStack() as stack:
        metrics = start_metrics(stack, spec.name, metrics_host, metrics_port, report)
        prepared: Prepared | None = None
        fault: TransientError | None = None
        try:
            spec.validate()
            if not locked:
                try:
                    stack.enter_context(state_lock(state, stop=stop, report=report))
                except Stopped:
                    report(f"feed {spec.name}: stopped before it started")
                    return
            attempt = stack.enter_context(ExitStack())  # an attempt's connections, closed before the next one's
            try:
                prepared = attach(spec, state, attempt, report)
                _check_retention(prepared, report)
            except TransientError as e:
                if not state.has_checkpoint():
                    raise
                prepared, fault = None, e
        except FeedBusy:
            raise  # about this runner, not the feed
        except ChangefeedError as e:
            state.record_failure(e)  # only if the state folder exists: bad input leaves none
            raise
        state.failed_file.unlink(missing_ok=True)
        _warn_if_readable(state, report)
        stack.callback(write_note, state.retrying_file, None)
        faults.mark_feed_group()
        faults.reach("startup")
        from .secrets import executor_env
        from .spark.job import spark_session

        spark = None if stop.is_set() else spark_session(  # stopped while it attached: no Spark to start
            master, log=None if verbose else state.spark_log,
            executor_env=executor_env([n.uri for n in spec.sources] + [spec.sink]))
        if verify_every_s:
            from .verify import verify_every

            verify_every(spec.name, state, verify_every_s, stop, report)
        meter: Meter | None = None
        report(f"feed {spec.name}: running ({'until caught up' if available_now else 'until stopped'}), "
               f"checkpoint in {state.checkpoint}")
        while not stop.is_set() and (fault is None or not _wait_out(fault, retry, spec, state, attempt, metrics,
                                                                     stop, report)):
            try:
                if prepared is None:  # after a transient fault: connect and check again
                    prepared = attach(spec, state, attempt, report)
                    _check_retention(prepared, report)
                if meter is None:
                    meter = Meter(report, prepared.ledger.totals)
                else:  # the sink's ledger of this attempt
                    meter.totals = prepared.ledger.totals
                _run_query(prepared, spark, meter, metrics, stop, retry, attempt, report,
                           available_now=available_now, report_every_s=report_every_s)
                break
            except NodesChanged as e:
                spec, prepared, fault = e.spec, None, None
                attempt.close()
                report(f"feed {spec.name}: its nodes are now {', '.join(n.name for n in spec.sources)}: "
                       "restarting the query to read them")
            except TransientError as e:
                prepared, fault = None, e
            except ChangefeedError as e:
                state.record_failure(e)
                raise
        changes, batches = (meter.changes, meter.batches) if meter else (0, 0)
        report(f"feed {spec.name}: stopped cleanly after {counted(changes, 'change')} in "
               f"{counted(batches, 'batch')}")


def _stop_on_signals(stop: threading.Event) -> None:
    """SIGINT/SIGTERM stop the feed cleanly at its next step, from the start on (a runner that waits
    for a verify, connects or starts Spark finishes that step, then stops); a second one ends the
    process at once."""
    def handle(sig: int, _frame: Any) -> None:
        if stop.is_set():
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)


def _warn_if_readable(state: FeedState, report: Callable[[str], None]) -> None:
    """A state folder other users may read or enter (made by an older changefeed, or by hand)."""
    from .secrets import loose

    mode = loose(state.dir)
    if mode:
        report(f"warning: the state folder {state.dir} is open to other users ({mode}): its checkpoint and logs "
               f"are the feed's; chmod -R go-rwx {state.dir}")


class NodesChanged(Exception):
    """The feed's stored nodes differ from the running query's: start again with `spec`."""

    def __init__(self, spec: FeedSpec) -> None:
        super().__init__(f"nodes changed to {[n.name for n in spec.sources]}")
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
    _check_retention_meanwhile(spec, state, retry.current)
    write_note(state.retrying_file, retry.current)
    if metrics is not None:
        metrics.update(state="retrying", reason=retry.current.reason, component=retry.current.component)
    report(f"feed {spec.name}: {retry.current.describe()}; next attempt in {delay:.1f}s")
    return stop.wait(delay)


def _run_query(prepared: Prepared, spark: Any, meter: Meter, metrics: Any, stop: threading.Event, retry: Retry,
               attempt: ExitStack, report: Callable[[str], None], *, available_now: bool,
               report_every_s: float) -> None:
    """One attempt: start the query, report, check and clean up until it stops, is stopped or fails;
    a failure is raised as its typed error (a lost connection as ConnectionFailed)."""
    from pyspark.errors import StreamingQueryException

    from .spark.job import start_query

    spec, state = prepared.spec, prepared.state
    meter.snapshot = SnapshotMeter(report, prepared.source_conn, prepared.ledger)
    meter.gauges = Gauges(metrics, prepared) if metrics else None
    cleanup = _outbox_cleanup(prepared, attempt)
    state.set_joining([n for n in state.joining() if n not in {s.name for s in spec.sources}])  # read from now on
    parallel, resync = _parallel_reads(spec, state, spark), resyncing(state)
    query = start_query(spark, spec, state, available_now=available_now, parallel_reads=parallel, resync=resync)
    batches_at_start = meter.batches
    try:
        with _lost_connections(prepared):
            while query.isActive and not stop.is_set():
                with suppress(StreamingQueryException):  # a failed query is handled below
                    query.awaitTermination(report_every_s)
                meter.update(query)
                if retry.current is not None and meter.batches > batches_at_start:
                    report(f"feed {spec.name}: the {retry.current.component} is back; carrying on")
                    retry.succeeded()
                    write_note(state.retrying_file, None)
                _clean_outbox(cleanup, prepared, report)
                if spec.snapshot == "only" and _snapshot_done(query):
                    report(f"feed {spec.name}: snapshot complete (--snapshot only)")
                    break
                _check_retention(prepared, report)
                if state.paused:
                    report(f"feed {spec.name}: paused; its slot keeps the WAL until changefeed resume")
                    break
                stored = state.load()
                if stored is not None and stored.nodes != spec.nodes:  # changefeed alter --add-node
                    raise NodesChanged(stored)
                if spec.capture_ddl:  # tables renamed meanwhile: status, verify, snapshot use the new names
                    follow_renames(stored or spec, state, conns=prepared.sources)
                wanted = (_parallel_reads(spec, state, spark), resyncing(state))  # (a snapshot request taken in:
                if query.isActive and (parallel, resync) != wanted:       # its tables follow only what they can)
                    if parallel != wanted[0]:
                        report(f"feed {spec.name}: " + ("snapshot chunks to read: restarting the query to read "
                                                        "them in parallel tasks" if wanted[0] else
                                                        "snapshot read: restarting the query without the shuffle"))
                    parallel, resync = wanted
                    _stop(query, state)
                    if query.exception() is not None:  # it failed before it stopped: a failure like any other
                        break
                    query = start_query(spark, spec, state, available_now=available_now, parallel_reads=parallel,
                                        resync=resync)
            if query.exception() is not None:
                _check_retention(prepared, report)  # a lost slot fails the reads: name it properly
                raise _query_error(query.exception(), state)
            _release_wal(prepared, query)
            _clean_outbox(cleanup, prepared, report)
    finally:
        if query.isActive:
            report(f"feed {spec.name}: stopping")
            _stop(query, state)
        with suppress(ChangefeedError, psycopg.Error):  # counts only: a server gone must not mask the error
            meter.update(query)


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


@contextmanager
def _lost_connections(prepared: Prepared) -> Iterator[None]:
    """The runner's own work on the source nodes and the sink: a lost connection is
    ConnectionFailed, naming the server whose connection broke."""
    try:
        yield
    except psycopg.OperationalError as e:
        broken = [n for n, conn in prepared.sources.items() if conn.broken]
        role = prepared.spec.role(broken[0]) if broken else "sink"
        with lost_connection(role):
            raise e from None


def _check_retention(prepared: Prepared, report: Callable[[str], None]) -> None:
    """Stop (typed error, recorded) when PostgreSQL invalidated a node's slot or past the
    retention budget on a node; warn near the budget. A connection lost meanwhile is
    ConnectionFailed."""
    spec = prepared.spec
    try:
        with _lost_connections(prepared):
            checkpoint = prepared.ledger.checkpoint() or {}
            resolved = prepared.ledger.last_resolved_ts()
        for node in spec.sources:
            conn = prepared.sources[node.name]
            with _about(spec, node):
                slot = src.slot_state(conn, node.slot)
                src.check_slot_usable(slot, node.slot, checkpoint.get(node.name), spec.name)
                if spec.multi_node:
                    src.check_slot_usable(src.slot_state(conn, node.prepare_slot), node.prepare_slot, None, spec.name)
                assert slot is not None
                if slot.restart_lsn is None:
                    continue
                current, now_ms = src.flush_lsn(conn)
            held = retention.Holding(node.slot, slot.restart_lsn, max(0, current - slot.restart_lsn),
                                     None if resolved is None else max(0.0, (now_ms - physical_ms(resolved)) / 1000),
                                     node.name if spec.multi_node else "")
            warning = retention.check(held, spec.name, spec.retention_s, spec.max_retained_wal)
            if warning:
                report(warning)
    except DefiniteError as e:
        prepared.state.record_failure(e)
        raise


def _check_retention_meanwhile(spec: FeedSpec, state: FeedState, fault: Retrying) -> None:
    """The retention budget while a fault lasts: nothing was delivered since it began, so the
    checkpoint is at least that old; the WAL each node's slot holds is asked of the nodes that
    answer. Past a budget the run ends (RetentionExceeded, recorded)."""
    try:
        for node in spec.sources:
            retained, restart = 0, 0
            if spec.max_retained_wal:
                with suppress(ChangefeedError), connect(node.uri, "source") as conn, lost_connection("source"):
                    slot = src.slot_state(conn, node.slot)
                    if slot is not None and slot.restart_lsn is not None:
                        restart, retained = slot.restart_lsn, max(0, src.flush_lsn(conn)[0] - slot.restart_lsn)
            retention.check(retention.Holding(node.slot, restart, retained, time.time() - fault.since,
                                              node.name if spec.multi_node else ""),
                            spec.name, spec.retention_s, spec.max_retained_wal)
    except ChangefeedError as e:
        state.record_failure(e)
        raise


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
    if cleanup is None or chunks_to_read(prepared.spec, prepared.state):
        return
    try:
        checkpoint = prepared.ledger.checkpoint()
        deleted = cleanup.tick(None if checkpoint is None else checkpoint[prepared.spec.sources[0].name])
    except ChangefeedError as e:
        report(f"feed {prepared.spec.name}: outbox cleanup failed, rows kept: {e}")
        return
    if deleted:
        report(f"feed {prepared.spec.name}: outbox cleanup deleted {deleted} delivered rows of {cleanup.spec.table}")


def _snapshot_done(query: Any) -> bool:
    """The last completed batch left no table to snapshot."""
    end = end_offset(query.lastProgress)
    return end is not None and not end.cursor.pending


def _logged_end(state: FeedState) -> tuple[Offset | None, bool]:
    """(The end offset of the last batch in the checkpoint's offset log, None before the first;
    whether Spark logged that batch as committed downstream too)."""
    logged = [p for p in (state.checkpoint / "offsets").glob("*") if p.name.isdigit()]
    if not logged:
        return None, False
    path = max(logged, key=lambda p: int(p.name))
    last = path.read_text().splitlines()
    end = Offset.from_json(last[-1]) if len(last) > 2 else None
    return end, (state.checkpoint / "commits" / path.name).exists()


def _parallel_reads(spec: FeedSpec, state: FeedState, spark: Any) -> bool:
    """Whether the query should read a batch's partitions in parallel tasks: always on a feed of
    several nodes (see spark.job.start_query); else while there are snapshot chunks to read, if
    the sink allows it (see sinks.registry) and `--snapshot-reads` asks for it (auto: Spark has
    PARALLEL_READ_SLOTS task slots, asked each time, as a cluster's executors may come later)."""
    if spec.multi_node:
        return True
    if spec.snapshot_reads == "sequential" or not (sink_of(spec.sink).parallel_reads and chunks_to_read(spec, state)):
        return False
    return spec.snapshot_reads == "parallel" or spark.sparkContext.defaultParallelism >= PARALLEL_READ_SLOTS


def chunks_to_read(spec: FeedSpec, state: FeedState) -> bool:
    """Whether the last batch Spark planned carries snapshot chunks and may still run (it is not
    logged as committed), or chunks are pending after it, or requested; a fresh checkpoint has its
    initial snapshot ahead."""
    end, committed = _logged_end(state)
    tables = () if spec.snapshot == "never" else spec.tables
    cursor = end.cursor if end else snapshot.Cursor(pending=snapshot.entries(tables, [n.name for n in spec.sources]))
    running_chunks = end is not None and bool(end.chunks) and not committed
    return running_chunks or bool(cursor.pending or SnapshotRequests(state.requests).after(cursor.requests))


def resyncing(state: FeedState) -> tuple[str, ...]:
    """Tables of snapshot requests the feed has not taken in yet: until then a replica table
    follows any schema change, as its rows are read again next (see core.schema_change)."""
    end, _ = _logged_end(state)
    taken = end.cursor.requests if end else 0
    return tuple(sorted({t for _, tables in SnapshotRequests(state.requests).after(taken) for t in tables}))


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
                    with _about(prepared.spec, node):
                        conn, lsn = prepared.sources[node.name], end.lsns[node.name]
                        src.advance(conn, node.slot, lsn)
                        if prepared.spec.multi_node:
                            src.advance(conn, node.prepare_slot, lsn)
            return


def _query_error(exc: Any, state: FeedState) -> ChangefeedError:
    """A query failure as the typed error it carries (errors.carried); any other failure (Spark's
    own, a Python worker that crashed) as QueryFailed."""
    text = str(exc)
    return errors.carried_in(text) or QueryFailed(
        f"the streaming query failed: {text.splitlines()[0] if text else exc!r}",
        f"Spark's log is {state.spark_log} (or run with --verbose); the feed restarts from its checkpoint",
        component="query")
