"""A feed's sinks as the definition holds them: names, URIs, ledger keys, each sink's own envelope."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.errors import ConfigError
from changefeed.sinks.base import ledger_path
from changefeed.sinks.registry import sink_named, validated
from changefeed.spec.definition import FeedSpec
from changefeed.spec.sinks import MESSAGE_KINDS, SCHEMES, envelope_of, parse_sink, parse_sinks
from changefeed.spec.state import FeedState

SOURCE = "postgresql://u:p@src/db"
DR, EVENTS, LAKE = "postgresql://u:p@replica/db", "kafka://broker:9092?topic_prefix=x.", "delta:///lake?mode=changelog"


def spec(*sinks: str, **kw: object) -> FeedSpec:
    sink, named = parse_sinks(list(sinks))
    return FeedSpec("shop", SOURCE, sink, ("public.orders",), sinks=named, **kw)  # type: ignore[arg-type]


def test_a_bare_sink_keeps_the_feeds_name_as_its_ledger_key() -> None:
    one = spec(DR)
    assert one.sink == DR and one.sinks == () and not one.several_sinks
    [target] = one.sink_targets
    assert (target.name, target.key, target.bare, target.option) == ("replica", "shop", True, "--sink")
    assert one.for_sink(target).key == "shop"


def test_named_sinks_keep_their_order_and_their_own_keys() -> None:
    three = validated(spec(f"dr={DR}", f"events={EVENTS}", f"lake={LAKE}"))
    assert [(t.name, t.key) for t in three.sink_targets] == [("dr", "shop.dr"), ("events", "shop.events"),
                                                             ("lake", "shop.lake")]
    assert three.several_sinks and three.sink == ""
    lake = three.for_sink(three.sink_named("lake"))
    assert (lake.sink, lake.sinks, lake.key, lake.name) == (LAKE, (), "shop.lake", "shop")
    with pytest.raises(ConfigError, match="no sink named 'kafka'") as e:
        three.sink_named("kafka")
    assert "dr, events, lake" in e.value.hint


def test_stored_and_read_back_the_same_without_a_view_key() -> None:
    three = spec(f"dr={DR}", f"events={EVENTS}")
    text = three.to_json()
    assert "sink_key" not in json.loads(text)
    assert FeedSpec.from_json(text, "test") == three
    view = three.for_sink(three.sink_targets[1])
    assert "sink_key" not in json.loads(view.to_json())


@pytest.mark.parametrize("sinks, words", [
    ([f"dr={DR}", f"dr={EVENTS}"], "two sinks are named dr"),
    ([f"a={DR}", f"b={DR}"], "sinks a and b have the same URI"),
    ([f"Dr={DR}", f"events={EVENTS}"], "sink name 'Dr' is not allowed"),
    ([DR, EVENTS], "several times without a name"),
    ([DR, f"replica={EVENTS}"], "two sinks are named replica"),
    ([f"dr={DR}", "lake=s3://bucket"], "unknown scheme 's3'"),
    ([f"dr={DR}", f"events={EVENTS}&format=avro"], "--sink events: format must be one of"),
    ([f"dr={DR}", f"events={EVENTS}&diff=maybe"], "diff true or false"),
])
def test_bad_sinks_are_config_errors(sinks: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        validated(spec(*sinks))


def test_feed_level_format_needs_a_message_sink_among_several() -> None:
    validated(spec(f"dr={DR}", f"events={EVENTS}", format="debezium"))  # for the Kafka sink
    with pytest.raises(ConfigError, match="apply to message sinks"):
        validated(spec(f"dr={DR}", f"lake={LAKE}", format="debezium"))
    with pytest.raises(ConfigError, match="--outbox needs a message sink"):
        validated(spec(f"dr={DR}", f"lake={LAKE}", outbox="public.orders"))


def test_a_message_sink_takes_its_own_envelope_from_its_uri() -> None:
    two = validated(spec(f"dr={DR}", f"events={EVENTS}&format=debezium&diff=true", format="json"))
    events = two.for_sink(two.sink_named("events"))
    assert (events.sink, events.format, events.diff) == (EVENTS, "debezium", True)
    dr = two.for_sink(two.sink_named("dr"))
    assert (dr.format, dr.diff) == ("json", False)


def test_a_lakes_own_diff_option_stays_in_its_uri() -> None:
    uri = "delta:///lake?mode=changelog&diff=true"
    assert envelope_of(uri) == (uri, {})
    one = spec(f"dr={DR}", f"lake={uri}")
    assert one.for_sink(one.sink_named("lake")).sink == uri


@given(st.sampled_from(["kafka://b:1?topic_prefix=a.&acks=all", "webhook-https://h/p?x=1,2&y=%24z"]),
       st.sampled_from(["json", "debezium", "text"]), st.booleans())
def test_envelope_keys_come_out_and_the_rest_of_the_query_stays(uri: str, fmt: str, diff: bool) -> None:
    with_envelope = f"{uri}&format={fmt}&diff={str(diff).lower()}"
    rest, own = envelope_of(with_envelope)
    assert own == {"format": fmt, "diff": str(diff).lower()}
    assert envelope_of(rest) == (rest, {})
    assert sorted(rest.split("?", 1)[1].split("&")) == sorted(uri.split("?", 1)[1].split("&"))


def test_parse_sink_tells_a_name_from_a_uri() -> None:
    assert parse_sink("dr=postgresql://u:p@h/db?sslmode=require") == ("dr", "postgresql://u:p@h/db?sslmode=require")
    assert parse_sink("postgresql://u:p@h/db?sslmode=require") == ("", "postgresql://u:p@h/db?sslmode=require")
    assert parse_sink("kafka://b:1?topic_prefix=a") == ("", "kafka://b:1?topic_prefix=a")
    assert parse_sinks(["kafka://b:1"]) == ("kafka://b:1", ())
    assert parse_sinks(["only=kafka://b:1"]) == ("", (("only", "kafka://b:1"),))


def test_each_file_ledger_has_its_own_file(tmp_path: Path) -> None:
    state = FeedState(tmp_path, "shop")
    bare = spec(EVENTS)
    three = spec(f"dr={DR}", f"events={EVENTS}", "hook=webhook-https://h/p")
    assert ledger_path(bare.for_sink(bare.sink_targets[0]), state).endswith("/shop/delivered.jsonl")
    paths = {ledger_path(three.for_sink(t), state) for t in three.sink_targets}
    assert {Path(p).name for p in paths} == {"delivered.dr.jsonl", "delivered.events.jsonl", "delivered.hook.jsonl"}


def test_message_kinds_are_the_sinks_that_deliver_messages() -> None:
    kinds = set(SCHEMES.values())
    assert {k for k in kinds if sink_named(k).messages} == set(MESSAGE_KINDS)


def test_a_bare_sink_and_named_ones_together() -> None:
    """A feed made with one sink, given more by name later: the bare one keeps its ledger."""
    both = validated(spec(DR, f"events={EVENTS}"))
    assert [(t.name, t.key, t.bare) for t in both.sink_targets] == [("replica", "shop", True),
                                                                    ("events", "shop.events", False)]
