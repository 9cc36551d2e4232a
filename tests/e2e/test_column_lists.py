"""--columns: a feed captures only the listed columns of a table, in its snapshot and stream. A
replica and Kafka fed from one slot under a writer that also changes the columns left out (the
runner SIGKILLed in the snapshot): the replica's table has only the listed columns and equals the
source's projection, `verify` agrees, and no Kafka message carries a column left out. Bad lists
(unknown column, key left out, an empty name, a REPLICA IDENTITY FULL table cut short) create
nothing."""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import uuid
from pathlib import Path

import psycopg
import pytest

from changefeed.local.kafka import LocalKafka, committed, read_partition
from support.feeds import assert_no_traceback, changefeed_cli, kill_running, start_changefeed, wait_for
from support.servers import Dbs
from support.writers import WRITE_PAUSE, writing

pytestmark = pytest.mark.timeout(600)
ROWS = 20000
LISTED = ("id", "name", "country")


def _customers(dbs: Dbs) -> None:
    with psycopg.connect(dbs.source, autocommit=True) as c:
        c.execute("CREATE TABLE customers (id bigint PRIMARY KEY, email text, name text NOT NULL, "
                  "card text, country text)")
        c.execute("INSERT INTO customers SELECT g, 'e' || g || '@x', 'n' || g, 'card' || g, 'se' "
                  "FROM generate_series(1, %s) g", (ROWS,))
        c.execute("CREATE TABLE audited (id int PRIMARY KEY, who text)")
        c.execute("ALTER TABLE audited REPLICA IDENTITY FULL")


def _writes(uri: str, stop: threading.Event, written: list[int]) -> None:
    rng = random.Random(11)
    with psycopg.connect(uri, autocommit=True) as c:
        n = ROWS
        while not stop.is_set():
            n += 1
            with c.transaction():
                c.execute("INSERT INTO customers VALUES (%s, 'new@x', %s, 'c', 'no')", (n, f"n{n}"))
                c.execute("UPDATE customers SET card = 'changed' WHERE id = %s", (rng.randint(1, n),))  # left out only
                c.execute("UPDATE customers SET country = 'dk', email = NULL WHERE id = %s", (rng.randint(1, n),))
                if n % 4 == 0:
                    c.execute("DELETE FROM customers WHERE id = %s", (rng.randint(1, n),))
            written[0] = n
            stop.wait(WRITE_PAUSE)


def _rows(uri: str) -> list[tuple[object, ...]]:
    with psycopg.connect(uri) as c:
        return c.execute(f"SELECT {', '.join(LISTED)} FROM customers ORDER BY id").fetchall()


def test_only_the_listed_columns_reach_the_replica_and_kafka(dbs: Dbs, kafka: LocalKafka, tmp_path: Path) -> None:
    _customers(dbs)
    prefix = f"c{uuid.uuid4().hex[:8]}."
    state, logs = tmp_path / "state", [tmp_path / "killed.log", tmp_path / "run.log"]
    run = ["run", "--name", dbs.name, "--state", str(state)]
    define = ["--source", dbs.source, "--sink", f"dr={dbs.sink}",
              "--sink", f"events=kafka://{kafka.bootstrap}?topic_prefix={prefix}&progress_topic=p{prefix}"
                        "&topic_partitions=1",
              "--tables", "public.customers", "--columns", f"public.customers={','.join(reversed(LISTED))}",
              "--snapshot-chunk-rows", "4000", "--snapshot-chunks-per-batch", "1"]
    runner = start_changefeed(*run, *define, log=logs[0])
    written = [0]
    try:
        with writing(_writes, dbs.source, written):
            wait_for("the snapshot under way", lambda: "snapshot public.customers:" in logs[0].read_text(), logs[0],
                     timeout=240)
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait(timeout=60)
            runner = start_changefeed(*run, log=logs[1])
            wait_for("the snapshot and changes", lambda: "snapshot public.customers: done" in logs[1].read_text()
                     and written[0] > ROWS + 300, logs[1], timeout=240)
        wait_for("the replica equal to the source's columns", lambda: _rows(dbs.sink) == _rows(dbs.source), logs[1],
                 timeout=120)
        with psycopg.connect(dbs.sink) as c:
            columns = [r[0] for r in c.execute("SELECT column_name FROM information_schema.columns WHERE "
                                               "table_name = 'customers' ORDER BY ordinal_position")]
        assert columns == ["id", "name", "country"]  # in the table's order
        verified = changefeed_cli("verify", "--name", dbs.name, "--state", str(state), "--sink", "dr")
        assert verified.returncode == 0, verified.stdout + verified.stderr
    finally:
        kill_running([runner])
    messages = [json.loads(r.value) for r in committed(read_partition(kafka.bootstrap, f"{prefix}public.customers",
                                                                      0, timeout=60)) if r.value]
    shown = {k for m in messages for row in (m.get("after"), m.get("before")) if row for k in row}
    assert shown == set(LISTED), shown
    assert {m["op"] for m in messages} >= {"r", "c", "u", "d"}
    for log in logs:
        assert_no_traceback(log.read_text())


@pytest.mark.parametrize("columns, words", [
    ("public.customers=id,nmae", "no column nmae"),
    ("public.customers=name,country", "leaves out id: the key"),
    ("public.customers=id,,name", "--columns takes SCHEMA.TABLE=COLUMN"),
    ("public.audited=id", "leaves out who: the table has REPLICA IDENTITY FULL"),
    ("public.other=id", "which the feed does not capture"),
])
def test_a_bad_column_list_creates_nothing(dbs: Dbs, tmp_path: Path, columns: str, words: str) -> None:
    _customers(dbs)
    done = changefeed_cli("create", "--name", dbs.name, "--state", str(tmp_path / "s"), "--source", dbs.source,
                          "--sink", dbs.sink, "--tables", "public.customers,public.audited", "--columns", columns)
    assert done.returncode != 0 and words in done.stderr, done.stderr
    assert_no_traceback(done.stderr)
    assert not (tmp_path / "s" / dbs.name).exists()
    with psycopg.connect(dbs.source) as c:
        assert not c.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name LIKE %s", (f"%{dbs.name}",)
                             ).fetchall()
        assert not c.execute("SELECT 1 FROM pg_publication WHERE pubname LIKE %s", (f"%{dbs.name}",)).fetchall()
