"""BatchApplier against a real replica, fed the builder's output for a real pgoutput stream (no Spark).

The source workload mixes inserts, updates (one changing the key, one leaving a TOASTed value
unchanged), deletes and a TRUNCATE; the builder's rows are applied in small chunks, as the Spark
sink hands them over.
"""
from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from changefeed.core import change as ch
from changefeed.errors import IncompleteBatch
from changefeed.postgres import source as src
from changefeed.postgres.decode.builder import HEARTBEAT_PREFIX, ChangeBuilder
from changefeed.sinks.replica import apply as replica
from changefeed.sinks.replica import insert_run, ledger, merge
from support.servers import Dbs, fingerprint

pytestmark = pytest.mark.timeout(300)

BIG = secrets.token_hex(60_000)  # ~120 KB, not compressible: stored out of line (TOAST)


Workload = Callable[[psycopg.Connection[Any]], None]


def _stream(dbs: Dbs, rows_per_batch: int = 500,
            workload: Workload | None = None) -> tuple[list[Any], list[src.SourceTable]]:
    """Run the workload (by default the one below) on the source; return the builder's record
    batches for all of it."""
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY, v text, big text)")
        c.execute("CREATE TABLE gone (id int PRIMARY KEY)")
        c.execute("CREATE PUBLICATION p FOR TABLE t, gone")
        c.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
        (workload or _workload)(c)
        end, _ = src.heartbeat(c, HEARTBEAT_PREFIX)  # flushed: decoding sees everything before it
        tables = src.describe_tables(c, ["public.t", "public.gone"])
        with psycopg.connect(dbs.source) as r:
            builder = ChangeBuilder(0, end, 0, 1 << 62, lambda rel: src.column_catalog(r, rel))
            # Small fetches, so that blocks end inside transactions (as big fetches do in big ones).
            batches = list(builder.batches(src.peek(r, "s", "p", end, fetch=777), rows_per_batch=rows_per_batch))
        c.execute("SELECT pg_drop_replication_slot('s')")
    return batches, tables


def _workload(c: psycopg.Connection[Any]) -> None:
    """Inserts, updates (an unchanged TOAST value, a key change), deletes, a TRUNCATE."""
    for k in range(30):  # 30 transactions: the builder cuts chunks only between transactions
        c.execute("INSERT INTO t SELECT g, 'v' || g, NULL FROM generate_series(%s::int, %s::int) g",
                  (k * 100 + 1, k * 100 + 100))
    c.execute("INSERT INTO gone SELECT generate_series(1, 50)")
    c.execute("UPDATE t SET big = %s WHERE id = 7", (BIG,))
    c.execute("UPDATE t SET v = 'touched' WHERE id = 7")  # big unchanged: TOAST marker
    c.execute("UPDATE t SET id = 100000 WHERE id = 8")  # key change
    c.execute("DELETE FROM t WHERE id % 10 = 0")
    c.execute("TRUNCATE gone")
    c.execute("INSERT INTO gone VALUES (1), (2)")
    with c.transaction():
        c.execute("UPDATE t SET v = 'twice' WHERE id < 100")
        c.execute("UPDATE t SET v = 'again' WHERE id < 50")


def _prepare_sink(dbs: Dbs, tables: list[src.SourceTable]) -> None:
    with dbs.dst() as d:
        ledger.ensure_meta(d)
        merge.ensure_tables(d, tables)


def _assert_replica_equals_source(dbs: Dbs) -> None:
    for table in ("t", "gone"):
        assert fingerprint(dbs.sink, table) == fingerprint(dbs.source, table), table


def _applied(dbs: Dbs, batches: list[Any], batch_id: int) -> tuple[replica.Applied, int]:
    """(what the batch did, how many rows it COPYed straight into their target)."""
    with psycopg.connect(dbs.sink, autocommit=True) as conn:
        applier = replica.BatchApplier(conn, dbs.name, batch_id)
        applier.begin()
        for rb in batches:
            applier.add(rb)
        return applier.commit(), applier.inserted_directly


def _inserts(batches: list[Any]) -> int:
    return sum(rb.column("op").to_pylist().count("c") for rb in batches)


@pytest.mark.parametrize("statement", ["MERGE", "upsert"])
@pytest.mark.parametrize("run_rows, chunk_rows", [(100_000, 500), (40, 500), (40, 100_000)])
def test_chunked_apply_equals_source_and_a_replay_changes_nothing(dbs: Dbs, run_rows: int, chunk_rows: int,
                                                                   statement: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Also with short insert runs COPYed straight into the targets, before updates, a key change,
    an unchanged TOAST value, deletes and a TRUNCATE in the same batch; with one big chunk, these
    share the insert runs' chunk, so the runs and the merges between them must keep stream order.
    Merged by PostgreSQL's MERGE, and as on a replica older than PostgreSQL 15 (a DELETE and an
    upsert)."""
    monkeypatch.setattr(replica, "INSERT_RUN_ROWS", run_rows)
    if statement == "upsert":
        monkeypatch.setattr(merge, "MERGE_VERSION", 10**9)
    batches, tables = _stream(dbs, chunk_rows)
    assert len(batches) > 5 if chunk_rows == 500 else len(batches) == 1
    _prepare_sink(dbs, tables)
    first, direct = _applied(dbs, batches, 0)
    assert (direct > _inserts(batches) // 2) if run_rows == 40 else direct == 0
    assert first.applied and first.changes == sum(
        1 for rb in batches for op in rb.column("op").to_pylist() if op in ch.DATA_OPS)
    _assert_replica_equals_source(dbs)
    with dbs.dst() as d:
        assert d.execute("SELECT big = %s FROM t WHERE id = 7", (BIG,)).fetchone() == (True,)
        before = d.execute("SELECT xmin::text::bigint FROM t ORDER BY id").fetchall()
    again, direct = _applied(dbs, batches, 1)
    assert not again.applied and again.end_lsn == first.end_lsn and direct == 0
    with dbs.dst() as d:
        assert d.execute("SELECT xmin::text::bigint FROM t ORDER BY id").fetchall() == before  # no row rewritten
        assert d.execute("SELECT batch_id FROM changefeed.progress WHERE feed = %s", (dbs.name,)).fetchall() == [(0,)]


def test_batch_without_progress_row_commits_nothing(dbs: Dbs) -> None:
    batches, tables = _stream(dbs)
    _prepare_sink(dbs, tables)
    *data, last = batches
    without_p = last.filter(pa.compute.not_equal(last.column("op"), ch.PROGRESS))
    with psycopg.connect(dbs.sink, autocommit=True) as conn:
        applier = replica.BatchApplier(conn, dbs.name, 0)
        applier.begin()
        for rb in [*data, without_p]:
            applier.add(rb)
        with pytest.raises(IncompleteBatch, match="no progress row"):
            applier.commit()


def test_batch_missing_a_partition_commits_nothing(dbs: Dbs) -> None:
    """The window's P row says the batch has two partitions (say a snapshot chunk too), and the
    input ends without the other one's: the applier rolls back what it applied."""
    batches, tables = _stream(dbs)
    _prepare_sink(dbs, tables)
    *data, last = batches
    ops = last.column("op").to_pylist()
    meta = last.column("meta").to_pylist()
    at = ops.index(ch.PROGRESS)
    meta[at] = dataclasses.replace(ch.Progress.from_meta(meta[at]), parts=2).to_meta()
    last = last.set_column(last.schema.get_field_index("meta"), "meta", pa.array(meta, pa.string()))
    with psycopg.connect(dbs.sink, autocommit=True) as conn:
        applier = replica.BatchApplier(conn, dbs.name, 0)
        applier.begin()
        for rb in [*data, last]:
            applier.add(rb)
        with pytest.raises(IncompleteBatch, match=r"partitions \[0\] of its 2"):
            applier.commit()
    with dbs.dst() as d:
        assert d.execute("SELECT count(*) FROM t").fetchone() == (0,)
        assert d.execute("SELECT count(*) FROM changefeed.progress WHERE feed = %s", (dbs.name,)).fetchone() == (0,)
    with dbs.dst() as d:
        assert d.execute("SELECT count(*) FROM t").fetchone() == (0,)
        assert d.execute("SELECT count(*) FROM changefeed.progress").fetchone() == (0,)


@pytest.mark.parametrize("held", [1, 2500])
def test_insert_run_that_meets_a_row_of_the_replica_falls_back_to_the_merge(
        dbs: Dbs, held: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica row in the way of an insert run (here one the replica held before) is upserted,
    as the merge does, and nothing of the failed COPY stays: each key once, the source's values.
    Held 2500: the run has taken several chunks when its COPY fails, and all of them are merged."""
    monkeypatch.setattr(replica, "INSERT_RUN_ROWS", 40)
    batches, tables = _stream(dbs)
    _prepare_sink(dbs, tables)
    with dbs.dst() as d:
        d.execute("INSERT INTO t VALUES (%s, 'held by the replica', NULL)", (held,))
    _, direct = _applied(dbs, batches, 0)
    assert 0 < direct < _inserts(batches)  # `gone` still went straight in; `t` did not after the conflict
    _assert_replica_equals_source(dbs)


def test_insert_runs_per_batch_are_capped(dbs: Dbs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past INSERT_RUNS_PER_BATCH savepoints, runs are merged: same replica, fewer direct rows."""
    monkeypatch.setattr(replica, "INSERT_RUN_ROWS", 40)
    monkeypatch.setattr(insert_run, "INSERT_RUNS_PER_BATCH", 1)
    batches, tables = _stream(dbs)
    _prepare_sink(dbs, tables)
    _, direct = _applied(dbs, batches, 0)
    # one run: the first inserts of one table, across the chunks they come in, up to a row of
    # another kind (a P row between chunks does not end it)
    rows = [(r["op"], r["table"]) for rb in batches for r in rb.to_pylist() if r["op"] != ch.PROGRESS]
    first = next(i for i, (op, _) in enumerate(rows) if op == "c")
    run = next(i for i in range(first, len(rows)) if rows[i] != ("c", rows[first][1])) - first
    assert run >= 1000 and direct == run
    _assert_replica_equals_source(dbs)


def test_a_tables_first_change_after_an_open_insert_run_of_another_is_applied(
        dbs: Dbs, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's first change to `gone` comes in the same segment as an insert run of `t` open
    before it (its R row earlier, its earlier changes left out: a window judged against a snapshot
    read, core.judge): the run is ended before `gone`'s staging table is made, on the one
    connection (it waited on itself before), and both tables get their rows."""
    monkeypatch.setattr(replica, "INSERT_RUN_ROWS", 40)

    def workload(c: psycopg.Connection[Any]) -> None:
        with c.transaction():
            c.execute("INSERT INTO gone VALUES (0)")  # (left out below: `gone`'s R row stays)
            c.execute("INSERT INTO t VALUES (0, 'v0', NULL)")
        with c.transaction():
            c.execute("INSERT INTO t SELECT g, 'v' || g, NULL FROM generate_series(1, 100) g")
            c.execute("INSERT INTO gone VALUES (1)")

    batches, tables = _stream(dbs, 100_000, workload)
    assert len(batches) == 1
    rows = batches[0]
    first_gone = next(i for i, r in enumerate(rows.to_pylist()) if r["op"] == "c" and r["table"] == "gone")
    kept = pa.array([i != first_gone for i in range(rows.num_rows)])
    _prepare_sink(dbs, tables)
    applied, direct = _applied(dbs, [rows.filter(kept)], 0)
    assert applied.applied and direct == 101
    assert fingerprint(dbs.sink, "t") == fingerprint(dbs.source, "t")
    with dbs.dst() as d:
        assert d.execute("SELECT array_agg(id) FROM gone").fetchone() == ([1],)


@pytest.mark.parametrize("default, applied", [("off", "local"), ("remote_write", "remote_write"), ("on", "on")])
def test_a_batch_commits_durably_whatever_the_replicas_default(dbs: Dbs, default: str, applied: str) -> None:
    """Spark logs a batch as done, and the slot moves past it, once its transaction committed: an
    asynchronous commit lost in a replica crash would never be replayed (seen in
    tests/e2e/test_outages.py before the applier raised it). Stronger settings stay as they are."""
    with dbs.dst() as d:
        ledger.ensure_meta(d)
        d.execute(f"ALTER DATABASE {dbs.name} SET synchronous_commit = {default}")
    with psycopg.connect(dbs.sink, autocommit=True) as conn:
        assert conn.execute("SHOW synchronous_commit").fetchone() == (default,)
        applier = replica.BatchApplier(conn, dbs.name, 0)
        applier.begin()
        assert conn.execute("SHOW synchronous_commit").fetchone() == (applied,)
        applier.rollback()
        assert conn.execute("SHOW synchronous_commit").fetchone() == (default,)  # for this transaction only


@pytest.mark.parametrize("held", [0, 3])
def test_snapshot_chunks_go_straight_into_the_target_unless_a_key_is_there(
        dbs: Dbs, held: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk's `r` rows are COPYed straight into a table that lacks their keys; where the replica
    holds some already (stale here), the chunk is merged: its rows win, each key once."""
    from changefeed.postgres import snapshot as snap_pg

    monkeypatch.setattr(replica, "INSERT_RUN_ROWS", 40)
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY, v text, big text)")
        c.execute("INSERT INTO t SELECT g, 'v' || g, NULL FROM generate_series(1, 300) g")
        tables = src.describe_tables(c, ["public.t"])
    _prepare_sink(dbs, tables)
    with dbs.dst() as d:
        d.execute("INSERT INTO t SELECT g, 'stale', NULL FROM generate_series(1, %s) g", (held,))
    with psycopg.connect(dbs.source, autocommit=True) as conn:
        found = snap_pg.ChunkRead()
        rows = list(snap_pg.read_chunk(conn, "public.t", None, None, 0, 1, found, rows_per_batch=100))
    done = ch.Progress(1, 1, None, found.rows, {"no": 0, "table": "public.t", "rows": found.rows, "read_lsn": 1})
    _, direct = _applied(dbs, [*rows, ch.progress_batch(done)], 0)
    assert direct == (300 if held == 0 else 0)
    assert fingerprint(dbs.sink, "t") == fingerprint(dbs.source, "t")


def test_the_replica_tables_key_is_read_in_its_order(dbs: Dbs) -> None:
    """A primary key's first column counts too (an int2vector's subscripts start at 0), and a key
    keeps its columns' order, not the table's."""
    from changefeed.sinks.replica import shape

    with dbs.dst() as d:
        d.execute("CREATE TABLE one (id bigint PRIMARY KEY, v text)")
        d.execute("CREATE TABLE two (a int, b int, v text, PRIMARY KEY (b, a))")
        d.execute("CREATE TABLE none_ (a int, v text)")
        assert shape.read(d, "public", "one").key == ("id",)  # type: ignore[union-attr]
        assert shape.read(d, "public", "two").key == ("b", "a")  # type: ignore[union-attr]
        assert shape.read(d, "public", "none_").key == ()  # type: ignore[union-attr]


def test_a_batch_leaves_the_replicas_primary_key_alone(dbs: Dbs) -> None:
    """The key the stream says a table has is the replica's already: no batch drops and rebuilds
    its index (each batch did, over the whole table, under an exclusive lock), and a foreign key on
    the replica that depends on it does not stop the feed."""
    batches, tables = _stream(dbs)
    _prepare_sink(dbs, tables)
    with dbs.dst() as d:
        d.execute("CREATE TABLE child (id int PRIMARY KEY, t_id int REFERENCES t (id))")
        index = d.execute("SELECT indexrelid FROM pg_index WHERE indrelid = 't'::regclass AND indisprimary").fetchone()
    first, _ = _applied(dbs, batches, 0)
    assert first.applied
    _assert_replica_equals_source(dbs)
    with dbs.dst() as d:
        assert d.execute("SELECT indexrelid FROM pg_index WHERE indrelid = 't'::regclass AND indisprimary"
                         ).fetchone() == index
