"""Initial snapshot: tables that already hold rows arrive whole, chunk by chunk, with their changes."""
from __future__ import annotations

import json
import random
import signal
import threading
import time
from pathlib import Path

import psycopg
import pytest
from test_replica import SCHEMA, TABLES, workload

from changefeed.control.runner import run
from changefeed.core.snapshot import MAX_AUTO_CHUNKS, auto_chunks
from changefeed.postgres import snapshot as snap_pg
from changefeed.sinks.replica import ReplicaSink
from changefeed.spec.definition import FeedSpec
from changefeed.spec.state import FeedState
from support.feeds import changefeed_cli, killed_by_fault, start_changefeed, wait_for
from support.servers import Dbs, fingerprint
from support.writers import writing

pytestmark = pytest.mark.timeout(900)
ROWS, CHUNK, ACCOUNTS = 40_000, 1_500, 40


def feed_once(dbs: Dbs, tmp_path: Path, **options: object) -> None:
    spec = FeedSpec(dbs.name, dbs.source, dbs.sink, TABLES, **options).validate()  # type: ignore[arg-type]
    run(spec, FeedState(tmp_path / "state", dbs.name), available_now=True, master="local[2]",
        handle_signals=False, report=lambda s: None)


def test_existing_rows_of_every_type_arrive_by_snapshot(dbs: Dbs, tmp_path: Path, spark: object) -> None:
    with dbs.src() as c:
        c.execute(SCHEMA)
        workload(c)  # every column type, TOASTed values, composite keys: all before the feed exists
    feed_once(dbs, tmp_path, snapshot_chunk_rows=37, snapshot_chunks_per_batch=6)
    for table in TABLES:
        assert fingerprint(dbs.source, table) == fingerprint(dbs.sink, table), table
    with dbs.dst() as d:
        chunks = d.execute("SELECT table_name, count(*), sum(rows) FROM changefeed.snapshot_chunks "
                           "WHERE feed = %s GROUP BY 1 ORDER BY 1", (dbs.name,)).fetchall()
        per_batch = d.execute("SELECT max(n) FROM (SELECT count(*) n FROM changefeed.snapshot_chunks "
                              "WHERE feed = %s GROUP BY batch_id) b", (dbs.name,)).fetchone()
    with dbs.src() as c:
        counts = {t: c.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}  # type: ignore[index]
    assert {t: int(r) for t, _, r in chunks} == counts
    assert per_batch == (6,)  # --snapshot-chunks-per-batch
    assert {t: n for t, n, _ in chunks} == {t: max(1, -(-n // 37)) for t, n in counts.items()}  # no empty tail



def test_by_default_a_batch_read_in_one_task_carries_what_max_bytes_per_batch_holds(dbs: Dbs, tmp_path: Path,
                                                                                      spark: object) -> None:
    """--snapshot-chunks-per-batch auto, chunks read by the writer's task (local[2]: sequential):
    a batch carries as many chunks as the replica's budget (a few times --max-bytes-per-batch)
    holds at the table's bytes per row."""
    with dbs.src() as c:
        c.execute("CREATE TABLE items (id bigint PRIMARY KEY, v text, n int)")
        c.execute("INSERT INTO items SELECT g, md5(g::text), 0 FROM generate_series(1, 20000) g")
        c.execute("ANALYZE items")
        per_row = snap_pg.row_bytes(c, "public.items")
    budget = 64 << 10
    expected = auto_chunks(False, budget, 500, per_row, ReplicaSink.snapshot_budget)
    assert ReplicaSink.snapshot_budget > 1 and expected > auto_chunks(False, budget, 500, per_row)
    assert 1 < expected < MAX_AUTO_CHUNKS, (per_row, expected)  # (the table's size sets it)
    spec = FeedSpec(dbs.name, dbs.source, dbs.sink, ("public.items",), snapshot_chunk_rows=500,
                    max_bytes_per_batch=budget, snapshot="only").validate()
    run(spec, FeedState(tmp_path / "state", dbs.name), available_now=True, master="local[2]",
        handle_signals=False, report=lambda s: None)
    assert fingerprint(dbs.source, "public.items") == fingerprint(dbs.sink, "public.items")
    with dbs.dst() as d:
        per_batch = [n for n, in d.execute("SELECT count(*) FROM changefeed.snapshot_chunks WHERE feed = %s "
                                           "GROUP BY batch_id ORDER BY min(chunk_no)", (dbs.name,))]
    assert sum(per_batch) == 40 and set(per_batch[:-1]) == {expected}, per_batch


def writer(uri: str, stop: threading.Event, counts: list[int]) -> None:
    """Inserts, updates and deletes all over the key range, and transfers that keep a sum fixed."""
    rng = random.Random(7)
    with psycopg.connect(uri, autocommit=True) as c:
        while not stop.is_set():
            with c.transaction():
                k = rng.randrange(1, 2 * ROWS)
                c.execute("INSERT INTO items VALUES (%s, 'new', 0) ON CONFLICT (id) DO UPDATE SET n = items.n + 1",
                          (k,))
                c.execute("DELETE FROM items WHERE id = %s", (rng.randrange(1, 2 * ROWS),))
                a, b = rng.randrange(ACCOUNTS), rng.randrange(ACCOUNTS)
                c.execute("UPDATE accounts SET balance = balance - 5 WHERE id = %s", (a,))
                c.execute("UPDATE accounts SET balance = balance + 5 WHERE id = %s", (b,))
            counts[0] += 1
            time.sleep(0.003)


def planned_chunks(state: Path, feed: str) -> list[list[object]]:
    """Every chunk in Spark's offset log: one entry per batch that planned it (replays reuse theirs)."""
    out = []
    offsets = (state / feed / "checkpoint" / "offsets").iterdir()
    for f in sorted((p for p in offsets if p.name.isdigit()), key=lambda p: int(p.name)):
        out += json.loads(f.read_text().splitlines()[-1]).get("chunks", [])
    return out


def applied_chunks(dbs: Dbs) -> list[tuple[int, str, int]]:
    with dbs.dst() as d:
        if not d.execute("SELECT to_regclass('changefeed.snapshot_chunks')").fetchone()[0]:  # type: ignore[index]
            return []
        return [tuple(r) for r in d.execute(  # type: ignore[misc]
            "SELECT chunk_no, table_name, rows FROM changefeed.snapshot_chunks WHERE feed = %s ORDER BY 1",
            (dbs.name,))]


@pytest.mark.parametrize("reads", ["parallel", "sequential"])
def test_snapshot_under_writes_survives_sigkill_and_resumes(dbs: Dbs, tmp_path: Path, reads: str,
                                                           spark_server: str) -> None:
    """Killed twice while a batch's chunks are read; then each chunk applied once, none lost. Chunks
    read in parallel tasks (shuffled to the writer), or one after the other by the writer's task."""
    with dbs.src() as c:
        c.execute("CREATE TABLE items (id bigint PRIMARY KEY, v text, n int)")
        c.execute("INSERT INTO items SELECT g * 2, md5(g::text), 0 FROM generate_series(1, %s) g", (ROWS,))
        c.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        c.execute("INSERT INTO accounts SELECT g, 1000 FROM generate_series(0, %s) g", (ACCOUNTS - 1,))
        c.execute("ANALYZE items")
    state = tmp_path / "state"
    base = ["run", "--name", dbs.name, "--state", str(state)]
    first = [*base, "--source", dbs.source, "--sink", dbs.sink, "--tables", "public.accounts,public.items",
             "--snapshot-chunk-rows", str(CHUNK), "--snapshot-chunks-per-batch", "4", "--snapshot-reads", reads]
    stop, counts = threading.Event(), [0]
    w = threading.Thread(target=writer, args=(dbs.source, stop, counts))
    w.start()
    progress = []
    try:
        for i, nth in enumerate((6, 7)):  # mid-batch: chunks read, their batch not yet applied
            fault_dir = tmp_path / f"faults{i}"
            fault_dir.mkdir()
            log = tmp_path / f"run{i}.log"
            p = start_changefeed(*(first if i == 0 else base), log=log,
                                 env={"CHANGEFEED_KILL_AT": f"snapshot_chunk:{nth}",
                                      "CHANGEFEED_FAULT_DIR": str(fault_dir)})
            killed_by_fault(p, log)
            progress.append(len(applied_chunks(dbs)))
            time.sleep(0.5)
    finally:
        stop.set()
        w.join()
    assert counts[0] > 100  # the writer really ran during the snapshot
    assert 0 < progress[0] < progress[1], progress  # each killed run finished some chunks, and kept them

    final = changefeed_cli(*base, "--available-now", "--master", spark_server)
    assert final.returncode == 0, final.stderr[-3000:]
    for table in ("public.items", "public.accounts"):
        assert fingerprint(dbs.source, table) == fingerprint(dbs.sink, table), table
    with dbs.dst() as d:
        assert d.execute("SELECT sum(balance) FROM accounts").fetchone()[0] == 1000 * ACCOUNTS  # type: ignore[index]
        readers = d.execute("SELECT count(*), count(DISTINCT read_task) FROM changefeed.snapshot_chunks "
                            "WHERE feed = %s GROUP BY batch_id", (dbs.name,)).fetchall()
    assert max(n for n, _ in readers) > 1, readers
    if reads == "parallel":
        assert all(n == tasks for n, tasks in readers), \
            f"chunks of a batch were not read by a Spark task each: (chunks, tasks) per batch {readers}"
    else:
        assert all(tasks == 1 for _, tasks in readers), f"chunks of a batch read by several tasks: {readers}"

    applied, planned = applied_chunks(dbs), planned_chunks(state, dbs.name)
    nos = [c[0] for c in planned]
    assert len(nos) == len(set(nos)), "a chunk was planned twice: the snapshot restarted"
    assert [c[0] for c in applied] == sorted(nos) == list(range(len(nos)))  # each applied once, none lost
    items = [c for c in planned if c[1] == "public.items"]
    assert len(items) <= 2 * ROWS // CHUNK // 2 + 3  # about the table's size in chunks, not twice it
    for before, after in zip(items, items[1:]):  # contiguous key ranges from start to end
        assert before[3] == after[2]
    # up to the last key when the read began (the writer's inserts fall below it; it deletes few)
    assert items[0][2] is None and 2 * ROWS - 1000 <= int(items[-1][3][0]) <= 2 * ROWS  # type: ignore[index]


def _appending(uri: str, stop: threading.Event, written: list[int]) -> None:
    """Appends 500 rows a transaction, several thousand rows a second: more a batch than a chunk
    of APPEND_CHUNK rows reads."""
    with psycopg.connect(uri, autocommit=True) as c:
        while not stop.is_set():
            c.execute("INSERT INTO appended (v) SELECT md5(g::text) FROM generate_series(1, 500) g")
            written[0] += 500
            time.sleep(0.05)


APPEND_ROWS, APPEND_CHUNK = 20_000, 1_000


def test_a_table_appended_to_faster_than_it_is_read_ends_its_snapshot(dbs: Dbs, tmp_path: Path) -> None:
    """The snapshot of a table whose writer appends more rows a batch than a batch's chunk reads
    ends at the last key the table had when its read began: the rows after it come by the stream
    (a read to the table's moving end would not finish while the writer runs)."""
    with dbs.src() as c:
        c.execute("CREATE TABLE appended (id bigserial PRIMARY KEY, v text)")
        c.execute("INSERT INTO appended (v) SELECT md5(g::text) FROM generate_series(1, %s) g", (APPEND_ROWS,))
    log, state = tmp_path / "run.log", tmp_path / "state"
    written = [0]
    runner = start_changefeed("run", "--name", dbs.name, "--state", str(state), "--source", dbs.source,
                              "--sink", dbs.sink, "--tables", "public.appended", "--snapshot-chunk-rows",
                              str(APPEND_CHUNK), "--snapshot-chunks-per-batch", "1", log=log)
    try:
        with writing(_appending, dbs.source, written):
            wait_for("the snapshot to end under the writer", lambda: "snapshot public.appended: done"
                     in log.read_text(), log, timeout=300)
            with dbs.src() as c:
                last_then = c.execute("SELECT max(id) FROM appended").fetchone()[0]  # type: ignore[index]
        wait_for_equal(dbs, "public.appended", log)
    finally:
        runner.send_signal(signal.SIGTERM)
        runner.wait(timeout=120)
    chunks = [c for c in planned_chunks(state, dbs.name) if c[1] == "public.appended"]
    ends = chunks[-1][3]
    assert ends is not None, "the read ran to the table's end"
    assert last_then > int(ends[0]) + APPEND_CHUNK, (last_then, ends)  # the writer was well past it
    assert len(chunks) == len({c[0] for c in chunks}) <= int(ends[0]) // APPEND_CHUNK + 1  # tiled up to it once
    with dbs.dst() as d:
        read = d.execute("SELECT sum(rows) FROM changefeed.snapshot_chunks WHERE feed = %s",
                         (dbs.name,)).fetchone()[0]  # type: ignore[index]
    assert APPEND_ROWS <= read <= int(ends[0]), (read, ends)



@pytest.mark.usefixtures("warm_spark")
def test_table_added_to_running_feed_arrives_with_existing_rows(dbs: Dbs, tmp_path: Path) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE first (id int PRIMARY KEY, v text)")
        c.execute("CREATE TABLE later (id int PRIMARY KEY, v text)")
        c.execute("INSERT INTO later SELECT g, 'old ' || g FROM generate_series(1, 5000) g")
    state = str(tmp_path / "state")
    log = tmp_path / "run.log"
    p = start_changefeed("run", "--name", dbs.name, "--state", state, "--source", dbs.source, "--sink", dbs.sink,
                         "--tables", "public.first", "--snapshot-chunk-rows", "700", log=log)
    try:
        with dbs.src() as c:
            c.execute("INSERT INTO first VALUES (1, 'a')")
        wait_for_equal(dbs, "public.first", log)
        altered = changefeed_cli("alter", "--name", dbs.name, "--state", state, "--add-tables", "public.later")
        assert altered.returncode == 0, altered.stderr
        with dbs.src() as c:
            c.execute("UPDATE later SET v = 'changed' WHERE id % 10 = 0")
            c.execute("DELETE FROM later WHERE id % 7 = 0")
            c.execute("INSERT INTO later SELECT g, 'new ' || g FROM generate_series(5001, 5100) g")
        wait_for_equal(dbs, "public.later", log)
        first_round = [c for c in applied_chunks(dbs) if c[1] == "public.later"]
        # 3857 old rows were never touched after the feed started: only the snapshot can bring them
        assert sum(c[2] for c in first_round) >= 3857
        again = changefeed_cli("snapshot", "--name", dbs.name, "--state", state, "--tables", "public.later")
        assert again.returncode == 0, again.stderr
        with dbs.src() as c:
            rows = c.execute("SELECT count(*) FROM later").fetchone()[0]  # type: ignore[index]
        wait_for("public.later read again, whole", lambda: sum(
            c[2] for c in applied_chunks(dbs) if c[1] == "public.later" and c not in first_round) >= rows, log, 120)
        wait_for_equal(dbs, "public.later", log)
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 0, log.read_text()[-3000:]
    assert "snapshot public.later" in log.read_text()  # progress was shown


def wait_for_equal(dbs: Dbs, table: str, log: Path, timeout: float = 180) -> None:
    wait_for(f"{table} to catch up", lambda: fingerprint(dbs.source, table) == _sink_fingerprint(dbs, table),
             log, timeout)


def _sink_fingerprint(dbs: Dbs, table: str) -> tuple[int, str] | None:
    try:
        return fingerprint(dbs.sink, table)
    except psycopg.errors.UndefinedTable:
        return None


def test_snapshot_modes_never_and_only(dbs: Dbs, tmp_path: Path, spark: object) -> None:
    with dbs.src() as c:
        c.execute(SCHEMA)
        workload(c)
    feed_once(dbs, tmp_path, snapshot="never")
    with dbs.dst() as d:
        assert d.execute("SELECT count(*) FROM kinds").fetchone() == (0,)  # existing rows not delivered
    with dbs.src() as c:
        c.execute("UPDATE regions SET v = 'streamed' WHERE id = 20")
    feed_once(dbs, tmp_path, snapshot="never")
    with dbs.dst() as d:
        assert d.execute("SELECT region, id, v FROM regions").fetchall() == [("r2", 20, "streamed")]


def test_snapshot_only_stops_once_the_rows_are_delivered(dbs: Dbs, tmp_path: Path, spark: object) -> None:
    with dbs.src() as c:
        c.execute(SCHEMA)
        workload(c)
    spec = FeedSpec(dbs.name, dbs.source, dbs.sink, TABLES, snapshot="only", snapshot_chunk_rows=100).validate()
    lines: list[str] = []
    run(spec, FeedState(tmp_path / "state", dbs.name), master="local[2]", handle_signals=False,
        report=lines.append, report_every_s=0.5)  # not --available-now: returns by itself
    assert any("snapshot complete" in line for line in lines), lines
    for table in TABLES:
        assert fingerprint(dbs.source, table) == fingerprint(dbs.sink, table), table
