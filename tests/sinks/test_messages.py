"""MessageStream without Spark: change rows in, messages out, with an outbox table routed to events."""
from __future__ import annotations

import json
from typing import Any

import pytest

from changefeed.core import change as ch
from changefeed.core.copytext import join_line
from changefeed.core.envelope import formatter
from changefeed.core.outbox import OutboxEvent, OutboxSpec
from changefeed.errors import IncompleteBatch
from changefeed.sinks.messages import MessageStream, outbox_spec

ORDERS = ch.TableShape("app", "orders", ("id", "total"), ("integer", "numeric"), ("id",), "d")
OUTBOX = ch.TableShape("app", "outbox", ("id", "aggregate_type", "aggregate_id", "event_type", "payload"),
                       ("text", "text", "text", "text", "jsonb"), ("id",), "d")


def rows(*items: tuple[str, ch.TableShape, list[str | None] | None], parts: int = 1) -> Any:
    """R rows for both tables, then one data row per (op, shape, values), then the P row of the
    batch's first of `parts` partitions."""
    out: list[dict[str, Any]] = []
    for shape in (ORDERS, OUTBOX):
        out.append({"op": ch.RELATION, "schema": shape.schema, "table": shape.table, "meta": shape.to_meta()})
    for i, (op, shape, values) in enumerate(items):
        line = None if values is None else join_line(None if v is None else v.encode() for v in values)
        out.append({"op": op, "schema": shape.schema, "table": shape.table, "lsn": 100 + i, "seq": i, "xid": 7,
                    "commit_time": 1_700_000_000_000_000, "commit_ts": 5 << 16,
                    "after": line if op in "cur" else None, "before": line if op == "d" else None})
    progress = ch.Progress(200, 6 << 16, 1_700_000_000_000_000, len(items), parts=parts)
    out.append({"op": ch.PROGRESS, "lsn": 200, "meta": progress.to_meta()})
    return ch.record_batch({n: [r.get(n) for r in out] for n in ch.NAMES})


EVENT = ["e1", "order", "42", "OrderPlaced", '{"total": 9.90}']


def test_outbox_rows_become_events_and_other_tables_stay_envelopes() -> None:
    stream = MessageStream(formatter("json", "f"), lambda s, t: f"{s}.{t}",
                           outbox=OutboxSpec("app.outbox", snapshot_events=True),
                           event_topic=lambda name: "cdc." + name)
    batch = rows(("c", ORDERS, ["42", "9.90"]), ("c", OUTBOX, EVENT), ("d", OUTBOX, EVENT),
                 ("u", OUTBOX, EVENT), ("t", OUTBOX, None), ("r", OUTBOX, ["e0", "user", "7", "Seen", "{}"]))
    messages = list(stream.messages(batch))
    assert [(m.topic, m.event) for m in messages] == [("app.orders", False), ("cdc.outbox.event.order", True),
                                                      ("cdc.outbox.event.user", True)]
    order, event, read = (m.record for m in messages)
    assert json.loads(order.value or b"")["after"] == {"id": 42, "total": "9.90"}
    assert event.key == b"42" and event.value == b'{"total": 9.90}' and dict(event.headers)["id"] == b"e1"
    assert read.key == b"7" and dict(read.headers)["event_type"] == b"Seen"
    assert stream.progress().end_lsn == 200


def test_a_batch_missing_a_partition_has_no_progress() -> None:
    stream = MessageStream(formatter("json", "f"), lambda s, t: f"{s}.{t}")
    assert len(list(stream.messages(rows(("c", ORDERS, ["42", "9.90"]), parts=2)))) == 1
    with pytest.raises(IncompleteBatch):
        stream.progress()  # so the Kafka sink aborts its transaction and the webhook sink sends no resolved


def test_webhook_events_are_json_objects() -> None:
    stream = MessageStream(formatter("text", "f"), outbox=OutboxSpec("app.outbox"),
                           event_record=OutboxEvent.json_record)
    (message,) = list(stream.messages(rows(("c", OUTBOX, EVENT))))
    assert message.event and json.loads(message.record.value or b"") == {
        "id": "e1", "aggregate_type": "order", "aggregate_id": "42", "event_type": "OrderPlaced",
        "payload": {"total": 9.9}}


def test_without_an_outbox_the_table_is_a_table() -> None:
    messages = list(MessageStream(formatter("json", "f")).messages(rows(("c", OUTBOX, EVENT))))
    assert len(messages) == 1 and not messages[0].event
    assert json.loads(messages[0].record.value or b"")["after"]["event_type"] == "OrderPlaced"


def test_sink_options_carry_the_outbox() -> None:
    spec = OutboxSpec("app.outbox", topic="ev.{event_type}", ttl_s=60)
    assert outbox_spec({"outbox": json.dumps(spec.to_json())}) == spec
    assert outbox_spec({"outbox": ""}) is None and outbox_spec({}) is None
