"""Option parsing that needs no server: sizes, durations, outbox options."""
from __future__ import annotations

from pathlib import Path

import pytest

from changefeed.errors import ConfigError
from changefeed.sinks.registry import validated
from changefeed.spec.definition import FeedSpec
from changefeed.spec.state import FeedState
from changefeed.spec.units import parse_duration, parse_size


@pytest.mark.parametrize("text, seconds", [("1s", 1.0), ("500ms", 0.5), ("2m", 120.0), ("1.5", 1.5), ("0", 0.0),
                                           (" 3 H ", 10800.0)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "-1s", "1 sec", "1s2"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="not a duration"):
        parse_duration(text)


@pytest.mark.parametrize("text, size", [("64MB", 64 << 20), ("1g", 1 << 30), ("1000", 1000), ("8kib", 8192)])
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


KAFKA = "kafka://127.0.0.1:9092"


def outbox_feed(**given: object) -> FeedSpec:
    base: dict[str, object] = {"name": "f", "source": "postgresql://h/db", "sink": KAFKA,
                               "tables": ("public.a", "public.outbox"), "outbox": "public.outbox"}
    return validated(FeedSpec(**{**base, **given}))  # type: ignore[arg-type]


def test_outbox_options_round_trip() -> None:
    spec = outbox_feed(outbox_columns="payload=body", outbox_topic="ev.{event_type}", outbox_ttl_s=60.0)
    assert FeedSpec.from_json(spec.to_json(), "test") == spec
    outbox = spec.outbox_spec
    assert outbox is not None and outbox.column("payload") == "body" and outbox.ttl_s == 60.0
    assert validated(FeedSpec("f", "postgresql://h/db", KAFKA, ("public.a",))).outbox_spec is None


@pytest.mark.parametrize("given, words", [
    ({"sink": "postgresql://h/replica"}, "needs a message sink"),
    ({"tables": ("public.a",)}, "not among the captured --tables"),
    ({"outbox": "outbox"}, "schema.table"),
    ({"outbox_topic": "ev.{table}"}, "unknown fields"),
    ({"outbox_columns": "id"}, "ROLE=COLUMN"),
    ({"outbox_ttl_s": -1.0}, "must not be negative"),
])
def test_outbox_options_refused(given: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        outbox_feed(**given)


def test_cli_captures_the_outbox_table(tmp_path: Path) -> None:
    from changefeed.cli import _spec_from_args, parser

    args = parser().parse_args(["run", "--name", "f", "--source", "postgresql://h/db", "--sink", KAFKA,
                                "--tables", "a", "--outbox", "outbox", "--outbox-ttl", "10m",
                                "--state", str(tmp_path)])
    spec = _spec_from_args(args, FeedState(tmp_path, "f"))
    assert spec.tables == ("public.a", "public.outbox") and spec.outbox == "public.outbox"
    assert spec.outbox_ttl_s == 600.0


@pytest.mark.parametrize("sink, refused", [
    ("postgresql://r/db", False), (KAFKA, False), ("webhook-https://h/hook", False), ("delta:///lake", True)])
def test_low_latency_takes_a_replica_kafka_or_a_webhook(sink: str, refused: bool) -> None:
    spec = FeedSpec("f", "postgresql://h/db", sink, ("public.a",), low_latency_s=3.0)
    if refused:
        with pytest.raises(ConfigError, match="not available on a sink that is not"):
            validated(spec)
    else:
        assert validated(spec).low_latency_s == 3.0


@pytest.mark.parametrize("given, seconds", [([], 0.0), (["--low-latency"], 45.0), (["--low-latency", "2m"], 120.0)])
def test_a_bare_low_latency_follows_for_less_than_a_minute(tmp_path: Path, given: list[str], seconds: float) -> None:
    """Spark stops a Python worker idle for a minute; past that, each batch boundary waits for
    the driver's sink commit to start one anew (spec.definition.DEFAULT_FOLLOW_S)."""
    from changefeed.cli import _spec_from_args, parser

    args = parser().parse_args(["run", "--name", "f", "--source", "postgresql://h/db", "--sink", "postgresql://h/r",
                                "--tables", "a", "--state", str(tmp_path), *given])
    assert _spec_from_args(args, FeedState(tmp_path, "f")).low_latency_s == seconds


A, B = "postgresql://u:p@a:5432/db", "postgresql://u:p@b:5432/db"


@pytest.mark.parametrize("given, source, nodes", [
    ([A], A, ()),  # one unnamed source: exactly the feed of before
    (["n1=" + A], A, ()),
    ([A, B], "", (("n1", A), ("n2", B))),
    (["east=" + A, "west=" + B], "", (("east", A), ("west", B))),
    (["main=" + A], "", (("main", A),)),
    ([A + "?target_session_attrs=read-write"], A + "?target_session_attrs=read-write", ()),  # '=' in the query
])
def test_sources_are_named_in_order(given: list[str], source: str, nodes: tuple[tuple[str, str], ...]) -> None:
    from changefeed.spec.definition import parse_sources

    assert parse_sources(given) == (source, nodes)
    spec = validated(FeedSpec("f", source, "postgresql://r/db", ("public.t",), nodes=nodes))
    assert [n.name for n in spec.sources] == ([n for n, _ in nodes] or ["n1"])
    assert spec.sources[0].slot == ("changefeed_f" if spec.sources[0].name == "n1" else f"changefeed_f_{nodes[0][0]}")


def test_nodes_round_trip_through_feed_json(tmp_path: Path) -> None:
    spec = validated(FeedSpec("f", "", "postgresql://r/db", ("public.t",), nodes=(("n1", A), ("n2", B))))
    state = FeedState(tmp_path, "f")
    state.save(spec)
    assert state.load() == spec and spec.multi_node


@pytest.mark.parametrize("nodes, sink, words", [
    ((("n1", A), ("n1", B)), "postgresql://r/db", "same name"),
    ((("n1", A), ("n2", A)), "postgresql://r/db", "same URI"),
    ((("N-1", A),), "postgresql://r/db", "node name 'N-1'"),
    ((("n1", A), ("n2", "mysql://x")), "postgresql://r/db", "--source n2 must be a postgresql"),
])
def test_bad_nodes_are_refused(nodes: tuple[tuple[str, str], ...], sink: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        validated(FeedSpec("f", "", sink, ("public.t",), nodes=nodes))


def test_nodes_deliver_to_every_sink_but_have_no_outbox() -> None:
    nodes = (("n1", A), ("n2", B))
    for sink in ("kafka://k:9092", "webhook-https://h/p", "postgresql://r/db"):
        assert validated(FeedSpec("f", "", sink, ("public.t",), nodes=nodes)).multi_node
    with pytest.raises(ConfigError, match="no --outbox"):
        validated(FeedSpec("f", "", KAFKA, ("public.t",), nodes=nodes, outbox="public.outbox"))


def test_the_wal_reader_is_stored_and_checked() -> None:
    spec = outbox_feed()
    assert spec.wal_reader == "peek"  # the default, chosen by bench/wal_readers.py
    streamed = outbox_feed(wal_reader="stream")
    assert FeedSpec.from_json(streamed.to_json(), "test").wal_reader == "stream"
    with pytest.raises(ConfigError, match="--wal-reader must be one of peek, stream, got 'walsender'"):
        outbox_feed(wal_reader="walsender")
