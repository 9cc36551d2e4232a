"""Stored generated columns (PostgreSQL 18 publishes them): a replica's column stays generated
and computes the same values; Kafka messages and the Delta change log carry the source's value,
in the snapshot and in the stream; `verify` finds the replica equal."""
from __future__ import annotations

import json
import threading
import uuid
from decimal import Decimal
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest

from changefeed.local.kafka import LocalKafka, committed, read_partition
from support.feeds import assert_no_traceback, changefeed_cli, kill_running, start_changefeed, wait_for
from support.servers import Dbs
from support.writers import writing

pytestmark = pytest.mark.timeout(600)
ROWS = 300


def _reprice(uri: str, stop: threading.Event, written: list[int]) -> None:
    with psycopg.connect(uri, autocommit=True) as c:
        while not stop.is_set() or written[0] < 100:
            written[0] += 1
            n = written[0]
            c.execute("UPDATE orders SET qty = qty + 1, price = price + 0.5 WHERE id = %s", (n % ROWS + 1,))
            c.execute("INSERT INTO orders (id, qty, price) VALUES (%s, 2, 1.25)", (ROWS + n,))
            stop.wait(0.01)


def _rows(uri: str) -> list[tuple[object, ...]]:
    with psycopg.connect(uri) as c:
        return c.execute("SELECT id, qty, price, total FROM orders ORDER BY id").fetchall()


def test_generated_columns_stay_generated_on_a_replica_and_carry_values_elsewhere(
        dbs: Dbs, kafka: LocalKafka, tmp_path: Path) -> None:
    with psycopg.connect(dbs.source, autocommit=True) as c:
        c.execute("CREATE TABLE orders (id int PRIMARY KEY, qty int NOT NULL, price numeric(10, 2) NOT NULL, "
                  "total numeric GENERATED ALWAYS AS (qty * price) STORED)")
        c.execute("INSERT INTO orders (id, qty, price) SELECT g, g, g / 4.0 FROM generate_series(1, %s) g", (ROWS,))
    prefix, lake, log = f"g{uuid.uuid4().hex[:8]}.", tmp_path / "lake", tmp_path / "run.log"
    runner = start_changefeed(
        "run", "--name", dbs.name, "--state", str(tmp_path / "state"), "--source", dbs.source, "--tables",
        "public.orders", "--sink", f"dr={dbs.sink}",
        "--sink", f"events=kafka://{kafka.bootstrap}?topic_prefix={prefix}&progress_topic=p{prefix}&topic_partitions=1",
        "--sink", f"lake=delta://{lake}?mode=changelog", log=log)
    written = [0]
    try:
        with writing(_reprice, dbs.source, written):
            wait_for("the snapshot and changes", lambda: "snapshot public.orders: done" in log.read_text(), log)
        wait_for("the replica equal to the source", lambda: _rows(dbs.sink) == _rows(dbs.source), log, timeout=120)
        with psycopg.connect(dbs.sink) as c:
            kind = c.execute("SELECT attgenerated FROM pg_attribute WHERE attrelid = 'orders'::regclass "
                             "AND attname = 'total'").fetchone()
        assert kind == ("s",)  # computed by the replica itself
        verified = changefeed_cli("verify", "--name", dbs.name, "--state", str(tmp_path / "state"), "--sink", "dr")
        assert verified.returncode == 0, verified.stdout + verified.stderr
    finally:
        kill_running([runner])
    messages = [json.loads(r.value) for r in committed(read_partition(kafka.bootstrap, f"{prefix}public.orders", 0,
                                                                      timeout=60)) if r.value]
    rows = [m["after"] for m in messages if m.get("after")]
    assert {m["op"] for m in messages} >= {"r", "c", "u"}
    assert all(Decimal(str(r["total"])) == r["qty"] * Decimal(str(r["price"])) for r in rows), rows[:3]
    from deltalake import DeltaTable

    changes = pa.table(DeltaTable(str(lake / "public.orders")).to_pyarrow_table()).to_pylist()
    assert {r["_op"] for r in changes} >= {"r", "c", "u"}
    # (numeric without a precision is a string in the lake, as any such column)
    assert all(Decimal(r["total"]) == r["qty"] * r["price"] for r in changes if r["_op"] != "d"), changes[:3]
    assert_no_traceback(log.read_text())
