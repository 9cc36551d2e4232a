"""The file ledger of message sinks, and how a sink URI picks its kind."""
from __future__ import annotations

from pathlib import Path

import pytest

from changefeed.core.change import BatchProgress
from changefeed.errors import ConfigError
from changefeed.sinks.ledger import FileLedger
from changefeed.sinks.registry import sink_of, validated
from changefeed.spec.definition import FeedSpec


def batch(end: int, ts: int, changes: int, *chunks: dict[str, object]) -> BatchProgress:
    return BatchProgress(end, ts, 1_700_000_000_123_456, changes, chunks)


def test_empty_ledger_has_recorded_nothing(tmp_path: Path) -> None:
    ledger = FileLedger(tmp_path / "delivered.jsonl")
    assert ledger.checkpoint() is None and ledger.last_resolved_ts() is None and ledger.last_batch() is None
    assert ledger.totals() == (0, 0) and ledger.snapshot_totals() == {} and ledger.recent_rate() == 0.0
    assert ledger.forget() is False


def test_replayed_batches_count_once_and_a_torn_line_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "delivered.jsonl"
    ledger = FileLedger(path)
    chunk = {"no": 0, "table": "public.t", "rows": 200, "read_lsn": 5, "task": 1}
    ledger.record(0, batch(100, 10, 200, chunk), 1.0, 2.0)
    ledger.record(1, batch(200, 20, 5), 2.0, 3.5)
    ledger.record(1, batch(200, 20, 5), 4.0, 5.0)  # replayed after a crash before Spark recorded it
    with open(path, "a") as f:
        f.write('{"batch": 2, "progress": {"end_lsn": 3')  # torn by a crash
    assert ledger.checkpoint() == {"n1": 200} and ledger.last_resolved_ts() == 20
    assert ledger.totals() == (2, 205)
    assert ledger.snapshot_totals() == {"public.t": (1, 200)}
    last = ledger.last_batch()
    assert last is not None and (last.end_lsn, last.batches, last.seconds) == (200, 2, 1.5)
    assert last.commit_time == "2023-11-14 22:13:20.123456+00"
    ledger.record(2, batch(300, 30, 1), 6.0, 7.0)  # the torn batch, replayed
    assert ledger.checkpoint() == {"n1": 300} and ledger.totals() == (3, 206)
    assert ledger.forget() is True and ledger.checkpoint() is None


@pytest.mark.parametrize("uri, kind", [("postgresql://u@h/db", "replica"), ("postgres://h/db", "replica"),
                                       ("webhook-https://h/p", "webhook"), ("webhook-http://h:8080/p?x=1", "webhook"),
                                       ("kafka://h:9092", "kafka"), ("delta:///lake", "delta")])
def test_sink_by_scheme(uri: str, kind: str) -> None:
    assert sink_of(uri).name == kind


def spec(sink: str, **kw: object) -> FeedSpec:
    return FeedSpec("f", "postgresql://h/db", sink, ("public.t",), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("sink, kw, words", [
    ("kafkaa://h:9092", {}, "unknown scheme 'kafkaa'"),
    ("h:5432/db", {}, "unknown scheme '<none>'"),
    ("webhook-https://h/p?flush_messages=0", {}, "flush_messages"),
    ("webhook-https://h/p", {"format": "xml"}, "--format must be one of json, debezium, text"),
    ("postgresql://h/db", {"format": "debezium"}, "apply to message sinks"),
    ("postgresql://h/db", {"diff": True}, "apply to message sinks"),
    ("delta:///lake?mode=scd2", {}, "mode must be one of changelog, mirror, history"),
    ("delta://host/lake", {}, "absolute folder"),
    ("delta:///lake?mode=mirror&diff=true", {}, "diff=true applies to mode=changelog only"),
    ("delta:///lake?buckets=0", {}, "buckets must be a whole number >= 1"),
    ("delta:///lake?table_template=/abs/{table}", {}, "table_template must name"),
    ("delta:///lake?colour=red", {}, "unknown Delta sink option 'colour'"),
    ("delta+s3://bucket/prefix", {}, "local or mounted folders only"),
    ("delta:///lake", {"format": "debezium"}, "apply to message sinks"),
])
def test_bad_sink_options_are_config_errors(sink: str, kw: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        validated(spec(sink, **kw))


def test_a_delta_sink_refuses_a_feed_of_several_nodes() -> None:
    nodes = (("a", "postgresql://h/db"), ("b", "postgresql://h2/db"))
    with pytest.raises(ConfigError, match="several source nodes"):
        validated(FeedSpec("f", "", "delta:///lake", ("public.t",), nodes=nodes))  # type: ignore[arg-type]


def test_webhook_spec_with_a_format_is_valid() -> None:
    assert validated(spec("webhook-https://h/p?resolved=true", format="debezium", diff=True)).format == "debezium"
