"""Kafka sink end to end, exactly once: a feed process writes to a real Kafka-protocol broker
(Tansu) while a writer commits, and is SIGKILLed in the middle of writing a batch, before and
after its transaction commits, and at a random moment. What a read_committed consumer gets (the
records of committed transactions, told apart by the control markers) holds every change
exactly once, in per-key order, on the same topics after every restart.

The same transactions write outbox events (--outbox): every other one deletes its event row at
once, the rest leave it to the TTL cleanup. Each event reaches its aggregate type's topic exactly
once, in per-aggregate order, and the cleanup removes only rows whose events were delivered.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg
import pytest

from changefeed.core.lsn import parse_lsn
from changefeed.local.kafka import LocalKafka, committed, read_partition
from support.feeds import changefeed_cli, kill_runs
from support.servers import Dbs
from support.writers import WRITE_PAUSE, writing

pytestmark = pytest.mark.timeout(900)
ACCOUNTS = 40


def writer(uri: str, stop: threading.Event, written: list[int]) -> None:
    """Each transaction appends ledger row n, moves 1 between two accounts, bumping their versions,
    and writes event n about the first account (deleting it in the same transaction when n is even)."""
    with psycopg.connect(uri, autocommit=True) as c:
        n = 0
        while not stop.is_set():
            n += 1
            with c.transaction():
                c.execute("INSERT INTO ledger (id, v) VALUES (%s, %s)", (n, f"entry {n}"))
                c.execute("UPDATE accounts SET balance = balance - 1, version = version + 1 WHERE id = %s",
                          (n % ACCOUNTS,))
                c.execute("UPDATE accounts SET balance = balance + 1, version = version + 1 WHERE id = %s",
                          ((n * 7 + 1) % ACCOUNTS,))
                c.execute("INSERT INTO outbox VALUES (%s, 'account', %s, 'Moved', %s)",
                          (f"e{n}", str(n % ACCOUNTS), json.dumps({"n": n, "amount": 1})))
                if n % 2 == 0:
                    c.execute("DELETE FROM outbox WHERE id = %s", (f"e{n}",))
            written[0] = n
            time.sleep(WRITE_PAUSE)


def topic_records(kafka: LocalKafka, topic: str) -> list[list[Any]]:
    """Per partition, the committed records' (key, value) decoded from JSON."""
    from confluent_kafka.admin import AdminClient

    meta = AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(topic, timeout=10).topics[topic]
    return [[(json.loads(r.key) if r.key else None, json.loads(r.value) if r.value else None)
             for r in committed(read_partition(kafka.bootstrap, topic, p, timeout=60))]
            for p in sorted(meta.partitions)]


@pytest.mark.slow
def test_sigkill_while_writing_to_kafka_loses_and_duplicates_nothing(dbs: Dbs, tmp_path: Path,
                                                                       kafka: LocalKafka, spark_server: str) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE ledger (id bigint PRIMARY KEY, v text NOT NULL)")
        c.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL, version int NOT NULL)")
        c.execute("INSERT INTO accounts SELECT g, 1000, 0 FROM generate_series(0, %s) g", (ACCOUNTS - 1,))
        c.execute("CREATE TABLE outbox (id text PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL,"
                  " event_type text NOT NULL, payload jsonb)")
        c.execute("INSERT INTO outbox SELECT 'old' || g, 'order', 'o' || g, 'Placed', '{\"old\": true}'"
                  " FROM generate_series(1, 5) g")  # before the feed: events too (--outbox-snapshot-events)
    prefix, progress_topic = f"k{uuid.uuid4().hex[:8]}.", f"progress-{uuid.uuid4().hex[:8]}"
    sink = (f"kafka://{kafka.bootstrap}?topic_prefix={prefix}&progress_topic={progress_topic}"
            "&topic_partitions=3&resolved=true")  # default timeouts
    state = str(tmp_path / "state")
    base = ["run", "--name", dbs.name, "--state", state]
    first = changefeed_cli(*base, "--source", dbs.source, "--sink", sink, "--tables", "public.ledger,public.accounts",
                           "--outbox", "public.outbox", "--outbox-ttl", "2s", "--outbox-snapshot-events",
                           "--available-now", "--master", spark_server)  # the snapshot, before any change
    # races it; its rows are events too
    assert first.returncode == 0, first.stderr[-3000:]

    written = [0]
    kills = ["sink_write:1", "after_sink_commit:1", "before_sink_commit:1", "random"]
    with writing(writer, dbs.source, written):
        kill_runs(base, kills, tmp_path, random_after=(10, 16))
    final = changefeed_cli(*base, "--available-now", "--master", spark_server)
    assert final.returncode == 0, final.stderr[-3000:]

    from confluent_kafka.admin import AdminClient

    topics = {t for t in AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(timeout=10).topics
              if t.startswith(prefix)}
    assert topics == {f"{prefix}public.ledger", f"{prefix}public.accounts", f"{prefix}outbox.event.account",
                      f"{prefix}outbox.event.order"}  # the same topics after every restart

    # ledger: every committed row exactly once
    ledger = [(k, v) for part in topic_records(kafka, f"{prefix}public.ledger") for k, v in part if "resolved" not in v]
    ids = sorted(k[0] for k, _ in ledger)
    assert ids == list(range(1, written[0] + 1)), f"{len(ids)} ids for {written[0]} rows, {len(set(ids))} distinct"

    # accounts: each key's versions arrive once each, in commit order, and end at the source's state
    versions: dict[int, list[int]] = defaultdict(list)
    balance: dict[int, int] = {}
    for part in topic_records(kafka, f"{prefix}public.accounts"):
        last_resolved = 0
        for key, value in part:
            if "resolved" in value:
                assert int(value["resolved"]) >= last_resolved, "resolved went backwards in a partition"
                last_resolved = int(value["resolved"])
                continue
            assert value["op"] == "r" or int(value["updated"]) > last_resolved, (value, last_resolved)
            versions[key[0]].append(value["after"]["version"])
            balance[key[0]] = value["after"]["balance"]
    with dbs.src() as c:
        source = {r[0]: (r[1], r[2]) for r in c.execute("SELECT id, balance, version FROM accounts")}
    for key, (bal, version) in source.items():
        assert versions[key] == list(range(version + 1)), f"account {key}: {versions[key]}"
        assert balance[key] == bal
    assert sum(balance.values()) == 1000 * ACCOUNTS

    # outbox: every event once, keyed by its aggregate, in per-aggregate order; cleaned rows were delivered
    events: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for agg_type in ("account", "order"):
        for p in range(3):
            for r in committed(read_partition(kafka.bootstrap, f"{prefix}outbox.event.{agg_type}", p)):
                headers = dict(r.headers)
                assert headers["aggregate_type"] == agg_type.encode() and r.key is not None
                payload = json.loads(r.value or b"")
                events[r.key.decode()].append(((headers["id"] or b"").decode(), payload.get("n", 0)))
    ids = [i for per in events.values() for i, _ in per]
    expected = {f"e{n}" for n in range(1, written[0] + 1)} | {f"old{g}" for g in range(1, 6)}
    assert len(ids) == len(set(ids)) and set(ids) == expected, f"{len(ids)} events, {len(set(ids))} distinct"
    for key, per in events.items():
        ns = [n for _, n in per]
        assert ns == sorted(ns), f"aggregate {key}: events out of order"
        assert key.startswith("o") or all(n % ACCOUNTS == int(key) for n in ns)
    with dbs.src() as c:
        left = {r[0] for r in c.execute("SELECT id FROM outbox")}
    assert not any(i[1:].isdigit() and int(i[1:]) % 2 == 0 for i in left if i.startswith("e"))
    kept = {f"e{n}" for n in range(1, written[0] + 1, 2)} | {f"old{g}" for g in range(1, 6)}
    assert left < kept, "the TTL cleanup deleted no delivered outbox row"

    # the progress topic: one committed record per batch, batch ids and resolved ts increasing (and each
    # run's claim of the feed for its lease term, which re-states the last batch's record)
    records = [json.loads(r.value) for r in committed(read_partition(kafka.bootstrap, progress_topic, 0))
               if r.key == dbs.name.encode()]
    claims = [r for r in records if r.get("claimed")]
    assert claims and [r["epoch"] for r in claims] == sorted({r["epoch"] for r in claims})  # a term each
    records = [r for r in records if not r.get("claimed")]
    batches = [r["batch"] for r in records]
    assert batches == sorted(set(batches)), "a batch was committed twice"
    resolved = [r["progress"]["resolved_ts"] for r in records]
    assert resolved == sorted(resolved)
    assert len(batches) >= 3  # the snapshot, the batch after_sink_commit kept, the final run
    status = json.loads(changefeed_cli("status", "--name", dbs.name, "--state", state, "--json").stdout)
    assert parse_lsn(status["checkpoint_lsn"]) == records[-1]["progress"]["end_lsn"], status
    assert status["batches"] == len(batches), status  # the ledger file agrees with the progress topic


@pytest.mark.usefixtures("warm_spark")
def test_an_outbox_snapshot_sends_no_row_it_held_and_racing_inserts_once(dbs: Dbs, tmp_path: Path,
                                                                        kafka: LocalKafka) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE outbox (id text PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL,"
                  " event_type text NOT NULL, payload jsonb)")
        c.execute("INSERT INTO outbox SELECT 'old' || g, 'order', 'o' || (g % 7), 'Placed', '{}'"
                  " FROM generate_series(1, 3000) g")
    prefix = f"k{uuid.uuid4().hex[:8]}."
    sink = f"kafka://{kafka.bootstrap}?topic_prefix={prefix}&progress_topic=progress-{prefix}&topic_partitions=1"
    base = ["run", "--name", dbs.name, "--state", str(tmp_path / "state")]

    def inserting(uri: str, stop: threading.Event, written: list[int]) -> None:
        with psycopg.connect(uri, autocommit=True) as c:
            while not stop.is_set():
                written[0] += 1
                c.execute("INSERT INTO outbox VALUES (%s, 'order', %s, 'Placed', '{}')",
                          (f"new{written[0]}", f"o{written[0] % 7}"))
                time.sleep(WRITE_PAUSE)

    created = changefeed_cli("create", *base[1:], "--source", dbs.source, "--sink", sink, "--tables", "public.outbox",
                             "--outbox", "public.outbox", "--snapshot-chunk-rows", "300",
                             "--snapshot-chunks-per-batch", "1")
    assert created.returncode == 0, created.stderr[-3000:]  # the slot: every insert from here on is an event
    written = [0]
    with writing(inserting, dbs.source, written):  # inserts race the snapshot's chunk reads
        first = changefeed_cli(*base, "--available-now")
        assert first.returncode == 0, first.stderr[-3000:]
    again = changefeed_cli("snapshot", "--name", dbs.name, "--state", str(tmp_path / "state"),
                           "--tables", "public.outbox")
    assert again.returncode == 0, again.stderr
    final = changefeed_cli(*base, "--available-now")  # the rest of the inserts, and a re-snapshot
    assert final.returncode == 0, final.stderr[-3000:]
    ids = [dict(r.headers)["id"].decode() for r in
           committed(read_partition(kafka.bootstrap, f"{prefix}outbox.event.order", 0, timeout=60))]
    assert written[0] > 100 and len(ids) == len(set(ids)), f"{len(ids)} events, {len(set(ids))} distinct"
    assert set(ids) == {f"new{n}" for n in range(1, written[0] + 1)}  # every insert once, no row it held
