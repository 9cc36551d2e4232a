"""Outbox events (`--outbox SCHEMA.TABLE`): rows of an outbox table become events, not row changes.

The transactional outbox pattern: the application writes its business rows and an event row in
one transaction; the feed turns each new event row into one message on a topic per aggregate
type (the `topic` template), keyed by the aggregate id (so one aggregate's events stay in order
on one partition), the payload as is (the jsonb's text: the application's bytes, not re-encoded),
and the event id, type and aggregate type in headers, so consumers can de-duplicate by id.

Only inserts are events: rows already there when a snapshot reads the table are not (they were
written before the feed, or were delivered already; `snapshot_events` sends them too). An insert
that races a snapshot is delivered by the stream, which holds every insert after the slot's
start: exactly once, whether the snapshot's read saw the row or not. The application may delete
the row in the same transaction (the insert still reaches the WAL and the feed) or leave it for
the cleanup job (postgres.outbox); updates, deletes and truncates of the outbox emit nothing.
Pure: no I/O.
"""
from __future__ import annotations

import json
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from changefeed.core.envelope import Change, Record
from changefeed.errors import ConfigError

ROLES = ("id", "aggregate_type", "aggregate_id", "event_type", "payload")
DEFAULT_TOPIC = "outbox.event.{aggregate_type}"
EVENT_OPS = ("c", "r")


def parse_columns(text: str) -> tuple[tuple[str, str], ...]:
    """`--outbox-columns id=event_id,payload=body`: (role, column) for every role, defaults filled in."""
    given: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        role, eq, column = part.partition("=")
        role, column = role.strip(), column.strip()
        if not eq or not column:
            raise ConfigError(f"--outbox-columns: {part!r} is not ROLE=COLUMN", "e.g. id=event_id,payload=body")
        if role not in ROLES:
            raise ConfigError(f"--outbox-columns: unknown role {role!r}", f"roles: {', '.join(ROLES)}")
        if role in given:
            raise ConfigError(f"--outbox-columns names {role} twice", "name each role once")
        given[role] = column
    columns = {role: given.get(role, role) for role in ROLES}
    if len(set(columns.values())) < len(ROLES):
        raise ConfigError(f"--outbox-columns maps two roles to one column: {columns}", "give each role its own column")
    return tuple(columns.items())


def check_topic_template(template: str) -> str:
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ConfigError(f"--outbox-topic {template!r} is not a valid template: {e}",
                          "e.g. outbox.event.{aggregate_type}") from None
    unknown = fields - {"aggregate_type", "event_type"}
    if unknown:
        raise ConfigError(f"--outbox-topic {template!r} uses unknown fields {sorted(unknown)}",
                          "use {aggregate_type} and {event_type}")
    return template


@dataclass(frozen=True)
class OutboxSpec:
    """Which table is the outbox, its columns by role, where its events go, when rows are cleaned up."""

    table: str  # schema.table
    columns: tuple[tuple[str, str], ...] = tuple((r, r) for r in ROLES)
    topic: str = DEFAULT_TOPIC
    ttl_s: float = 0.0  # 0: the feed never deletes outbox rows
    snapshot_events: bool = False  # rows a snapshot reads are events too (re-sent by every re-snapshot)

    def column(self, role: str) -> str:
        return dict(self.columns)[role]

    def to_json(self) -> dict[str, object]:
        return {"table": self.table, "columns": dict(self.columns), "topic": self.topic, "ttl_s": self.ttl_s,
                "snapshot_events": self.snapshot_events}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> OutboxSpec:
        columns = d.get("columns") or {}
        assert isinstance(columns, Mapping)
        return cls(str(d["table"]), tuple((r, str(columns.get(r, r))) for r in ROLES),
                   str(d.get("topic", DEFAULT_TOPIC)), float(d.get("ttl_s", 0.0)),
                   bool(d.get("snapshot_events", False)))


@dataclass(frozen=True)
class OutboxEvent:
    id: str
    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: str | None  # JSON text as stored

    def record(self) -> Record:
        """The Kafka message: key = aggregate id, value = payload, the rest in headers."""
        return Record(self.aggregate_id.encode(), None if self.payload is None else self.payload.encode(),
                      (("id", self.id.encode()), ("event_type", self.event_type.encode()),
                       ("aggregate_type", self.aggregate_type.encode())))

    def json_record(self) -> Record:
        """For sinks without headers (webhook): one JSON object holding the event, payload inline."""
        value = {"id": self.id, "aggregate_type": self.aggregate_type, "aggregate_id": self.aggregate_id,
                 "event_type": self.event_type, "payload": None if self.payload is None else json.loads(self.payload)}
        return Record(self.aggregate_id.encode(), json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


class OutboxRouter:
    """route(change): None for changes of other tables, else the outbox event (or none) it makes."""

    def __init__(self, spec: OutboxSpec) -> None:
        self.spec = spec
        self.schema, _, self.table = spec.table.partition(".")
        self._index: dict[str, int] | None = None
        self._columns: tuple[str, ...] = ()

    def owns(self, schema: str, table: str) -> bool:
        return schema == self.schema and table == self.table

    def route(self, change: Change) -> OutboxEvent | None:
        """The event of an insert of the outbox table (or of a snapshot read, with `snapshot_events`);
        None for anything else."""
        if change.op not in EVENT_OPS or change.shape is None or not self.owns(change.shape.schema, change.shape.table):
            return None
        if change.op == "r" and not self.spec.snapshot_events:
            return None
        if self._columns != change.shape.columns:  # the table's shape changed (or first use)
            self._columns = change.shape.columns
            missing = [c for c in dict(self.spec.columns).values() if c not in change.shape.columns]
            if missing:
                raise ConfigError(f"outbox table {self.spec.table} has no column {', '.join(missing)}",
                                  "name its columns with --outbox-columns ROLE=COLUMN,...")
            self._index = {role: change.shape.columns.index(col) for role, col in self.spec.columns}
        assert self._index is not None and change.after is not None
        values = {role: change.after[i] for role, i in self._index.items()}
        for role in ("id", "aggregate_type", "aggregate_id", "event_type"):
            if values[role] is None:
                raise ConfigError(f"outbox table {self.spec.table}: an event without {role} "
                                  f"(column {self.spec.column(role)} is NULL) at LSN {change.lsn:X}",
                                  f"make {self.spec.column(role)} NOT NULL; the feed stopped before delivering it")
        text = {role: v.decode() for role, v in values.items() if v is not None}  # a NULL payload left out
        return OutboxEvent(text["id"], text["aggregate_type"], text["aggregate_id"], text["event_type"],
                           text.get("payload"))

    def topic(self, event: OutboxEvent) -> str:
        return self.spec.topic.format(aggregate_type=event.aggregate_type, event_type=event.event_type)
