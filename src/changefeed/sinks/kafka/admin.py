"""Kafka sink, control side: check the cluster, create the feed's topics.

`check` runs before anything else of a feed is created: client settings librdkafka refuses, an
unreachable broker, refused credentials, or (exactly once) a cluster that cannot start the feed's
transactions stop `run` there with a typed error. Topics the sink writes
to are created when missing (`create_topics=true`, the default) with `topic_partitions` and
`replication_factor` (-1: the broker's defaults); the progress topic has one partition and is
compacted, so the last record of each feed stays however long the feed is down.

"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from changefeed.errors import ConfigError, ConnectionFailed, SinkError
from changefeed.sinks.kafka.failures import kafka_error
from changefeed.sinks.kafka.options import KafkaOptions

_known: set[tuple[str, str]] = set()  # (bootstrap, topic) seen to exist by this process


def admin(opts: KafkaOptions) -> Any:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    try:
        return AdminClient({**opts.client_config()})  # a copy typed as AdminClient's wider dict
    except KafkaException as e:
        raise opts.refused(e.args[0].str()) from None


def check_cluster(opts: KafkaOptions) -> set[str]:
    """The cluster's topics; a typed error when it cannot be reached or refuses us."""
    from confluent_kafka import KafkaException

    try:
        return set(admin(opts).list_topics(timeout=opts.timeout_s).topics)
    except KafkaException as e:
        error = kafka_error(e, "reading the cluster's metadata", opts)
        if error.exit_code == 75:  # transient: the usual cause here is a wrong address
            raise ConnectionFailed(f"cannot reach Kafka at {opts.bootstrap} within {opts.timeout_s:g} s: "
                                   f"{e.args[0].str()}", "check the host:port list of the --sink URI and that "
                                   "the brokers run; TLS or SASL clusters need security.protocol") from None
        raise error from None


def check_transactions(opts: KafkaOptions, feed: str) -> None:
    """Start the feed's transactional producer once (which also ends a dead runner's open
    transaction, as every batch does): the broker's word on the transactional id and timeout
    comes before the slot is created, not at the first batch."""
    from confluent_kafka import KafkaError, KafkaException, Producer

    try:
        Producer(opts.producer_config(feed)).init_transactions(opts.timeout_s)
    except KafkaException as e:
        err = e.args[0]
        txn = opts.timeouts.transaction_ms
        if err.code() == KafkaError.INVALID_TRANSACTION_TIMEOUT:
            source = ("transaction.timeout.ms" if "transaction.timeout.ms" in opts.timeouts.given
                      else f"timeout={opts.timeout_s:g}s")
            raise ConfigError(f"Kafka {opts.bootstrap} refuses transaction.timeout.ms={txn} (from {source}): "
                              f"{err.str()}", "lower it, or raise the brokers' transaction.max.timeout.ms "
                              "(Kafka's default is 900000)") from None
        error = kafka_error(e, f"starting transactions as changefeed-{feed}", opts)
        if error.exit_code == 75:
            error.hint = ("the cluster's transaction coordinator did not answer in time: a cluster needs at least "
                          "transaction.state.log.replication.factor brokers (and min.insync.replicas of them) for "
                          "transactions; or raise timeout=, or use delivery=at_least_once")
        raise error from None


def create_topics(opts: KafkaOptions, topics: Iterable[str], *, progress: bool = False) -> None:
    """Create those of `topics` that are missing (`progress`: as the one-partition compacted progress topic)."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]  # documented here, not re-exported

    missing = [t for t in dict.fromkeys(topics) if (opts.bootstrap, t) not in _known]
    if not missing:
        return
    client = admin(opts)
    try:
        existing = set(client.list_topics(timeout=opts.timeout_s).topics)
    except KafkaException as e:
        raise kafka_error(e, "reading the cluster's metadata", opts) from None
    new = [t for t in missing if t not in existing]
    if new:
        specs = [NewTopic(t, 1, opts.replication_factor, config={"cleanup.policy": "compact"}) if progress else
                 NewTopic(t, opts.topic_partitions, opts.replication_factor) for t in new]
        for topic, future in client.create_topics(specs, operation_timeout=opts.timeout_s,
                                                  request_timeout=opts.timeout_s).items():
            try:
                future.result()
            except KafkaException as e:
                if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise SinkError(f"Kafka {opts.bootstrap}: cannot create topic {topic}: {e.args[0].str()}",
                                    "create it yourself, or grant the sink's principal Create on the cluster") from None
    _known.update((opts.bootstrap, t) for t in missing)
