"""Sinks by URI scheme: `--sink SCHEME://...` names the package `sinks/NAME/` whose `SINK` serves it.

Adding a sink: a package with a `SINK` (sinks.base.Sink) and its schemes here. Packages are
imported only when a feed uses them, so a sink's dependencies cost nothing to feeds without it.
"""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import FeedSpec, FeedState
    from .base import Sink
    from .ledger import Ledger

SCHEMES = {"postgresql": "replica", "postgres": "replica", "kafka": "kafka", "webhook-http": "webhook",
           "webhook-https": "webhook", "delta": "delta", "delta+s3": "delta", "delta+gs": "delta",
           "delta+az": "delta", "delta+abfss": "delta"}
EXAMPLES = ("postgresql://USER:PASSWORD@HOST:5432/DB (a replica), kafka://HOST:9092, webhook-https://HOST/PATH "
            "or delta:///ABS/PATH")


def sink_named(name: str) -> "Sink":
    """The sink of package `sinks/NAME/`."""
    return import_module(f"{__package__}.{name}").SINK  # type: ignore[no-any-return]


def sink_of(uri: str) -> "Sink":
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if scheme not in SCHEMES:
        raise ConfigError(f"--sink has an unknown scheme {scheme or '<none>'!r}", f"use {EXAMPLES}")
    return sink_named(SCHEMES[scheme])


def validate_sink(uri: str) -> None:
    """Check the sink URI and its options without connecting."""
    sink_of(uri).validate(uri)


def open_ledger(spec: "FeedSpec", state: "FeedState") -> "Ledger":
    """The feed's ledger; a sink that keeps it remotely connects (ConnectionFailed, AuthenticationFailed)."""
    return sink_of(spec.sink).open_ledger(spec, state)
