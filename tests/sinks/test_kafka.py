"""Kafka sink without Spark: URI options, and batches written to a real broker (Tansu).

What a consumer sees is read with `local_kafka.read_partition`, which tells committed from aborted
and open transactions by their control markers (Tansu's own read_committed does not hide aborted
records), so "committed" below means what a read_committed consumer of Apache Kafka gets.
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from changefeed.core.change import BatchProgress
from changefeed.core.envelope import Record
from changefeed.errors import ConfigError, ConnectionFailed, SinkError, TransientError
from changefeed.local.kafka import LocalKafka, committed, read_partition
from changefeed.sinks.kafka.admin import check_cluster, create_topics
from changefeed.sinks.kafka.batch import KafkaBatch, ProgressRecord, committed_progress
from changefeed.sinks.kafka.ledger import KafkaLedger
from changefeed.sinks.kafka.options import KafkaOptions, sanitize_topic

pytestmark = pytest.mark.timeout(120)


# -- options ------------------------------------------------------------------------------------
def test_defaults_and_hosts() -> None:
    o = KafkaOptions.parse("kafka://k1:9092,k2:9093")
    assert o.bootstrap == "k1:9092,k2:9093" and o.delivery == "exactly_once" and not o.emit_resolved
    assert o.topic("public", "accounts") == "public.accounts"
    assert o.producer_config("f1")["transactional.id"] == "changefeed-f1"
    assert o.producer_config("f1")["enable.idempotence"] is True
    assert "transactional.id" not in KafkaOptions.parse("kafka://k:1?delivery=at_least_once").producer_config("f")


def test_topic_names_from_prefix_and_template() -> None:
    o = KafkaOptions.parse("kafka://k:9092?topic_prefix=cdc.&topic_name={table}-of-{schema}")
    assert o.topic("public", "t") == "cdc.t-of-public"
    assert KafkaOptions.parse("kafka://k:9092").topic("my schema", "tä/x") == "my_schema.t__x"
    assert sanitize_topic("a" * 300) == "a" * 249


def test_client_settings_pass_through(tmp_path: Path) -> None:
    path = tmp_path / "kafka.json"
    path.write_text(json.dumps({"sasl.username": "u", "sasl.password": "secret", "linger.ms": 5}))
    o = KafkaOptions.parse(f"kafka://k:9092?security.protocol=SASL_SSL&sasl.mechanism=PLAIN&kafka_config=@{path}")
    config = o.client_config()
    assert config["security.protocol"] == "SASL_SSL" and config["sasl.password"] == "secret"
    assert config["linger.ms"] == "5" and o.producer_config("f")["linger.ms"] == "5"  # the user's wins
    assert "secret" not in o.describe() and "sasl.username" in o.describe()
    inline = KafkaOptions.parse('kafka://k:9092?kafka_config={"acks":"all","compression.type":"gzip"}')
    assert inline.client_config()["compression.type"] == "gzip"


def test_clients_connect_to_every_broker_unless_told_otherwise() -> None:
    """Sparse connections make a fresh transactional producer wait for a retry timer (bench/README.md)."""
    assert KafkaOptions.parse("kafka://k:9092").producer_config("f")["enable.sparse.connections"] == "false"
    sparse = KafkaOptions.parse("kafka://k:9092?enable.sparse.connections=true")
    assert sparse.producer_config("f")["enable.sparse.connections"] == "true"


@pytest.mark.parametrize("uri, words", [
    ("kafka://", "HOST:PORT"),
    ("kafka://k", "HOST:PORT"),
    ("kafka://user:pw@k:9092", "sasl.username"),
    ("kafka://k:9092/topic", "path"),
    ("kafka://k:9092?delivery=twice", "exactly_once"),
    ("kafka://k:9092?tombstones=maybe", "true or false"),
    ("kafka://k:9092?topic_name={db}.{table}", "unknown fields"),
    ("kafka://k:9092?topic_name={table", "not a valid template"),
    ("kafka://k:9092?topic_partitions=0", "-1"),
    ("kafka://k:9092?replication_factor=x", "whole number"),
    ("kafka://k:9092?transactional.id=mine", "sets transactional.id itself"),
    ("kafka://k:9092?enable.idempotence=false", "itself"),
    ("kafka://k:9092?kafka_config=[1]", "JSON object"),
    ("kafka://k:9092?kafka_config={oops", "not JSON"),
    ("kafka://k:9092?kafka_config=@/nonexistent/k.json", "cannot read"),
    ("kafka://k:9092?progress_topic=a b", "not a valid Kafka topic"),
    ("kafka://k:9092?timeout=0", "between 1s and 15m"),
    ("kafka://k:9092?flush=1", "unknown Kafka sink option 'flush'"),
])
def test_bad_options_are_config_errors(uri: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        KafkaOptions.parse(uri)
    assert words in str(e.value)


# -- against the broker ---------------------------------------------------------------------------
def unique(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def opts_for(kafka: LocalKafka, **params: str) -> KafkaOptions:
    query = "&".join(f"{k}={v}" for k, v in {"topic_prefix": unique("p"), "progress_topic": unique("progress"),
                                              "timeout": "10s", **params}.items())
    return KafkaOptions.parse(f"kafka://{kafka.bootstrap}?{query}")


def progress(end_lsn: int, changes: int = 0) -> BatchProgress:
    return BatchProgress(end_lsn, end_lsn * 10, None, changes, ())


def write(opts: KafkaOptions, feed: str, query: str, batch: int, messages: list[tuple[str, Record]],
          end_lsn: int) -> ProgressRecord | None:
    """One batch; None if it was skipped as already committed."""
    out = KafkaBatch(opts, feed, query, batch)
    if out.open() is not None:
        return None
    for topic, record in messages:
        out.send(topic, record)
    return out.close(progress(end_lsn, len(messages)))


def committed_values(kafka: LocalKafka, topic: str, partition: int = 0) -> list[bytes | None]:
    return [r.value for r in committed(read_partition(kafka.bootstrap, topic, partition))]


def rec(i: int) -> Record:
    return Record(json.dumps([i]).encode(), json.dumps({"v": i}).encode())


def test_a_batch_commits_its_messages_with_its_progress_record(kafka: LocalKafka) -> None:
    opts, feed = opts_for(kafka, topic_partitions="1"), unique("f")
    create_topics(opts, [opts.progress_topic], progress=True)
    topic = opts.topic("public", "t")
    done = write(opts, feed, "q1", 0, [(topic, rec(i)) for i in range(5)], end_lsn=100)
    assert done is not None and done.messages == 5
    assert committed_values(kafka, topic) == [rec(i).value for i in range(5)]
    found = committed_progress(opts, feed)
    assert found == ProgressRecord(feed, "q1", 0, progress(100, 5), 5)


def test_a_replayed_batch_is_skipped_and_writes_nothing(kafka: LocalKafka) -> None:
    opts, feed = opts_for(kafka, topic_partitions="1"), unique("f")
    topic = opts.topic("public", "t")
    assert write(opts, feed, "q1", 0, [(topic, rec(1))], end_lsn=100) is not None
    assert write(opts, feed, "q1", 1, [(topic, rec(2))], end_lsn=200) is not None
    before = len(read_partition(kafka.bootstrap, topic))
    assert write(opts, feed, "q1", 1, [(topic, rec(2))], end_lsn=200) is None  # Spark replays batch 1
    assert write(opts, feed, "q1", 0, [(topic, rec(1))], end_lsn=100) is None
    assert len(read_partition(kafka.bootstrap, topic)) == before  # not even aborted records
    assert committed_values(kafka, topic) == [rec(1).value, rec(2).value]


def test_a_batch_cut_off_mid_transaction_is_aborted_and_written_again(kafka: LocalKafka) -> None:
    opts, feed = opts_for(kafka, topic_partitions="1"), unique("f")
    topic = opts.topic("public", "t")
    write(opts, feed, "q1", 0, [(topic, rec(0))], end_lsn=100)
    dying = KafkaBatch(opts, feed, "q1", 1)
    assert dying.open() is None
    for i in range(1, 4):
        dying.send(topic, rec(i))
    dying._producer.flush(10)  # the records reach the broker inside the open transaction; then the process dies
    assert [r.outcome for r in read_partition(kafka.bootstrap, topic)][-3:] == ["open"] * 3
    producer = dying._producer
    dying._producer = None  # (kept alive: a killed process sends no abort either)
    assert committed_progress(opts, feed).batch == 0  # type: ignore[union-attr]
    again = write(opts, feed, "q1", 1, [(topic, rec(i)) for i in range(1, 4)], end_lsn=200)  # the replay
    assert again is not None and again.batch == 1
    outcomes = [r.outcome for r in read_partition(kafka.bootstrap, topic)]
    assert outcomes.count("aborted") == 3 and "open" not in outcomes  # fenced by the replay's producer
    assert committed_values(kafka, topic) == [rec(i).value for i in range(4)]
    del producer


def test_a_batch_already_delivered_under_another_query_is_not_committed_twice(kafka: LocalKafka) -> None:
    opts, feed = opts_for(kafka, topic_partitions="1"), unique("f")
    topic = opts.topic("public", "t")
    write(opts, feed, "old-query", 7, [(topic, rec(1))], end_lsn=500)
    out = KafkaBatch(opts, feed, "new-query", 0)
    assert out.open() is None  # another query: not known to be a replay ...
    out.send(topic, rec(1))
    kept = out.close(progress(500, 1))  # ... but its end LSN is not past the committed one
    assert kept.query == "old-query"
    assert committed_values(kafka, topic) == [rec(1).value]


def test_keyless_and_resolved_messages_go_to_every_partition(kafka: LocalKafka) -> None:
    opts, feed = opts_for(kafka, topic_partitions="3"), unique("f")
    topic = opts.topic("public", "t")
    out = KafkaBatch(opts, feed, "q", 0)
    out.open()
    truncate = Record(None, b'{"op":"t"}')
    out.send(topic, truncate)
    out.resolved([topic], b'{"resolved":"9"}')
    out.close(progress(10))
    for p in range(3):
        assert committed_values(kafka, topic, p) == [truncate.value, b'{"resolved":"9"}']


def test_at_least_once_writes_without_transactions_or_progress(kafka: LocalKafka) -> None:
    opts, feed = opts_for(kafka, topic_partitions="1", delivery="at_least_once"), unique("f")
    topic = opts.topic("public", "t")
    assert write(opts, feed, "q", 0, [(topic, rec(i)) for i in range(3)], end_lsn=10) is not None
    records = read_partition(kafka.bootstrap, topic)
    assert [r.value for r in records] == [rec(i).value for i in range(3)]
    assert {r.outcome for r in records} == {"none"}


def test_headers_keys_and_tombstones_arrive_as_sent(kafka: LocalKafka) -> None:
    opts, feed = opts_for(kafka, topic_partitions="1"), unique("f")
    topic = opts.topic("public", "t")
    sent = [Record(b'{"id":1}', b'{"op":"d"}', (("__debezium.newkey", b'{"id":2}'),)), Record(b'{"id":1}', None)]
    write(opts, feed, "q", 0, [(topic, r) for r in sent], end_lsn=10)
    got = committed(read_partition(kafka.bootstrap, topic))
    assert [(r.key, r.value, r.headers) for r in got] == [
        (b'{"id":1}', b'{"op":"d"}', [("__debezium.newkey", b'{"id":2}')]), (b'{"id":1}', None, [])]


def test_a_run_of_messages_arrives_in_order_between_single_ones_with_its_tombstones(kafka: LocalKafka) -> None:
    """send_run (messages built by columns) keeps the batch's order with send, counts each
    message and tombstone, and fails on an earlier delivery's error like send."""
    opts, feed = opts_for(kafka, topic_partitions="1"), unique("f")
    topic = opts.topic("public", "t")
    out = KafkaBatch(opts, feed, "q", 0)
    assert out.open() is None
    out.send(topic, rec(0))
    out.send_run(topic, [b"[1]", b"[2]"], [rec(i).value or b"" for i in (1, 2)])
    out.send_run(topic, [b"[3]"], [b'{"op":"d"}'], tombstones=True)
    out.send(topic, rec(4))
    done = out.close(progress(100, 6))
    assert done.messages == 6 and type(done.messages) is int
    got = committed(read_partition(kafka.bootstrap, topic))
    assert [(r.key, r.value) for r in got] == [(rec(0).key, rec(0).value), (rec(1).key, rec(1).value),
                                               (rec(2).key, rec(2).value), (rec(3).key, b'{"op":"d"}'),
                                               (rec(3).key, None), (rec(4).key, rec(4).value)]
    assert committed_progress(opts, feed) == done


def test_the_ledger_creates_topics_and_the_compacted_progress_topic(kafka: LocalKafka, tmp_path: Path) -> None:
    from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]

    from changefeed.postgres.source import SourceTable

    opts = opts_for(kafka, topic_partitions="2")
    tables = [SourceTable("public", "a", ("id",), ("integer",), ("id",)), SourceTable("s", "b", (), (), ())]
    KafkaLedger(str(tmp_path / "delivered.jsonl"), opts, "f").prepare(tables)
    meta = AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(timeout=10).topics
    assert len(meta[opts.topic("public", "a")].partitions) == 2 and len(meta[opts.topic("s", "b")].partitions) == 2
    assert len(meta[opts.progress_topic].partitions) == 1
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    resource = ConfigResource("topic", opts.progress_topic)
    configs: dict[str, Any] = admin.describe_configs([resource])[resource].result(timeout=10)
    assert configs["cleanup.policy"].value == "compact"
    KafkaLedger(str(tmp_path / "delivered.jsonl"), opts, "f").prepare(tables)  # again: they exist, fine


def test_missing_topics_without_create_topics_are_a_sink_error(kafka: LocalKafka, tmp_path: Path) -> None:
    from changefeed.postgres.source import SourceTable

    opts = opts_for(kafka, create_topics="false")
    with pytest.raises(SinkError) as e:
        KafkaLedger(str(tmp_path / "d.jsonl"), opts, "f").prepare([SourceTable("public", "a", (), (), ())])
    assert "create_topics=false" in str(e.value) and opts.topic("public", "a") in str(e.value)


def test_an_unreachable_cluster_is_a_connection_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    opts = KafkaOptions.parse(f"kafka://127.0.0.1:{port}?timeout=2s")
    with pytest.raises(ConnectionFailed) as e:
        check_cluster(opts)
    assert f"127.0.0.1:{port}" in str(e.value) and "hint:" in str(e.value)
    with pytest.raises(TransientError):
        KafkaBatch(opts, "f", "q", 0).open()  # init_transactions times out: the feed retries on a rerun


def test_a_claim_fenced_by_a_leftover_producer_is_tried_again(kafka: LocalKafka,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-attaching runner's claim races a task of its stopped query, whose producer (same
    transactional id) starts after the claim's: the claim is fenced, tries again, and lands."""
    from confluent_kafka import Producer

    from changefeed.sinks.kafka import batch as kafka_batch

    opts, feed = opts_for(kafka, topic_partitions="1"), unique("f")
    topic = opts.topic("public", "t")
    assert write(opts, feed, "q1", 0, [(topic, rec(0))], end_lsn=100) is not None
    opened, leftovers = [0], []
    real_open = KafkaBatch.open

    def open_then_fenced(self: KafkaBatch) -> ProgressRecord | None:
        done = real_open(self)
        opened[0] += 1
        if opened[0] == 1:  # the leftover task's producer starts now: it fences the claim's
            leftover = Producer(opts.producer_config(feed))
            leftover.init_transactions(10)
            leftovers.append(leftover)
        return done

    monkeypatch.setattr(KafkaBatch, "open", open_then_fenced)
    kafka_batch.claim(opts, feed, 7)
    assert opened[0] == 2, "the fenced claim was not tried again"
    found = committed_progress(opts, feed)
    assert found is not None and (found.epoch, found.claimed, found.query, found.batch) == (7, True, "q1", 0)
    leftovers.clear()  # never close() a fenced producer (Tansu does not answer its abort)


def test_a_claim_fenced_every_time_gives_up_with_a_typed_error(kafka: LocalKafka,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from confluent_kafka import Producer

    from changefeed.sinks.kafka import batch as kafka_batch
    from changefeed.sinks.kafka.failures import ProducerFenced

    opts, feed = opts_for(kafka, topic_partitions="1"), unique("f")
    leftovers = []
    real_open = KafkaBatch.open

    def open_then_fenced(self: KafkaBatch) -> ProgressRecord | None:
        done = real_open(self)
        leftover = Producer(opts.producer_config(feed))
        leftover.init_transactions(10)
        leftovers.append(leftover)
        return done

    monkeypatch.setattr(KafkaBatch, "open", open_then_fenced)
    monkeypatch.setattr(kafka_batch, "CLAIM_TRIES", 2)
    with pytest.raises(ProducerFenced) as e:
        kafka_batch.claim(opts, feed, 3)
    assert len(leftovers) == 2 and "claiming the feed for lease term 3" in str(e.value) and "hint:" in str(e.value)
    leftovers.clear()
