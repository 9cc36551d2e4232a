"""ChangeBuilder fed REAL pgoutput streams: window membership, split windows vs one window, row content.

A module-scoped capture runs a scripted workload on a fresh database of the session's source
server (as the `dbs` fixture does) and peeks the whole slot once; pg_walinspect tells where each
logical message's WAL record starts. A window [start, end) is built by a fresh ChangeBuilder fed
what the server sends for a peek up to `end` from a slot at `start` (records that start in
[start, end)), plus every earlier transaction (as from a slot that lags), which it must drop.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import secrets
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from changefeed.core import change as ch
from changefeed.core.copytext import split_line
from changefeed.core.hlc import ceiling_of_ms, from_millis, window_end_ts
from changefeed.core.lsn import format_lsn
from changefeed.postgres.decode import builder as cb
from changefeed.postgres.decode import pgoutput as po
from changefeed.postgres.decode.builder import HEARTBEAT_PREFIX, ChangeBuilder, offline_catalog
from changefeed.postgres.source import column_catalog

pytestmark = pytest.mark.timeout(300)

PUB = "chg_pub"
DATA = ch.DATA_OPS


@dataclass(repr=False)
class Stream:
    conn: psycopg.Connection[Any]   # open on the source database (for the real column catalog)
    raw: list[bytes]
    msgs: list[Any]                 # decoded, in stream order
    start_lsn: int                  # the slot's start: nothing at or before it is in the stream
    end_lsn: int                    # past everything in the stream
    commits: list[tuple[po.Begin, po.Commit]]
    xids: dict[str, int]            # step name -> xid
    message_lsns: dict[str, int]    # non-transactional message -> LSN returned by pg_logical_emit_message
    big: tuple[str, str]            # the two TOASTed values
    message_starts: dict[int, int]  # end LSN of a logical message's WAL record -> its start LSN

    def __repr__(self) -> str:
        return f"<Stream of {len(self.raw)} messages, {len(self.commits)} commits>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))

    def commit_of(self, step: str) -> po.Commit:
        return next(c for b, c in self.commits if b.xid == self.xids[step])

    def window_input(self, start: int, end: int) -> list[bytes]:
        """The messages of every transaction committed before `end`, and the non-transactional
        messages whose record starts in [start, end)."""
        out: list[bytes] = []
        txn: list[bytes] | None = None
        for raw, m in zip(self.raw, self.msgs):
            if isinstance(m, po.Begin):
                txn = [raw] if m.final_lsn < end else None
            elif txn is not None:
                txn.append(raw)
                if isinstance(m, po.Commit):
                    out.extend(txn)
                    txn = None
            elif isinstance(m, po.Message) and not m.transactional and start <= self.message_starts[m.lsn] < end:
                out.append(raw)
        return out


def _lsn(conn: psycopg.Connection[Any], sql: str) -> int:
    return int(conn.execute(f"SELECT ({sql} - '0/0'::pg_lsn)::bigint").fetchone()[0])


@pytest.fixture(scope="module")
def stream(servers: Any) -> Iterator[Stream]:
    source = servers[0]
    db = f"chg_{os.getpid()}_{secrets.token_hex(4)}"
    slot = db  # slot names are server-wide
    with psycopg.connect(source.uri(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {db}")
    conn = psycopg.connect(source.uri(db), autocommit=True)
    conn.execute("SET synchronous_commit = on")
    conn.execute("""
        CREATE TABLE a (id int PRIMARY KEY, v text);
        CREATE TABLE b (id int PRIMARY KEY, doc text, doc2 text, n int);
        CREATE TABLE f (id int PRIMARY KEY, v text, n int);
        ALTER TABLE f REPLICA IDENTITY FULL;
        CREATE TABLE p (id int PRIMARY KEY);
        CREATE TABLE c (id int PRIMARY KEY, p int REFERENCES p);
        CREATE TABLE ri (id int PRIMARY KEY, code text NOT NULL UNIQUE, v text);
        ALTER TABLE ri REPLICA IDENTITY USING INDEX ri_code_key;
    """)
    conn.execute(f"CREATE PUBLICATION {PUB} FOR TABLE a, b, f, p, c, ri")
    start = _lsn(conn, f"(SELECT lsn FROM pg_create_logical_replication_slot('{slot}', 'pgoutput'))")
    xids: dict[str, int] = {}
    message_lsns: dict[str, int] = {}

    def txn(name: str, *statements: str) -> list[Any]:
        out = []
        with conn.transaction():
            for s in statements:
                cur = conn.execute(s)
                out.append(cur.fetchall() if cur.description else None)
            xids[name] = int(conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0])
        return out

    def message(name: str, prefix: str, content: str) -> None:
        message_lsns[name] = _lsn(conn, f"pg_logical_emit_message(false, '{prefix}', '{content}', true)")

    try:
        txn("insert_a", "INSERT INTO a VALUES (1, 'x'), (2, 'y'), (3, NULL)")
        big = txn("insert_b", "INSERT INTO b SELECT 1, string_agg(md5(random()::text), ''), "
                              "string_agg(md5(random()::text), ''), 1 FROM generate_series(1, 3200) "
                              "RETURNING doc, doc2")[0][0]
        message("hb1", HEARTBEAT_PREFIX, "")
        txn("toast_update", "UPDATE b SET n = 2 WHERE id = 1")
        txn("key_update", "UPDATE a SET id = 10 WHERE id = 1")
        txn("delete_a", "DELETE FROM a WHERE id = 2")
        message("note", "note", "hi there")
        txn("multi", "INSERT INTO a VALUES (4, 'multi')",
            "SELECT pg_logical_emit_message(true, 'audit', 'who=me')",
            "UPDATE b SET id = 5, n = 3 WHERE id = 1")
        message("hb2", HEARTBEAT_PREFIX, "")
        conn.execute("ALTER TABLE a ADD COLUMN w int DEFAULT 42")
        txn("after_alter", "INSERT INTO a VALUES (20, E'tab\\there', 7)")
        txn("escape_update", "UPDATE a SET v = E'back\\\\slash\\nnl' WHERE id = 20")
        txn("insert_f", "INSERT INTO f VALUES (1, 'p', NULL)")
        txn("update_f", "UPDATE f SET v = 'q' WHERE id = 1")
        txn("delete_f", "DELETE FROM f WHERE id = 1")
        txn("insert_ri", "INSERT INTO ri VALUES (1, 'a', 'x')")
        txn("update_ri_identity", "UPDATE ri SET code = 'b' WHERE id = 1")
        txn("update_ri_pk", "UPDATE ri SET id = 2 WHERE id = 1")
        txn("delete_ri", "DELETE FROM ri WHERE id = 2")
        txn("insert_pc", "INSERT INTO p VALUES (1)", "INSERT INTO c VALUES (1, 1)")
        txn("truncate", "TRUNCATE p CASCADE")
        for i in range(8):
            txn(f"loop{i}", f"INSERT INTO a VALUES ({100 + i}, 'loop')", f"UPDATE a SET v = 'l{i}' WHERE id = 3")
            if i == 3:
                message("hb3", HEARTBEAT_PREFIX, "")
            if i == 5:
                message("note2", "note", "second")
        txn("mixed", "INSERT INTO a VALUES (30, 'm'), (31, 'm'), (32, NULL)", "DELETE FROM a WHERE id = 30",
            "INSERT INTO ri VALUES (5, 'c5', 'x')", "UPDATE a SET v = 'n' WHERE id = 31",
            "INSERT INTO a VALUES (33, '')", "DELETE FROM a WHERE id IN (32, 33)")
        txn("txn_heartbeat", f"SELECT pg_logical_emit_message(true, '{HEARTBEAT_PREFIX}', 'x')",
            "DELETE FROM a WHERE id = 100")
        message("hb_end", HEARTBEAT_PREFIX, "")
        target = _lsn(conn, "pg_current_wal_insert_lsn()")
        deadline = time.monotonic() + 30
        while _lsn(conn, "pg_current_wal_flush_lsn()") < target:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        raw = [bytes(r[0]) for r in conn.execute(
            f"SELECT data FROM pg_logical_slot_peek_binary_changes('{slot}', NULL, NULL, 'proto_version', '1', "
            f"'publication_names', '{PUB}', 'messages', 'true')").fetchall()]
        msgs = [po.decode(r) for r in raw]
        conn.execute("CREATE EXTENSION pg_walinspect")
        message_starts = {int(e): int(b) for b, e in conn.execute(
            "SELECT start_lsn - '0/0'::pg_lsn, end_lsn - '0/0'::pg_lsn FROM pg_get_wal_records_info("
            f"'{format_lsn(start)}', '{format_lsn(target)}') WHERE resource_manager = 'LogicalMessage'")}
        commits = []
        begin = None
        for m in msgs:
            if isinstance(m, po.Begin):
                begin = m
            elif isinstance(m, po.Commit):
                assert begin is not None
                commits.append((begin, m))
        yield Stream(conn, raw, msgs, start, target + 1, commits, xids, message_lsns, (big[0], big[1]),
                     message_starts)
    finally:
        conn.execute(f"SELECT pg_drop_replication_slot('{slot}')")
        conn.close()
        with psycopg.connect(source.uri(), autocommit=True) as admin:
            admin.execute(f"DROP DATABASE {db}")


SHORT_RUN = cb._SHORT_RUN


@pytest.fixture(scope="module", autouse=True)
def every_run_as_arrays() -> Iterator[None]:
    """The builder feeds short runs of plain changes one by one; the transactions here are small,
    so take every run as arrays, the path that a real workload's big transactions take."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(cb, "_SHORT_RUN", 1)
        yield


# -- helpers --------------------------------------------------------------------------------------

def blocks_of(messages: list[bytes], cuts: Any = ()) -> list[list[bytes]]:
    """`messages` as blocks (a peek's fetches), cut before the indexes in `cuts`."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(messages)}), len(messages)]
    return [messages[a:b] for a, b in itertools.pairwise(bounds)]


def build(s: Stream, start: int, end: int, start_ts: int = 0, end_ts: int | None = None,
          catalog: Any = offline_catalog, rows_per_batch: int = 65536) -> list[dict[str, Any]]:
    """One window as production builds it, from `batches`; rows as dicts."""
    builder = ChangeBuilder(start, end, start_ts, start_ts if end_ts is None else end_ts, catalog)
    out: list[dict[str, Any]] = []
    for rb in builder.batches([s.window_input(start, end)], rows_per_batch):
        assert rb.schema == ch.arrow_schema()
        out.extend(rb.to_pylist())
    return out


def build_one_by_one(builder: ChangeBuilder, messages: list[bytes], rows_per_batch: int,
                     cuts: Any = ()) -> list[pa.RecordBatch]:
    """The reference for `batches`: each message through `feed`, batches cut as `batches` cuts them
    (blocks cut before the indexes in `cuts`: a large open transaction goes out at a block's end)."""
    out = []
    size = max(1, rows_per_batch // 16)
    ends = {c for c in cuts if 0 < c < len(messages)} | {len(messages)}
    for i, d in enumerate(messages, 1):
        builder.feed(d)
        if builder.done:
            break
        if builder.pending() >= size:
            out.append(builder.take())
            size = min(size * 4, rows_per_batch)
        if i in ends and builder._large_open(rows_per_batch):
            builder._part_out()
            out.append(builder.take())
    out.append(builder.finish())
    return out


def data_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["op"] in DATA]


def strip(rows: list[dict[str, Any]], *fields: str) -> list[tuple[Any, ...]]:
    return [tuple(v for k, v in r.items() if k not in fields) for r in rows]


def rows_of(rows: list[dict[str, Any]], lsn: int) -> list[dict[str, Any]]:
    return [r for r in rows if r["lsn"] == lsn and r["op"] != ch.PROGRESS]


def expected_lsns(s: Stream, start: int, end: int) -> set[int]:
    """LSNs that must carry data rows in window [start, end), from the decoded stream alone."""
    out = set()
    for begin, commit in s.commits:
        if start <= begin.final_lsn < end:
            out.add(begin.final_lsn)
    for m in s.msgs:
        if isinstance(m, po.Message) and not m.transactional and m.prefix != HEARTBEAT_PREFIX \
                and start <= s.message_starts[m.lsn] < end:
            out.add(m.lsn)
    return out


def check_window(s: Stream, rows: list[dict[str, Any]], start: int, end: int, start_ts: int, end_ts: int) -> None:
    """Invariants every window must hold on its own."""
    assert rows, "a window always ends with its P row"
    progress_row = rows[-1]
    assert progress_row["op"] == ch.PROGRESS
    assert [r["op"] for r in rows].count(ch.PROGRESS) == 1
    progress = ch.Progress.from_meta(progress_row["meta"])
    data = data_rows(rows)
    txn_data = [r for r in data if r["xid"] != 0]
    assert progress.end_lsn == end == progress_row["lsn"]
    assert progress.resolved_ts == end_ts == progress_row["commit_ts"]
    assert progress.changes == len(data)
    assert progress.last_commit_time == (txn_data[-1]["commit_time"] if txn_data else None)
    assert {r["lsn"] for r in data} == expected_lsns(s, start, end)

    by_commit = {b.final_lsn: (b, c) for b, c in s.commits}
    shapes: dict[tuple[str, str], ch.TableShape] = {}
    last_lsn, last_seq, last_ts = start - 1, -1, start_ts
    for r in rows[:-1]:
        if r["xid"] != 0:
            assert start <= r["lsn"] < end  # its commit record starts in the window
        else:
            assert r["lsn"] > start  # a message's END: its record starts in the window
        if r["lsn"] == last_lsn:  # more rows of the same transaction: seq counts on, same ts
            assert r["seq"] == last_seq + 1
            assert r["commit_ts"] == last_ts
        else:  # the next transaction (or non-transactional message), in LSN order
            assert r["lsn"] > last_lsn and r["seq"] == 0
            if r["xid"] != 0:
                assert r["commit_ts"] > last_ts  # strictly after everything before it in the window
            else:  # a non-transactional message: no commit; never earlier than what came before it
                assert r["op"] == "m" and r["commit_time"] is None
                assert last_ts <= r["commit_ts"] <= end_ts
        last_lsn, last_seq, last_ts = r["lsn"], r["seq"], r["commit_ts"]
        if r["xid"] != 0:
            begin, commit = by_commit[r["lsn"]]
            assert (r["xid"], r["commit_time"]) == (begin.xid, commit.commit_time_us)
            assert r["commit_ts"] > start_ts
            assert r["commit_ts"] >= from_millis(commit.commit_time_us // 1000)
        if r["op"] == ch.RELATION:
            shapes[(r["schema"], r["table"])] = ch.TableShape.from_meta(r["schema"], r["table"], r["meta"])
            assert r["after"] is None and r["before"] is None
        elif r["schema"] is not None:
            shape = shapes.get((r["schema"], r["table"]))
            assert shape is not None, f"{r['op']} row for {r['table']} before its R row in this window"
            for line in (r["after"], r["before"]):
                if line is not None:
                    assert len(split_line(line)) == len(shape.columns)
            if r["old_key"] is not None:
                assert len(split_line(r["old_key"])) == len(shape.key)
    for r in txn_data:
        assert r["commit_ts"] <= end_ts  # nothing above the resolved ts the window reports


def cut_points(s: Stream) -> list[int]:
    """Interesting window bounds: where commit and message records start and end, and their neighbours."""
    pts = set()
    for b, c in s.commits:
        pts |= {c.commit_lsn - 1, c.commit_lsn, c.commit_lsn + 1, c.end_lsn}
    for end, start in s.message_starts.items():
        pts |= {start - 1, start, start + 1, end - 1, end, end + 1}
    return sorted(p for p in pts if s.start_lsn < p < s.end_lsn)


CUTS = st.data()
WINDOW_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def draw_cuts(s: Stream, data: st.DataObject) -> list[int]:
    pts = cut_points(s)
    cuts = data.draw(st.lists(st.sampled_from(pts) | st.integers(s.start_lsn + 1, s.end_lsn - 1),
                              unique=True, max_size=8), label="cuts")
    return sorted(cuts)


# -- the stream itself ----------------------------------------------------------------------------

def test_capture_has_what_the_tests_need(stream: Stream) -> None:
    assert len(stream.commits) == len(stream.xids)
    assert [b.xid for b, _ in stream.commits] == list(stream.xids.values())
    ends = [c.end_lsn for _, c in stream.commits]
    assert ends == sorted(ends) and len(set(ends)) == len(ends)
    assert stream.start_lsn < ends[0] and ends[-1] < stream.end_lsn
    assert [b.final_lsn for b, _ in stream.commits] == [c.commit_lsn for _, c in stream.commits]
    for name, lsn in stream.message_lsns.items():
        assert any(isinstance(m, po.Message) and m.lsn == lsn and not m.transactional for m in stream.msgs), name
    # pgoutput gives a message's record END (as pg_logical_emit_message returns it), never its start.
    assert set(stream.message_lsns.values()) <= set(stream.message_starts)


# -- window membership ----------------------------------------------------------------------------

def test_one_window_over_everything(stream: Stream) -> None:
    rows = build(stream, stream.start_lsn, stream.end_lsn, 0, ceiling_of_ms(10**13))
    check_window(stream, rows, stream.start_lsn, stream.end_lsn, 0, ceiling_of_ms(10**13))
    assert {r["xid"] for r in data_rows(rows)} - {0} == set(stream.xids.values())


def test_window_takes_exactly_the_commits_starting_inside_it(stream: Stream) -> None:
    finals = [b.final_lsn for b, _ in stream.commits]
    start, end = finals[2], finals[6]
    rows = build(stream, start, end)
    got = {r["lsn"] for r in data_rows(rows) if r["xid"] != 0}
    assert got == set(finals[2:6])
    # A bound one byte into a commit record takes that commit; one byte past a start leaves it.
    assert {r["lsn"] for r in data_rows(build(stream, start, end + 1)) if r["xid"]} == set(finals[2:7])
    assert {r["lsn"] for r in data_rows(build(stream, start + 1, end)) if r["xid"]} == set(finals[3:6])
    # A window with no commit in it: just the P row.
    empty = build(stream, finals[4] + 1, finals[4] + 2, 5, 9)
    assert [r["op"] for r in empty] == [ch.PROGRESS]
    assert ch.Progress.from_meta(empty[0]["meta"]) == ch.Progress(finals[4] + 2, 9, None, 0)


@WINDOW_SETTINGS
@given(CUTS)
def test_any_window_holds_its_invariants(stream: Stream, data: st.DataObject) -> None:
    pts = cut_points(stream)
    start = data.draw(st.sampled_from([stream.start_lsn, *pts]), label="start")
    end = data.draw(st.sampled_from([p for p in [*pts, stream.end_lsn] if p >= start]), label="end")
    inside = [c.commit_time_us // 1000 for b, c in stream.commits if start <= b.final_lsn < end]
    if inside:
        # The window's start ts was read from the clock before its first commit; its end ts after the last.
        start_ts = data.draw(st.integers(0, from_millis(inside[0]) - 1), label="start_ts")
        end_ts = ceiling_of_ms(max(inside) + data.draw(st.integers(0, 5), label="slack"))
    else:
        start_ts = end_ts = data.draw(st.integers(0, 1 << 60), label="start_ts")
    rows = build(stream, start, end, start_ts, end_ts)
    check_window(stream, rows, start, end, start_ts, end_ts)


def test_rebuilding_a_window_gives_identical_rows(stream: Stream) -> None:
    finals = [b.final_lsn for b, _ in stream.commits]
    for start, end in [(stream.start_lsn, stream.end_lsn), (finals[3], finals[12])]:
        first = ChangeBuilder(start, end, 77, 1 << 59)
        second = ChangeBuilder(start, end, 77, 1 << 59)
        for d in stream.window_input(start, end):
            first.feed(d)
        for d in stream.window_input(start, end):
            second.feed(d)
        a, b = first.finish(), second.finish()
        assert a.equals(b)
        assert a.num_rows > 1


# -- split windows vs one window ------------------------------------------------------------------

@WINDOW_SETTINGS
@given(CUTS)
def test_split_windows_chained_on_last_ts_equal_one_window(stream: Stream, data: st.DataObject) -> None:
    """Each window starting at the previous one's last emitted commit_ts reproduces one window exactly."""
    cuts = draw_cuts(stream, data)
    note(f"cuts {cuts}")
    bounds = [stream.start_lsn, *cuts, stream.end_lsn]
    start_ts0 = data.draw(st.integers(0, 1 << 60), label="start_ts")
    whole = data_rows(build(stream, stream.start_lsn, stream.end_lsn, start_ts0))
    split: list[dict[str, Any]] = []
    ts = start_ts0
    for lo, hi in zip(bounds, bounds[1:]):
        rows = data_rows(build(stream, lo, hi, ts))
        split.extend(rows)
        ts = max([ts] + [r["commit_ts"] for r in rows])
    # Identical except `seq`, which counts the R rows a window adds before a table's first change.
    assert strip(split, "seq") == strip(whole, "seq")


@WINDOW_SETTINGS
@given(CUTS)
def test_split_windows_as_in_production(stream: Stream, data: st.DataObject) -> None:
    """Window k+1 starts at window k's END ts (a server clock reading at the cut, as a ceiling of its ms)."""
    cuts = draw_cuts(stream, data)
    bounds = [stream.start_lsn, *cuts, stream.end_lsn]
    first_ms = stream.commits[0][1].commit_time_us // 1000
    whole_rows = build(stream, stream.start_lsn, stream.end_lsn, 0, ceiling_of_ms(first_ms + 10**6))
    split: list[dict[str, Any]] = []
    start_ts = 0
    clock_ms = first_ms - 1
    for lo, hi in zip(bounds, bounds[1:]):
        # The clock reading at the cut: not before any commit up to it, and later than the previous reading.
        latest_ms = max([clock_ms + 1] + [c.commit_time_us // 1000 for b, c in stream.commits if b.final_lsn < hi])
        clock_ms = latest_ms + data.draw(st.integers(0, 3), label="clock slack ms")
        end_ts = window_end_ts(start_ts, clock_ms)  # as ChangeStreamReader.latestOffset plans it
        rows = build(stream, lo, hi, start_ts, end_ts)
        check_window(stream, rows, lo, hi, start_ts, end_ts)
        split.extend(data_rows(rows))
        start_ts = end_ts
    whole = data_rows(whole_rows)
    # No loss, no duplicates, same rows in the same order.
    assert strip(split, "seq", "commit_ts") == strip(whole, "seq", "commit_ts")
    # One commit_ts per transaction, strictly increasing from one transaction to the next.
    txn_ts: dict[int, int] = {}
    for r in split:
        if r["xid"] != 0:
            assert txn_ts.setdefault(r["lsn"], r["commit_ts"]) == r["commit_ts"]
    ordered = list(txn_ts.values())
    assert ordered == sorted(ordered) and len(set(ordered)) == len(ordered)
    assert len(ordered) == len(stream.commits)


@WINDOW_SETTINGS
@given(CUTS)
def test_commit_ts_keeps_increasing_when_the_clock_stalls_or_steps_back(stream: Stream, data: st.DataObject) -> None:
    """The HLC exists for clocks that do not move forward; windows must not undo that.

    Offsets are planned as in ChangeStreamReader.latestOffset: end ts = max(ceiling of the server
    clock's ms at the cut, start ts). When the clock reading at a cut is not past the previous one
    (same millisecond, or an NTP step back), the window's transactions still get fresh timestamps
    above its start ts, so they must stay at or below the resolved ts the window reports (the next
    window starts from it) - else the next window hands out the same timestamps again.
    """
    cuts = draw_cuts(stream, data)
    bounds = [stream.start_lsn, *cuts, stream.end_lsn]
    split: list[dict[str, Any]] = []
    start_ts = 0
    for lo, hi in zip(bounds, bounds[1:]):
        latest_ms = max([0] + [c.commit_time_us // 1000 for b, c in stream.commits if b.final_lsn < hi])
        clock_ms = latest_ms + data.draw(st.integers(-2000, 3), label="clock offset ms")
        end_ts = window_end_ts(start_ts, clock_ms)
        rows = build(stream, lo, hi, start_ts, end_ts)
        window_ts = [r["commit_ts"] for r in data_rows(rows) if r["xid"] != 0]
        resolved = ch.Progress.from_meta(rows[-1]["meta"]).resolved_ts
        assert all(ts <= resolved for ts in window_ts), (
            f"window [{lo}, {hi}) reports resolved ts {resolved} but emitted commit_ts up to {max(window_ts)}")
        split.extend(data_rows(rows))
        start_ts = end_ts
    per_txn = list(dict.fromkeys((r["lsn"], r["commit_ts"]) for r in split if r["xid"] != 0))
    ts = [t for _, t in per_txn]
    assert all(a < b for a, b in zip(ts, ts[1:])), "commit_ts not strictly increasing across windows"


def test_clock_step_back_never_hands_out_the_same_commit_ts_twice(stream: Stream) -> None:
    """Concrete case of the property above: the server clock was an hour fast when the previous batch
    was planned (resolved ts S), then got corrected; the next cuts read the right time."""
    ends = [b.final_lsn for b, _ in stream.commits]
    now_ms = stream.commits[-1][1].commit_time_us // 1000
    start_ts = ceiling_of_ms(now_ms + 3_600_000)  # S, from the fast clock
    seen: dict[int, int] = {}
    for lo, hi in [(stream.start_lsn, ends[0]), (ends[0], ends[2]), (ends[2], ends[4])]:
        end_ts = window_end_ts(start_ts, now_ms)  # as ChangeStreamReader.latestOffset plans it
        for r in data_rows(build(stream, lo, hi, start_ts, end_ts)):
            assert seen.setdefault(r["commit_ts"], r["lsn"]) == r["lsn"], (
                f"commit_ts {r['commit_ts']} given to the transactions at LSN {seen[r['commit_ts']]} and {r['lsn']}")
        start_ts = end_ts


# -- content of the rows ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def whole(stream: Stream) -> list[dict[str, Any]]:
    return build(stream, stream.start_lsn, stream.end_lsn)


def txn_rows(stream: Stream, rows: list[dict[str, Any]], step: str) -> list[dict[str, Any]]:
    return rows_of(rows, stream.commit_of(step).commit_lsn)


def test_relation_rows_describe_tables_before_first_change(stream: Stream, whole: list[dict[str, Any]]) -> None:
    first = txn_rows(stream, whole, "insert_a")
    assert [r["op"] for r in first] == ["R", "c", "c", "c"]
    shape = ch.TableShape.from_meta("public", "a", first[0]["meta"])
    assert (first[0]["schema"], first[0]["table"]) == ("public", "a")
    assert shape.columns == ("id", "v") and shape.key == ("id",) and shape.replica_identity == "d"
    assert [r["after"] for r in first[1:]] == [b"1\tx", b"2\ty", b"3\t\\N"]
    assert all(r["before"] is None and r["old_key"] is None and r["unchanged"] is None for r in first[1:])
    # Already described in this window: no second R row for the same shape.
    assert [r["op"] for r in txn_rows(stream, whole, "key_update")] == ["u"]


def test_relation_rows_with_the_real_catalog(stream: Stream) -> None:
    rows = build(stream, stream.start_lsn, stream.end_lsn, catalog=lambda rel: column_catalog(stream.conn, rel))
    shapes = [ch.TableShape.from_meta(r["schema"], r["table"], r["meta"]) for r in rows
              if r["op"] == ch.RELATION and r["table"] == "a"]
    assert shapes[0].types == ("integer", "text")
    # After ADD COLUMN w int DEFAULT 42 the table is described again, wider, with the value old rows read as.
    wide = [s for s in shapes if len(s.columns) == 3]
    assert wide and wide[0].columns == ("id", "v", "w") and wide[0].types == ("integer", "text", "integer")
    assert wide[0].missing == (None, None, "42")
    b_shape = next(ch.TableShape.from_meta(r["schema"], r["table"], r["meta"]) for r in rows
                   if r["op"] == ch.RELATION and r["table"] == "b")
    assert b_shape.types == ("integer", "text", "text", "integer") and b_shape.key == ("id",)


def test_unchanged_toast_columns(stream: Stream, whole: list[dict[str, Any]]) -> None:
    doc, doc2 = stream.big
    assert len(doc) == len(doc2) == 3200 * 32
    ins = [r for r in txn_rows(stream, whole, "insert_b") if r["op"] == "c"]
    assert [r["after"] for r in ins] == [f"1\t{doc}\t{doc2}\t1".encode()]
    (upd,) = txn_rows(stream, whole, "toast_update")
    assert upd["op"] == "u"
    assert split_line(upd["after"]) == [b"1", None, None, b"2"]
    assert upd["unchanged"] == "{1,2}"
    assert upd["before"] is None and upd["old_key"] is None


def test_key_change_fills_old_key(stream: Stream, whole: list[dict[str, Any]]) -> None:
    (upd,) = txn_rows(stream, whole, "key_update")
    assert upd["op"] == "u" and upd["after"] == b"10\tx"
    assert upd["old_key"] == b"1"
    assert split_line(upd["before"]) == [b"1", None]
    # A key change of a row with TOASTed values: old key, and the values still unchanged.
    (upd_b,) = [r for r in txn_rows(stream, whole, "multi") if r["table"] == "b" and r["op"] == "u"]
    assert split_line(upd_b["after"]) == [b"5", None, None, b"3"]
    assert upd_b["unchanged"] == "{1,2}"
    assert upd_b["old_key"] == b"1"


def test_delete_puts_old_tuple_in_before(stream: Stream, whole: list[dict[str, Any]]) -> None:
    (dele,) = txn_rows(stream, whole, "delete_a")
    assert dele["op"] == "d" and dele["after"] is None and dele["old_key"] is None
    assert split_line(dele["before"]) == [b"2", None]
    f_rows = txn_rows(stream, whole, "delete_f")
    assert [(r["op"], r["before"]) for r in f_rows] == [("d", b"1\tq\t\\N")]


def rows_and_shape(stream: Stream, table: str) -> tuple[list[dict[str, Any]], ch.TableShape]:
    """The whole stream's rows, built with the real catalog, and the R row's shape of `table`."""
    rows = build(stream, stream.start_lsn, stream.end_lsn, catalog=lambda rel: column_catalog(stream.conn, rel))
    (r_row,) = [r for r in rows if r["op"] == ch.RELATION and r["table"] == table]
    return rows, ch.TableShape.from_meta("public", table, r_row["meta"])


def test_full_identity_table_is_keyed_by_its_primary_key(stream: Stream) -> None:
    """A REPLICA IDENTITY FULL table with a primary key: pgoutput flags ALL columns as identity.

    change.py documents `old_key` as "the old primary key when an update changed it" and the R row's
    `key` as the key columns; the replica is created with the source's PRIMARY KEY (describe_tables)
    and applied with ON CONFLICT (key). So the R row must say key=(id,) and an update that leaves id
    alone must not carry an old_key.
    """
    rows, shape = rows_and_shape(stream, "f")
    assert shape.replica_identity == "f"
    (upd,) = rows_of(rows, stream.commit_of("update_f").commit_lsn)
    assert upd["after"] == b"1\tq\t\\N"
    assert upd["before"] == b"1\tp\t\\N"  # FULL identity: the whole old row
    assert (shape.key, upd["old_key"]) == (("id",), None)


def test_replica_identity_index_table_is_keyed_by_that_index(stream: Stream) -> None:
    """Table `ri`: PRIMARY KEY (id) plus REPLICA IDENTITY USING INDEX on UNIQUE (code).

    PostgreSQL gives old values only for the identity (code): an update of `code` sends K=(NULL,'a',NULL),
    an update of `id` alone sends no old tuple, a delete sends (NULL,'b',NULL). Only code identifies the
    row in every change, so it must be the key; with (id, code) the old key of the first update is
    (NULL, 'a'), which matches no replica row, and the update of id alone cannot be matched either.
    """
    rows, shape = rows_and_shape(stream, "ri")
    assert shape.replica_identity == "i"
    (upd,) = rows_of(rows, stream.commit_of("update_ri_identity").commit_lsn)
    assert upd["after"] == b"1\tb\tx"
    assert (shape.key, upd["old_key"]) == (("code",), b"a")
    (dele,) = rows_of(rows, stream.commit_of("delete_ri").commit_lsn)
    before = dict(zip(shape.columns, split_line(dele["before"])))
    assert all(before[k] is not None for k in shape.key), f"delete's old row {before} lacks key {shape.key}"


def test_escaping_in_after(stream: Stream, whole: list[dict[str, Any]]) -> None:
    ins = [r for r in txn_rows(stream, whole, "after_alter") if r["op"] == "c"]
    assert [r["after"] for r in ins] == [b"20\ttab\\there\t7"]
    (upd,) = txn_rows(stream, whole, "escape_update")
    assert upd["after"] == b"20\tback\\\\slash\\nnl\t7"
    assert split_line(upd["after"]) == [b"20", b"back\\slash\nnl", b"7"]


def test_add_column_redescribes_the_table(stream: Stream, whole: list[dict[str, Any]]) -> None:
    rows = txn_rows(stream, whole, "after_alter")
    assert [r["op"] for r in rows] == ["R", "c"]
    assert json.loads(rows[0]["meta"])["columns"] == ["id", "v", "w"]


def test_inserts_updates_and_deletes_of_one_transaction(stream: Stream, whole: list[dict[str, Any]]) -> None:
    rows = txn_rows(stream, whole, "mixed")
    assert [(r["table"], r["op"], r["after"], r["before"]) for r in rows] == [
        ("a", "c", b"30\tm\t42", None), ("a", "c", b"31\tm\t42", None), ("a", "c", b"32\t\\N\t42", None),
        ("a", "d", None, b"30\t\\N\t\\N"), ("ri", "c", b"5\tc5\tx", None), ("a", "u", b"31\tn\t42", None),
        ("a", "c", b"33\t\t42", None), ("a", "d", None, b"32\t\\N\t\\N"), ("a", "d", None, b"33\t\\N\t\\N")]
    assert [r["seq"] for r in rows] == list(range(9))


def test_truncate_rows(stream: Stream, whole: list[dict[str, Any]]) -> None:
    rows = txn_rows(stream, whole, "truncate")
    truncs = [r for r in rows if r["op"] == "t"]
    assert sorted(r["table"] for r in truncs) == ["c", "p"]
    assert all(r["after"] is None and r["before"] is None for r in truncs)


def test_messages(stream: Stream, whole: list[dict[str, Any]]) -> None:
    multi = txn_rows(stream, whole, "multi")
    (audit,) = [r for r in multi if r["op"] == "m"]
    assert (audit["after"], json.loads(audit["meta"])) == (b"who=me", {"prefix": "audit"})
    assert audit["xid"] == stream.xids["multi"] and audit["schema"] is None
    # Transactional rows keep statement order: insert a, message, update b.
    assert [(r["op"], r["table"]) for r in multi if r["op"] != "R"] == [("c", "a"), ("m", None), ("u", "b")]
    notes = [r for r in whole if r["op"] == "m" and r["xid"] == 0]
    assert [(r["lsn"], r["after"], json.loads(r["meta"])["prefix"]) for r in notes] == [
        (stream.message_lsns["note"], b"hi there", "note"), (stream.message_lsns["note2"], b"second", "note")]
    assert all(r["commit_time"] is None and r["schema"] is None for r in notes)
    # Heartbeats, transactional or not, never become rows.
    assert all(json.loads(r["meta"])["prefix"] != HEARTBEAT_PREFIX for r in whole if r["op"] == "m")
    assert [r["op"] for r in txn_rows(stream, whole, "txn_heartbeat")] == ["d"]
    progress = ch.Progress.from_meta(whole[-1]["meta"])
    assert progress.changes == len(data_rows(whole))


@pytest.mark.parametrize("rows_per_batch", [1, 7, 65536])
def test_batches_split_only_transactions_larger_than_a_batch(stream: Stream, rows_per_batch: int) -> None:
    """A transaction goes out whole, or, if it holds more rows than a batch, in parts cut at block
    ends (here: every 5 messages); the parts' rows are the transaction's rows, `seq` and all."""
    one = build(stream, stream.start_lsn, stream.end_lsn, 3, 10**15)
    builder = ChangeBuilder(stream.start_lsn, stream.end_lsn, 3, 10**15)
    batches = list(builder.batches(blocks_of(stream.raw, range(0, len(stream.raw), 5)), rows_per_batch))
    assert [r for rb in batches for r in rb.to_pylist()] == one
    size = Counter(r["lsn"] for r in one)
    seen: set[int] = set()
    split = 0
    for rb in batches:
        lsns = set(rb.column("lsn").to_pylist())
        for lsn in lsns & seen:
            assert size[lsn] > rows_per_batch, "a transaction no larger than a batch spread over two"
            split += 1
        seen |= lsns
    assert (split > 0) == (rows_per_batch < 65536)


def test_batches_stop_reading_after_the_window(stream: Stream) -> None:
    end = stream.commits[6][0].final_lsn
    consumed = 0

    def counted() -> Iterator[list[bytes]]:
        nonlocal consumed
        for block in blocks_of(stream.raw, range(0, len(stream.raw), 3)):
            consumed += 1
            yield block

    rows = [r for rb in ChangeBuilder(stream.start_lsn, end, 0, 0).batches(counted()) for r in rb.to_pylist()]
    # It stops at the Begin of transaction 7: its commit record starts at or after the end.
    seventh_begin = [i for i, m in enumerate(stream.msgs) if isinstance(m, po.Begin)][6]
    assert stream.msgs[seventh_begin].final_lsn >= end
    assert consumed == seventh_begin // 3 + 1  # not a block after the one holding that Begin
    assert rows == build(stream, stream.start_lsn, end)
    assert rows[-1]["op"] == ch.PROGRESS
    assert max(r["lsn"] for r in data_rows(rows)) < end


# -- malformed streams -------------------------------------------------------------------------------

def _first(stream: Stream, pred: Any) -> bytes:
    return next(raw for raw, m in zip(stream.raw, stream.msgs) if pred(m))


@pytest.mark.parametrize("what", ["insert", "update", "update_key", "update_full", "delete", "truncate"])
def test_change_before_its_relation_raises_decode_error(stream: Stream, what: str) -> None:
    picks = {
        "insert": lambda m: isinstance(m, po.Insert),
        "update": lambda m: isinstance(m, po.Update) and m.old is None,
        "update_key": lambda m: isinstance(m, po.Update) and m.old_is_key,
        "update_full": lambda m: isinstance(m, po.Update) and m.old is not None and not m.old_is_key,
        "delete": lambda m: isinstance(m, po.Delete),
        "truncate": lambda m: isinstance(m, po.Truncate),
    }
    begin = _first(stream, lambda m: isinstance(m, po.Begin))
    builder = ChangeBuilder(0, 1 << 62, 0, 0)
    builder.feed(begin)
    with pytest.raises(po.DecodeError):
        builder.feed(_first(stream, picks[what]))


def test_change_outside_a_transaction_raises_decode_error(stream: Stream) -> None:
    builder = ChangeBuilder(0, 1 << 62, 0, 0)
    builder.feed(_first(stream, lambda m: isinstance(m, po.Relation) and m.name == "a"))
    with pytest.raises(po.DecodeError):
        builder.feed(_first(stream, lambda m: isinstance(m, po.Insert)))


def test_feed_all_equals_batches(stream: Stream) -> None:
    """Feeding past the window's end (ignoring `done`) adds nothing."""
    finals = [b.final_lsn for b, _ in stream.commits]
    builder = ChangeBuilder(finals[1], finals[9], 11, 1 << 59)
    for d in stream.raw:
        builder.feed(d)
    assert builder.done
    assert builder.finish().to_pylist() == build(stream, finals[1], finals[9], 11, 1 << 59)


def test_take_returns_arrow_schema(stream: Stream) -> None:
    builder = ChangeBuilder(stream.start_lsn, stream.end_lsn, 0, 0)
    rb = builder.take()
    assert isinstance(rb, pa.RecordBatch) and rb.num_rows == 0 and rb.schema == ch.arrow_schema()
    for d in stream.raw:
        builder.feed(d)
    assert builder.pending() > 0
    rb = builder.take()
    assert builder.pending() == 0 and rb.num_rows > 0
    assert rb.schema.names == list(ch.NAMES)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_corrupted_changes_raise_decode_error_or_build(stream: Stream, data: st.DataObject) -> None:
    """The builder parses I/U/D itself, a block at a time: damage must end as DecodeError, never
    another error, and exactly as feeding the messages one by one ends (same error, or same rows)."""
    plain = [i for i, raw in enumerate(stream.raw) if raw[:1] in (b"I", b"U", b"D")]
    index = data.draw(st.sampled_from(plain), label="message index")
    msg = bytearray(stream.raw[index])
    if data.draw(st.booleans(), label="truncate"):
        del msg[data.draw(st.integers(1, len(msg) - 1), label="cut"):]
    else:
        at = data.draw(st.integers(1, len(msg) - 1), label="at")
        msg[at] = data.draw(st.integers(0, 255), label="byte")
    raw = [bytes(msg) if i == index else d for i, d in enumerate(stream.raw)]
    cuts = data.draw(st.lists(st.integers(1, len(raw) - 1), max_size=6), label="block cuts")

    def outcome(build: Any) -> Any:
        builder = ChangeBuilder(0, 1 << 62, 0, 1 << 62)
        try:
            return [r for rb in build(builder) for r in rb.to_pylist()]
        except po.DecodeError as e:
            return f"DecodeError: {e}"

    assert outcome(lambda b: b.batches(blocks_of(raw, cuts), 7)) == outcome(lambda b: build_one_by_one(b, raw, 7))


@WINDOW_SETTINGS
@given(CUTS)
def test_blocks_build_exactly_what_messages_one_by_one_build(stream: Stream, data: st.DataObject) -> None:
    """Wherever the blocks are cut: the same record batches as `feed` per message, cut at the same rows."""
    pts = cut_points(stream)
    start = data.draw(st.sampled_from([stream.start_lsn, *pts]), label="start")
    end = data.draw(st.sampled_from([p for p in [*pts, stream.end_lsn] if p >= start]), label="end")
    messages = stream.window_input(start, end)
    cuts = data.draw(st.lists(st.integers(1, max(1, len(messages) - 1)), max_size=12), label="block cuts")
    rows_per_batch = data.draw(st.sampled_from([1, 5, 40, 65536]), label="rows_per_batch")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(cb, "_SHORT_RUN", data.draw(st.sampled_from([1, 3, SHORT_RUN]), label="short run"))
        got = list(ChangeBuilder(start, end, 5, 1 << 60).batches(blocks_of(messages, cuts), rows_per_batch))
    want = build_one_by_one(ChangeBuilder(start, end, 5, 1 << 60), messages, rows_per_batch, cuts)
    assert [rb.num_rows for rb in got] == [rb.num_rows for rb in want]
    for g, w in zip(got, want):
        assert g.schema == w.schema == ch.arrow_schema()
        assert g.equals(w), (g.to_pylist(), w.to_pylist())


def test_feed_block_equals_feed(stream: Stream) -> None:
    """With the real catalog, and past the window's end (ignoring `done`)."""
    finals = [b.final_lsn for b, _ in stream.commits]
    catalog = functools.partial(column_catalog, stream.conn)
    one, blocks = (ChangeBuilder(finals[1], finals[12], 3, 1 << 59, catalog) for _ in range(2))
    for d in stream.raw:
        one.feed(d)
    for block in blocks_of(stream.raw, range(0, len(stream.raw), 7)):
        blocks.feed_block(block)
    assert (one.done, one.changes, one.pending()) == (blocks.done, blocks.changes, blocks.pending())
    assert one.finish().equals(blocks.finish())


# -- a window followed as the server writes it, cut into sub-windows ------------------------------

FOLLOWED = 1 << 62  # a followed window's end: no transaction lies past it


def follow(stream: Stream, ends: list[int], tries: set[int]) -> list[list[dict[str, Any]]]:
    """The sub-windows one builder makes of the whole stream fed as blocks ending at `ends`, cut
    after a block that ends at one of `tries` (and after the last) wherever it can be."""
    messages = stream.window_input(stream.start_lsn, stream.end_lsn)
    builder = ChangeBuilder(stream.start_lsn, FOLLOWED, 0, FOLLOWED)
    windows: list[list[dict[str, Any]]] = []
    at = 0
    for block in blocks_of(messages, ends):
        builder.feed_block(block)
        at += len(block)
        if (at in tries or at == len(messages)) and builder.cuttable():
            windows.append(builder.cut().to_pylist())
    return windows


def check_followed(stream: Stream, windows: list[list[dict[str, Any]]]) -> None:
    """Each sub-window holds a window's invariants on its own (its end the last commit record's
    end, resolved at that commit's timestamp, its tables described before their first change), and
    together they are the one window, commit timestamps included."""
    assert windows, "the stream holds commits: at least the last block ends after one"
    lo, lo_ts, followed = stream.start_lsn, 0, []
    for rows in windows:
        progress = ch.Progress.from_meta(rows[-1]["meta"])
        assert progress.end_lsn in {c.end_lsn for _, c in stream.commits}
        check_window(stream, rows, lo, progress.end_lsn, lo_ts, progress.resolved_ts)
        followed.extend(data_rows(rows))
        lo, lo_ts = progress.end_lsn, progress.resolved_ts
    whole = data_rows(build(stream, stream.start_lsn, lo, 0, FOLLOWED))
    assert strip(followed, "seq") == strip(whole, "seq")


@WINDOW_SETTINGS
@given(CUTS)
def test_a_followed_window_cut_at_commits_equals_one_window(stream: Stream, data: st.DataObject) -> None:
    """Blocks and cuts drawn: see check_followed."""
    n = len(stream.window_input(stream.start_lsn, stream.end_lsn))
    ends = data.draw(st.lists(st.integers(1, n - 1), unique=True, max_size=30), label="block ends")
    tries = data.draw(st.sets(st.sampled_from(sorted(ends))) if ends else st.just(set()), label="cuts tried")
    check_followed(stream, follow(stream, ends, tries))


def test_a_followed_window_cut_after_every_message(stream: Stream) -> None:
    """Every message a block of its own, a cut tried after each: as many sub-windows as can be
    (a non-transactional message after a commit waits for the next commit's cut)."""
    n = len(stream.window_input(stream.start_lsn, stream.end_lsn))
    windows = follow(stream, list(range(1, n)), set(range(1, n)))
    assert len(windows) > len(stream.commits) // 2
    check_followed(stream, windows)


def test_a_followed_window_never_ends_before_a_message_it_holds(stream: Stream) -> None:
    """Blocks that end right after each non-transactional message, which follows a commit: the
    cut there must wait for the next commit (the message's record lies past the last one's end)."""
    messages = stream.window_input(stream.start_lsn, stream.end_lsn)
    after = [i + 1 for i, m in enumerate(map(po.decode, messages))
             if isinstance(m, po.Message) and not m.transactional and 0 < i + 1 < len(messages)]
    assert any(isinstance(po.decode(messages[i - 2]), po.Commit) for i in after), "a message right after a commit"
    check_followed(stream, follow(stream, after, set(after)))

