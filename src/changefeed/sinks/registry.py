"""Sinks by URI scheme: `--sink SCHEME://...` names the package `sinks/NAME/` whose `SINK` serves it.

Adding a sink: a package with a `SINK` (sinks.base.Sink) and its schemes in spec.sinks.SCHEMES. Packages are
imported only when a feed uses them, so a sink's dependencies cost nothing to feeds without it.
"""
from __future__ import annotations

from contextlib import nullcontext
from importlib import import_module
from typing import TYPE_CHECKING

from changefeed.errors import ConfigError, SourceNotReady
from changefeed.spec.sinks import kind_of

if TYPE_CHECKING:
    from collections.abc import Sequence

    from changefeed.postgres.source import SourceTable
    from changefeed.sinks.base import Sink
    from changefeed.sinks.ledger import Ledger
    from changefeed.spec.definition import FeedSpec
    from changefeed.spec.sinks import SinkTarget
    from changefeed.spec.state import FeedState


def sink_named(name: str) -> "Sink":
    """The sink of package `sinks/NAME/`."""
    sink: Sink = import_module(f"{__package__}.{name}").SINK
    return sink


def sink_of(uri: str) -> "Sink":
    return sink_named(kind_of(uri))


def sinks_of(spec: "FeedSpec") -> list[tuple["SinkTarget", "FeedSpec", "Sink"]]:
    """Each sink of the feed: its target, the feed as it sees it (FeedSpec.for_sink), its kind."""
    views = [(t, spec.for_sink(t)) for t in spec.sink_targets]
    return [(t, view, sink_of(view.sink)) for t, view in views]


def validated(spec: "FeedSpec") -> "FeedSpec":
    """`spec`, checked as a whole: the definition itself, then each sink URI's options and what
    each sink says of the feed (without connecting)."""
    from changefeed.sinks.fan_out import named

    spec.validate()
    kinds = []
    for target, one, sink in sinks_of(spec):
        with named(target.name) if spec.several_sinks else nullcontext():
            sink.validate(one.sink)
            sink.check_feed(one)
        kinds.append(sink)
    if not any(k.messages for k in kinds) and (spec.format != "json" or spec.diff):
        raise ConfigError("--format and --diff apply to message sinks (Kafka, webhook), not to a replica",
                          "leave them out: a replica receives rows")
    if spec.outbox and not any(k.messages for k in kinds):
        raise ConfigError("--outbox needs a message sink (kafka://, webhook-https://)",
                          "a replica copies the outbox table like any other: leave --outbox out")
    return spec


def check_keys(spec: "FeedSpec", tables: "Sequence[SourceTable]") -> None:
    """Refuse a table without a key (postgres.source.describe_tables: REPLICA IDENTITY FULL, no
    primary key) for a sink that applies changes by key."""
    from changefeed.postgres.source import keyless

    without = keyless(tables)
    by_key = [target.name for target, view, sink in sinks_of(spec) if sink.needs_key(view.sink)]
    if without and by_key:
        raise SourceNotReady(f"table {', '.join(without)} has no primary key (REPLICA IDENTITY FULL only): sink "
                             f"{', '.join(by_key)} applies each change to the row of its key",
                             f"ALTER TABLE {without[0]} ADD PRIMARY KEY (...); or capture the table in a feed whose "
                             "sinks only append (Kafka, webhooks, a Delta change log: delta://...?mode=changelog)")


def open_ledger(spec: "FeedSpec", state: "FeedState") -> "Ledger":
    """The feed's ledger (with several sinks, all of theirs as one: sinks.ledgers); a sink that
    keeps it remotely connects (ConnectionFailed, AuthenticationFailed)."""
    if not spec.several_sinks:
        [(_, one, sink)] = sinks_of(spec)
        return sink.open_ledger(one, state)
    from changefeed.sinks.fan_out import named
    from changefeed.sinks.ledgers import SinkLedgers

    each: list[tuple[str, Ledger]] = []
    try:
        for target, one, sink in sinks_of(spec):
            with named(target.name):
                each.append((target.name, sink.open_ledger(one, state)))
    except BaseException:
        SinkLedgers(each).close()
        raise
    return SinkLedgers(each)
