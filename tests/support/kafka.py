"""One real Kafka-protocol broker for the session, and how a test reads what a feed sent it."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


def kafka_sink(bootstrap: str, partitions: int) -> tuple[str, str, str]:
    """(A Kafka sink URI whose topics and progress topic are the caller's own, its topic prefix,
    its progress topic), the topics made with `partitions` partitions."""
    import uuid

    prefix, progress_topic = f"k{uuid.uuid4().hex[:8]}.", f"progress-{uuid.uuid4().hex[:8]}"
    return (f"kafka://{bootstrap}?topic_prefix={prefix}&progress_topic={progress_topic}"
            f"&topic_partitions={partitions}", prefix, progress_topic)


def kafka_partitions(bootstrap: str, topic: str) -> list[Any]:
    """Every record of each partition of `topic`, with its transaction's outcome (local_kafka.LogRecord)."""
    from confluent_kafka.admin import AdminClient

    from changefeed.local.kafka import read_partition

    meta = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10).topics[topic]
    return [read_partition(bootstrap, topic, p, timeout=60) for p in sorted(meta.partitions)]


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real Kafka-protocol broker (Tansu, in memory) for the session."""
    import gc

    from changefeed.local.kafka import LocalKafka

    broker = LocalKafka.start(tmp_path_factory.mktemp("kafka"))
    try:
        yield broker
    finally:
        gc.collect()  # destroy clients still in reference cycles while the broker is up
        broker.stop()
