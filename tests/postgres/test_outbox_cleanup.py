"""postgres.outbox against a real PostgreSQL: the table check, and TTL cleanup that never deletes undelivered rows.

Cleanup runs on a fake clock the tests advance; "the feed's checkpoint" is an LSN the test passes
to tick(), chosen relative to the marks the cleanup took (cleanup.marks).
"""
from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import psycopg
import pytest

from changefeed.core.outbox import OutboxSpec, parse_columns
from changefeed.errors import ConfigError, ConnectionFailed, DefiniteError, SourceNotReady
from changefeed.postgres.connect import insert_lsn
from changefeed.postgres.outbox import OutboxCleanup, check_outbox_table
from support.servers import Dbs

pytestmark = pytest.mark.timeout(120)

TABLE = "public.outbox"
DDL = ("CREATE TABLE outbox (id bigserial PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL, "
       "event_type text NOT NULL, payload jsonb)")
TTL = 100.0
T0 = 1000.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def insert(conn: psycopg.Connection[Any], n: int, agg: str = "order") -> None:
    conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                 "SELECT %s, 'a' || g, 'created', '{}'::jsonb FROM generate_series(1, %s) g", (agg, n))


def count(conn: psycopg.Connection[Any]) -> int:
    return int(conn.execute("SELECT count(*) FROM outbox").fetchone()[0])  # type: ignore[index]


def wal_now(conn: psycopg.Connection[Any]) -> int:
    return insert_lsn(conn)


@pytest.fixture
def src(dbs: Dbs) -> Any:
    with dbs.src() as c:
        c.execute(DDL)
        yield c


def cleanup(dbs: Dbs, tmp_path: Path, clock: Clock, ttl: float = TTL, **kw: Any) -> OutboxCleanup:
    return OutboxCleanup(dbs.source, OutboxSpec(TABLE, ttl_s=ttl), tmp_path / "state" / "marks.jsonl",
                         clock=clock, mark_every_s=kw.pop("mark_every_s", 10.0), **kw)


def marked(dbs: Dbs, tmp_path: Path, **kw: Any) -> tuple[Clock, OutboxCleanup]:
    """A cleanup on a clock at T0 that has taken its first mark (and deleted nothing)."""
    clock = Clock()
    c = cleanup(dbs, tmp_path, clock, **kw)
    c.tick(None)
    return clock, c


# -- check_outbox_table ---------------------------------------------------------------------

def test_check_accepts_a_good_table(src: psycopg.Connection[Any]) -> None:
    check_outbox_table(src, OutboxSpec(TABLE))  # raises on any problem


def test_check_missing_table(src: psycopg.Connection[Any]) -> None:
    with pytest.raises(SourceNotReady, match="public.nope does not exist") as e:
        check_outbox_table(src, OutboxSpec("public.nope"))
    assert e.value.hint


def test_check_missing_column(src: psycopg.Connection[Any]) -> None:
    src.execute("ALTER TABLE outbox DROP COLUMN event_type")
    with pytest.raises(ConfigError, match="no column event_type") as e:
        check_outbox_table(src, OutboxSpec(TABLE))
    assert "--outbox-columns" in e.value.hint


def test_check_nullable_aggregate_id(src: psycopg.Connection[Any]) -> None:
    src.execute("ALTER TABLE outbox ALTER COLUMN aggregate_id DROP NOT NULL")
    with pytest.raises(SourceNotReady, match="aggregate_id allows NULL") as e:
        check_outbox_table(src, OutboxSpec(TABLE))
    assert e.value.hint == "run ALTER TABLE \"public\".\"outbox\" ALTER COLUMN \"aggregate_id\" SET NOT NULL"
    src.execute(e.value.hint.removeprefix("run "))  # the hint is runnable and fixes it
    check_outbox_table(src, OutboxSpec(TABLE))


def test_check_payload_type(src: psycopg.Connection[Any]) -> None:
    src.execute("ALTER TABLE outbox ALTER COLUMN payload TYPE bytea USING convert_to(payload::text, 'UTF8')")
    with pytest.raises(SourceNotReady, match="payload column payload is bytea"):
        check_outbox_table(src, OutboxSpec(TABLE))
    src.execute("ALTER TABLE outbox ALTER COLUMN payload TYPE text USING convert_from(payload, 'UTF8')")
    check_outbox_table(src, OutboxSpec(TABLE))


def test_check_custom_column_names(src: psycopg.Connection[Any]) -> None:
    src.execute("CREATE SCHEMA app; CREATE TABLE app.events (event_id uuid PRIMARY KEY, aggregate_type text NOT NULL, "
                "aggregate_id text NOT NULL, event_type text NOT NULL, body json)")
    custom = OutboxSpec("app.events", parse_columns("id=event_id,payload=body"))
    check_outbox_table(src, custom)
    with pytest.raises(ConfigError, match=r"no column id \(role id\), payload \(role payload\)"):
        check_outbox_table(src, OutboxSpec("app.events"))  # the default names are not there
    src.execute("ALTER TABLE app.events ALTER COLUMN event_type DROP NOT NULL")
    with pytest.raises(SourceNotReady, match="SET NOT NULL") as e:
        check_outbox_table(src, custom)
    assert '"app"."events" ALTER COLUMN "event_type"' in e.value.hint


# -- cleanup --------------------------------------------------------------------------------

def test_cleanup_deletes_delivered_rows_in_batches(dbs: Dbs, src: psycopg.Connection[Any], tmp_path: Path) -> None:
    insert(src, 25)
    clock = Clock()
    c = cleanup(dbs, tmp_path, clock, batch_rows=10)
    assert c.tick(None) == 0  # takes the first mark, deletes nothing without a checkpoint
    [m] = c.marks
    assert m.time == T0 and m.lsn <= wal_now(src)
    clock.now = T0 + TTL
    assert c.tick(m.lsn) == 25
    assert c.last_batches == 3  # 10 + 10 + 5: each batch its own DELETE
    assert count(src) == 0
    c.close()


def test_cleanup_batches_stop_after_a_short_one(dbs: Dbs, src: psycopg.Connection[Any], tmp_path: Path) -> None:
    insert(src, 20)
    clock, c = marked(dbs, tmp_path, batch_rows=10)
    clock.now = T0 + TTL
    assert c.tick(c.marks[0].lsn) == 20
    assert c.last_batches == 3  # 10, 10, then 0 (< 10) ends it
    assert c.tick(c.marks[0].lsn) == 0 and c.last_batches == 1
    c.close()


def test_cleanup_never_deletes_above_the_checkpoint(dbs: Dbs, src: psycopg.Connection[Any], tmp_path: Path) -> None:
    insert(src, 5)
    clock, c = marked(dbs, tmp_path)
    m = c.marks[0]
    clock.now = T0 + 10 * TTL
    assert c.tick(m.lsn - 1) == 0 and c.last_batches == 0
    assert count(src) == 5
    assert c.tick(m.lsn) == 5  # the same mark, once the checkpoint reaches it
    assert count(src) == 0
    c.close()


def test_cleanup_keeps_rows_of_a_transaction_open_at_the_mark(dbs: Dbs, src: psycopg.Connection[Any],
                                                              tmp_path: Path) -> None:
    insert(src, 3, "old")
    clock = Clock()
    c = cleanup(dbs, tmp_path, clock)
    with psycopg.connect(dbs.source) as open_tx:  # not autocommit: the transaction stays open
        insert(open_tx, 1, "open")
        c.tick(None)  # the mark while `open` is in flight
        open_tx.commit()
    insert(src, 1, "late")  # committed after the mark
    checkpoint = wal_now(src)  # past the mark, and past both commits
    assert checkpoint > c.marks[0].lsn
    clock.now = T0 + TTL  # the mark at T0 is usable; the one taken now is not, yet
    assert c.tick(checkpoint) == 3
    assert sorted(r[0] for r in src.execute("SELECT aggregate_type FROM outbox")) == ["late", "open"]
    clock.now = T0 + 2 * TTL  # the mark taken at T0 + TTL, after both commits, now is usable
    assert c.tick(c.marks[1].lsn) == 2
    assert count(src) == 0
    c.close()


def test_cleanup_waits_for_the_ttl(dbs: Dbs, src: psycopg.Connection[Any], tmp_path: Path) -> None:
    insert(src, 4)
    clock, c = marked(dbs, tmp_path)
    lsn = c.marks[0].lsn
    clock.now = T0 + TTL - 0.5
    assert c.tick(lsn) == 0
    assert count(src) == 4
    clock.now = T0 + TTL
    assert c.tick(lsn) == 4
    c.close()


def test_ttl_zero_does_nothing(dbs: Dbs, src: psycopg.Connection[Any], tmp_path: Path) -> None:
    insert(src, 3)
    marks = tmp_path / "state" / "marks.jsonl"
    clock = Clock()
    c = OutboxCleanup(dbs.source, OutboxSpec(TABLE, ttl_s=0), marks, clock=clock)
    for step in range(3):
        clock.now = T0 + step * 1000
        assert c.tick(wal_now(src)) == 0
    assert count(src) == 3
    assert not marks.exists() and not marks.parent.exists()
    # it does not even connect
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nowhere = OutboxCleanup(f"postgresql://u:p@127.0.0.1:{port}/x", OutboxSpec(TABLE, ttl_s=0), marks)
    assert nowhere.tick(1 << 40) == 0
    with pytest.raises(ConnectionFailed):  # ... while with a TTL it would, and say so
        OutboxCleanup(f"postgresql://u:p@127.0.0.1:{port}/x", OutboxSpec(TABLE, ttl_s=TTL), marks).tick(None)


def test_marks_survive_a_restart_and_a_torn_line(dbs: Dbs, src: psycopg.Connection[Any], tmp_path: Path) -> None:
    insert(src, 6)
    clock, first = marked(dbs, tmp_path)
    first.close()
    path = tmp_path / "state" / "marks.jsonl"
    [line] = path.read_text().splitlines()
    m1 = json.loads(line)
    with open(path, "a") as f:
        f.write('{"time": 1050.0, "horizon": 9')  # a crash in the middle of appending the next mark
    insert(src, 2, "mid")  # after the first mark: the next one covers these

    clock.now = T0 + TTL
    second = cleanup(dbs, tmp_path, clock)
    assert [m.lsn for m in second.marks] == [m1["lsn"]]
    assert second.tick(m1["lsn"]) == 6  # the mark from before the restart
    lines = [json.loads(x) for x in path.read_text().splitlines()]  # every line parses: torn line gone
    assert [x["time"] for x in lines] == [T0, T0 + TTL]

    assert sorted(r[0] for r in src.execute("SELECT aggregate_type FROM outbox")) == ["mid", "mid"]
    clock.now = T0 + 2 * TTL
    assert second.tick(lines[1]["lsn"]) == 2  # the second mark is used ...
    kept = [json.loads(x)["time"] for x in path.read_text().splitlines()]
    assert kept == [T0 + TTL, T0 + 2 * TTL]  # ... and the first, covering less, dropped
    assert not list(path.parent.glob("*.tmp"))
    second.close()


def test_corrupt_marks_file_is_an_error(dbs: Dbs, tmp_path: Path) -> None:
    path = tmp_path / "state" / "marks.jsonl"
    path.parent.mkdir()
    path.write_text('garbage\n{"time": 1.0, "horizon": 5, "lsn": 7}\n')
    with pytest.raises(DefiniteError, match="line 1 is corrupt"):
        cleanup(dbs, tmp_path, Clock()).tick(None)


def test_partitioned_outbox_deletes_only_old_rows(dbs: Dbs, tmp_path: Path) -> None:
    """Two partitions both hold a row at ctid (0,1): deleting by ctid alone would take the young one too."""
    with dbs.src() as conn:
        conn.execute("CREATE TABLE outbox (id bigserial, aggregate_type text NOT NULL, aggregate_id text NOT NULL, "
                     "event_type text NOT NULL, payload jsonb, PRIMARY KEY (aggregate_type, id)) "
                     "PARTITION BY LIST (aggregate_type)")
        conn.execute("CREATE TABLE outbox_old PARTITION OF outbox FOR VALUES IN ('old')")
        conn.execute("CREATE TABLE outbox_new PARTITION OF outbox FOR VALUES IN ('new')")
        check_outbox_table(conn, OutboxSpec(TABLE))
        insert(conn, 3, "old")
        clock, c = marked(dbs, tmp_path)
        insert(conn, 1, "new")
        assert conn.execute("SELECT ctid::text FROM outbox_new").fetchone()[0] == "(0,1)"  # type: ignore[index]
        clock.now = T0 + TTL
        assert c.tick(wal_now(conn)) == 3
        assert [r[0] for r in conn.execute("SELECT aggregate_type FROM outbox")] == ["new"]
        c.close()


def test_postgres_errors_are_typed(dbs: Dbs, src: psycopg.Connection[Any], tmp_path: Path) -> None:
    clock, c = marked(dbs, tmp_path)
    src.execute("DROP TABLE outbox")
    clock.now = T0 + TTL
    with pytest.raises(SourceNotReady, match="outbox"):
        c.tick(c.marks[0].lsn)
    c.close()
