"""Which progress reader an exactly-once feed uses: `progress_reader=auto|consumer|markers`.

`consumer` (sinks.kafka.progress) relies on the broker honouring `read_committed`: its Fetch
answers list the aborted transactions, so a read_committed consumer never gets their records
(Apache Kafka, Confluent, MSK, Redpanda). `markers` (sinks.kafka.log) relies only on what every
broker must do, write COMMIT / ABORT control markers after a transaction's records, and reads
them itself; it speaks fewer logins (`log.unsupported_settings`). Trusting a consumer on a broker
that leaks aborted records would take an aborted batch's progress record for a committed one, and
skip that batch: lost changes. So `auto` asks the broker once per feed start, on the driver:

the probe writes one record (key `changefeed-probe`, never a feed's name, which has no `-`) to
partition 0 of the progress topic in a transaction of its own (`changefeed-probe-FEED`), aborts
it, and reads from that record on as a read_committed consumer. Seeing the record means the
broker leaks aborted records: markers. Passing it unseen (a later record, or the end of the
partition past it) means it honours read_committed: consumer. No answer within `timeout` (an open
transaction holding the last stable offset back) is no proof: markers, the reader that is right on
every broker, or a transient error where the sink's settings rule markers out; it is not kept.

The verdict is kept per process by (bootstrap servers, progress topic), and handed to the Spark
writer tasks in the writer options (`resolve` gives the options with the reader named), so the
batches do not probe again.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from changefeed.errors import ChangefeedError, ConfigError, SinkError, TransientError
from changefeed.sinks.kafka.failures import kafka_error
from changefeed.sinks.kafka.options import KafkaOptions
from changefeed.sinks.kafka.progress import POLL_S, consumer_config

PROBE_KEY = b"changefeed-probe"
_verdicts: dict[tuple[str, str], Verdict] = {}


@dataclass(frozen=True)
class Verdict:
    """The reader to use, and how that was decided (for the start's log line)."""

    reader: str  # consumer | markers
    probed: bool  # False: named by progress_reader
    seen: str = ""  # what the probe saw
    certain: bool = True  # False: the probe got no answer (markers, as they are right everywhere)

    def line(self) -> str:
        if not self.probed:
            how = "a read_committed consumer" if self.reader == "consumer" else "transaction markers"
            return f"kafka progress: progress_reader={self.reader} (as set), reading with {how}"
        if self.reader == "consumer":
            return f"kafka progress: broker honours read_committed ({self.seen}), reading with a consumer"
        return f"kafka progress: broker {self.seen} (probe), reading transaction markers"


def probe_id(feed: str) -> str:
    """The probe's transactional id: its own, so the probe never fences the feed's producer."""
    return f"changefeed-probe-{feed}"


def probe(opts: KafkaOptions, feed: str) -> Verdict:
    """Write and abort a probe record on the progress topic, then see whether a read_committed consumer gets it."""
    from confluent_kafka import KafkaException

    try:
        offset = _aborted_record(opts, feed)
        return _consumer_sees(opts, offset)
    except KafkaException as e:
        error = kafka_error(e, f"probing whether it honours read_committed (as {probe_id(feed)})", opts)
        raise _named(error) from None
    except ChangefeedError as e:
        raise _named(e) from None


def verdict(opts: KafkaOptions, feed: str) -> Verdict:
    """The reader for the feed: as named, else the probe's verdict (once per process and progress topic)."""
    if opts.progress_reader != "auto":
        return Verdict(opts.progress_reader, probed=False)
    key = (opts.bootstrap, opts.progress_topic)
    found = _verdicts.get(key) or probe(opts, feed)
    if found.certain:  # no answer is asked again at the next start
        _verdicts[key] = found
    return found


def resolve(opts: KafkaOptions, feed: str) -> KafkaOptions:
    """`opts` with progress_reader consumer or markers (as given or probed); a ConfigError if the
    broker needs the marker reader and it cannot use the sink's settings. At-least-once feeds read
    no progress: their options are returned as they are."""
    if opts.delivery != "exactly_once":
        return opts
    found = verdict(opts, feed)
    if found.reader == "markers" and found.probed:
        try:
            opts.check_markers(f"Kafka {opts.bootstrap} {found.seen}")
        except ConfigError as e:
            if found.certain:
                raise
            raise TransientError(e.message, "an open transaction on the progress topic (another feed's that died "
                                 "mid-commit: the broker aborts it after its transaction.timeout.ms) may hold "
                                 "read_committed consumers back; run the feed again, or set progress_reader=consumer "
                                 "on a broker that honours read_committed") from None
    return opts.reading(found.reader)


def _aborted_record(opts: KafkaOptions, feed: str) -> int:
    """The offset of a record written to partition 0 of the progress topic in an aborted transaction."""
    from confluent_kafka import Producer

    offsets: list[int] = []
    failed: list[Any] = []

    def delivered(err: Any, msg: Any) -> None:
        (failed if err is not None else offsets).append(err if err is not None else msg.offset())

    producer = Producer({**opts.producer_config(feed), "transactional.id": probe_id(feed)})
    topic = producer.list_topics(opts.progress_topic, timeout=opts.timeout_s).topics.get(opts.progress_topic)
    if topic is None or topic.error is not None or 0 not in topic.partitions:
        raise SinkError(f"Kafka {opts.bootstrap} has no progress topic {opts.progress_topic} to probe",
                        "run the feed (it creates the topic), or create it: one partition, cleanup.policy=compact")
    producer.init_transactions(opts.timeout_s)
    producer.begin_transaction()
    producer.produce(opts.progress_topic, key=PROBE_KEY, value=b'{"probe":"aborted on purpose"}', partition=0,
                     on_delivery=delivered)
    left = producer.flush(opts.timeouts.delivery_ms / 1000 + opts.timeout_s)
    producer.abort_transaction(opts.timeout_s)
    if failed:
        from confluent_kafka import KafkaException

        raise KafkaException(failed[0])
    if left or not offsets:
        raise TransientError(f"Kafka {opts.bootstrap}: the probe record was not acknowledged in time",
                             "the broker may be slow; run the feed again")
    return offsets[0]


def _consumer_sees(opts: KafkaOptions, offset: int) -> Verdict:
    """Read from `offset` as a read_committed consumer until the probe record or a position past it shows."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    consumer = Consumer(consumer_config(opts.client_config(), "probe"))
    try:
        consumer.assign([TopicPartition(opts.progress_topic, 0, offset)])
        deadline = time.monotonic() + opts.timeout_s
        while time.monotonic() < deadline:
            msg = consumer.poll(POLL_S)
            if msg is None:
                continue
            err = msg.error()
            if err is not None and err.code() != KafkaError._PARTITION_EOF:
                continue  # librdkafka retries; no answer in time is no proof either way
            at = msg.offset() or 0  # (typed as optional: set on every message and end-of-partition event)
            if err is None and at == offset:
                return Verdict("markers", True, "leaks aborted records to read_committed consumers")
            if at > offset:  # a later record, or the end of the partition, past the probe's
                return Verdict("consumer", True, f"the probe's aborted record at offset {offset} was skipped")
        return Verdict("markers", True, f"gave a read_committed consumer nothing past offset {offset} within "
                                        f"{opts.timeout_s:g} s", certain=False)
    finally:
        consumer.close()


def _named(error: ChangefeedError) -> ChangefeedError:
    error.hint = (f"{error.hint}; or skip the probe by naming the reader: progress_reader=consumer (a broker that "
                  "honours read_committed: Apache Kafka, Confluent, MSK, Redpanda) or progress_reader=markers")
    return error
