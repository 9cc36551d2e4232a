"""Envelopes: golden files per format over every column type, and consumers that read them back.

The inputs are change rows as the pipeline carries them, with values exactly as PostgreSQL 18
printed them for this workload (captured once through pgoutput from a real server; the `text`
golden equals test_decoding's output for the same changes, checked on that server):

    CREATE TABLE all_types (id integer PRIMARY KEY, big bigint, small smallint, amount numeric(12,2),
      ratio double precision, score real, name text, label varchar(20), flag boolean, at timestamptz,
      local_at timestamp, day date, t time, span interval, doc jsonb, raw json, data bytea, uid uuid,
      ints integer[], tags text[], grid integer[], stamps timestamptz[], body text);
    CREATE TABLE accounts (region text, id bigint, balance numeric, "user" text, "Display Name" text,
      PRIMARY KEY (region, id));  -- REPLICA IDENTITY FULL

Regenerate the golden files with UPDATE_GOLDEN=1 (then review the diff by eye).
"""
from __future__ import annotations

import base64
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from changefeed.core.change import TableShape
from changefeed.core.copytext import join_line
from changefeed.core.envelope import (
    FORMATS,
    Change,
    DebeziumFormat,
    Formatter,
    JsonFormat,
    Record,
    TextFormat,
    formatter,
    resolved,
)
from changefeed.errors import ConfigError

GOLDEN = Path(__file__).parent.parent / "data" / "envelopes"

ALL_TYPES = TableShape(
    "public", "all_types",
    ("id", "big", "small", "amount", "ratio", "score", "name", "label", "flag", "at", "local_at", "day", "t", "span",
     "doc", "raw", "data", "uid", "ints", "tags", "grid", "stamps", "body"),
    ("integer", "bigint", "smallint", "numeric(12,2)", "double precision", "real", "text", "character varying(20)",
     "boolean", "timestamp with time zone", "timestamp without time zone", "date", "time without time zone",
     "interval", "jsonb", "json", "bytea", "uuid", "integer[]", "text[]", "integer[]", "timestamp with time zone[]",
     "text"),
    ("id",), "d")
ACCOUNTS = TableShape("public", "accounts", ("region", "id", "balance", "user", "Display Name"),
                      ("text", "bigint", "numeric", "text", "text"), ("region", "id"), "f")


def _values(shape: TableShape, **columns: bytes) -> list[bytes | None]:
    """A row in column order: the given text-form values, NULL elsewhere."""
    return [columns.get(c) for c in shape.columns]


EVERY_TYPE = dict(
    big=b"9007199254740993", small=b"-32768", amount=b"1234567890.12", ratio=b"3.141592653589793", score=b"1.5",
    name=b"plain text", label=b"short", flag=b"t", at=b"2024-01-02 03:04:05.123456+00",
    local_at=b"2024-01-02 03:04:05", day=b"2024-02-29", t=b"03:04:05.5", span=b"1 year 2 mons 3 days 04:05:06.789",
    doc=b'{"a": 1, "b": [true, null, "x"], "c": {"d": 1.50}}', raw=b'{"z": 1,  "a": [1, 2]}', data=rb"\x00ff0010",
    uid=b"a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", ints=b"{1,NULL,3}",
    tags=rb'{plain,"with space","quo\"te","back\\slash","comma,here","{brace}",NULL,"NULL",""}',
    grid=b"{{1,2},{3,4}}", stamps=b'{"2024-01-02 03:04:05+00",NULL}', body=b"short body")
EDGES = dict(  # printed under TimeZone Asia/Kolkata, hence the offsets
    big=b"-9223372036854775808", small=b"32767", amount=b"NaN", ratio=b"NaN", score=b"-Infinity",
    name=b"it's\ta\nnew line \\ back", label="héllo wörld".encode(), flag=b"f", at=b"2024-01-02 08:34:05.123456+05:30",
    local_at=b"infinity", day=b"0044-03-15 BC", t=b"24:00:00", span=b"-1 days +02:03:00",
    doc=b'[1, "two", null, {"x": []}]', raw=b"null", data=rb"\x", uid=b"00000000-0000-0000-0000-000000000000",
    ints=b"{}", tags=b"{}", grid=b"[0:1][1:2]={{1,2},{3,4}}",
    stamps=b'{infinity,"0044-03-15 17:53:28+05:53:28 BC",NULL}', body=b"")
MOVED = {**EDGES, "name": b"moved", "at": b"2024-01-02 03:04:05.123456+00",
         "stamps": b'{infinity,"0044-03-15 12:00:00+00 BC",NULL}'}


def _row(op: str, shape: TableShape | None, lsn: int, xid: int, commit_time: int | None, commit_ts: int,
         after: list[bytes | None] | bytes | None = None, before: list[bytes | None] | None = None,
         old_key: list[bytes | None] | None = None, unchanged: str | None = None,
         meta: str | None = None) -> dict[str, Any]:
    """A change row as `RecordBatch.to_pylist()` gives it (values as COPY text lines)."""
    def line(values: list[bytes | None] | None) -> bytes | None:
        return None if values is None else join_line(values)

    return {"op": op, "schema": shape and shape.schema, "table": shape and shape.table, "lsn": lsn, "seq": 0,
            "xid": xid, "commit_time": commit_time, "commit_ts": commit_ts,
            "after": after if isinstance(after, bytes) else line(after), "before": line(before),
            "old_key": line(old_key), "unchanged": unchanged, "meta": meta}


KEY_ONLY_2 = _values(ALL_TYPES, id=b"2")
ACCOUNT_EU = [b"eu", b"1", b"100.50", b"ann", None]
ACCOUNT_EU_2 = [b"eu", b"1", b"75.25", b"ann", b"Ann O'Neil"]
CHANGES: list[tuple[str, dict[str, Any], TableShape | None]] = [
    ("insert: every type", _row("c", ALL_TYPES, 37220280, 807, 1795326090827763, 470633962753753088,
                                _values(ALL_TYPES, id=b"1", **EVERY_TYPE)), ALL_TYPES),
    ("insert: NULLs", _row("c", ALL_TYPES, 37220464, 808, 1795326090828643, 470633962754015232, KEY_ONLY_2), ALL_TYPES),
    ("insert: edge values", _row("c", ALL_TYPES, 37220952, 809, 1795326090829013, 470633962754277376,
                                 _values(ALL_TYPES, id=b"3", **EDGES)), ALL_TYPES),
    ("snapshot read", _row("r", ALL_TYPES, 37219000, 0, None, 470633962753490944,
                           _values(ALL_TYPES, id=b"4", **EVERY_TYPE)), ALL_TYPES),
    ("update: body TOASTed and unchanged", _row(
        "u", ALL_TYPES, 37264368, 811, 1795326090835133, 470633962755850240,
        _values(ALL_TYPES, id=b"6", name=b"renamed", flag=b"f"), unchanged="{22}"), ALL_TYPES),
    ("update: key 3 -> 5", _row("u", ALL_TYPES, 37264872, 812, 1795326090835382, 470633962755850241,
                                _values(ALL_TYPES, id=b"5", **MOVED), before=_values(ALL_TYPES, id=b"3"),
                                old_key=[b"3"]), ALL_TYPES),
    ("delete: key only", _row("d", ALL_TYPES, 37264992, 813, 1795326090835540, 470633962755850242,
                              before=KEY_ONLY_2), ALL_TYPES),
    ("insert: composite key", _row("c", ACCOUNTS, 37265296, 814, 1795326090835843, 470633962755850243,
                                   ACCOUNT_EU), ACCOUNTS),
    ("update: REPLICA IDENTITY FULL", _row("u", ACCOUNTS, 37265512, 815, 1795326090836146, 470633962756112384,
                                           ACCOUNT_EU_2, before=ACCOUNT_EU), ACCOUNTS),
    ("insert: to be truncated", _row("c", ACCOUNTS, 37265712, 816, 1795326090836327, 470633962756112385,
                                     [b"us", b"2", b"0", None, None]), ACCOUNTS),
    ("delete: REPLICA IDENTITY FULL", _row("d", ACCOUNTS, 37265864, 817, 1795326090836481, 470633962756112386,
                                           before=ACCOUNT_EU_2), ACCOUNTS),
    ("truncate", _row("t", ACCOUNTS, 37268872, 818, 1795326090837468, 470633962756374528), ACCOUNTS),
    ("insert: after the truncate", _row("c", ACCOUNTS, 37269576, 819, 1795326090839070, 470633962756898816,
                                        [b"us", b"3", b"0.00000000000000000001", b"bob", b"Bob"]), ACCOUNTS),
    ("message: transactional", _row("m", None, 37269576, 819, 1795326090839070, 470633962756898816,
                                    b'{"event": "shipped"}', meta='{"prefix": "app"}'), None),
    ("message: not transactional", _row("m", None, 37269688, 0, None, 470633962756898816, b"beat",
                                        meta='{"prefix": "ping"}'), None),
]
RESOLVED_TS = 470633962757160959

GOLDEN_FORMATS: dict[str, Formatter] = {
    "json": JsonFormat(),
    "json_diff": JsonFormat(diff=True),
    "debezium": DebeziumFormat("golden", "golden", version="changefeed-golden"),
    "text": TextFormat(),
}


def _changes() -> list[tuple[str, Change]]:
    return [(label, Change.from_row(row, shape)) for label, row, shape in CHANGES]


def _records(fmt: Formatter) -> list[Record]:
    return [r for _, change in _changes() for r in fmt.records(change)]


def _render(fmt: Formatter) -> bytes:
    """All records of all changes, readable: `key:`, `header NAME:` and `value:` lines per record."""
    out = []
    for label, change in _changes():
        out.append(b"# " + label.encode())
        for r in fmt.records(change):
            out.append(b"key: " + (b"(none)" if r.key is None else r.key))
            out.extend(b"header " + name.encode() + b": " + v for name, v in r.headers)
            out.append(b"value: " + (b"(tombstone)" if r.value is None else r.value))
    return b"\n".join(out) + b"\n"


@pytest.mark.parametrize("name", GOLDEN_FORMATS)
def test_golden(name: str) -> None:
    path = GOLDEN / f"{name}.txt"
    got = _render(GOLDEN_FORMATS[name])
    if name == "json":
        got += b"# resolved\nvalue: " + resolved(RESOLVED_TS) + b"\n"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(got)
    assert got == path.read_bytes(), f"{path} differs; UPDATE_GOLDEN=1 regenerates it (then review the diff)"


def _strict_json(raw: bytes) -> Any:
    """Parse as JSON consumers must: NaN or Infinity literals are errors."""
    def reject(constant: str) -> None:
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(raw, parse_constant=reject)


# -- consumers ------------------------------------------------------------------------------------
# Field names from Debezium's documentation of the PostgreSQL connector's change events.
PAYLOAD_FIELDS = {"before", "after", "source", "op", "ts_ms", "ts_us", "ts_ns", "transaction", "message"}
SOURCE_FIELDS = {"version", "connector", "name", "ts_ms", "ts_us", "ts_ns", "snapshot", "db", "sequence", "schema",
                 "table", "txId", "lsn", "xmin"}
SOURCE_REQUIRED = {"version", "connector", "name", "ts_ms", "snapshot", "db", "schema", "table"}
OPS = {"c", "u", "d", "r", "t", "m"}

State = dict[str, dict[tuple[Any, ...], dict[str, Any]]]


def consume_debezium(records: list[Record]) -> tuple[State, list[tuple[str, bytes]]]:
    """A consumer written the way Debezium consumers read events: the payload (unwrapped if the
    converter added a schema), dispatch on `op`, rows from before/after, keys from the key struct;
    tombstones are skipped. Rows merge into what the key held (an omitted column keeps its value)."""
    tables: State = defaultdict(dict)
    messages = []
    for record in records:
        if record.value is None:
            continue
        event = _strict_json(record.value)
        payload = event.get("payload", event)
        assert set(payload) <= PAYLOAD_FIELDS and payload["op"] in OPS, payload
        source = payload["source"]
        assert SOURCE_REQUIRED <= set(source) <= SOURCE_FIELDS, source
        assert source["connector"] == "postgresql" and source["snapshot"] in ("true", "false")
        assert isinstance(payload["ts_ms"], int) and isinstance(source["ts_ms"], int) and isinstance(source["lsn"], int)
        op = payload["op"]
        if op == "m":
            assert _strict_json(record.key or b"") == {"prefix": payload["message"]["prefix"]}
            messages.append((payload["message"]["prefix"], base64.b64decode(payload["message"]["content"])))
            continue
        rows = tables[f"{source['schema']}.{source['table']}"]
        if op == "t":
            assert record.key is None and "before" not in payload and "after" not in payload
            rows.clear()
            continue
        key = _strict_json(record.key or b"")
        image = payload["before"] if op == "d" else payload["after"]
        assert {k: image[k] for k in key} == key, "the key struct holds the row's key columns"
        if op == "d":
            assert payload["after"] is None
            del rows[tuple(key.values())]
        else:
            if op in ("c", "r"):
                assert payload["before"] is None
            rows[tuple(key.values())] = {**rows.get(tuple(key.values()), {}), **payload["after"]}
    return tables, messages


def consume_json(records: list[Record]) -> tuple[State, list[tuple[str, bytes]]]:
    """A consumer of the json format: merge `after` into the row under `key`, null `after` deletes."""
    tables: State = defaultdict(dict)
    messages = []
    for record in records:
        value = _strict_json(record.value or b"")
        if value["op"] == "m":
            messages.append((value["message"]["prefix"], base64.b64decode(value["message"]["content"])))
            continue
        rows = tables[value["table"]]
        if value["op"] == "t":
            rows.clear()
            continue
        key = tuple(value["key"])
        assert _strict_json(record.key or b"") == value["key"]
        if value["after"] is None:
            del rows[key]
        else:
            rows[key] = {**rows.get(key, {}), **value["after"]}
    return tables, messages


EXPECTED_KEYS = {"public.all_types": {(1,), (4,), (5,), (6,)}, "public.accounts": {("us", 3)}}
EXPECTED_MESSAGES = [("app", b'{"event": "shipped"}'), ("ping", b"beat")]


def test_debezium_consumer_reads_every_event() -> None:
    tables, messages = consume_debezium(_records(GOLDEN_FORMATS["debezium"]))
    assert {t: set(rows) for t, rows in tables.items()} == EXPECTED_KEYS
    assert messages == EXPECTED_MESSAGES
    assert tables["public.all_types"][(5,)]["name"] == "moved"
    assert tables["public.accounts"][("us", 3)] == {"region": "us", "id": 3, "balance": "0.00000000000000000001",
                                                     "user": "bob", "Display Name": "Bob"}


@pytest.mark.parametrize("diff", [False, True])
def test_json_consumer_ends_where_the_debezium_one_does(diff: bool) -> None:
    debezium, _ = consume_debezium(_records(GOLDEN_FORMATS["debezium"]))
    tables, messages = consume_json(_records(JsonFormat(diff)))
    assert tables == debezium and messages == EXPECTED_MESSAGES


def test_values_are_typed() -> None:
    (value,) = [_strict_json(r.value or b"") for r in JsonFormat().records(_changes()[0][1])]
    after = value["after"]
    assert after["big"] == 9007199254740993 and after["small"] == -32768 and after["score"] == 1.5
    assert after["amount"] == "1234567890.12" and after["flag"] is True
    assert after["at"] == "2024-01-02T03:04:05.123456Z" and after["day"] == "2024-02-29"
    assert after["doc"] == {"a": 1, "b": [True, None, "x"], "c": {"d": 1.5}}
    assert base64.b64decode(after["data"]) == b"\x00\xff\x00\x10"
    assert after["tags"] == ["plain", "with space", 'quo"te', "back\\slash", "comma,here", "{brace}", None, "NULL", ""]
    assert after["grid"] == [[1, 2], [3, 4]] and after["ints"] == [1, None, 3]
    assert value["updated"] == "470633962753753088" and value["op"] == "c" and value["key"] == [1]


def test_unchanged_toast_column_is_omitted_never_a_placeholder() -> None:
    change = dict(_changes())["update: body TOASTed and unchanged"]
    for fmt in (JsonFormat(), JsonFormat(diff=True), GOLDEN_FORMATS["debezium"]):
        (record,) = fmt.records(change)
        after = _strict_json(record.value or b"")["after"]
        assert "body" not in after and after["name"] == "renamed" and after["t"] is None
    assert TextFormat().line(change).endswith(b" body[text]:unchanged-toast-datum")


def test_key_change_retracts_the_old_key() -> None:
    change = dict(_changes())["update: key 3 -> 5"]
    old, new = JsonFormat(diff=True).records(change)
    assert (old.key, new.key) == (b"[3]", b"[5]")
    assert _strict_json(old.value or b"")["after"] is None and _strict_json(old.value or b"")["op"] == "d"
    assert _strict_json(new.value or b"")["before"] == {"id": 3}
    delete, tombstone, create = GOLDEN_FORMATS["debezium"].records(change)
    assert delete.key == tombstone.key == b'{"id":3}' and tombstone.value is None
    assert delete.headers == (("__debezium.newkey", b'{"id":5}'),)
    assert create.headers == (("__debezium.oldkey", b'{"id":3}'),)
    assert _strict_json(create.value or b"")["op"] == "c"


def test_before_only_with_diff_and_only_what_the_source_sent() -> None:
    changes = dict(_changes())
    plain = _strict_json(JsonFormat().records(changes["delete: key only"])[0].value or b"")
    assert "before" not in plain and plain["after"] is None and plain["key"] == [2]
    key_only = _strict_json(JsonFormat(diff=True).records(changes["delete: key only"])[0].value or b"")
    assert key_only["before"] == {"id": 2}
    full = _strict_json(JsonFormat(diff=True).records(changes["update: REPLICA IDENTITY FULL"])[0].value or b"")
    assert full["before"] == {"region": "eu", "id": 1, "balance": "100.50", "user": "ann", "Display Name": None}
    sent_none = _strict_json(
        JsonFormat(diff=True).records(changes["update: body TOASTed and unchanged"])[0].value or b"")
    assert sent_none["before"] is None


def test_formatter_factory() -> None:
    assert formatter("json", "f") == JsonFormat()
    assert formatter("json", "f", diff=True) == JsonFormat(diff=True)
    debezium = formatter("debezium", "orders", database="shop")
    assert isinstance(debezium, DebeziumFormat) and (debezium.feed, debezium.database) == ("orders", "shop")
    assert debezium.version.startswith("changefeed-")
    assert formatter("text", "f") == TextFormat()
    with pytest.raises(ConfigError) as e:
        formatter("avro", "f")
    assert "avro" in e.value.message and all(name in e.value.hint for name in FORMATS)


def test_resolved() -> None:
    assert resolved(42) == b'{"resolved":"42"}'


def test_change_from_row() -> None:
    _, row, shape = CHANGES[4]
    change = Change.from_row(row, shape)
    assert change.unchanged == frozenset({22}) and change.after is not None and change.after[22] is None
    assert change.before is None and change.old_key is None and change.qualified == "public.all_types"
    message = Change.from_row(CHANGES[-1][1], None)
    assert (message.prefix, message.content, message.transactional) == ("ping", b"beat", False)


HISTORY = TableShape("public", "pgbench_history", ("tid", "aid", "delta"), ("integer", "integer", "integer"), (), "f")


def test_a_table_without_a_key_gets_null_keys_its_old_row_and_no_tombstone() -> None:
    insert = Change.from_row(_row("c", HISTORY, 100, 9, 1795326090839070, 470633962756898816,
                                  [b"1", b"7", b"-5"]), HISTORY)
    delete = Change.from_row(_row("d", HISTORY, 200, 10, 1795326090839071, 470633962756898817,
                                  before=[b"1", b"7", b"-5"]), HISTORY)
    for change in (insert, delete):
        [record] = JsonFormat().records(change)
        assert record.key is None
        value = json.loads(record.value or b"")
        assert value["before"] == (None if change.op == "c" else {"tid": 1, "aid": 7, "delta": -5}), value
    [deleted] = DebeziumFormat("golden", "golden").records(delete)  # no tombstone: it would have no key
    assert deleted.key is None and json.loads(deleted.value or b"")["before"]["aid"] == 7
