"""How exactly once reads its progress: the probe's verdict on a real broker (Tansu leaks aborted
records to read_committed consumers, so `auto` must choose the markers there), the consumer reader
(right where the broker honours read_committed, and shown here to be wrong where it does not),
the choice handed from the driver to the batches, and the option's checks."""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from changefeed.core.change import BatchProgress
from changefeed.core.envelope import Record
from changefeed.errors import ConfigError, TransientError
from changefeed.local.kafka import LocalKafka, read_partition
from changefeed.sinks.kafka import log, probe, progress
from changefeed.sinks.kafka.admin import create_topics
from changefeed.sinks.kafka.batch import KafkaBatch, committed_progress
from changefeed.sinks.kafka.ledger import KafkaLedger
from changefeed.sinks.kafka.options import KafkaOptions
from changefeed.sinks.kafka.readback import reading

pytestmark = pytest.mark.timeout(120)
LEAKS = "kafka progress: broker leaks aborted records to read_committed consumers (probe), reading transaction markers"


def unique(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def opts_for(kafka: LocalKafka, query: str = "") -> KafkaOptions:
    """Options with a progress topic of their own, created as the ledger creates it."""
    opts = KafkaOptions.parse(f"kafka://{kafka.bootstrap}?progress_topic={unique('progress')}&timeout=5s"
                              f"&topic_prefix={unique('p')}{query}")
    create_topics(opts, [opts.progress_topic], progress=True)
    return opts


def config(kafka: LocalKafka) -> dict[str, str]:
    return {"bootstrap.servers": kafka.bootstrap, "log_level": "0"}


def txn(p: Producer, topic: str, key: bytes, value: bytes, *, commit: bool) -> None:
    p.begin_transaction()
    p.produce(topic, key=key, value=value, partition=0)
    p.flush(10)
    (p.commit_transaction if commit else p.abort_transaction)(10)


def producer(kafka: LocalKafka, **extra: str) -> Producer:
    p = Producer({**config(kafka), "transactional.id": unique("t"), **extra})
    p.init_transactions(10)
    return p


# -- the probe -----------------------------------------------------------------------------------
def test_the_probe_finds_that_the_test_broker_leaks_aborted_records(kafka: LocalKafka) -> None:
    opts, feed = opts_for(kafka), unique("f")
    found = probe.verdict(opts, feed)
    assert (found.reader, found.probed, found.certain) == ("markers", True, True) and found.line() == LEAKS
    assert probe.resolve(opts, feed).progress_reader == "markers"  # the verdict is kept: no second probe
    assert probe.verdict(opts, unique("other")) is found
    records = read_partition(kafka.bootstrap, opts.progress_topic)
    assert [(r.key, r.outcome) for r in records] == [(probe.PROBE_KEY, "aborted")]
    assert committed_progress(opts, feed) is None  # the probe's record is no feed's progress


def test_a_probe_without_an_answer_chooses_the_markers_and_is_not_kept(kafka: LocalKafka) -> None:
    """Another producer's open transaction on the progress topic holds read_committed consumers back."""
    opts, feed = opts_for(kafka, "&timeout=1s"), unique("f")
    stuck = producer(kafka)
    stuck.begin_transaction()
    stuck.produce(opts.progress_topic, key=b"other", value=b"open", partition=0)
    stuck.flush(10)
    found = probe.verdict(opts, feed)
    assert (found.reader, found.certain) == ("markers", False) and "nothing past offset" in found.line()
    assert (opts.bootstrap, opts.progress_topic) not in probe._verdicts
    stuck.abort_transaction(10)
    assert probe.verdict(opts, feed).certain  # asked again: now it is known


def test_a_named_reader_is_not_probed(kafka: LocalKafka) -> None:
    opts = opts_for(kafka, "&progress_reader=consumer")
    found = probe.verdict(opts, unique("f"))
    assert (found.reader, found.probed) == ("consumer", False)
    assert found.line() == "kafka progress: progress_reader=consumer (as set), reading with a read_committed consumer"
    assert read_partition(kafka.bootstrap, opts.progress_topic) == []  # no probe record


def test_where_the_broker_needs_markers_a_login_they_cannot_use_is_refused(kafka: LocalKafka,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """GSSAPI passes the option check with auto; at start, a verdict of markers refuses it, naming the
    way out. (Tansu has no SASL, so the verdicts are set here as the probe would find them.)"""
    opts = KafkaOptions.parse(f"kafka://{kafka.bootstrap}?security.protocol=SASL_PLAINTEXT&progress_topic=p1")
    monkeypatch.setitem(probe._verdicts, (opts.bootstrap, "p1"), probe.Verdict("markers", True, "leaks"))
    with pytest.raises(ConfigError, match="sasl.mechanism=GSSAPI") as e:
        probe.resolve(opts, "f")
    assert "progress_reader=consumer" in e.value.hint
    monkeypatch.setitem(probe._verdicts, (opts.bootstrap, "p1"), probe.Verdict("consumer", True, "skipped"))
    assert probe.resolve(opts, "f").progress_reader == "consumer"
    monkeypatch.delitem(probe._verdicts, (opts.bootstrap, "p1"))
    monkeypatch.setattr(probe, "probe", lambda *_: probe.Verdict("markers", True, "gave nothing", certain=False))
    with pytest.raises(TransientError, match="GSSAPI"):  # no answer is no verdict: try again later
        probe.resolve(opts, "f")


# -- the consumer reader -------------------------------------------------------------------------------
def test_the_consumer_reader_finds_the_last_committed_record(kafka: LocalKafka) -> None:
    opts = opts_for(kafka)
    p = producer(kafka, **{"compression.type": "zstd"})
    txn(p, opts.progress_topic, b"feed", b"old", commit=True)
    for i in range(12):
        txn(p, opts.progress_topic, b"other", b"%d" % i, commit=True)
    args = (config(kafka), opts.progress_topic, 0, lambda r: r.key == b"feed")
    found = progress.last_committed(*args, window=2, timeout=5)  # found by stepping back
    assert found is not None and (found.offset, found.value) == (0, b"old")
    assert progress.last_committed(config(kafka), opts.progress_topic, 0, lambda r: r.key == b"x") is None
    txn(p, opts.progress_topic, b"feed", b"new", commit=True)
    assert progress.last_committed(*args, window=3).value == b"new"  # type: ignore[union-attr]


def test_the_consumer_reader_waits_for_an_open_transaction_before_the_end(kafka: LocalKafka) -> None:
    """A record committed after another producer's open transaction lies past the last stable offset:
    stopping there would miss it (a duplicate batch), so the read waits, then fails as transient."""
    opts = opts_for(kafka)
    stuck, mine = producer(kafka), producer(kafka)
    stuck.begin_transaction()
    stuck.produce(opts.progress_topic, key=b"other", value=b"open", partition=0)
    stuck.flush(10)
    txn(mine, opts.progress_topic, b"feed", b"after it", commit=True)
    with pytest.raises(TransientError, match="stalled"):
        progress.last_committed(config(kafka), opts.progress_topic, 0, lambda r: r.key == b"feed", timeout=1)
    stuck.commit_transaction(10)
    found = progress.last_committed(config(kafka), opts.progress_topic, 0, lambda r: r.key == b"feed")
    assert found is not None and found.value == b"after it"


def test_on_a_broker_that_leaks_an_explicit_consumer_reader_takes_aborted_records(kafka: LocalKafka) -> None:
    """Why auto chooses the markers on Tansu, and why progress_reader=consumer is the user's word that
    the broker honours read_committed: here an aborted progress record would count as committed
    (its batch skipped: lost), where the markers reader knows better."""
    opts = opts_for(kafka)
    p = producer(kafka)
    txn(p, opts.progress_topic, b"feed", b"committed", commit=True)
    txn(p, opts.progress_topic, b"feed", b"aborted", commit=False)
    args = (config(kafka), opts.progress_topic, 0, lambda r: r.key == b"feed")
    assert progress.last_committed(*args).value == b"aborted"  # type: ignore[union-attr]
    assert log.last_committed(*args).value == b"committed"  # type: ignore[union-attr]
    assert probe.verdict(opts, unique("f")).reader == "markers"


# -- from the driver to the batches ----------------------------------------------------------------------
def test_the_ledger_probes_at_start_and_says_so(kafka: LocalKafka, tmp_path: Path) -> None:
    opts = KafkaOptions.parse(f"kafka://{kafka.bootstrap}?progress_topic={unique('progress')}&timeout=5s")
    ledger = KafkaLedger(str(tmp_path / "delivered.jsonl"), opts, unique("f"))
    ledger.check()
    assert ledger.notes() == []
    ledger.prepare([])
    assert ledger.notes() == [LEAKS]
    assert KafkaLedger(str(tmp_path / "x"), KafkaOptions.parse(f"kafka://{kafka.bootstrap}?delivery=at_least_once"),
                       "f").notes() == []


@pytest.mark.parametrize("reader", ["consumer", "markers"])
def test_batches_read_their_progress_with_the_reader_named(kafka: LocalKafka, reader: str) -> None:
    """With nothing aborted, both readers find the committed batch (on Tansu too), and a replay is skipped."""
    opts, feed = opts_for(kafka, f"&progress_reader={reader}"), unique("f")
    topic = opts.topic("public", "t")

    def write(batch: int) -> Any:
        out = KafkaBatch(opts, feed, "q1", batch)
        if (done := out.open()) is not None:
            return done
        out.send(topic, Record(b"[1]", b"{}"))
        return out.close(BatchProgress(100 + batch, 1000, None, 1, ()))

    assert write(0).batch == 0 and write(1).batch == 1
    assert write(1).progress.end_lsn == 101  # the replay found batch 1 committed
    assert [r.key for r in read_partition(kafka.bootstrap, opts.progress_topic)] == [feed.encode()] * 2


def test_verify_reads_with_the_feeds_reader(kafka: LocalKafka) -> None:
    opts = opts_for(kafka)
    assert reading(opts, unique("f")).progress_reader == "markers"  # probed: Tansu leaks
    loose = KafkaOptions.parse(f"kafka://{kafka.bootstrap}?delivery=at_least_once")
    assert reading(loose, "f").progress_reader == "markers"  # no transactions: no probe
    kerberos = KafkaOptions.parse("kafka://k:9092?delivery=at_least_once&security.protocol=SASL_SSL")
    assert reading(kerberos, "f").progress_reader == "consumer"


@pytest.mark.parametrize("uri, words", [
    ("kafka://k:9092?progress_reader=yes", "progress_reader must be one of auto, consumer, markers, got 'yes'"),
    ("kafka://k:9092?progress_reader=Consumer", "got 'Consumer'"),
])
def test_a_bad_progress_reader_is_a_config_error(uri: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        KafkaOptions.parse(uri)
    assert words in str(e.value) and "honours read_committed" in e.value.hint
    assert KafkaOptions.parse("kafka://k:9092").progress_reader == "auto"

