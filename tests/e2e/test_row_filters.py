"""--where: a feed captures only the rows a predicate lets through, in its snapshot and its stream.
Rows inserted on both sides of the filter, updated across it both ways and deleted, under a
writer while the snapshot is read (the runner SIGKILLed in it): the replica ends equal to
`SELECT ... WHERE predicate` on the source, and `verify` (which filters the source's side the
same way) finds it equal. Predicates PostgreSQL would refuse are refused before anything is
created."""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from changefeed.local.kafka import LocalKafka, committed, read_partition
from support.feeds import changefeed_cli, kill_running, killed_by_fault, start_changefeed, wait_for
from support.servers import Dbs
from support.writers import writing

pytestmark = pytest.mark.timeout(600)
FILTER = "region = 'eu' AND qty >= 0"
ROWS = 30000
PACE = 300


def _orders(dbs: Dbs) -> None:
    with psycopg.connect(dbs.source, autocommit=True) as c:
        c.execute("CREATE TABLE orders (id bigint PRIMARY KEY, region text NOT NULL, qty int NOT NULL, note text)")
        c.execute("ALTER TABLE orders REPLICA IDENTITY FULL")  # (the filter reads region and qty)
        c.execute("INSERT INTO orders SELECT g, CASE WHEN g %% 3 = 0 THEN 'eu' ELSE 'us' END, g %% 11 - 2, 'old' "
                  "FROM generate_series(1, %s) g", (ROWS,))
        c.execute("CREATE TABLE plain (id bigint PRIMARY KEY, region text NOT NULL)")


def _moving(uri: str, stop: threading.Event, written: list[int]) -> None:
    """Inserts on both sides of the filter, updates across it both ways, deletes: at most about
    PACE transactions a second (a writer that outruns the feed on a loaded machine only grows the
    lag the test waits out)."""
    rng = random.Random(7)
    with psycopg.connect(uri, autocommit=True) as c:
        n = ROWS
        while not stop.is_set():
            n += 1
            with c.transaction():
                c.execute("INSERT INTO orders VALUES (%s, %s, %s, 'new')", (n, rng.choice(["eu", "us"]), n % 7))
                c.execute("UPDATE orders SET region = CASE region WHEN 'eu' THEN 'us' ELSE 'eu' END, note = 'moved' "
                          "WHERE id = %s", (rng.randint(1, n),))
                c.execute("UPDATE orders SET qty = -qty - 1 WHERE id = %s", (rng.randint(1, n),))
                c.execute("UPDATE orders SET note = 'touched' WHERE id = %s", (rng.randint(1, n),))
                if n % 5 == 0:
                    c.execute("DELETE FROM orders WHERE id = %s", (rng.randint(1, n),))
            written[:] = [n]
            time.sleep(1 / PACE)


def _rows(uri: str, where: str = "TRUE") -> list[tuple[object, ...]]:
    with psycopg.connect(uri) as c:
        return c.execute(f"SELECT id, region, qty, note FROM orders WHERE {where} ORDER BY id").fetchall()


def test_a_row_filter_keeps_the_replica_equal_to_the_filtered_source(dbs: Dbs, tmp_path: Path) -> None:
    _orders(dbs)
    state, log = tmp_path / "state", tmp_path / "run.log"
    run = ["run", "--name", dbs.name, "--state", str(state)]
    define = ["--source", dbs.source, "--sink", dbs.sink, "--tables", "public.orders",
              "--where", f"public.orders={FILTER}", "--snapshot-chunk-rows", "2000", "--snapshot-chunks-per-batch", "1"]
    killed = tmp_path / "killed.log"
    # SIGKILLed as it reads the filtered snapshot's 3rd chunk of about 5 (a kill on the first progress
    # line could come after the last chunk on a loaded machine: that line can be the "done" one)
    runner = start_changefeed(*run, *define, log=killed, env={
        "CHANGEFEED_KILL_AT": "snapshot_chunk:3", "CHANGEFEED_FAULT_DIR": str(tmp_path)})
    written = [0]
    try:
        with writing(_moving, dbs.source, written):
            killed_by_fault(runner, killed)
            runner = start_changefeed(*run, log=log)
            wait_for("the snapshot and changes", lambda: "snapshot public.orders: done" in log.read_text() and
                     written[0] > ROWS + 300, log, timeout=240)
        wait_for("the replica equal to the filtered source", lambda: _rows(dbs.sink) == _rows(dbs.source, FILTER),
                 log, timeout=120)
        verified = changefeed_cli("verify", "--name", dbs.name, "--state", str(state))
        assert verified.returncode == 0, verified.stdout + verified.stderr
    finally:
        kill_running([runner])
    got = _rows(dbs.sink)
    assert got and all(r[1] == "eu" and int(str(r[2])) >= 0 for r in got)
    assert any(r[3] == "moved" for r in got), "no row moved into the filter"


NEW_FILTER = "region = 'us'"


def test_a_filter_changed_on_a_running_feed_sends_the_rows_that_left_as_deletes(dbs: Dbs, tmp_path: Path,
                                                                               kafka: LocalKafka) -> None:
    """`alter --where` under the writer: the rows the new filter keeps out leave the replica and
    reach Kafka as deletes, the rows it lets in arrive by a snapshot; the runner is SIGKILLed
    right after it restarts on the new filter; both sinks end equal to the newly filtered source."""
    _orders(dbs)
    state, log = tmp_path / "state", tmp_path / "run.log"
    prefix = f"w{uuid.uuid4().hex[:8]}."
    feed = ["--name", dbs.name, "--state", str(state)]
    define = ["--source", dbs.source, "--sink", f"replica={dbs.sink}", "--sink",
              f"events=kafka://{kafka.bootstrap}?topic_prefix={prefix}&progress_topic={prefix}progress"
              "&topic_partitions=1", "--tables", "public.orders", "--where", f"public.orders={FILTER}",
              "--snapshot-chunk-rows", "5000"]
    runner = start_changefeed("run", *feed, *define, log=log)
    written = [0]
    try:
        with writing(_moving, dbs.source, written):
            wait_for("the first snapshot", lambda: "snapshot public.orders: done" in log.read_text(), log, timeout=240)
            altered = changefeed_cli("alter", *feed, "--where", f"public.orders={NEW_FILTER}")
            assert altered.returncode == 0, altered.stderr[-3000:]
            assert "reach the sinks as deletes" in altered.stdout and "Traceback" not in altered.stderr
            wait_for("the restart on the new filter", lambda: "its row filters changed" in log.read_text(), log)
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait(timeout=60)
            runner = start_changefeed("run", *feed, log=log)
            at = written[0]
            wait_for("changes after the restart", lambda: written[0] > at + 200, log, timeout=120)
        wait_for("the replica equal to the newly filtered source",
                 lambda: _rows(dbs.sink) == _rows(dbs.source, NEW_FILTER), log, timeout=180)
        for sink in ("replica", "events"):
            verified = changefeed_cli("verify", *feed, "--sink", sink)
            assert verified.returncode == 0, (sink, verified.stdout[-2000:], verified.stderr[-2000:])
    finally:
        kill_running([runner])
    ops: dict[str, set[int]] = {}
    for r in committed(read_partition(kafka.bootstrap, f"{prefix}public.orders", 0, timeout=60)):
        if r.key is not None and r.value is not None:
            ops.setdefault(json.loads(r.value)["op"], set()).add(json.loads(r.key)[0])
    old_eu = {g for g in range(1, ROWS + 1) if g % 3 == 0 and g % 11 - 2 >= 0}
    assert len(ops.get("d", set()) & old_eu) > len(old_eu) // 2, "the rows that left reached Kafka as deletes"
    assert {g for g in range(1, 2000) if g % 3} & ops.get("r", set()), "the rows let in came by a snapshot"


@pytest.mark.parametrize("where, words", [
    ("public.plain=region = 'eu'", "outside the table's replica identity (id)"),
    ("public.orders=regio = 'eu'", "PostgreSQL refuses"),
    ("public.orders=region = = 'eu'", "PostgreSQL refuses"),
    ("public.other=id > 0", "does not capture"),
    ("public.orders", "SCHEMA.TABLE=PREDICATE"),
])
def test_a_row_filter_postgres_would_refuse_creates_nothing(dbs: Dbs, tmp_path: Path, where: str,
                                                            words: str) -> None:
    _orders(dbs)
    state = tmp_path / "state"
    done = changefeed_cli("create", "--name", dbs.name, "--state", str(state), "--source", dbs.source,
                          "--sink", dbs.sink, "--tables", "public.orders,public.plain", "--where", where)
    assert done.returncode != 0 and words in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not (state / dbs.name).exists()
    with psycopg.connect(dbs.source) as c:
        assert not c.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s",
                             (f"changefeed_{dbs.name}",)).fetchall()
        assert not c.execute("SELECT 1 FROM pg_publication WHERE pubname LIKE %s", (f"changefeed_%{dbs.name}",)
                             ).fetchall()
