"""Sinks come and go on a feed, running or not: `alter --add-sink NAME=URI` and `--remove-sink NAME`.

An added sink gets its targets and ledger made first (nothing else changes if that fails), then
the definition, then (unless `--no-snapshot`) a snapshot request for it alone: the captured
tables' existing rows, read for that sink only (core.sink_scope), while the stream goes on for
all. A running feed restarts its query with the new set of sinks at its next report; the request
is taken in only by a query that writes to the sink. A removed sink's ledger is dropped once no
query writes to it: by the runner as it restarts without it, or here for a feed not running.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import closing

from changefeed.control.lag_budget import Lag
from changefeed.control.runner_lock import holder
from changefeed.errors import ConfigError
from changefeed.postgres import requests
from changefeed.postgres import source as src
from changefeed.postgres.connect import first_node, lost_connection
from changefeed.sinks.fan_out import named
from changefeed.sinks.registry import check_keys, sinks_of, validated
from changefeed.spec.definition import FeedSpec
from changefeed.spec.sinks import SinkTarget, parse_sink
from changefeed.spec.state import FeedState


def add_sink(spec: FeedSpec, state: FeedState, given: str, *, snapshot: bool = True,
             report: Callable[[str], None] = print) -> FeedSpec:
    """Add the sink `given` (NAME=URI) to the feed; its snapshot request follows unless not `snapshot`."""
    name, uri = parse_sink(given)
    if not name:
        raise ConfigError("--add-sink takes NAME=URI", "e.g. --add-sink lake=delta:///data/lake")
    grown = validated(FeedSpec(**{**spec.__dict__, "sinks": (*spec.sinks, (name, uri))})).protected()
    grown.check_secrets()
    target = grown.sink_named(name)
    [(_, view, sink)] = [s for s in sinks_of(grown) if s[0] == target]
    with first_node(spec) as conn:
        tables = src.describe_tables(conn, list(spec.tables), spec.column_lists)
    check_keys(grown, tables)
    keyless = src.keyless(tables)
    if snapshot and keyless:  # (the others go on taking its changes meanwhile: core.snapshot.held_back holds all)
        raise ConfigError(f"table {', '.join(keyless)} has no key: a sink added to a running feed cannot be given its "
                          "existing rows without some of its changes twice",
                          f"add the sink with --no-snapshot (changes from now on), or capture {keyless[0]} in a "
                          "feed of its own")
    with named(name), lost_connection("sink"), closing(sink.open_ledger(view, state)) as ledger:
        ledger.check()
        if ledger.checkpoint() is not None:
            raise ConfigError(f"sink {name} ({target.key}) holds batches of feed {spec.name} already",
                              "give the sink another name, or clear its ledger (changefeed.progress on a replica, "
                              "the progress topic's records, the lake's _changefeed folder)")
        ledger.prepare(tables)
        for note in ledger.notes():
            report(f"feed {spec.name}: sink {name}: {note}")
    state.save(grown)
    if snapshot:
        with requests.on_source(spec, state) as queued:
            queued.add(list(spec.tables), only=(name,))
    return grown


def remove_sink(spec: FeedSpec, state: FeedState, name: str) -> FeedSpec:
    """Remove sink `name` from the feed; its ledger is dropped (now, or by the running runner)."""
    target = spec.sink_named(name)
    if len(spec.sink_targets) == 1:
        raise ConfigError(f"{name} is the only sink of feed {spec.name}", "a feed needs a sink: add another first, "
                          "or remove the feed (changefeed remove)")
    shrunk = spec.without_sinks({name})
    if not shrunk.several_sinks:  # (nothing left to go on without it)
        shrunk = FeedSpec(**{**shrunk.__dict__, "sink_lag_budget_s": 0.0, "sink_lag_budget_bytes": 0})
    state.save(validated(shrunk))
    with first_node(spec) as conn:
        requests.void(conn, spec.name, name)
    if holder(state) is None:
        forget([target], spec, state)
        Lag.load(state).forget({name})
    return shrunk


def forget(gone: list[SinkTarget], spec: FeedSpec, state: FeedState) -> None:
    """Drop the ledgers of sinks `gone` of `spec` (no query writes to them any more)."""
    for target, view, sink in sinks_of(spec):
        if target in gone:
            with named(target.name), lost_connection("sink"), closing(sink.open_ledger(view, state)) as ledger:
                ledger.forget()


def gone(before: FeedSpec, after: FeedSpec) -> list[SinkTarget]:
    """The sinks of `before` that `after` has not."""
    return [t for t in before.sink_targets if t not in after.sink_targets]

