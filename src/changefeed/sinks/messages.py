"""Change rows as messages: what every message sink (webhook, Kafka) delivers.

A batch's change rows arrive as Arrow record batches in stream order, with their control rows:
`R` rows describe a table for the rows after them, `P` rows carry the batch's progress. Each data
row becomes the `Record`s of the chosen envelope (core.envelope), in the same order, so per-key
order is the source's commit order; each goes to the topic `topic_of(schema, table)` names (a
logical decoding message: `topic_of("", "")`). With `tombstones`, a delete (also the delete half
of a key change) is followed by a tombstone of its key, for log compaction. With an outbox
(core.outbox), the outbox table's inserts become its events instead (`event_record` makes the
message: with headers for Kafka, one JSON object for webhooks), on the event's topic, and its
other changes nothing. Pure: no I/O.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from changefeed.core import change as ch
from changefeed.core import envelope_columns, followed
from changefeed.core.envelope import Change, Formatter, Record
from changefeed.core.outbox import OutboxEvent, OutboxRouter, OutboxSpec
from changefeed.errors import IncompleteBatch, SinkError


class Message(NamedTuple):
    topic: str  # where a topic-based sink sends it; "" for sinks without topics
    record: Record
    event: bool = False  # an outbox event, not a change envelope


class Run(NamedTuple):
    """Messages built by columns, all to one topic: each key with its value, followed by a
    tombstone of the key when `tombstones` (a run of deletes for log compaction)."""
    topic: str
    keys: list[bytes]
    values: list[bytes]
    tombstones: bool = False

    def messages(self) -> Iterator[Message]:
        for key, value in zip(self.keys, self.values):
            yield Message(self.topic, Record(key, value))
            if self.tombstones:
                yield Message(self.topic, Record(key, None))


def no_topic(schema: str, table: str) -> str:
    return ""


class MessageStream:
    """Feed a batch's record batches in order; take the messages, then the batch's progress."""

    def __init__(self, formatter: Formatter, topic_of: Callable[[str, str], str] = no_topic,
                 tombstones: bool = False, outbox: OutboxSpec | None = None,
                 event_record: Callable[[OutboxEvent], Record] = OutboxEvent.record,
                 event_topic: Callable[[str], str] = str) -> None:
        self.formatter, self.tombstones = formatter, tombstones
        self.topic_of = functools.lru_cache(maxsize=1024)(topic_of)  # asked once per change
        self.outbox = OutboxRouter(outbox) if outbox is not None else None
        self.event_record, self.event_topic = event_record, event_topic
        self._shapes: dict[tuple[str, str], ch.TableShape] = {}
        self._progress: list[ch.Progress] = []

    def messages(self, rb: Any) -> Iterator[Message]:
        """The batch's messages in its order, one by one."""
        for part in self.parts(rb):
            if isinstance(part, Run):
                yield from part.messages()
            else:
                yield part

    def parts(self, rb: Any) -> Iterator[Message | Run]:
        """The batch's messages in its order: runs of plain changes of one table built by columns
        where the format can (core.envelope_columns), every other row one by one."""
        kinds = envelope_columns.kinds(rb) if self.formatter.columnar else None
        if kinds is None or not kinds.any():
            yield from self._each(rb)
            return
        schemas, tables = rb.column("schema").to_pylist(), rb.column("table").to_pylist()
        i, n = 0, rb.num_rows
        while i < n:
            j, kind, table = i + 1, kinds[i], (schemas[i], tables[i])
            while j < n and kinds[j] == kind and (kind == envelope_columns.OTHER or (schemas[j], tables[j]) == table):
                j += 1
            rows = rb.slice(i, j - i)
            if kind == envelope_columns.OTHER:
                yield from self._each(rows)
            else:
                yield from self._by_columns(rows, *table, deleted=bool(kind == envelope_columns.DELETE))
            i = j

    def _by_columns(self, rows: Any, schema: str, table: str, *, deleted: bool) -> Iterator[Message | Run]:
        shape = self._shapes.get((schema, table))
        built = None
        if shape is not None and shape.key and not (self.outbox is not None and self.outbox.owns(schema, table)):
            built = self.formatter.by_columns(rows, shape, deleted=deleted)
        if built is None:
            yield from self._each(rows)
        else:
            yield Run(self.topic_of(schema or "", table or ""), built.keys, built.values,
                      built.tombstones or (deleted and self.tombstones))

    def _each(self, rb: Any) -> Iterator[Message]:
        names = rb.schema.names  # rows from column lists: faster than RecordBatch.to_pylist
        for row in (dict(zip(names, values)) for values in zip(*(c.to_pylist() for c in rb.columns))):
            op = row["op"]
            if op == ch.RELATION:
                self._shapes[(row["schema"], row["table"])] = ch.TableShape.from_meta(
                    row["schema"], row["table"], row["meta"])
            elif op == ch.PROGRESS:
                self._progress.append(ch.Progress.from_meta(row["meta"]))
            elif op in ch.DATA_OPS:
                shape = None
                if op != "m":
                    shape = self._shapes.get((row["schema"], row["table"]))
                    if shape is None:
                        raise SinkError(f"change for {row['schema']}.{row['table']} before its description (R row)",
                                        "this is a bug in the change stream; report it")
                change = Change.from_row(row, shape)
                if self.outbox is not None and self.outbox.owns(row["schema"], row["table"]):
                    event = self.outbox.route(change)
                    if event is not None:
                        yield Message(self.event_topic(self.outbox.topic(event)), self.event_record(event), True)
                    continue
                topic = self.topic_of(row["schema"] or "", row["table"] or "")
                for record in self._with_tombstones(change, self.formatter.records(change)):
                    yield Message(topic, record)

    def _with_tombstones(self, change: Change, records: list[Record]) -> list[Record]:
        """A tombstone after a delete, and after the old key's delete of a key change (its first record)."""
        if not self.tombstones or not (change.op == "d" or change.old_key is not None):
            return records
        return [records[0], Record(records[0].key, None), *records[1:]]

    def progress(self) -> ch.BatchProgress:
        return ch.BatchProgress.of(self._progress)

    def whole(self) -> bool:
        """Whether the `P` rows not taken yet are every input partition's of a batch (or sub-window)."""
        try:
            ch.BatchProgress.of(followed.folded(self._progress))
        except IncompleteBatch:
            return False
        return True

    def take_progress(self) -> ch.BatchProgress:
        """A followed batch's sub-windows since the last take, as one (core.followed.folded)."""
        taken, self._progress = followed.folded(self._progress), []
        return ch.BatchProgress.of(taken)


def outbox_spec(options: dict[str, str]) -> OutboxSpec | None:
    """The outbox a sink's options name (their `outbox`: OutboxSpec as JSON), None without one."""
    text = options.get("outbox", "")
    return OutboxSpec.from_json(json.loads(text)) if text else None
