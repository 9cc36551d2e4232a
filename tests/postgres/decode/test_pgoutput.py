"""The pgoutput decoder against REAL bytes captured from PostgreSQL's logical decoding.

One module-scoped capture runs a scripted workload on a fresh database (of the session's source
server, like the `dbs` fixture does) and peeks the slot; each test asserts on the decoded messages.
Hypothesis tests then truncate and corrupt those real messages.
"""
from __future__ import annotations

import os
import secrets
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from changefeed.postgres.decode import pgoutput as po
from changefeed.postgres.decode.pgoutput import UNCHANGED, DecodeError, decode, decode_tuple

pytestmark = pytest.mark.timeout(120)

PUB = "pgo_pub"
ORIGIN_LSN = 0xABCDEF
ORIGIN_TIME = datetime(2001, 2, 3, 4, 5, 6, 789012, tzinfo=timezone.utc)  # replaces the commit time


@dataclass
class Txn:
    begin: po.Begin
    begin_row_lsn: int
    body: list[Any] = field(default_factory=list)  # decoded messages between Begin and Commit
    row_xids: set[int] = field(default_factory=set)
    commit: po.Commit | None = None
    commit_row_lsn: int | None = None

    def of(self, kind: type) -> list[Any]:
        return [m for m in self.body if isinstance(m, kind)]


@dataclass(repr=False)
class Capture:
    raw: list[bytes]                 # every message, in stream order
    rows: list[tuple[int, int, Any]]  # (row lsn, row xid, decoded message)
    txns: dict[str, Txn]             # by step name
    steps: dict[str, dict[str, Any]]
    outside: list[tuple[int, po.Message]]  # (row lsn, message) for messages outside transactions
    oids: dict[str, int]
    attrs: dict[str, list[tuple[str, int, int]]]  # table -> [(name, atttypid, atttypmod)] (final shape)
    expected_types_rows: list[list[bytes | None]]

    def __repr__(self) -> str:  # keeps Hypothesis' failure reports readable
        return f"<Capture of {len(self.raw)} pgoutput messages>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))


def _now_us(conn: psycopg.Connection[Any]) -> int:
    return int(conn.execute("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint").fetchone()[0])


def _insert_lsn(conn: psycopg.Connection[Any]) -> int:
    return int(conn.execute("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint").fetchone()[0])


def _raw_row(cur: psycopg.Cursor[Any], row: int) -> list[bytes | None]:
    """One result row exactly as the server's output functions wrote it (text format)."""
    res = cur.pgresult
    assert res is not None
    return [res.get_value(row, i) for i in range(res.nfields)]


def _txn(conn: psycopg.Connection[Any], *statements: str) -> dict[str, Any]:
    """Run statements as one transaction; note its xid, WAL position and clock around the commit."""
    info: dict[str, Any] = {"results": []}
    with conn.transaction():
        info["lsn_before"] = _insert_lsn(conn)
        for s in statements:
            cur = conn.execute(s)
            info["results"].append(cur.fetchall() if cur.description else None)
        info["xid"] = int(conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0])
        info["clock_before_commit"] = _now_us(conn)
    info["clock_after_commit"] = _now_us(conn)
    info["lsn_after"] = _insert_lsn(conn)
    return info


def _wait_flushed(conn: psycopg.Connection[Any]) -> None:
    target = _insert_lsn(conn)
    deadline = time.monotonic() + 30
    while int(conn.execute("SELECT (pg_current_wal_flush_lsn() - '0/0'::pg_lsn)::bigint").fetchone()[0]) < target:
        assert time.monotonic() < deadline, "WAL never flushed"
        time.sleep(0.01)


TYPES_COLUMNS = ("id", "i", "b", "n", "t", "flag", "ts", "d", "j", "raw", "u", "ia", "ta", "m")
TYPES_ROW1 = ("1, -7, 9007199254740993, 12345.678, E'tab\\there\\nnl\\\\bs', true, "
              "'2024-01-02 03:04:05.123456+00', '2024-02-29', '{\"a\": [1, null], \"b\": \"é\"}', '\\x00ff', "
              "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{1,NULL,3}', '{\"x y\",\"q\\\"\",NULL}', 'happy'")


@pytest.fixture(scope="module")
def cap(servers: Any) -> Iterator[Capture]:
    source = servers[0]
    db = f"pgo_{os.getpid()}_{secrets.token_hex(4)}"
    slot = db  # slot names are server-wide
    origin = f"cf_origin_{db}"
    with psycopg.connect(source.uri(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {db}")
    conn = psycopg.connect(source.uri(db), autocommit=True)
    conn.execute("SET synchronous_commit = on")
    # TimeZone/DateStyle of the decoding session decide the text form of dates and timestamps.
    conn.execute("SET TimeZone = 'UTC'")
    conn.execute("SET DateStyle = 'ISO, MDY'")
    conn.execute("""
        CREATE TYPE mood AS ENUM ('sad', 'happy');
        CREATE TABLE t_types (id int PRIMARY KEY, i int, b bigint, n numeric(12,3), t text, flag bool,
            ts timestamptz, d date, j jsonb, raw bytea, u uuid, ia int[], ta text[], m mood);
        CREATE TABLE t_toast (id int PRIMARY KEY, big text, small int);
        CREATE TABLE t_full (id int PRIMARY KEY, v text, n int);
        ALTER TABLE t_full REPLICA IDENTITY FULL;
        CREATE TABLE t_key (id int PRIMARY KEY, v text);
        CREATE TABLE t_parent (id serial PRIMARY KEY);
        CREATE TABLE t_child (id serial PRIMARY KEY, parent int REFERENCES t_parent);
        CREATE TABLE t_origin (id int PRIMARY KEY);
        CREATE TABLE t_ri (id int PRIMARY KEY, code text NOT NULL UNIQUE, v text);
        ALTER TABLE t_ri REPLICA IDENTITY USING INDEX t_ri_code_key;
        CREATE TABLE t_unpublished (id int PRIMARY KEY);
    """)
    conn.execute(f"CREATE PUBLICATION {PUB} FOR TABLE "
                 "t_types, t_toast, t_full, t_key, t_parent, t_child, t_origin, t_ri")
    conn.execute(f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')")
    steps: dict[str, dict[str, Any]] = {}
    try:
        steps["insert_types"] = _txn(
            conn, f"INSERT INTO t_types VALUES ({TYPES_ROW1}), "
                  "(2, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)")
        cur = conn.execute(f"SELECT {', '.join(TYPES_COLUMNS)} FROM t_types ORDER BY id")
        expected_types_rows = [_raw_row(cur, 0), _raw_row(cur, 1)]
        steps["update_types"] = _txn(conn, "UPDATE t_types SET t = 'changed' WHERE id = 1")
        steps["delete_types"] = _txn(conn, "DELETE FROM t_types WHERE id = 2")
        steps["unpublished"] = _txn(conn, "INSERT INTO t_unpublished VALUES (1)")
        steps["insert_toast"] = _txn(
            conn, "INSERT INTO t_toast SELECT 1, string_agg(md5(random()::text), ''), 1 "
                  "FROM generate_series(1, 3200) RETURNING big, pg_column_size(big)")
        steps["update_toast"] = _txn(conn, "UPDATE t_toast SET small = 2 WHERE id = 1")
        steps["insert_full"] = _txn(conn, "INSERT INTO t_full VALUES (1, 'a', NULL)")
        steps["update_full"] = _txn(conn, "UPDATE t_full SET v = 'b' WHERE id = 1")
        steps["delete_full"] = _txn(conn, "DELETE FROM t_full WHERE id = 1")
        steps["insert_key"] = _txn(conn, "INSERT INTO t_key VALUES (1, 'a')")
        steps["update_key"] = _txn(conn, "UPDATE t_key SET id = 10 WHERE id = 1")
        steps["insert_ri"] = _txn(conn, "INSERT INTO t_ri VALUES (1, 'a', 'x')")
        steps["update_ri_identity"] = _txn(conn, "UPDATE t_ri SET code = 'b' WHERE id = 1")
        steps["update_ri_pk"] = _txn(conn, "UPDATE t_ri SET id = 2 WHERE id = 1")
        steps["delete_ri"] = _txn(conn, "DELETE FROM t_ri WHERE id = 2")
        steps["insert_parent_child"] = _txn(
            conn, "INSERT INTO t_parent DEFAULT VALUES", "INSERT INTO t_child (parent) VALUES (1)")
        steps["truncate_cascade"] = _txn(conn, "TRUNCATE t_parent CASCADE")
        steps["truncate_restart"] = _txn(conn, "TRUNCATE t_child RESTART IDENTITY")
        steps["truncate_both"] = _txn(conn, "TRUNCATE t_parent RESTART IDENTITY CASCADE")
        steps["truncate_plain"] = _txn(conn, "TRUNCATE t_key")
        conn.execute("ALTER TABLE t_key ADD COLUMN extra int DEFAULT 7")
        steps["insert_after_alter"] = _txn(conn, "INSERT INTO t_key VALUES (2, 'b', 8)")
        steps["txn_message"] = _txn(
            conn, "SELECT (pg_logical_emit_message(true, 'pfx', 'hello') - '0/0'::pg_lsn)::bigint",
            "INSERT INTO t_key VALUES (3, 'c', 9)")
        steps["plain_message"] = {"lsn": int(conn.execute(
            "SELECT (pg_logical_emit_message(false, 'pfx2', '\\x00010203ff'::bytea, true) - '0/0'::pg_lsn)::bigint"
        ).fetchone()[0])}
        with psycopg.connect(source.uri(db), autocommit=True) as oc:
            oc.execute("SET synchronous_commit = on")
            oc.execute("SELECT pg_replication_origin_create(%s)", (origin,))
            oc.execute("SELECT pg_replication_origin_session_setup(%s)", (origin,))
            steps["origin"] = _txn(oc, f"SELECT pg_replication_origin_xact_setup('0/{ORIGIN_LSN:X}', "
                                       f"'{ORIGIN_TIME.isoformat()}')",
                                   "INSERT INTO t_origin VALUES (1)")
            oc.execute("SELECT pg_replication_origin_session_reset()")
        steps["heartbeat"] = {"lsn": int(conn.execute(
            "SELECT (pg_logical_emit_message(false, 'changefeed.heartbeat', '', true) - '0/0'::pg_lsn)::bigint"
        ).fetchone()[0])}
        _wait_flushed(conn)

        oids = {name: int(oid) for name, oid in conn.execute(
            "SELECT relname, oid::int8 FROM pg_class WHERE relname LIKE 't\\_%' AND relkind = 'r'").fetchall()}
        oids["mood"] = int(conn.execute("SELECT 'mood'::regtype::oid::int8").fetchone()[0])
        attrs: dict[str, list[tuple[str, int, int]]] = {}
        for table in ("t_types", "t_toast", "t_full", "t_key", "t_parent", "t_child", "t_ri"):
            attrs[table] = [(r[0], int(r[1]), int(r[2])) for r in conn.execute(
                "SELECT attname, atttypid::int8, atttypmod FROM pg_attribute WHERE attrelid = %s::regclass "
                "AND attnum > 0 AND NOT attisdropped ORDER BY attnum", (table,)).fetchall()]

        peeked = conn.execute(
            "SELECT (lsn - '0/0'::pg_lsn)::bigint, xid::text::bigint, data "
            f"FROM pg_logical_slot_peek_binary_changes('{slot}', NULL, NULL, 'proto_version', '1', "
            f"'publication_names', '{PUB}', 'messages', 'true')").fetchall()
    finally:
        conn.execute(f"SELECT pg_drop_replication_slot('{slot}')")
        conn.close()
        with psycopg.connect(source.uri(), autocommit=True) as admin:
            admin.execute("SELECT pg_replication_origin_drop(%s) FROM pg_replication_origin WHERE roname = %s",
                          (origin, origin))
            admin.execute(f"DROP DATABASE {db}")

    raw = [bytes(d) for _, _, d in peeked]
    rows = [(int(lsn), int(xid), decode(bytes(d))) for lsn, xid, d in peeked]
    txns: list[Txn] = []
    outside: list[tuple[int, po.Message]] = []
    current: Txn | None = None
    for lsn, xid, msg in rows:
        if isinstance(msg, po.Begin):
            assert current is None, "Begin inside a transaction"
            current = Txn(msg, lsn)
            current.row_xids.add(xid)
        elif isinstance(msg, po.Commit):
            assert current is not None, "Commit outside a transaction"
            current.commit, current.commit_row_lsn = msg, lsn
            current.row_xids.add(xid)
            txns.append(current)
            current = None
        elif current is not None:
            current.body.append(msg)
            current.row_xids.add(xid)
        else:
            assert isinstance(msg, po.Message), f"{msg!r} outside a transaction"
            outside.append((lsn, msg))
    assert current is None, "stream ends inside a transaction"
    transactional = [name for name, s in steps.items() if "xid" in s and name != "unpublished"]
    assert len(txns) == len(transactional), (len(txns), transactional)
    return_value = Capture(raw, rows, dict(zip(transactional, txns)), steps, outside, oids, attrs,
                           expected_types_rows)
    yield return_value


# -- transaction framing ------------------------------------------------------------------------

def test_every_transaction_is_framed_consistently(cap: Capture) -> None:
    previous_end = 0
    for name, txn in cap.txns.items():
        step, b, c = cap.steps[name], txn.begin, txn.commit
        assert c is not None
        assert b.final_lsn == c.commit_lsn, name
        assert c.end_lsn > c.commit_lsn, name
        assert c.flags == 0
        assert b.commit_time_us == c.commit_time_us
        assert b.xid == step["xid"], name
        assert txn.row_xids == {step["xid"]}, name
        # The commit record lies between what the session saw before and after committing.
        assert step["lsn_before"] <= c.commit_lsn < c.end_lsn <= step["lsn_after"], name
        assert txn.begin_row_lsn < c.commit_lsn
        assert txn.commit_row_lsn == c.end_lsn  # the SQL interface reports the commit's end LSN
        if name == "origin":
            continue  # a replicated transaction carries its origin's commit time: see test_origin_message
        # Epoch conversion: the commit time is a Unix µs value between the clock readings around COMMIT.
        assert step["clock_before_commit"] <= c.commit_time_us <= step["clock_after_commit"], name
        assert c.end_lsn > previous_end
        previous_end = c.end_lsn


def test_unpublished_tables_send_nothing(cap: Capture) -> None:
    xid = cap.steps["unpublished"]["xid"]
    assert all(t.begin.xid != xid for t in cap.txns.values())
    assert all(getattr(m, "relation_oid", None) != cap.oids["t_unpublished"] for _, _, m in cap.rows)


def test_every_message_type_is_present(cap: Capture) -> None:
    kinds = {type(m) for _, _, m in cap.rows}
    assert kinds == {po.Begin, po.Commit, po.Origin, po.Relation, po.Type, po.Insert, po.Update, po.Delete,
                     po.Truncate, po.Message}


# -- relations, types and values ----------------------------------------------------------------

def test_relation_and_type_messages(cap: Capture) -> None:
    txn = cap.txns["insert_types"]
    typ, rel = txn.body[0], txn.body[1]
    assert typ == po.Type(cap.oids["mood"], "public", "mood")  # custom types are described first
    assert isinstance(rel, po.Relation)
    assert (rel.oid, rel.schema, rel.name, rel.replica_identity) == (cap.oids["t_types"], "public", "t_types", "d")
    assert [(c.name, c.type_oid, c.typmod) for c in rel.columns] == cap.attrs["t_types"]
    assert [c.name for c in rel.columns] == list(TYPES_COLUMNS)
    # Well-known built-in type OIDs (pg_type.dat) and numeric(12,3)'s typmod ((12 << 16 | 3) + 4).
    assert [c.type_oid for c in rel.columns] == [23, 23, 20, 1700, 25, 16, 1184, 1082, 3802, 17, 2950, 1007, 1009,
                                                 cap.oids["mood"]]
    assert rel.columns[3].typmod == (12 << 16 | 3) + 4
    assert all(c.typmod == -1 for i, c in enumerate(rel.columns) if i != 3)
    assert [c.is_key for c in rel.columns] == [True] + [False] * 13
    assert rel.key_indexes == (0,)


def test_insert_values_are_postgresql_text_form(cap: Capture) -> None:
    inserts = cap.txns["insert_types"].of(po.Insert)
    assert [i.relation_oid for i in inserts] == [cap.oids["t_types"]] * 2
    assert [i.new for i in inserts] == cap.expected_types_rows  # what the server's output functions write
    assert inserts[0].new == [
        b"1", b"-7", b"9007199254740993", b"12345.678", b"tab\there\nnl\\bs", b"t",
        b"2024-01-02 03:04:05.123456+00", b"2024-02-29", '{"a": [1, null], "b": "é"}'.encode(), b"\\x00ff",
        b"a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", b"{1,NULL,3}", b'{"x y","q\\"",NULL}', b"happy"]
    assert inserts[1].new == [b"2"] + [None] * 13


def test_update_with_default_identity_sends_no_old_tuple(cap: Capture) -> None:
    (upd,) = cap.txns["update_types"].body
    assert isinstance(upd, po.Update)
    assert upd.relation_oid == cap.oids["t_types"]
    assert upd.old is None and upd.old_is_key is False
    assert upd.new == [cap.expected_types_rows[0][0], *cap.expected_types_rows[0][1:4], b"changed",
                       *cap.expected_types_rows[0][5:]]


def test_delete_with_default_identity_sends_key_only(cap: Capture) -> None:
    (dele,) = cap.txns["delete_types"].body
    assert dele == po.Delete(cap.oids["t_types"], [b"2"] + [None] * 13, True)


def test_toast_insert_then_unchanged_marker(cap: Capture) -> None:
    big, stored_size = cap.steps["insert_toast"]["results"][0][0]
    assert len(big) == 3200 * 32 and stored_size >= len(big)  # not compressed: stored out of line
    rel, ins = cap.txns["insert_toast"].body
    assert isinstance(rel, po.Relation) and rel.name == "t_toast"
    assert ins == po.Insert(cap.oids["t_toast"], [b"1", big.encode(), b"1"])
    (upd,) = cap.txns["update_toast"].body
    assert isinstance(upd, po.Update)
    assert upd.old is None
    assert upd.new[0] == b"1" and upd.new[2] == b"2"
    assert upd.new[1] is UNCHANGED
    assert repr(upd.new[1]) == "UNCHANGED"


def test_replica_identity_full_sends_whole_old_row(cap: Capture) -> None:
    rel, ins = cap.txns["insert_full"].body
    assert isinstance(rel, po.Relation)
    assert rel.replica_identity == "f"
    # With REPLICA IDENTITY FULL PostgreSQL flags every column as part of the identity.
    assert [c.is_key for c in rel.columns] == [True, True, True]
    assert ins == po.Insert(cap.oids["t_full"], [b"1", b"a", None])
    (upd,) = cap.txns["update_full"].body
    assert upd == po.Update(cap.oids["t_full"], [b"1", b"a", None], False, [b"1", b"b", None])
    (dele,) = cap.txns["delete_full"].body
    assert dele == po.Delete(cap.oids["t_full"], [b"1", b"b", None], False)


def test_replica_identity_index(cap: Capture) -> None:
    rel, ins = cap.txns["insert_ri"].body
    assert isinstance(rel, po.Relation) and rel.replica_identity == "i"
    assert [(c.name, c.is_key) for c in rel.columns] == [("id", False), ("code", True), ("v", False)]
    assert rel.key_indexes == (1,)
    assert ins == po.Insert(cap.oids["t_ri"], [b"1", b"a", b"x"])
    # Changing the identity column sends the old identity (other columns NULL) ...
    assert cap.txns["update_ri_identity"].body == [po.Update(cap.oids["t_ri"], [None, b"a", None], True,
                                                             [b"1", b"b", b"x"])]
    # ... changing only the primary key sends no old tuple at all ...
    assert cap.txns["update_ri_pk"].body == [po.Update(cap.oids["t_ri"], None, False, [b"2", b"b", b"x"])]
    # ... and a delete carries the identity only.
    assert cap.txns["delete_ri"].body == [po.Delete(cap.oids["t_ri"], [None, b"b", None], True)]


def test_key_change_sends_old_key_tuple(cap: Capture) -> None:
    (upd,) = cap.txns["update_key"].body
    assert upd == po.Update(cap.oids["t_key"], [b"1", None], True, [b"10", b"a"])


def test_truncate_options(cap: Capture) -> None:
    parent, child = cap.oids["t_parent"], cap.oids["t_child"]
    (tr,) = cap.txns["truncate_cascade"].of(po.Truncate)
    assert sorted(tr.relation_oids) == sorted([parent, child])  # CASCADE reached the referencing table
    assert (tr.cascade, tr.restart_identity) == (True, False)
    assert cap.txns["truncate_restart"].of(po.Truncate) == [po.Truncate((child,), False, True)]
    (both,) = cap.txns["truncate_both"].of(po.Truncate)
    assert sorted(both.relation_oids) == sorted([parent, child])
    assert (both.cascade, both.restart_identity) == (True, True)
    assert cap.txns["truncate_plain"].of(po.Truncate) == [po.Truncate((cap.oids["t_key"],), False, False)]
    # Relations are described before the truncate that names them.
    body = cap.txns["truncate_cascade"].body
    described = {m.oid for m in body[:body.index(tr)] if isinstance(m, po.Relation)}
    assert set(tr.relation_oids) <= described


def test_add_column_sends_a_wider_relation(cap: Capture) -> None:
    first = next(m for t in cap.txns.values() for m in t.body if isinstance(m, po.Relation) and m.name == "t_key")
    assert [c.name for c in first.columns] == ["id", "v"]
    rel, ins = cap.txns["insert_after_alter"].body
    assert isinstance(rel, po.Relation) and rel.oid == first.oid
    assert [(c.name, c.type_oid, c.typmod) for c in rel.columns] == cap.attrs["t_key"]
    assert [c.name for c in rel.columns] == ["id", "v", "extra"]
    assert [c.is_key for c in rel.columns] == [True, False, False]
    assert ins == po.Insert(first.oid, [b"2", b"b", b"8"])


def test_transactional_message(cap: Capture) -> None:
    txn = cap.txns["txn_message"]
    msg = txn.body[0]
    assert msg == po.Message(True, cap.steps["txn_message"]["results"][0][0][0], "pfx", b"hello")
    assert txn.begin.final_lsn > msg.lsn
    assert isinstance(txn.body[-1], po.Insert) and txn.body[-1].new == [b"3", b"c", b"9"]


def test_non_transactional_messages(cap: Capture) -> None:
    assert [m for _, m in cap.outside] == [
        po.Message(False, cap.steps["plain_message"]["lsn"], "pfx2", b"\x00\x01\x02\x03\xff"),
        po.Message(False, cap.steps["heartbeat"]["lsn"], "changefeed.heartbeat", b""),
    ]
    assert all(row_lsn == m.lsn for row_lsn, m in cap.outside)  # the SQL interface's lsn column agrees


def test_origin_message(cap: Capture) -> None:
    txn = cap.txns["origin"]
    origin = txn.body[0]
    assert isinstance(origin, po.Origin)
    assert origin.commit_lsn == ORIGIN_LSN
    assert origin.name.startswith("cf_origin_")
    unix_us = (ORIGIN_TIME - datetime(1970, 1, 1, tzinfo=timezone.utc)) // timedelta(microseconds=1)
    assert txn.begin.commit_time_us == txn.commit.commit_time_us == unix_us == 981_173_106_789_012
    assert txn.of(po.Insert) == [po.Insert(cap.oids["t_origin"], [b"1"])]


# -- robustness -----------------------------------------------------------------------------------

def _decodes_or_decode_error(data: bytes) -> None:
    try:
        result = decode(data)
    except DecodeError:
        return
    assert isinstance(result, (po.Begin, po.Commit, po.Origin, po.Relation, po.Type, po.Insert, po.Update,
                               po.Delete, po.Truncate, po.Message, po.BeginPrepare, po.Prepare, po.CommitPrepared,
                               po.RollbackPrepared))


ROBUST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@ROBUST
@given(st.data())
def test_truncated_real_messages_raise_decode_error(cap: Capture, data: st.DataObject) -> None:
    index = data.draw(st.integers(0, len(cap.raw) - 1), label="message index")
    msg = cap.raw[index]
    note(f"message {index}: {decode(msg)!r:.300}")
    cut = data.draw(st.integers(min_value=0, max_value=len(msg) - 1), label="cut")
    with pytest.raises(DecodeError):
        decode(msg[:cut])


@ROBUST
@given(st.data())
def test_corrupted_real_messages_decode_or_raise_decode_error(cap: Capture, data: st.DataObject) -> None:
    msg = bytearray(cap.raw[data.draw(st.integers(0, len(cap.raw) - 1), label="message index")])
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        op = data.draw(st.sampled_from(["set", "insert", "delete"]), label="op")
        i = data.draw(st.integers(0, len(msg)), label="at")
        if op == "set" and i < len(msg):
            msg[i] = data.draw(st.integers(0, 255), label="byte")
        elif op == "insert":
            msg[i:i] = data.draw(st.binary(min_size=1, max_size=8), label="bytes")
        elif i < len(msg):
            del msg[i:i + data.draw(st.integers(1, 8), label="n")]
    _decodes_or_decode_error(bytes(msg))


@ROBUST
@given(st.sampled_from(b"BCORYIUDTM"), st.binary(max_size=64))
def test_random_bodies_decode_or_raise_decode_error(kind: int, body: bytes) -> None:
    _decodes_or_decode_error(bytes([kind]) + body)


@pytest.mark.parametrize("data", [b"", b"\x00", b"Z", b"x123", b"k" + b"\x00" * 30])
def test_unknown_or_empty_message_raises_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        decode(data)


def test_bad_tuple_kinds_raise_decode_error(cap: Capture) -> None:
    ins = next(r for r in cap.raw if r[:1] == b"I")
    assert ins[5:6] == b"N"
    with pytest.raises(DecodeError):
        decode(ins[:5] + b"X" + ins[6:])  # not 'N'
    with pytest.raises(DecodeError):
        decode(ins[:8] + b"?" + ins[9:])  # first column kind
    dele = next(r for r in cap.raw if r[:1] == b"D")
    with pytest.raises(DecodeError):
        decode(dele[:5] + b"N" + dele[6:])  # deletes carry 'K' or 'O'
    upd = next(r for r in cap.raw if r[:1] == b"U")
    with pytest.raises(DecodeError):
        decode(upd[:5] + b"Q" + upd[6:])


# -- TupleData --------------------------------------------------------------------------------------

COLUMN = st.one_of(
    st.tuples(st.just("t"), st.binary(max_size=40)),
    st.tuples(st.just("b"), st.binary(max_size=40)),
    st.tuples(st.just("n"), st.none()),
    st.tuples(st.just("u"), st.none()),
)


def _encode_tuple(cols: list[tuple[str, bytes | None]]) -> bytes:
    out = bytearray(struct.pack(">h", len(cols)))
    for kind, value in cols:
        out += kind.encode()
        if kind in "tb":
            assert value is not None
            out += struct.pack(">i", len(value)) + value
    return bytes(out)


def _expected(cols: list[tuple[str, bytes | None]]) -> list[Any]:
    return [value if kind in "tb" else None if kind == "n" else UNCHANGED for kind, value in cols]


@settings(max_examples=300, deadline=None)
@given(st.lists(COLUMN, max_size=30), st.binary(max_size=10), st.binary(max_size=10))
def test_decode_tuple_returns_exactly_the_synthesised_columns(
        cols: list[tuple[str, bytes | None]], before: bytes, after: bytes) -> None:
    body = _encode_tuple(cols)
    values, end = decode_tuple(before + body + after, len(before))
    assert end == len(before) + len(body)
    assert len(values) == len(cols)
    for (kind, value), got in zip(cols, values):
        if kind == "u":
            assert got is UNCHANGED
        elif kind == "n":
            assert got is None
        else:
            assert type(got) is bytes and got == value
    # The same tuple inside real Insert / Update / Delete messages.
    oid = struct.pack(">I", 16384)
    assert decode(b"I" + oid + b"N" + body) == po.Insert(16384, _expected(cols))
    assert decode(b"U" + oid + b"K" + body + b"N" + body) == po.Update(16384, _expected(cols), True, _expected(cols))
    assert decode(b"U" + oid + b"N" + body) == po.Update(16384, None, False, _expected(cols))
    assert decode(b"D" + oid + b"O" + body) == po.Delete(16384, _expected(cols), False)


@settings(max_examples=300, deadline=None)
@given(st.lists(COLUMN, min_size=1, max_size=12), st.data())
def test_truncated_synthesised_tuple_messages_raise_decode_error(
        cols: list[tuple[str, bytes | None]], data: st.DataObject) -> None:
    msg = b"I" + struct.pack(">I", 16384) + b"N" + _encode_tuple(cols)
    cut = data.draw(st.integers(min_value=0, max_value=len(msg) - 1), label="cut")
    with pytest.raises(DecodeError):
        decode(msg[:cut])


# -- change_layout: the one reading of an Insert's, Update's or Delete's header and tuple kinds ----------

def test_change_layout_of_real_changes(cap: Capture) -> None:
    """Every real change: the decoded message's kind, relation and old tuple, and a new tuple (or a
    Delete's old one) that ends its message."""
    changes = [(raw, m) for raw, (_, _, m) in zip(cap.raw, cap.rows)
               if isinstance(m, (po.Insert, po.Update, po.Delete))]
    assert {type(m) for _, m in changes} == {po.Insert, po.Update, po.Delete}
    for raw, msg in changes:
        kind, oid, old, new_at = po.change_layout(raw)
        assert (kind, oid) == (raw[0], msg.relation_oid)
        if isinstance(msg, po.Delete):
            assert (old, new_at) == (po.KEY if msg.old_is_key else po.OLD, 0)
            assert decode_tuple(raw, po.TUPLE_AT) == (msg.old, len(raw))
            continue
        if isinstance(msg, po.Update) and msg.old is not None:
            assert (old, new_at) == (po.KEY if msg.old_is_key else po.OLD, 0)
            values, end = decode_tuple(raw, po.TUPLE_AT)
            assert values == msg.old
            new_at = po.new_tuple_at(raw, end)
        else:
            assert (old, new_at) == (0, po.TUPLE_AT)
        assert decode_tuple(raw, new_at) == (msg.new, len(raw))


OID = struct.pack(">I", 16384)
ONE = struct.pack(">h", 1) + b"t" + struct.pack(">i", 1) + b"1"  # TupleData: one column, "1"


@pytest.mark.parametrize(("data", "error"), [
    (b"I" + OID + b"K" + ONE, "Insert: expected 'N', got b'K'"),
    (b"I" + OID, "Insert: expected 'N', got b''"),
    (b"D" + OID + b"N" + ONE, "Delete: expected 'K' or 'O', got b'N'"),
    (b"U" + OID + b"Q" + ONE, "Update: expected 'K', 'O' or 'N', got b'Q'"),
    (b"U", "Update: expected 'K', 'O' or 'N', got b''"),
    (b"B" + OID + b"N" + ONE, "not an Insert, Update or Delete message: b'B'"),
])
def test_change_layout_errors(data: bytes, error: str) -> None:
    """The builder's per-message path reads the layout too: the same errors from both."""
    with pytest.raises(DecodeError) as e:
        po.change_layout(data)
    assert e.value.message == error
    if data[:1] != b"B":
        with pytest.raises(DecodeError) as d:
            decode(data)
        assert d.value.message == error


@pytest.mark.parametrize(("data", "error"), [
    (b"U" + OID + b"K" + ONE + b"X" + ONE, "Update: expected 'N' after the old tuple, got b'X'"),
    (b"U" + OID + b"O" + ONE, "Update: expected 'N' after the old tuple, got b''"),
])
def test_an_update_without_a_new_tuple_after_its_old_one_raises(data: bytes, error: str) -> None:
    with pytest.raises(DecodeError) as e:
        po.new_tuple_at(data, po.TUPLE_AT + len(ONE))
    assert e.value.message == error
    with pytest.raises(DecodeError) as d:
        decode(data)
    assert d.value.message == error


def test_change_layout_of_synthesised_changes() -> None:
    assert po.change_layout(b"I" + OID + b"N" + ONE) == (po.INSERT, 16384, 0, po.TUPLE_AT)
    assert po.change_layout(b"U" + OID + b"N" + ONE) == (po.UPDATE, 16384, 0, po.TUPLE_AT)
    for old in (po.KEY, po.OLD):
        data = b"U" + OID + bytes([old]) + ONE + b"N" + ONE
        assert po.change_layout(data) == (po.UPDATE, 16384, old, 0)
        assert po.new_tuple_at(data, po.TUPLE_AT + len(ONE)) == len(data) - len(ONE)
        assert po.change_layout(b"D" + OID + bytes([old]) + ONE) == (po.DELETE, 16384, old, 0)
