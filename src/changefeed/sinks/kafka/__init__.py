"""The Kafka sink: each change a record on its table's topic, exactly once (Kafka transactions).

`options` parses the URI, `client` tunes librdkafka, `admin` checks the cluster and keeps the
ledger, `batch` writes a batch in one transaction, `probe` decides how its progress is read:
`progress` as a read_committed consumer, or `log` from the transaction markers (`records` decodes
the record batches), `readback` reads a topic as a consumer holds it (verify), `writer` is the
batch writer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from changefeed.sinks.base import BatchWriter, Recorded, Sink, ledger_path
from changefeed.sinks.message_writer import message_options

if TYPE_CHECKING:
    from changefeed.sinks.ledger import Ledger
    from changefeed.spec.definition import FeedSpec
    from changefeed.spec.state import FeedState


class KafkaSink(Sink):
    name = "kafka"
    messages = True  # delivers in arrival order: snapshot chunk rows must come after their window's changes

    def validate(self, uri: str) -> None:
        from changefeed.sinks.kafka.options import KafkaOptions

        KafkaOptions.parse(uri)

    def resumable(self, uri: str) -> bool:
        """Exactly once: the progress record commits with the batch and carries the runner's term."""
        from changefeed.sinks.kafka.options import KafkaOptions

        return KafkaOptions.parse(uri).delivery == "exactly_once"

    def open_ledger(self, spec: "FeedSpec", state: "FeedState") -> "Ledger":
        from changefeed.sinks.kafka.ledger import KafkaLedger
        from changefeed.sinks.kafka.options import KafkaOptions

        return KafkaLedger(ledger_path(spec, state), KafkaOptions.parse(spec.sink), spec.key, outbox=spec.outbox)

    def writer_options(self, spec: "FeedSpec", state: "FeedState") -> dict[str, str]:
        from changefeed.sinks.kafka.options import KafkaOptions
        from changefeed.sinks.kafka.probe import resolve

        opts = resolve(KafkaOptions.parse(spec.sink), spec.key)  # the driver's verdict: writer tasks do not probe
        topics = [opts.topic(*t.split(".", 1)) for t in spec.tables if t != spec.outbox]  # events: their own topics
        return {**message_options(spec, state), "topics": ",".join(topics), "progress_reader": opts.progress_reader}

    def writer(self, options: dict[str, str]) -> BatchWriter:
        from changefeed.sinks.kafka.writer import KafkaWriter

        return KafkaWriter(options)

    def recorded(self, options: dict[str, str]) -> "Recorded":
        from changefeed.sinks.kafka.followed import CommittedEnd
        from changefeed.sinks.kafka.options import KafkaOptions

        return CommittedEnd(KafkaOptions.parse(options["uri"]).reading(options.get("progress_reader") or "auto"),
                            options["key"])

    def check_feed(self, spec: "FeedSpec") -> None:
        from changefeed.errors import ConfigError
        from changefeed.sinks.kafka.options import KafkaOptions

        if spec.low_latency_s and KafkaOptions.parse(spec.sink).delivery != "exactly_once":
            raise ConfigError("--low-latency into Kafka needs delivery=exactly_once: its sub-windows commit as "
                              "transactions, each with its progress record",
                              "drop delivery=at_least_once from the --sink URI, or leave --low-latency out")


SINK = KafkaSink()
