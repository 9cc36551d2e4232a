"""Sinks by URI scheme: `--sink SCHEME://...` names the package `sinks/NAME/` whose `SINK` serves it.

Adding a sink: a package with a `SINK` (sinks.base.Sink) and its schemes here. Packages are
imported only when a feed uses them, so a sink's dependencies cost nothing to feeds without it.
"""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from changefeed.errors import ConfigError

if TYPE_CHECKING:
    from changefeed.sinks.base import Sink
    from changefeed.sinks.ledger import Ledger
    from changefeed.spec.definition import FeedSpec
    from changefeed.spec.state import FeedState

SCHEMES = {"postgresql": "replica", "postgres": "replica", "kafka": "kafka", "webhook-http": "webhook",
           "webhook-https": "webhook", "delta": "delta", "delta+s3": "delta", "delta+gs": "delta",
           "delta+az": "delta", "delta+abfss": "delta"}
EXAMPLES = ("postgresql://USER:PASSWORD@HOST:5432/DB (a replica), kafka://HOST:9092, webhook-https://HOST/PATH "
            "or delta:///ABS/PATH")


def sink_named(name: str) -> "Sink":
    """The sink of package `sinks/NAME/`."""
    sink: Sink = import_module(f"{__package__}.{name}").SINK
    return sink


def sink_of(uri: str) -> "Sink":
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if scheme not in SCHEMES:
        raise ConfigError(f"--sink has an unknown scheme {scheme or '<none>'!r}", f"use {EXAMPLES}")
    return sink_named(SCHEMES[scheme])


def validated(spec: "FeedSpec") -> "FeedSpec":
    """`spec`, checked as a whole: the definition itself, then the sink URI's options and what the
    sink says of the feed (without connecting)."""
    spec.validate()
    sink = sink_of(spec.sink)
    sink.validate(spec.sink)
    sink.check_feed(spec)
    if not sink.messages and (spec.format != "json" or spec.diff):
        raise ConfigError("--format and --diff apply to message sinks (Kafka, webhook), not to a replica",
                          "leave them out: a replica receives rows")
    if spec.outbox and not sink.messages:
        raise ConfigError("--outbox needs a message sink (kafka://, webhook-https://)",
                          "a replica copies the outbox table like any other: leave --outbox out")
    return spec


def open_ledger(spec: "FeedSpec", state: "FeedState") -> "Ledger":
    """The feed's ledger; a sink that keeps it remotely connects (ConnectionFailed, AuthenticationFailed)."""
    return sink_of(spec.sink).open_ledger(spec, state)
