"""--sink-lag-budget: a feed of three sinks (a replica, Kafka exactly once behind a TCP proxy, a
Delta change log) under a writer moving money. Kafka's broker out of reach for 30 s: the replica
and the lake go on, Kafka is caught up from a copy of the slot once it answers; the runner is
SIGKILLed meanwhile and the next one finishes it. Then, with a budget of 10 s, out of reach for
good: the feed stops naming the sink, the copy keeping Kafka's WAL; run again on a new host (no
state folder) with the broker back, Kafka is caught up first. Every sink gets every change once,
Kafka and the lake carry the same commit timestamp for each transaction, money is never
half-moved."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from changefeed.local.kafka import LocalKafka, committed, read_partition
from support.feeds import assert_no_traceback, kill_running, start_changefeed, status_of, wait_for
from support.servers import Dbs, free_port
from support.writers import moving_money, writing

pytestmark = pytest.mark.timeout(900)
ACCOUNTS, BALANCE = 20, 1000


def test_with_a_lag_budget_the_others_go_on_and_the_sink_is_caught_up(dbs: Dbs, tmp_path: Path) -> None:
    from tcp_proxy import TcpProxy

    with psycopg.connect(dbs.source, autocommit=True) as c:
        c.execute("CREATE TABLE ledger (id bigint PRIMARY KEY, v text NOT NULL)")
        c.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        c.execute("INSERT INTO accounts SELECT g, %s FROM generate_series(0, %s) g", (BALANCE, ACCOUNTS - 1))
    broker_port, tag = free_port(), uuid.uuid4().hex[:8]
    lake = tmp_path / "lake"
    with TcpProxy(broker_port) as proxy, LocalKafka.start(tmp_path / "kafka", broker_port,
                                                          advertised_port=proxy.port):
        bootstrap = f"127.0.0.1:{proxy.port}"
        read = _Read(dbs, bootstrap, f"m{tag}.", lake)
        state = tmp_path / "state"
        run = ["run", "--name", dbs.name, "--state", str(state), "--retry-max-backoff", "2s"]
        define = ["--source", dbs.source, "--sink", f"dr={dbs.sink}",
                  "--sink", f"events=kafka://{bootstrap}?timeout=5s&topic_partitions=1&topic_prefix={read.prefix}",
                  "--sink", f"lake=delta://{lake}?mode=changelog", "--tables", "public.ledger,public.accounts"]
        logs = [tmp_path / f"run{i}.log" for i in range(4)]
        runner = start_changefeed(*run, *define, "--sink-lag-budget", "5m", log=logs[0])
        written = [0]
        try:
            with writing(moving_money(ACCOUNTS), dbs.source, written):
                wait_for("changes in every sink", lambda: read.least() > 100, logs[0], timeout=240)
                proxy.down()
                began = time.monotonic()
                wait_for("Kafka left behind", lambda: "sink events failed" in logs[0].read_text(), logs[0],
                         timeout=90)
                behind = status_of(dbs.name, state)["sinks"]["events"]["behind"]
                assert str(behind).startswith("since"), behind
                went_on = read.replica_top(), len(read.lake_ledger()["c"])
                wait_for("the replica and the lake going on", lambda: read.replica_top() > went_on[0] + 200 and
                         len(read.lake_ledger()["c"]) > went_on[1] + 200, logs[0], timeout=60)
                time.sleep(max(0.0, 30 - (time.monotonic() - began)))
                proxy.up()
                wait_for("Kafka answering", lambda: "sink events answers again" in logs[0].read_text(), logs[0],
                         timeout=120)
                time.sleep(random.uniform(0.5, 4.0))  # SIGKILLed while catching Kafka up (or just after)
                os.killpg(runner.pid, signal.SIGKILL)
                runner.wait(timeout=60)
                runner = start_changefeed(*run, log=logs[3])
                wait_for("Kafka caught up", lambda: "sink events caught up" in logs[0].read_text() +
                         logs[3].read_text(), logs[3], timeout=120)
                wait_for("the slot's copy dropped", lambda: _slot_position(dbs) is None, logs[3])
                assert status_of(dbs.name, state)["sinks"]["events"]["behind"] == "no"
                runner.send_signal(signal.SIGTERM)
                assert runner.wait(timeout=120) == 0, logs[3].read_text()[-3000:]

                # a budget of 10 s, and the broker out of reach for longer: the feed stops
                runner = start_changefeed(*run, "--sink-lag-budget", "10s", log=logs[1])
                wait_for("a batch", lambda: "batches since start" in logs[1].read_text(), logs[1], timeout=120)
                proxy.down()
                assert runner.wait(timeout=180) == 2, logs[1].read_text()[-3000:]
                text = logs[1].read_text()
                assert "sink events is past --sink-lag-budget 10s" in text and "--remove-sink events" in text, \
                    text[-3000:]
                kept = _slot_position(dbs)
                time.sleep(2)
            assert kept is not None and kept < read.replica_checkpoint(), "the slot's copy moved on with the others"
            # the feed run again on a new host (no state folder: no checkpoint, nothing known behind),
            # the broker back: Kafka is found behind the feed's slot and caught up from the copy
            shutil.rmtree(state / dbs.name)
            proxy.up()
            runner = start_changefeed(*run, *define, "--sink-lag-budget", "10s", log=logs[2])
            wait_for("every row in every sink", lambda: read.least() >= written[0], logs[2], timeout=300)
            # every row can be in Kafka a moment before the catch-up sees it has reached the others
            wait_for("Kafka caught up", lambda: "sink events caught up" in logs[2].read_text(), logs[2], timeout=120)
            assert "sinks events lack WAL the feed's slot gave up" in logs[2].read_text()
            wait_for("the slot's copy dropped", lambda: _slot_position(dbs) is None, logs[2])
            runner.send_signal(signal.SIGTERM)
            assert runner.wait(timeout=120) == 0, logs[2].read_text()[-3000:]
        finally:
            kill_running([runner])
        n = written[0]
        in_kafka, in_lake = read.kafka_ledger(), read.lake_ledger()
    # every row once (inserted, or read by the snapshot that raced the writer's first rows, or both)
    for sink, got in (("Kafka", in_kafka), ("the lake", in_lake)):
        assert sorted(got["c"].keys() | got["r"].keys()) == list(range(1, n + 1)), f"{sink}: rows missing of {n}"
    kafka_c, lake_c = in_kafka["c"], in_lake["c"]
    differ = sorted(i for i in kafka_c.keys() | lake_c.keys() if kafka_c.get(i) != lake_c.get(i))
    assert not differ, (f"{len(differ)} inserts differ between Kafka and the lake (id: Kafka's ts, the lake's ts): "
                        f"{[(i, kafka_c.get(i), lake_c.get(i)) for i in differ[:5]]}")
    with psycopg.connect(dbs.sink) as c:
        assert [r[0] for r in c.execute("SELECT id FROM ledger ORDER BY id")] == list(range(1, n + 1))
        assert c.execute("SELECT sum(balance) FROM accounts").fetchone()[0] == ACCOUNTS * BALANCE
    for log in logs:
        assert_no_traceback(log.read_text())
    assert "slot cflag_" in logs[0].read_text() and "keeps its WAL" in logs[0].read_text()


class _Read:
    """What each sink holds."""

    def __init__(self, dbs: Dbs, bootstrap: str, prefix: str, lake: Path) -> None:
        self.dbs, self.bootstrap, self.prefix, self.lake = dbs, bootstrap, prefix, lake

    def kafka_ledger(self) -> dict[str, dict[int, int]]:
        """Per op (c: inserted, r: read by the snapshot), ledger id -> commit ts of what a
        read_committed reader gets (a repeat fails)."""
        from confluent_kafka.admin import AdminClient

        topic = f"{self.prefix}public.ledger"
        out: dict[str, dict[int, int]] = {"c": {}, "r": {}}
        if topic not in AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(timeout=10).topics:
            return out
        for r in committed(read_partition(self.bootstrap, topic, 0, timeout=60)):
            if r.key is not None and r.value is not None and (op := json.loads(r.value)["op"]) in out:
                n = json.loads(r.key)[0]
                assert n not in out[op], f"ledger row {n} twice in Kafka as {op}"
                out[op][n] = int(json.loads(r.value)["updated"])
        return out

    def lake_ledger(self) -> dict[str, dict[int, int]]:
        from deltalake import DeltaTable

        path = str(self.lake / "public.ledger")
        out: dict[str, dict[int, int]] = {"c": {}, "r": {}}
        if not DeltaTable.is_deltatable(path):
            return out
        for r in pa.table(DeltaTable(path).to_pyarrow_table()).to_pylist():
            if r["_op"] in out:
                assert r["id"] not in out[r["_op"]], f"ledger row {r['id']} twice in the lake as {r['_op']}"
                out[r["_op"]][r["id"]] = r["_commit_ts"]
        return out

    def replica_top(self) -> int:
        with psycopg.connect(self.dbs.sink) as c:
            if c.execute("SELECT to_regclass('public.ledger')").fetchone()[0] is None:
                return 0  # (made as the feed starts)
            return int(c.execute("SELECT coalesce(max(id), 0) FROM ledger").fetchone()[0])

    def replica_checkpoint(self) -> int:
        """The end LSN of the replica's last batch."""
        with psycopg.connect(self.dbs.sink) as c:
            row: Any = c.execute("SELECT max(end_lsn) - '0/0'::pg_lsn FROM changefeed.progress WHERE feed = %s",
                                 (f"{self.dbs.name}.dr",)).fetchone()
            return None if row is None else int(row[0])

    def least(self) -> int:
        """The highest ledger row every sink has."""
        return min(self.replica_top(), *(max([*got["c"], *got["r"]], default=0)
                                         for got in (self.kafka_ledger(), self.lake_ledger())))


def _slot_position(dbs: Dbs) -> int | None:
    """Where the copy of the feed's slot that keeps Kafka's WAL is."""
    with psycopg.connect(dbs.source) as c:
        row: Any = c.execute("SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots "
                             "WHERE slot_name = %s", (f"cflag_{dbs.name}",)).fetchone()
        return None if row is None else int(row[0])
