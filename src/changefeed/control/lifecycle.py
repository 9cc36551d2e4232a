"""A feed's life outside `run`: create, list, pause, resume, remove; tables added, snapshots asked for.

Feed definitions live under the state directory (`DIR/NAME/feed.json`). A paused feed keeps its
slot, so the source holds its WAL and `resume` catches up from the checkpoint; a runner that sees
the pause stops cleanly at its next report. `remove` drops what the feed created on the source
(slot, publication), its rows in the sink's bookkeeping tables, and its state folder; the
replica's tables stay.
"""
from __future__ import annotations

import shutil
from collections.abc import Sequence
from contextlib import ExitStack, closing, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psycopg import sql

from changefeed import faults
from changefeed.control.attach import add_source, prepare
from changefeed.control.runner_lock import holder, run_state
from changefeed.control.status import holding, paused_elsewhere, runners
from changefeed.core import snapshot
from changefeed.errors import ChangefeedError, ConfigError, FeedBusy
from changefeed.postgres import ddl_capture, feed_record, lease, requests, slots
from changefeed.postgres import source as src
from changefeed.postgres.connect import connect, first_node, redact
from changefeed.postgres.source import split_table
from changefeed.sinks.registry import check_keys, open_ledger, sinks_of
from changefeed.spec.definition import FeedSpec, SourceNode
from changefeed.spec.state import FeedState


def create(spec: FeedSpec, state: FeedState) -> None:
    """Check everything and create publication, slot and target tables, without running."""
    if state.load() is not None:
        raise ConfigError(f"feed {spec.name} already exists ({state.spec_file})",
                          "run it with changefeed run --name NAME, or remove it first")
    with ExitStack() as stack:
        prepare(spec, state, stack)


@dataclass
class Listed:
    name: str
    state: str  # see runner_lock.run_state
    tables: tuple[str, ...]
    source: str
    sink: str
    active: str | None = None  # who holds the lease now, on any host (status.holding); None: nobody
    standbys: list[str] = field(default_factory=list)


def list_feeds(root: Path | str) -> list[Listed]:
    out = []
    for spec_file in sorted(Path(root).glob("*/feed.json")):
        state = FeedState(root, spec_file.parent.name)
        spec = state.load()
        assert spec is not None
        source = redact(spec.source) if not spec.nodes else \
            ", ".join(f"{n.name}={redact(n.uri)}" for n in spec.sources)
        sinks = ", ".join(redact(t.uri) if t.bare else f"{t.name}={redact(t.uri)}" for t in spec.sink_targets)
        listed = Listed(spec.name, run_state(state), spec.tables, source, sinks)
        with suppress(ChangefeedError):  # a source that does not answer: the state folder's view only
            held, listed.standbys, by = runners(spec)
            listed.active = holding(held) if held is not None and not held.free else None
            listed.state = paused_elsewhere(listed.state, by)
        out.append(listed)
    return out


def pause(spec: FeedSpec, state: FeedState) -> bool:
    """Pause the feed here and on its first source node, where the runner that is active and its
    standbys, on any host, see it; False if the source was out of reach (paused here only)."""
    state.paused_file.touch()
    try:
        with first_node(spec, connect_timeout=5) as conn:
            feed_record.pause(conn, spec.name, lease.me())
    except ChangefeedError:
        return False
    return True


def remove(spec: FeedSpec, state: FeedState) -> list[str]:
    """Drop the feed's slot, publication, sink bookkeeping and state folder; returns what went."""
    who = holder(state)
    if who:
        raise FeedBusy(f"feed {spec.name} is running: held by {who}", "stop it (or pause it) first, then remove it")
    gone = []
    with ExitStack() as stack:
        # every node checked before anything is dropped on any
        held = [(node, _held_for_removal(spec, node, stack)) for node in spec.sources]
        for node, (conn, slot) in held:
            gone += _drop(conn, spec.name, node, slot, f" on source node {node.name}" if spec.multi_node else "")
        lease.forget(held[0][1][0], spec.name)  # its lease and terms: a feed made again starts at term 1
        feed_record.forget(held[0][1][0], spec.name)
        requests.forget(held[0][1][0], spec.name)
    with closing(open_ledger(spec, state)) as ledger:
        if ledger.forget():
            kinds = {sink.name for _, _, sink in sinks_of(spec)}
            gone.append("its bookkeeping in the sink (changefeed.progress and changefeed.snapshot_chunks)"
                        if kinds == {"replica"} and not spec.several_sinks else
                        "its delivery ledger" + ("s" if spec.several_sinks else ""))
    shutil.rmtree(state.dir)
    gone.append(f"state folder {state.dir}")
    return gone


def add_tables(spec: FeedSpec, state: FeedState, tables: tuple[str, ...], *, snapshot: bool = True) -> FeedSpec:
    """Bring `tables` into the feed, running or not: target tables, publication, then a request
    for their existing rows (the stream carries their changes from the publication change on).

    A batch whose window brings a change of them has taken the request in, so the sinks get
    nothing of them before their read, which is a first read (core.judge): no change it saw comes
    again. On a feed of one node the request is made in the transaction that publishes the
    tables, and a runner takes requests in once a window's end is fixed (spark.source); on a feed
    of several, the publications and the request are made under a lock a runner fixes a window's
    end under (postgres.requests.publishing)."""
    new = tuple(t for t in tables if t not in spec.tables)
    if not new:
        raise ConfigError(f"feed {spec.name} already captures {', '.join(tables)}", "name tables it does not capture")
    grown = FeedSpec(**{**spec.__dict__, "tables": spec.tables + new}).validate()
    with ExitStack() as stack:
        conns = [(node, stack.enter_context(connect(node.uri, spec.role(node.name))))
                 for node in spec.sources]
        # on every node first
        described = [src.describe_tables(conn, list(grown.tables), grown.column_lists) for _, conn in conns]
        check_keys(grown, described[0])
        ledger = open_ledger(spec, state)
        stack.callback(ledger.close)
        ledger.prepare(described[0][len(spec.tables):])  # before the publications: changes need a target
        first = conns[0][1]  # (where the feed's requests are: postgres.requests)
        queued = requests.SourceRequests(lambda: first, spec.name, state.requests)
        with requests.publishing(first, spec.name) if spec.multi_node else nullcontext():
            for (node, conn), node_tables in zip(conns, described):
                with conn.transaction():
                    src.ensure_publication(conn, node.publication, node_tables, grown.row_filters,
                                           grown.column_lists)
                    if snapshot and not spec.multi_node:
                        queued.add(new, first=True)
                if spec.capture_ddl:  # the new tables' shapes
                    ddl_capture.install(conn, spec.name, node.publication)
            if snapshot and spec.multi_node:  # (once published everywhere: a read must see every change before)
                faults.reach("tables_published")
                queued.add(new, first=True)
    state.save(grown)
    return grown


def add_node(spec: FeedSpec, state: FeedState, name: str, uri: str) -> FeedSpec:
    """Add source node `name` at `uri` to a feed of several nodes, running or not: check it, create
    its publication and slot, store it, and ask for its existing rows (a running feed restarts
    its query to read the node; see control.runner.run)."""
    if not spec.multi_node:
        raise ConfigError(f"feed {spec.name} reads one unnamed source: it cannot take more nodes",
                          "create the feed with named nodes (--source NAME=URI ...), which may be one")
    from changefeed.spec.secrets import protect_uri

    uri = protect_uri(uri, f"--add-node {name}")
    grown = FeedSpec(**{**spec.__dict__, "nodes": spec.nodes + ((name, uri),)}).validate()
    node = next(n for n in grown.sources if n.name == name)
    # A running query plans no batch from here until it reads the new node: a distributed
    # transaction with a part there would look whole without it (postgres/cut.py).
    state.set_joining([*state.joining(), name])
    try:
        add_source(grown, node)
    except BaseException:
        state.set_joining([n for n in state.joining() if n != name])
        raise
    state.save(grown)
    if spec.snapshot != "never":
        _request(spec, state, [snapshot.on_node(name, t) for t in spec.tables])
    return grown


def capture_ddl(spec: FeedSpec, state: FeedState) -> FeedSpec:
    """Turn on --capture-ddl for a feed, running or not: its event triggers from now on."""
    on = FeedSpec(**{**spec.__dict__, "capture_ddl": True}).validate()
    with ExitStack() as stack:
        for node in spec.sources:
            ddl_capture.install(stack.enter_context(connect(node.uri, spec.role(node.name))), spec.name,
                                node.publication)
    state.save(on)
    return on


def set_rates(spec: FeedSpec, state: FeedState, rates: dict[str, int]) -> FeedSpec:
    """Change --snapshot-rate / --max-rate, running or not: a running feed's source reads them from
    the stored definition as it plans its next batch (spark.source)."""
    changed = FeedSpec(**{**spec.__dict__, **rates}).validate()
    state.save(changed)
    return changed


def rename_table(spec: FeedSpec, state: FeedState, old: str, new: str) -> FeedSpec:
    """Follow a table renamed on the source: the stopped feed captures it under its new name (its
    rows before the rename, still in the WAL under the old one, go to it too), and a replica's
    table is renamed the same way."""
    if old not in spec.tables:
        raise ConfigError(f"feed {spec.name} does not capture {old}", f"its tables: {', '.join(spec.tables)}")
    if new in spec.tables:
        raise ConfigError(f"feed {spec.name} captures {new} already", "name the table's new name once")
    who = holder(state)
    if who:
        raise FeedBusy(f"feed {spec.name} is running: held by {who}", "stop it first")
    renamed = FeedSpec(**{**spec.__dict__, "tables": tuple(new if t == old else t for t in spec.tables),
                          "renamed": (*spec.renamed, (old, new))}).validate()
    with ExitStack() as stack:
        for node in spec.sources:
            src.describe_tables(stack.enter_context(connect(node.uri, spec.role(node.name))), [new])
        for target, one, sink in sinks_of(spec):
            if sink.name == "replica":
                _rename_on_replica(stack.enter_context(connect(one.sink, target.option[2:])), old, new)
    state.save(renamed)
    return renamed


def _rename_on_replica(conn: Any, old: str, new: str) -> None:
    (old_schema, old_name), (new_schema, new_name) = split_table(old), split_table(new)
    if conn.execute("SELECT to_regclass(%s)", (sql.Identifier(new_schema, new_name).as_string(conn),)).fetchone()[0]:
        return  # renamed before (or created by alter --add-tables)
    with conn.transaction():
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(new_schema)))
        if old_schema != new_schema:
            conn.execute(sql.SQL("ALTER TABLE {} SET SCHEMA {}").format(sql.Identifier(old_schema, old_name),
                                                                     sql.Identifier(new_schema)))
        if old_name != new_name:
            conn.execute(sql.SQL("ALTER TABLE {} RENAME TO {}").format(sql.Identifier(new_schema, old_name),
                                                                    sql.Identifier(new_name)))


def remove_node(spec: FeedSpec, state: FeedState, name: str) -> tuple[FeedSpec, list[str]]:
    """Take node `name` out of a stopped feed and drop its slot and publication there; its rows
    on the replica stay. Returns the feed and what went."""
    if name not in [n.name for n in spec.sources]:
        raise ConfigError(f"feed {spec.name} has no node {name}",
                          f"its nodes: {', '.join(n.name for n in spec.sources)}")
    if len(spec.sources) == 1:
        raise ConfigError(f"node {name} is the feed's only node", "remove the feed instead (changefeed remove)")
    who = holder(state)
    if who:
        raise FeedBusy(f"feed {spec.name} is running: held by {who}", "stop it (or pause it) first")
    shrunk = FeedSpec(**{**spec.__dict__, "nodes": tuple(p for p in spec.nodes if p[0] != name)}).validate()
    node = next(n for n in spec.sources if n.name == name)
    with ExitStack() as stack:
        conn, slot = _held_for_removal(spec, node, stack)
        state.save(shrunk)  # before anything is dropped: a crash leaves a slot behind, never a node without one
        state.set_joining([n for n in state.joining() if n != name])
        return shrunk, _drop(conn, spec.name, node, slot)


def _held_for_removal(spec: FeedSpec, node: SourceNode, stack: ExitStack) -> tuple[Any, slots.SlotState | None]:
    """A connection to `node` holding the feed's lock there (refused while a runner elsewhere holds
    it), and the feed's slot there, which must not be in use."""
    conn = stack.enter_context(connect(node.uri, spec.role(node.name)))
    src.lock_feed(conn, spec.name)
    slot = slots.slot_state(conn, node.slot)
    if slot is not None and slot.active_pid:
        raise FeedBusy(f"replication slot {node.slot} is in use by backend pid {slot.active_pid}",
                       "stop whatever reads it first")
    return conn, slot


def _drop(conn: Any, feed: str, node: SourceNode, slot: slots.SlotState | None, on: str = "") -> list[str]:
    """Drop the feed's slot, publication and DDL capture on `node`; what went."""
    gone = [f"{what}{on}" for what in ddl_capture.uninstall(conn, feed)]
    if slot is not None:
        slots.drop(conn, node.slot)
        gone.append(f"slot {node.slot}{on}")
    for extra in (node.prepare_slot, node.lag_slot):
        if slots.slot_state(conn, extra) is not None:
            slots.drop(conn, extra)
            gone.append(f"slot {extra}{on}")
    if conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (node.publication,)).fetchone():
        conn.execute(sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(node.publication)))
        gone.append(f"publication {node.publication}{on}")
    return gone


def request_snapshot(spec: FeedSpec, state: FeedState, tables: tuple[str, ...]) -> int:
    """Ask the feed to read `tables`' existing rows again (while it keeps streaming)."""
    unknown = [t for t in tables if t not in spec.tables]
    if unknown:
        raise ConfigError(f"feed {spec.name} does not capture {', '.join(unknown)}",
                          "add them first with changefeed alter --add-tables")
    with first_node(spec) as conn:
        keyless = src.keyless(src.describe_tables(conn, list(tables), spec.column_lists))
    if keyless:
        raise ConfigError(f"table {', '.join(keyless)} has no key: its rows sent again could not be told from new "
                          "equal rows by the sinks, which hold its rows already",
                          "leave it out of --tables; to start a sink over, remove the feed and create it again")
    return _request(spec, state, tables)


def _request(spec: FeedSpec, state: FeedState, tables: Sequence[str]) -> int:
    """Queue a snapshot request of `tables` where every runner of the feed reads it: on its first
    source node (postgres.requests)."""
    with requests.on_source(spec, state) as queued:
        return queued.add(tables)
