"""Reading a partition as a `read_committed` consumer: the progress reader on brokers that honour it.

Apache Kafka (and Confluent, MSK, Redpanda ...) lists the aborted transactions in its Fetch
answers and ends a `read_committed` read at the last stable offset (LSO), below the first open
transaction: a consumer with `isolation.level=read_committed` then gets exactly the committed and
non-transactional records. Reading with librdkafka's consumer and the sink's own client settings
works with every login, TLS setup and codec librdkafka has, where the marker reader
(sinks.kafka.log) speaks only some. Which of the two a feed uses is `progress_reader`
(sinks.kafka.probe); both offer `last_committed` with the same signature.

The consumer is assigned the partition directly (no group membership, no offset commits; a
throwaway group.id, as librdkafka asks for one). A read to offset `end` is done once the consumer
has passed `end`: a record at or past it, or the end-of-partition event at or past it. Stopping at
an earlier end-of-partition would be wrong: an open transaction of another producer (another feed
sharing the progress topic) holds the LSO back, and a committed record of ours past it would be
missed, so such a read waits, and fails with a transient error if the LSO stays put for `timeout`.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from changefeed.errors import SinkError, TransientError
from changefeed.sinks.kafka.log import LogRecord, search_back

POLL_S = 0.1
_FAILS = ("TOPIC_AUTHORIZATION_FAILED", "UNKNOWN_TOPIC_OR_PART", "_UNKNOWN_TOPIC", "_UNKNOWN_PARTITION",
          "SASL_AUTHENTICATION_FAILED", "_AUTHENTICATION", "_SSL")  # a rerun will not mend these


class LastCommitted(Protocol):
    """The last committed (or non-transactional) record of a partition that `match`es, None if none does."""

    def __call__(self, config: Mapping[str, str], topic: str, partition: int, match: Callable[[LogRecord], bool], *,
                 window: int = 1000, timeout: float = 10.0) -> LogRecord | None: ...


def reader(name: str) -> LastCommitted:
    """The progress reader called `name`: consumer or markers (auto is resolved before: sinks.kafka.probe)."""
    from changefeed.sinks.kafka import log

    readers: dict[str, LastCommitted] = {"consumer": last_committed, "markers": log.last_committed}
    if name not in readers:
        raise ValueError(f"no progress reader {name!r}: resolve progress_reader first")
    return readers[name]


def consumer_config(config: Mapping[str, str], purpose: str) -> dict[str, Any]:
    """A read_committed consumer of assigned partitions with the sink's client settings."""
    return {**config, "group.id": f"changefeed-{purpose}-{uuid.uuid4().hex[:12]}", "isolation.level": "read_committed",
            "enable.partition.eof": True, "enable.auto.commit": False, "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest", "fetch.wait.max.ms": 50}


def offsets(config: Mapping[str, str], topic: str, partition: int, *, timeout: float) -> tuple[int, int]:
    """(log start offset, high watermark): the end of the log, open transactions included (read_uncommitted)."""
    from confluent_kafka import IsolationLevel, KafkaException, TopicPartition
    from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]  # documented, not re-exported

    admin = AdminClient(dict(config))
    tp = TopicPartition(topic, partition)
    specs = (OffsetSpec.earliest(), OffsetSpec.latest())  # type: ignore[no-untyped-call]  # untyped in confluent_kafka
    try:
        low, high = (admin.list_offsets({tp: spec}, isolation_level=IsolationLevel.READ_UNCOMMITTED,
                                        request_timeout=timeout)[tp].result().offset for spec in specs)
    except KafkaException as e:
        raise _error(e.args[0], f"listing the offsets of {topic}[{partition}]") from None
    return int(low), int(high)


def read(consumer: Any, topic: str, partition: int, start: int, end: int, *, timeout: float) -> list[LogRecord]:
    """The committed and non-transactional records at offsets [start, end), read by `consumer` (of
    `consumer_config`). Waits while the LSO stays below `end`, up to `timeout` without progress."""
    from confluent_kafka import KafkaError, TopicPartition

    out: list[LogRecord] = []
    if end <= start:
        return out
    consumer.assign([TopicPartition(topic, partition, start)])
    position, deadline = start, time.monotonic() + timeout
    last_error = ""
    while position < end:
        if time.monotonic() > deadline:
            raise TransientError(f"reading {topic}[{partition}] as a read_committed consumer stalled at offset "
                                 f"{position} (end {end}){': ' + last_error if last_error else ''}",
                                 "an open transaction holds the last stable offset back (another feed sharing the "
                                 "topic that died mid-commit: the broker aborts it after its transaction.timeout.ms), "
                                 "or the broker is slow; the feed resumes from its checkpoint when run again")
        msg = consumer.poll(POLL_S)
        if msg is None:
            continue
        err = msg.error()
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                if msg.offset() > position:
                    position, deadline = msg.offset(), time.monotonic() + timeout
                continue
            if err.fatal() or err.name() in _FAILS:
                raise _error(err, f"reading {topic}[{partition}]")
            last_error = err.str()  # librdkafka retries the others itself
            continue
        position, deadline = msg.offset() + 1, time.monotonic() + timeout
        if msg.offset() < end:
            out.append(LogRecord(msg.offset(), msg.key(), msg.value(), list(msg.headers() or []), -1, -1, "committed"))
    consumer.unassign()
    return out


def read_partition(config: Mapping[str, str], topic: str, partition: int, start: int, end: int, *,
                   timeout: float = 10.0) -> list[LogRecord]:
    """What a read_committed consumer gets of offsets [start, end) of the partition."""
    from confluent_kafka import Consumer

    consumer = Consumer(consumer_config(config, "read"))
    try:
        return read(consumer, topic, partition, start, end, timeout=timeout)
    finally:
        consumer.close()


def last_committed(config: Mapping[str, str], topic: str, partition: int, match: Callable[[LogRecord], bool], *,
                   window: int = 1000, timeout: float = 10.0) -> LogRecord | None:
    """LastCommitted by a read_committed consumer: the tail `window` offsets first, then twice as far
    back each time nothing matches (the progress topic is compacted; the newest records are wanted).
    The end is the high watermark when called: every record of the feed lies below it, as the
    feed's own producer (fenced and its open transaction aborted by init_transactions) writes none."""
    from confluent_kafka import Consumer

    first, high = offsets(config, topic, partition, timeout=timeout)
    consumer = Consumer(consumer_config(config, "progress"))
    try:
        return search_back(first, high, window, lambda start, end: [
            r for r in read(consumer, topic, partition, start, end, timeout=timeout) if match(r)])
    finally:
        consumer.close()


def _error(err: Any, doing: str) -> SinkError | TransientError:
    what = f"Kafka, {doing}: {err.name()} ({err.str()})"
    if err.fatal() or err.name() in _FAILS:
        return SinkError(what, "check the topic exists and the sink's principal may Read and Describe it, and the "
                               "login settings of the --sink URI")
    return TransientError(what, "the broker may be down or slow; the feed resumes from its checkpoint when run again")
