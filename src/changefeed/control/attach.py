"""Attaching a runner to its feed: check every node and the sink, create what is missing (undone
again if a later step fails), take the feed's locks, open the ledger.

Everything that can fail on bad input is checked before anything is created or advanced.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from functools import cached_property
from typing import Any
from urllib.parse import urlsplit

import psycopg
from psycopg import sql

from changefeed import faults
from changefeed.control.lease_keeper import Keeper
from changefeed.control.runner_lock import state_lock
from changefeed.core.offsets import Offset
from changefeed.errors import (
    ChangefeedError,
    ConfigError,
    SlotLost,
    SourceNotReady,
    start_over_hint,
)
from changefeed.postgres import ddl_capture, feed_record, lease, requests, row_filter, slots, twophase
from changefeed.postgres import source as src
from changefeed.postgres.connect import connect, lost_connection
from changefeed.postgres.outbox import check_outbox_table
from changefeed.postgres.requests import SourceRequests
from changefeed.sinks.ledger import Ledger
from changefeed.sinks.registry import check_keys, open_ledger, validated
from changefeed.spec.definition import FeedSpec, SourceNode
from changefeed.spec.secrets import same as same_secret
from changefeed.spec.state import FeedState


@dataclass
class Prepared:
    spec: FeedSpec
    state: FeedState
    sources: dict[str, Any]  # per source node, a connection that holds the feed's advisory lock there
    ledger: Ledger
    epoch: int | None = None  # the runner's lease term, once it took the lease (control.lease_keeper)
    keeper: Keeper | None = None  # renews that term's lease
    resume: Offset | None = None  # where a query without a checkpoint starts (spark.checkpoint.resume)
    until: Offset | None = None  # where its first batch then ends (several sinks: spark.checkpoint.resume_until)
    whole: FeedSpec | None = None  # the feed's definition, when `spec` leaves out sinks behind (control.lag_budget)
    read_from: dict[str, str] | None = None  # per node, the slot the query reads, if not the feed's (the same)

    @property
    def definition(self) -> FeedSpec:
        """The feed as defined, every sink in it (what is stored, and what an alter is compared with)."""
        return self.whole or self.spec

    @property
    def source_conn(self) -> Any:
        """The first node's connection (a one-node feed's only one)."""
        return self.sources[self.spec.sources[0].name]

    @cached_property
    def requests(self) -> SourceRequests:
        """The feed's snapshot requests, read on that connection (postgres.requests)."""
        return SourceRequests(lambda: self.source_conn, self.spec.name, self.state.requests)


def prepare(spec: FeedSpec, state: FeedState, stack: ExitStack, report: Callable[[str], None] = print) -> Prepared:
    """Check everything, then create publication, slot and target tables if missing."""
    validated(spec)
    stack.enter_context(state_lock(state))
    return attach(spec, state, stack, report)


@dataclass
class _Checked:
    """What the checks found on one source node."""

    node: SourceNode
    conn: Any
    tables: list[src.SourceTable]
    slot: slots.SlotState | None


def attach(spec: FeedSpec, state: FeedState, stack: ExitStack, report: Callable[[str], None] = print, *,
           behind: frozenset[str] = frozenset()) -> Prepared:
    """Connect to every source node and the sink, check them all, then create what is missing on
    each node (each step leaves what exists as it is, so a runner that lost its servers calls
    this again to carry on). Nothing is created anywhere before every check passed; a slot or
    publication created on one node is dropped again when a later step fails. `behind`: sinks the
    others go on without (control.lag_budget), left out of all but the stored definition."""
    spec.check_secrets()
    if spec.capture_ddl:
        spec = follow_renames(spec, state, stack)
    checked = [_check_node(spec, node, stack, report) for node in spec.sources]
    _check_same_tables(spec, checked)
    with about(spec, spec.sources[0]):  # (a lost connection is ConnectionFailed, as in every check here)
        _check_same_feed(spec, state, checked[0].conn)
    whole, spec = spec, spec.without_sinks(set(behind)) if behind else spec
    sinks = " and ".join(_endpoint(t.uri) for t in spec.sink_targets)
    with told_if_slow(f"the sink {sinks} to answer", report), lost_connection("sink"):
        ledger = open_ledger(spec, state)
        stack.callback(ledger.close)
        checkpoint = ledger.checkpoint() or {}
        for c in checked:
            if state.has_checkpoint() or c.slot is not None or c.node.name in checkpoint:  # (the sink's: a
                # runner without the checkpoint resumes from the sink, which needs the slot as much)
                with about(spec, c.node):
                    slots.check_slot_usable(c.slot, c.node.slot, checkpoint.get(c.node.name), spec.name)
                    if spec.multi_node:
                        _check_prepare_slot(spec, c)
        ledger.check()
    # -- nothing was created up to here --
    created: list[tuple[_Checked, bool, list[str]]] = []  # (node, publication created, slots created)
    try:
        _create(spec, checked, created)
        if created[0][2] and not checkpoint and not state.has_checkpoint():  # a feed new under its name
            requests.forget(checked[0].conn, spec.name)
        with lost_connection("sink"):
            ledger.prepare(checked[0].tables)
    except Exception:
        _undo(spec, created)  # leave nothing half-made behind: the next run starts clean
        raise
    for note in ledger.notes():
        report(f"feed {spec.name}: {note}")
    state.save(whole)
    with about(spec, spec.sources[0]):
        feed_record.store(checked[0].conn, spec.name, whole.to_json(), lease.me())  # what a standby runs
    return Prepared(spec, state, {c.node.name: c.conn for c in checked}, ledger, whole=whole if behind else None)


def _check_same_feed(spec: FeedSpec, state: FeedState, conn: Any) -> None:
    """A feed new to this state folder whose name another runner's feed has on this source must
    be the same feed (its sink and tables): two definitions under one name would write to two
    places from one slot."""
    if state.spec_file.exists():
        return
    stored = feed_record.load(conn, spec.name)
    if stored is None:
        return
    other = FeedSpec.from_json(stored.definition, "the definition stored on the source")
    same_sinks = [t.name for t in other.sink_targets] == [t.name for t in spec.sink_targets] and all(
        same_secret(a.uri, b.uri, a.option) for a, b in zip(spec.sink_targets, other.sink_targets))
    differs = [option for option, same in (("--tables", set(other.tables) == set(spec.tables)),
                                           ("--sink", same_sinks)) if not same]
    if differs:
        raise ConfigError(f"feed {spec.name} exists on this source with a different {' and '.join(differs)} "
                          f"(stored by {stored.stored_by} at {stored.stored_at})",
                          "give the same definition (or run --standby --name NAME --source URI, which takes the "
                          "stored one), or choose another --name")


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
    with told_if_slow(f"the {role} {_endpoint(node.uri)} to answer", report), about(spec, node):
        conn = stack.enter_context(connect(node.uri, role))
    with about(spec, node):
        src.check_wal_level(conn)
        tables = src.describe_tables(conn, list(spec.tables), spec.column_lists)
        check_keys(spec, tables)
        printed = row_filter.check(conn, spec.row_filters, spec.name)
        row_filter.check_published(conn, node.publication, list(spec.tables), spec.row_filters, printed,
                                   spec.name)
        if spec.outbox_spec is not None:
            check_outbox_table(conn, spec.outbox_spec)
        slot = slots.slot_state(conn, node.slot)
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
        with about(spec, first):
            conn = stack.enter_context(connect(first.uri, spec.role(first.name)))
            tables = src.describe_tables(conn, list(spec.tables), spec.column_lists)
            _check_same_tables(spec, [_Checked(first, conn, tables, None), checked])
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
        with about(spec, c.node):
            publication = src.ensure_publication(c.conn, c.node.publication, c.tables, spec.row_filters,
                                                 spec.column_lists)
            made: list[str] = []
            created.append((c, publication, made))
            if c.slot is None:
                # (a run that died may have left the prepare slot)
                if spec.multi_node and slots.slot_state(c.conn, c.node.prepare_slot) is None:
                    slots.create_slot(c.conn, c.node.prepare_slot, two_phase=True, failover=spec.failover_slot)
                    made.append(c.node.prepare_slot)
                slots.create_slot(c.conn, c.node.slot, failover=spec.failover_slot)
                made.append(c.node.slot)
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
    state = slots.slot_state(c.conn, c.node.prepare_slot)
    if state is None:
        raise SlotLost(f"replication slot {c.node.prepare_slot} is missing: without it the feed cannot tell which "
                       "commits are parts of one distributed transaction", start_over_hint(spec.name))
    slots.check_slot_usable(state, c.node.prepare_slot, None, spec.name)


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
def about(spec: FeedSpec, node: SourceNode) -> Iterator[None]:
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
    for c, publication, names in created:
        with suppress(psycopg.Error):
            for slot in names:
                slots.drop(c.conn, slot)
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


@contextmanager
def lost_connections(prepared: Prepared) -> Iterator[None]:
    """The runner's own work on the source nodes and the sink: a lost connection is
    ConnectionFailed, naming the server whose connection broke."""
    try:
        yield
    except psycopg.OperationalError as e:
        broken = [n for n, conn in prepared.sources.items() if conn.broken]
        role = prepared.spec.role(broken[0]) if broken else "sink"
        with lost_connection(role):
            raise e from None
