"""A feed's sinks: a bare `--sink URI`, named ones (`--sink NAME=URI`), or both, all fed from
one read of the slot.

Each sink keeps its own ledger under its own key, so that a batch replayed after a crash between
two sinks' commits reaches only the sinks that lack it. The bare sink (a feed made before sinks had
names, or with one sink) keeps the feed's name as its key, so its ledger stays where it was; a
named sink's key is `FEED.NAME`. A message sink may carry its own `format` and `diff` in its URI's
query, taken out here before the sink reads the URI: they override the feed's --format and --diff
for that sink alone.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit, urlunsplit

from changefeed.errors import ConfigError

# Which sink package (sinks/NAME/) serves a URI scheme; sinks.registry imports the package.
SCHEMES = {"postgresql": "replica", "postgres": "replica", "kafka": "kafka", "webhook-http": "webhook",
           "webhook-https": "webhook", "delta": "delta", "delta+s3": "delta", "delta+gs": "delta",
           "delta+az": "delta", "delta+abfss": "delta"}
EXAMPLES = ("postgresql://USER:PASSWORD@HOST:5432/DB (a replica), kafka://HOST:9092, webhook-https://HOST/PATH "
            "or delta:///ABS/PATH")
_SINK_NAME = re.compile(r"^[a-z][a-z0-9_]{0,19}$")
ENVELOPE_KEYS = ("format", "diff")  # of a message sink's URI: its own envelope
MESSAGE_KINDS = ("kafka", "webhook")  # the sinks that deliver messages (sinks.base.Sink.messages)


@dataclass(frozen=True)
class SinkTarget:
    """One sink of a feed: its name (the bare sink's is its kind: replica, kafka, ...), its URI
    as stored, and the key its ledger is kept under."""

    name: str
    uri: str
    key: str
    bare: bool = False

    @property
    def option(self) -> str:
        """How messages name its URI's option."""
        return "--sink" if self.bare else f"--sink {self.name}"


def targets(feed: str, bare: str, named: tuple[tuple[str, str], ...]) -> tuple[SinkTarget, ...]:
    """The sinks of feed `feed`: the bare one first, then the named ones in the order given."""
    out = [SinkTarget(kind_of(bare), bare, feed, bare=True)] if bare else []
    return (*out, *(SinkTarget(name, uri, f"{feed}.{name}") for name, uri in named))


def kind_of(uri: str) -> str:
    """The sink package serving `uri` (ConfigError for an unknown scheme)."""
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if scheme not in SCHEMES:
        raise ConfigError(f"--sink has an unknown scheme {scheme or '<none>'!r}", f"use {EXAMPLES}")
    return SCHEMES[scheme]


def parse_sinks(given: list[str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """`--sink` values -> FeedSpec's (sink, sinks): a bare URI is the bare sink (named by its kind in
    messages, its ledger under the feed's name: a feed made with one sink that gets more later);
    named ones (`NAME=URI`) are listed in order."""
    pairs = [parse_sink(text) for text in given]
    bare = [uri for name, uri in pairs if not name]
    if len(bare) > 1:
        raise ConfigError("--sink given several times without a name",
                          "name each sink: --sink NAME=URI (e.g. --sink dr=postgresql://... --sink events=kafka://...)")
    return (bare[0] if bare else ""), tuple((name, uri) for name, uri in pairs if name)


def parse_sink(text: str) -> tuple[str, str]:
    """One `--sink` value -> (name, URI); name "" for a bare URI."""
    name, sep, uri = text.partition("=")
    named = bool(sep) and "://" not in name and "/" not in name and "?" not in name
    return (name.strip(), uri.strip()) if named else ("", text.strip())


def check_names(sinks: tuple[SinkTarget, ...]) -> None:
    """ConfigError for a sink name that is not allowed, one given twice, or a URI given twice."""
    for t in sinks:
        if not t.bare and not _SINK_NAME.match(t.name):
            raise ConfigError(f"sink name {t.name!r} is not allowed",
                              "use 1-20 lowercase letters, digits or _, starting with a letter")
    names = [t.name for t in sinks]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"two sinks are named {twice[0]}", "give each --sink NAME=URI its own name")
    uris = [t.uri for t in sinks]
    again = [t for t in sinks if uris.count(t.uri) > 1]
    if again:
        raise ConfigError(f"sinks {' and '.join(t.name for t in again)} have the same URI",
                          "each sink keeps its own ledger where it writes: give each its own destination")


def envelope_of(uri: str) -> tuple[str, dict[str, str]]:
    """(`uri` without its `format` and `diff` query keys, those keys' values) of a message sink;
    (`uri`, {}) of any other (where such keys are the sink's own, e.g. Delta's diff)."""
    if kind_of(uri) not in MESSAGE_KINDS:
        return uri, {}
    parts = urlsplit(uri)
    kept, own = [], {}
    for pair in parts.query.split("&") if parts.query else []:  # as written: the rest keeps its encoding
        key, _, value = pair.partition("=")
        if unquote(key) in ENVELOPE_KEYS:
            own[unquote(key)] = unquote(value)
        else:
            kept.append(pair)
    return (urlunsplit(parts._replace(query="&".join(kept))), own) if own else (uri, {})
