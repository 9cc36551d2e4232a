"""Sink kinds by URI scheme: how `--sink` is checked, which Spark sink writes, where its ledger is.

Adding a sink: its module(s) here and in `spark/`, and one entry in SINKS.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import FeedSpec, FeedState
    from .ledger import Ledger


@dataclass(frozen=True)
class SinkKind:
    name: str
    spark_format: str  # the Spark data source that writes it
    messages: bool  # delivers formatted messages (--format), not rows
    parallel_reads: bool  # arrival order of a batch's partitions at the writer does not matter


REPLICA = SinkKind("replica", "changefeed-postgres", messages=False, parallel_reads=True)
# A message sink delivers in arrival order: snapshot chunk rows must come after their window's changes.
WEBHOOK = SinkKind("webhook", "changefeed-webhook", messages=True, parallel_reads=False)
KAFKA = SinkKind("kafka", "changefeed-kafka", messages=True, parallel_reads=False)
SINKS = {"postgresql": REPLICA, "postgres": REPLICA, "webhook-http": WEBHOOK, "webhook-https": WEBHOOK,
         "kafka": KAFKA}
EXAMPLES = "postgresql://USER:PASSWORD@HOST:5432/DB (a replica), kafka://HOST:9092 or webhook-https://HOST/PATH"


def sink_kind(uri: str) -> SinkKind:
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if scheme not in SINKS:
        raise ConfigError(f"--sink has an unknown scheme {scheme or '<none>'!r}", f"use {EXAMPLES}")
    return SINKS[scheme]


def validate_sink(uri: str) -> None:
    """Check the sink URI and its options without connecting."""
    kind = sink_kind(uri)
    if kind is WEBHOOK:
        from .webhook import WebhookOptions

        WebhookOptions.parse(uri)
    elif kind is KAFKA:
        from .kafka import KafkaOptions

        KafkaOptions.parse(uri)


def open_ledger(spec: "FeedSpec", state: "FeedState") -> "Ledger":
    """The feed's ledger; for the replica this connects (ConnectionFailed, AuthenticationFailed)."""
    kind = sink_kind(spec.sink)
    if kind is REPLICA:
        from ..postgres.connect import connect
        from .postgres_replica import ReplicaLedger

        return ReplicaLedger(connect(spec.sink, "sink"), spec.name)
    if kind is KAFKA:
        from .kafka import KafkaOptions
        from .kafka_admin import KafkaLedger

        return KafkaLedger(ledger_path(state), KafkaOptions.parse(spec.sink), spec.name, outbox=spec.outbox)
    from .webhook import WebhookOptions
    from .webhook_batch import WebhookLedger

    return WebhookLedger(ledger_path(state), WebhookOptions.parse(spec.sink))


def ledger_path(state: "FeedState") -> str:
    return str(state.dir / "delivered.jsonl")
