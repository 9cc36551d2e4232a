"""Outbox routing without I/O: which changes are events, their topics, keys, headers and payloads."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.core.change import TableShape
from changefeed.core.envelope import Change
from changefeed.core.outbox import OutboxRouter, OutboxSpec, check_topic_template, parse_columns
from changefeed.errors import ConfigError

SHAPE = TableShape("app", "outbox", ("id", "aggregate_type", "aggregate_id", "event_type", "payload", "created"),
                   ("uuid", "text", "text", "text", "jsonb", "timestamptz"), ("id",), "d")


def change(op: str, values: list[str | None], shape: TableShape = SHAPE) -> Change:
    row = [None if v is None else v.encode() for v in values]
    return Change(op, shape, after=row if op != "d" else None, before=row if op == "d" else None, lsn=0x10)


ROW = ["6f1c", "order", "o-17", "OrderPlaced", '{"total": 12.50, "items": [1, 2]}', "2026-11-23 10:00:00+00"]


def test_an_insert_is_an_event_keyed_by_its_aggregate() -> None:
    router = OutboxRouter(OutboxSpec("app.outbox"))
    event = router.route(change("c", ROW))
    assert event is not None and router.topic(event) == "outbox.event.order"
    record = event.record()
    assert record.key == b"o-17"
    assert record.value == b'{"total": 12.50, "items": [1, 2]}'  # as stored: 12.50 keeps its digits
    assert dict(record.headers) == {"id": b"6f1c", "event_type": b"OrderPlaced", "aggregate_type": b"order"}
    webhook = json.loads(event.json_record().value or b"")
    assert webhook == {"id": "6f1c", "aggregate_type": "order", "aggregate_id": "o-17", "event_type": "OrderPlaced",
                       "payload": {"total": 12.5, "items": [1, 2]}}


def test_only_inserts_are_events_snapshot_reads_when_asked() -> None:
    router = OutboxRouter(OutboxSpec("app.outbox"))
    assert router.route(change("r", ROW)) is None  # a row the outbox held already: not sent again
    assert OutboxRouter(OutboxSpec("app.outbox", snapshot_events=True)).route(change("r", ROW)) is not None
    assert OutboxSpec.from_json(OutboxSpec("app.outbox", snapshot_events=True).to_json()).snapshot_events
    assert not OutboxSpec.from_json({"table": "app.outbox"}).snapshot_events  # what older feeds stored
    for op in ("u", "d", "t"):
        assert router.route(change(op, ROW)) is None
    other = TableShape("app", "orders", SHAPE.columns, SHAPE.types, ("id",), "d")
    assert router.route(change("c", ROW, other)) is None
    assert not router.owns("public", "outbox") and router.owns("app", "outbox")


def test_custom_columns_and_topic_template() -> None:
    shape = TableShape("app", "events", ("event_id", "kind", "agg", "what", "body"),
                       ("bigint", "text", "text", "text", "json"), ("event_id",), "d")
    spec = OutboxSpec("app.events", parse_columns("id=event_id, aggregate_type=kind,aggregate_id=agg,"
                                                  "event_type=what,payload=body"),
                      check_topic_template("events-{aggregate_type}-{event_type}"))
    router = OutboxRouter(spec)
    event = router.route(change("c", ["7", "user", "u1", "Renamed", None], shape))
    assert event is not None and router.topic(event) == "events-user-Renamed"
    assert event.record().value is None and event.record().key == b"u1"  # a NULL payload: no value
    assert json.loads(event.json_record().value or b"")["payload"] is None


def test_a_missing_column_or_null_role_is_a_clear_error() -> None:
    router = OutboxRouter(OutboxSpec("app.outbox", parse_columns("payload=body")))
    with pytest.raises(ConfigError, match="no column body") as e:
        router.route(change("c", ROW))
    assert "--outbox-columns" in e.value.hint
    with pytest.raises(ConfigError, match="without aggregate_id") as e:
        OutboxRouter(OutboxSpec("app.outbox")).route(change("c", ["1", "order", None, "X", "{}", None]))
    assert "NOT NULL" in e.value.hint


@pytest.mark.parametrize("text, words", [
    ("id", "ROLE=COLUMN"), ("ident=x", "unknown role"), ("id=a,id=b", "twice"), ("id=payload", "two roles"),
    ("id=", "ROLE=COLUMN"),
])
def test_bad_column_maps(text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_columns(text)


def test_column_defaults_and_topic_fields() -> None:
    assert dict(parse_columns("")) == {r: r for r in ("id", "aggregate_type", "aggregate_id", "event_type", "payload")}
    assert dict(parse_columns("payload=body"))["payload"] == "body"
    with pytest.raises(ConfigError, match="unknown fields"):
        check_topic_template("outbox.{table}")
    with pytest.raises(ConfigError, match="not a valid template"):
        check_topic_template("outbox.{aggregate_type")


def test_spec_survives_json() -> None:
    spec = OutboxSpec("app.events", parse_columns("payload=body"), "t.{event_type}", 3600.0)
    assert OutboxSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30)


@given(text, text, text, text, st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                                          lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
                                              st.text(max_size=5), kids, max_size=3), max_leaves=8))
def test_any_event_round_trips(event_id: str, agg_type: str, agg_id: str, event_type: str, payload: object) -> None:
    stored = json.dumps(payload)
    event = OutboxRouter(OutboxSpec("app.outbox")).route(change("c", [event_id, agg_type, agg_id, event_type, stored,
                                                                      None]))
    assert event is not None
    record = event.record()
    assert (record.key or b"").decode() == agg_id and (record.value or b"").decode() == stored
    assert dict(record.headers)["id"].decode() == event_id
    assert json.loads(event.json_record().value or b"")["payload"] == payload
