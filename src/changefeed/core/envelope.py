"""Envelopes (`--format`): how a change becomes messages (key, value) for Kafka and webhook sinks.

A formatter turns one `Change` into a list of `Record`s, usually one; the list is needed where
Debezium emits several events for one change (a delete and its tombstone; a key change). Values
are typed by `core.pgvalue` in every JSON format. All output is deterministic: timestamps come
from the commit, never from the clock, so a replayed batch yields byte-identical messages.

`json` (default). Key: JSON array of the primary key values. Value:
    {"after": {column: value, ...} | null, "before": {...} | null, "key": [...],
     "op": "c" | "u" | "d" | "r", "updated": "<commit ts>", "table": "schema.table"}
`before` is present only with `diff`; it is null when the source did not send an old row (an
update that kept its key, under REPLICA IDENTITY DEFAULT). Under DEFAULT or USING INDEX the old
row holds only the identity columns, and `before` holds just those. `updated` is the commit's
HLC timestamp (core.hlc) as a decimal string, comparable with `resolved(ts)`'s
{"resolved": "<ts>"}: once a resolved message arrives, every change up to its ts has arrived.
A column whose TOASTed value an update left unchanged is omitted from `after`: neither a
placeholder nor null (the source did not send it). Consumers merge `after` into the row they
hold under the same key, which also gives that column its value. An update that changes the
key is a delete of the old key (after null) followed by the update under the new key (with
`diff`, its `before` names the old key). A truncate has no key: {"op": "t", "table", "updated"};
a logical decoding message is keyed by [prefix]:
{"message": {"prefix", "content" (base64)}, "op": "m", "updated"}.

`debezium`: the value is the `payload` of a Debezium PostgreSQL connector change event, as
Kafka Connect's JsonConverter writes it with schemas.enable=false: before, after, source
{version, connector "postgresql", name (the feed), ts_ms/ts_us/ts_ns (commit time), snapshot
("true" for snapshot reads, else "false"), db, schema, table, txId, lsn, xmin}, op, ts_ms/ts_us/
ts_ns, transaction (null). The key is the struct of the key columns, {"id": 1}. As Debezium
does: a delete is followed by a tombstone (same key, value None) for log compaction; an update
that changes the key becomes a delete of the old key (header `__debezium.newkey`), its
tombstone, and a create of the new key (header `__debezium.oldkey`); a truncate has a null key
and no before/after; a message is keyed {"prefix": ...} with "message": {"prefix", "content"}
and empty schema and table, txId null when not transactional. Where we differ:
  * Values are typed as above, not by Debezium's default converters: numeric is a decimal string
    (Debezium: base64 of the unscaled bytes, decimal.handling.mode=precise; =string matches
    ours), timestamptz keeps the source's offset ('Z' for UTC; Debezium: always UTC), timestamp
    and date are ISO 8601 strings (Debezium: µs since the epoch, days since the epoch), json and
    jsonb are inline JSON (Debezium: a string holding the JSON), interval and time are their
    PostgreSQL text (Debezium: µs), NaN and ±Infinity floats are strings. Integers, floats,
    booleans, text, uuid, bytea (base64) and arrays of them come out as Debezium writes them.
  * An unchanged TOASTed column is omitted from `after` (Debezium: the placeholder
    "__debezium_unavailable_value").
  * `source.lsn` is the LSN of the transaction's commit record (the same for all its changes;
    for a snapshot read, the start of the batch window that delivers it; for a non-transactional
    message, its end), not of the change's own record, which change rows do not keep; so `source.sequence` is
    left out. The envelope's ts_ms is the commit timestamp's physical part, not the time of
    processing. `source.version` is changefeed's, not a Debezium version.
`diff` does not apply: Debezium always carries `before` (null when not sent).

`text`: one line per change in the form of PostgreSQL's test_decoding plugin, e.g.
`table public.t: INSERT: id[integer]:1 name[text]:'x'`, UPDATE with `old-key: ... new-tuple: ...`
when an old row was sent, DELETE, `TRUNCATE: (no-flags)` (the flags are not captured), and
`message: transactional: 1 prefix: p, sz: 3 content:abc`. Snapshot reads print as INSERT.
Types print without modifiers, as test_decoding prints them; an unchanged TOASTed value prints
as `unchanged-toast-datum`. Values print raw, as there: one with a newline spans lines. The key
is the json format's.
"""
from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple, Protocol

from changefeed import __version__
from changefeed.core.change import TableShape
from changefeed.core.copytext import split_line
from changefeed.core.hlc import physical_ms
from changefeed.core.pgvalue import UNQUOTED_TYPES, Convert, base_name, converter
from changefeed.errors import ConfigError

FORMATS = ("json", "debezium", "text")

Values = Sequence[bytes | None]


class Record(NamedTuple):
    """One message: key None means no key (truncate), value None is a tombstone."""

    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()


@dataclass(frozen=True)
class Change:
    """One data change as formatters need it: its table's shape and values split from COPY text.

    `after`/`before`/`old_key` hold text-form values (None for NULL) in column order (`old_key`:
    key order, set when an update changed the key); `unchanged` holds the indexes of columns
    whose TOASTed value an update left unchanged (None in `after`). Times: `commit_time` in Unix
    µs (None for snapshot reads and non-transactional messages), `commit_ts` the HLC timestamp.
    """

    op: str
    shape: TableShape | None  # None for a logical decoding message
    after: Values | None = None
    before: Values | None = None
    old_key: Values | None = None
    unchanged: frozenset[int] = frozenset()
    lsn: int = 0
    xid: int = 0
    commit_time: int | None = None
    commit_ts: int = 0
    prefix: str = ""  # of a message
    content: bytes = b""  # of a message

    @classmethod
    def from_row(cls, row: Mapping[str, Any], shape: TableShape | None) -> Change:
        """A change row (core.change fields, e.g. from RecordBatch.to_pylist()) of `shape`'s table."""
        common = {"lsn": row["lsn"], "xid": row["xid"], "commit_time": row["commit_time"],
                  "commit_ts": row["commit_ts"]}
        if row["op"] == "m":
            return cls("m", None, prefix=json.loads(row["meta"])["prefix"], content=row["after"], **common)
        after, before, old_key = (None if row[f] is None else split_line(row[f])
                                  for f in ("after", "before", "old_key"))
        unchanged = frozenset(int(i) for i in row["unchanged"][1:-1].split(",")) if row["unchanged"] else frozenset()
        return cls(row["op"], shape, after=after, before=before, old_key=old_key, unchanged=unchanged, **common)

    @property
    def table_shape(self) -> TableShape:
        assert self.shape is not None, f"a {self.op!r} change without its table's shape"
        return self.shape

    @property
    def qualified(self) -> str:
        return f"{self.table_shape.schema}.{self.table_shape.table}"

    @property
    def transactional(self) -> bool:
        return self.xid != 0


class Formatter(Protocol):
    """What sinks call: the messages for one change, in the order they must be sent. `columnar`:
    whether runs of plain changes (core.envelope_columns.kinds) may be built by columns instead,
    by `by_columns` (None: that run goes change by change)."""

    @property
    def columnar(self) -> bool: ...

    def records(self, change: Change) -> list[Record]: ...

    def by_columns(self, rows: Any, shape: TableShape, *, deleted: bool) -> Columnar | None: ...


class Columnar(NamedTuple):
    """A run's messages built by columns: keys[i] with values[i], each followed by a tombstone of
    its key when `tombstones` (the format's own, after a delete)."""
    keys: list[bytes]
    values: list[bytes]
    tombstones: bool = False


def formatter(name: str, feed: str, diff: bool = False, database: str = "") -> Formatter:
    """The formatter for `--format name`; `feed` and `database` name the source in Debezium events."""
    if name == "json":
        return JsonFormat(diff)
    if name == "debezium":
        return DebeziumFormat(feed, database)
    if name == "text":
        return TextFormat()
    raise ConfigError(f"unknown --format {name!r}", f"use one of: {', '.join(FORMATS)}")


def resolved(ts: int) -> bytes:
    """The json format's resolved message: every change with `updated` <= ts has been sent."""
    return _dumps({"resolved": str(ts)})


# -- typed values -----------------------------------------------------------------------------
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)  # one for all: per-change


def _dumps(value: Any) -> bytes:
    return _ENCODER.encode(value).encode()


@lru_cache(maxsize=256)
def _converters(shape: TableShape) -> tuple[tuple[str, Convert], ...]:
    """Per column of the shape: its name and its value converter (looked up once per shape)."""
    return tuple((c, converter(t)) for c, t in zip(shape.columns, shape.types))


def _row(change: Change, values: Values, skip: frozenset[int] = frozenset()) -> dict[str, Any]:
    columns = _converters(change.table_shape)
    if not skip:
        return {c: None if v is None else conv(v.decode("utf-8")) for (c, conv), v in zip(columns, values)}
    return {c: None if v is None else conv(v.decode("utf-8"))
            for i, ((c, conv), v) in enumerate(zip(columns, values)) if i not in skip}


def _after(change: Change) -> dict[str, Any] | None:
    return None if change.after is None else _row(change, change.after, change.unchanged)


def _before(change: Change) -> dict[str, Any] | None:
    """The old row; under an identity other than FULL only its identity columns were sent (never
    NULL: PostgreSQL requires them NOT NULL), so its NULLs are columns the source left out."""
    if change.before is None:
        return None
    if change.table_shape.replica_identity == "f":
        return _row(change, change.before)
    return _row(change, change.before, frozenset(i for i, v in enumerate(change.before) if v is None))


def _key_values(change: Change, old: bool = False) -> list[Any]:
    """The key's values: of the new row, the deleted row, or (`old`) before a key change."""
    keys = _key_converters(change.table_shape)
    if old:
        assert change.old_key is not None
        return [None if v is None else conv(v.decode("utf-8")) for (_, conv), v in zip(keys, change.old_key)]
    values = change.before if change.op == "d" else change.after
    assert values is not None, f"a {change.op!r} change without its row"
    return [None if (v := values[i]) is None else conv(v.decode("utf-8")) for i, conv in keys]


@lru_cache(maxsize=256)
def _key_converters(shape: TableShape) -> tuple[tuple[int, Convert], ...]:
    """Per key column: its index among the columns, and its value converter."""
    return tuple((shape.columns.index(k), converter(shape.types[shape.columns.index(k)])) for k in shape.key)


def _json_key(change: Change) -> bytes | None:
    if change.op == "m":
        return _dumps([change.prefix])
    return None if change.op == "t" else _dumps(_key_values(change))


def _message(change: Change) -> dict[str, str]:
    return {"prefix": change.prefix, "content": base64.b64encode(change.content).decode("ascii")}


# -- json ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class JsonFormat:
    diff: bool = False

    @property
    def columnar(self) -> bool:
        return not self.diff

    def by_columns(self, rows: Any, shape: TableShape, *, deleted: bool) -> Columnar | None:
        from changefeed.core.envelope_columns import json_records  # (Arrow: kept out of the planner's imports)

        built = json_records(rows, shape, _dumps, deleted=deleted)
        return None if built is None else Columnar(*built)

    def records(self, change: Change) -> list[Record]:
        updated = str(change.commit_ts)
        if change.op == "m":
            return [Record(_json_key(change), _dumps({"message": _message(change), "op": "m", "updated": updated}))]
        if change.op == "t":
            return [Record(None, _dumps({"op": "t", "table": change.qualified, "updated": updated}))]
        out = []
        if change.old_key is not None:
            out.append(self._record(change, "d", _key_values(change, old=True), None))
        out.append(self._record(change, change.op, _key_values(change), _after(change)))
        return out

    def _record(self, change: Change, op: str, key: list[Any], after: dict[str, Any] | None) -> Record:
        value: dict[str, Any] = {"after": after}
        if self.diff or not change.table_shape.key:  # (without a key, the old row is what says which row)
            value["before"] = _before(change)
        value.update(key=key, op=op, updated=str(change.commit_ts), table=change.qualified)
        return Record(_dumps(key) if change.table_shape.key else None, _dumps(value))  # (no key: a null one)


# -- debezium -------------------------------------------------------------------------------
@dataclass(frozen=True)
class DebeziumFormat:
    feed: str
    database: str = ""
    version: str = f"changefeed-{__version__}"
    columnar = True  # (a class attribute, not a field)

    def by_columns(self, rows: Any, shape: TableShape, *, deleted: bool) -> Columnar | None:
        from changefeed.core.debezium_columns import debezium_records  # (Arrow: as above)

        built = debezium_records(rows, shape, _dumps, (self.version, self.feed, self.database), deleted=deleted)
        return None if built is None else Columnar(*built, tombstones=deleted)

    def records(self, change: Change) -> list[Record]:
        if change.op == "m":
            return [Record(_dumps({"prefix": change.prefix}), self._event(change, "m", message=_message(change)))]
        if change.op == "t":
            return [Record(None, self._event(change, "t"))]
        key = self._key(change)
        if change.op == "d":
            deleted = self._event(change, "d", {"before": _before(change), "after": None})
            return [Record(key, deleted), Record(key, None)] if key is not None else [Record(None, deleted)]
        if change.old_key is None:
            return [Record(key, self._event(change, change.op, {"before": _before(change), "after": _after(change)}))]
        old_key = self._key(change, old=True)
        assert key is not None and old_key is not None  # (a key changed: the table has one)
        return [
            Record(old_key, self._event(change, "d", {"before": _before(change), "after": None}),
                   (("__debezium.newkey", key),)),
            Record(old_key, None),
            Record(key, self._event(change, "c", {"before": None, "after": _after(change)}),
                   (("__debezium.oldkey", old_key),)),
        ]

    def _key(self, change: Change, old: bool = False) -> bytes | None:
        """The record's key; None for a table without one (and no tombstone after its deletes)."""
        if not change.table_shape.key:
            return None
        return _dumps(dict(zip(change.table_shape.key, _key_values(change, old))))

    def _event(self, change: Change, op: str, rows: dict[str, Any] | None = None,
               message: dict[str, str] | None = None) -> bytes:
        """The event's payload: with `rows` (before, after) for row changes, `message` for messages."""
        ts_ms = physical_ms(change.commit_ts)
        value = {**(rows or {}), "source": self._source(change), "op": op,
                 "ts_ms": ts_ms, "ts_us": ts_ms * 1000, "ts_ns": ts_ms * 1_000_000}
        if rows is not None:
            value["transaction"] = None
        if message is not None:
            value["message"] = message
        return _dumps(value)

    def _source(self, change: Change) -> dict[str, Any]:
        us = change.commit_time if change.commit_time is not None else physical_ms(change.commit_ts) * 1000
        shape = change.shape
        return {
            "version": self.version, "connector": "postgresql", "name": self.feed,
            "ts_ms": us // 1000, "ts_us": us, "ts_ns": us * 1000,
            "snapshot": "true" if change.op == "r" else "false", "db": self.database,
            "schema": shape.schema if shape else "", "table": shape.table if shape else "",
            "txId": change.xid if change.transactional else None, "lsn": change.lsn, "xmin": None,
        }


# -- text -----------------------------------------------------------------------------------
# PostgreSQL's keywords that quote_identifier() quotes (all but the unreserved ones; PostgreSQL 18).
_KEYWORDS = frozenset("""
all analyse analyze and any array as asc asymmetric authorization between bigint binary bit boolean both
case cast char character check coalesce collate collation column concurrently constraint create cross
current_catalog current_date current_role current_schema current_time current_timestamp current_user dec
decimal default deferrable desc distinct do else end except exists extract false fetch float for foreign
freeze from full grant greatest group grouping having ilike in initially inner inout int integer intersect
interval into is isnull join json json_array json_arrayagg json_exists json_object json_objectagg json_query
json_scalar json_serialize json_table json_value lateral leading least left like limit localtime
localtimestamp merge_action national natural nchar none normalize not notnull null nullif numeric offset on
only or order out outer overlaps overlay placing position precision primary real references returning right
row select session_user setof similar smallint some substring symmetric system_user table tablesample then
time timestamp to trailing treat trim true union unique user using values varchar variadic verbose when
where window with xmlattributes xmlconcat xmlelement xmlexists xmlforest xmlnamespaces xmlparse xmlpi xmlroot
xmlserialize xmltable
""".split())
_IDENT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_")


def quote_identifier(name: str) -> str:
    """As PostgreSQL's quote_identifier(): quoted unless lowercase, simple and not a keyword."""
    if (name and (name[0] == "_" or "a" <= name[0] <= "z") and set(name) <= _IDENT_CHARS
            and name not in _KEYWORDS):
        return name
    return '"' + name.replace('"', '""') + '"'


def _literal(value: bytes, type_name: str) -> bytes:
    """As test_decoding's print_literal(): numbers bare, booleans as words, bits as B'..', the
    rest single-quoted with quotes doubled."""
    if type_name in UNQUOTED_TYPES:
        return value
    if type_name == "boolean":
        return b"true" if value == b"t" else b"false"
    if type_name in ("bit", "bit varying"):
        return b"B'" + value + b"'"
    return b"'" + value.replace(b"'", b"''") + b"'"


@dataclass(frozen=True)
class TextFormat:
    columnar = True

    def by_columns(self, rows: Any, shape: TableShape, *, deleted: bool) -> Columnar | None:
        header = f"table {quote_identifier(shape.schema)}.{quote_identifier(shape.table)}:"
        labels = [f" {quote_identifier(c)}[{base_name(t)}]:" for c, t in zip(shape.columns, shape.types)]
        from changefeed.core.text_columns import text_records  # (Arrow: as above)

        built = text_records(rows, shape, _dumps, header, labels, deleted=deleted)
        return None if built is None else Columnar(*built)

    def records(self, change: Change) -> list[Record]:
        return [Record(_json_key(change), self.line(change))]

    def line(self, change: Change) -> bytes:
        if change.op == "m":
            head = (f"message: transactional: {int(change.transactional)} prefix: {change.prefix}, "
                    f"sz: {len(change.content)} content:")
            return head.encode() + change.content
        shape = change.table_shape
        table = f"table {quote_identifier(shape.schema)}.{quote_identifier(shape.table)}:".encode()
        if change.op == "t":
            return table + b" TRUNCATE: (no-flags)"
        if change.op == "d":
            old = b" (no-tuple-data)" if change.before is None else self._tuple(shape, change.before, skip_nulls=True)
            return table + b" DELETE:" + old
        new = self._tuple(shape, change.after or (), unchanged=change.unchanged)
        if change.op != "u":
            return table + b" INSERT:" + new
        if change.before is None:
            return table + b" UPDATE:" + new
        return table + b" UPDATE: old-key:" + self._tuple(shape, change.before, skip_nulls=True) + b" new-tuple:" + new

    @staticmethod
    def _tuple(shape: TableShape, values: Values, skip_nulls: bool = False,
               unchanged: frozenset[int] = frozenset()) -> bytes:
        """test_decoding's tuple_to_stringinfo(): ` name[type]:value` per column."""
        out = []
        for i, (column, type_name, value) in enumerate(zip(shape.columns, shape.types, values)):
            if value is None and skip_nulls:
                continue
            name = base_name(type_name)
            if i in unchanged:
                text = b"unchanged-toast-datum"
            elif value is None:
                text = b"null"
            else:
                text = _literal(value, name)
            out.append(f" {quote_identifier(column)}[{name}]:".encode() + text)
        return b"".join(out)
