"""End to end: a mixed workload over many column types reaches the replica exactly as in the source."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from changefeed.control.runner import run
from changefeed.spec.definition import FeedSpec
from changefeed.spec.state import FeedState
from support.servers import Dbs, fingerprint

SCHEMA = """
CREATE TABLE kinds (id int PRIMARY KEY, i int, b bigint, n numeric(30,8), t text, flag bool, ts timestamptz,
                    d date, j jsonb, raw bytea, u uuid, ints int[], texts text[], big text);
CREATE TABLE regions (region text, id int, v text, PRIMARY KEY (region, id));
CREATE TABLE audit (id bigint PRIMARY KEY, note text, payload text);
ALTER TABLE audit REPLICA IDENTITY FULL;
CREATE TABLE ledger (id bigserial PRIMARY KEY, v text);
"""
TABLES = ("public.kinds", "public.regions", "public.audit", "public.ledger")
BIG = "(SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 3200))"  # ~100 KB, not compressible


def workload(c: psycopg.Connection) -> None:
    c.execute("""
        INSERT INTO kinds SELECT g, g, g * 10000000000, g / 7.0, 'row ' || g, g % 2 = 0, now(), current_date,
            jsonb_build_object('g', g, 'nested', jsonb_build_array(1, 'two', null)), decode(md5(g::text), 'hex'),
            gen_random_uuid(), ARRAY[g, g + 1], ARRAY['a' || g, NULL, 'tab' || chr(9) || 'x'], NULL
        FROM generate_series(1, 300) g""")
    c.execute("INSERT INTO kinds (id, t, texts) VALUES (1000, E'back\\\\slash\\nnew line\\ttab \\u00e9\\u4e2d', "
              "ARRAY[E'q\"uote', '{brace}', ''])")
    c.execute("INSERT INTO kinds (id) VALUES (1001)")  # all NULLs
    c.execute(f"INSERT INTO kinds (id, t, big) VALUES (2000, 'toast', {BIG}), (2001, 'toast2', {BIG})")
    c.execute("UPDATE kinds SET t = 'toast, other column changed' WHERE id = 2000")  # big stays TOASTed
    c.execute("UPDATE kinds SET id = 2003, t = 'key moved' WHERE id = 2001")  # key change, big unchanged
    c.execute("UPDATE kinds SET n = n * 2, flag = NOT flag WHERE id % 5 = 0")
    c.execute("DELETE FROM kinds WHERE id % 7 = 0")
    c.execute("INSERT INTO regions SELECT 'r' || (g % 3), g, 'v' || g FROM generate_series(1, 60) g")
    c.execute("UPDATE regions SET region = 'moved' WHERE id < 5")  # composite key changes
    c.execute("DELETE FROM regions WHERE id BETWEEN 10 AND 14")
    c.execute(f"INSERT INTO audit SELECT g, 'note ' || g, CASE WHEN g = 1 THEN {BIG} END FROM generate_series(1, 50) g")
    c.execute("UPDATE audit SET note = 'full identity update' WHERE id <= 10")
    c.execute("DELETE FROM audit WHERE id > 40")
    c.execute("INSERT INTO ledger (v) SELECT 'before truncate ' || g FROM generate_series(1, 100) g")
    c.execute("TRUNCATE ledger")
    c.execute("INSERT INTO ledger (v) SELECT 'after truncate ' || g FROM generate_series(1, 100) g")
    with c.transaction():  # a transaction spanning all tables
        c.execute("UPDATE kinds SET i = -1 WHERE id = 1")
        c.execute("INSERT INTO regions VALUES ('tx', 1, 'in tx')")
        c.execute("DELETE FROM audit WHERE id = 1")
        c.execute("INSERT INTO ledger (v) VALUES ('in tx')")
    c.execute("ALTER TABLE kinds ADD COLUMN added int DEFAULT 42, ADD COLUMN added_null text")
    c.execute("UPDATE kinds SET added = 7, added_null = 'set' WHERE id BETWEEN 1 AND 20")
    c.execute("INSERT INTO kinds (id, t, added) VALUES (3000, 'after alter', 1)")
    c.execute("UPDATE kinds SET t = 'toast updated after alter' WHERE id = 2000")


def feed_once(dbs: Dbs, tmp_path: Path, **limits: Any) -> None:
    spec = FeedSpec(dbs.name, dbs.source, dbs.sink, TABLES, **limits).validate()  # type: ignore[arg-type]
    run(spec, FeedState(tmp_path / "state", dbs.name), available_now=True, master="local[2]",
        handle_signals=False, report=lambda s: None)


def assert_replica_equal(dbs: Dbs) -> None:
    for table in TABLES:
        assert fingerprint(dbs.source, table) == fingerprint(dbs.sink, table), table


@pytest.mark.parametrize("limits", [{}, {"max_changes_per_batch": 20, "max_bytes_per_batch": 0},
                                    {"wal_reader": "stream", "max_bytes_per_batch": 65536}],
                         ids=["one-batch", "many-small-batches", "streamed-byte-batches"])
def test_mixed_workload_reaches_replica(dbs: Dbs, tmp_path: Path, spark: object, limits: dict[str, Any]) -> None:
    with dbs.src() as c:
        c.execute(SCHEMA)
    feed_once(dbs, tmp_path, **limits)  # creates slot, publication and (empty) target tables
    with dbs.dst() as d:
        assert d.execute("SELECT count(*) FROM kinds").fetchone() == (0,)
    with dbs.src() as c:
        workload(c)
    feed_once(dbs, tmp_path, **limits)
    assert_replica_equal(dbs)
    with dbs.dst() as d:
        big = d.execute("SELECT id, length(big), t FROM kinds WHERE id IN (2000, 2003) ORDER BY id").fetchall()
        assert big == [(2000, 102400, "toast updated after alter"), (2003, 102400, "key moved")]
        assert d.execute("SELECT count(*) FROM kinds WHERE added = 42").fetchone()[0] > 200  # type: ignore[index]
        batches = d.execute("SELECT batch_id, end_lsn, resolved_ts FROM changefeed.progress WHERE feed = %s "
                            "ORDER BY batch_id", (dbs.name,)).fetchall()
    assert [b[1] for b in batches] == sorted(b[1] for b in batches)
    assert [b[2] for b in batches] == sorted(b[2] for b in batches)
    if limits:
        assert len(batches) > 10  # the read limit really cut the work into many batches


def test_toast_value_kept_when_update_lands_in_a_later_batch(dbs: Dbs, tmp_path: Path, spark: object) -> None:
    with dbs.src() as c:
        c.execute(SCHEMA)
    feed_once(dbs, tmp_path)
    with dbs.src() as c:
        c.execute(f"INSERT INTO kinds (id, t, big) VALUES (1, 'a', {BIG})")
    feed_once(dbs, tmp_path)
    with dbs.src() as c:
        c.execute("UPDATE kinds SET t = 'b' WHERE id = 1")
        c.execute("UPDATE kinds SET id = 2 WHERE id = 1")
        c.execute("UPDATE kinds SET t = 'c' WHERE id = 2")
    feed_once(dbs, tmp_path)
    assert_replica_equal(dbs)
    with dbs.dst() as d:
        assert d.execute("SELECT id, t, length(big) FROM kinds").fetchall() == [(2, "c", 102400)]


def test_rerun_with_nothing_new_changes_nothing(dbs: Dbs, tmp_path: Path, spark: object) -> None:
    with dbs.src() as c:
        c.execute(SCHEMA)
        feed_once(dbs, tmp_path)
        c.execute("INSERT INTO ledger (v) SELECT 'x' || g FROM generate_series(1, 10) g")
    feed_once(dbs, tmp_path)
    with dbs.dst() as d:
        before = d.execute("SELECT count(*), max(end_lsn) FROM changefeed.progress").fetchone()
    feed_once(dbs, tmp_path)
    assert_replica_equal(dbs)
    with dbs.dst() as d:
        after = d.execute("SELECT count(*), max(end_lsn) FROM changefeed.progress").fetchone()
    assert after[1] >= before[1]  # type: ignore[index]
    with dbs.src() as c:  # the slot was advanced to what the sink committed
        confirmed = c.execute("SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s",
                              (f"changefeed_{dbs.name}",)).fetchone()[0]  # type: ignore[index]
    assert confirmed == after[1]  # type: ignore[index]
