"""The Kafka sink with no options at all: `--sink kafka://HOST:PORT`, end to end and under SIGKILL.

A broker of its own, so the default topic names (`public.ledger`) and the default progress topic
(`_changefeed_progress`) are really the ones used, and the default timeouts (`timeout=30s`, the
client's derived from it) are what the producer runs with.

What the broker is relied on for: Tansu keeps the records of aborted transactions in the log and
writes COMMIT / ABORT control markers after each transaction's records, and `init_transactions`
of a new producer aborts the open transaction of a dead one (fencing). Tansu does not hide
aborted records from `read_committed` consumers, so this test does not use one: it reads every
partition with `local_kafka.read_partition`, which sets each record's outcome from the markers,
and counts the committed records only, what an Apache Kafka `read_committed` consumer gets. The
kills leave aborted records in the log, and the test asserts they are there, so it shows that
the committed ones are told apart by the markers, not merely that nothing was ever aborted.
"""
from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from changefeed.core.lsn import parse_lsn
from changefeed.local.kafka import LocalKafka, committed, read_partition
from support.feeds import changefeed_cli, kill_runs
from support.kafka import kafka_partitions
from support.servers import Dbs
from support.writers import WRITE_PAUSE, writing

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
COUNTERS = 25


@pytest.fixture
def own_kafka(tmp_path: Path) -> Iterator[LocalKafka]:
    with LocalKafka.start(tmp_path / "kafka") as broker:
        yield broker


def writer(uri: str, stop: threading.Event, written: list[int]) -> None:
    """Transaction n inserts ledger row n and bumps the version of counter n % COUNTERS."""
    with psycopg.connect(uri, autocommit=True) as c:
        n = 0
        while not stop.is_set():
            n += 1
            with c.transaction():
                c.execute("INSERT INTO ledger (id, v) VALUES (%s, %s)", (n, f"entry {n}"))
                c.execute("UPDATE counters SET version = version + 1 WHERE id = %s", (n % COUNTERS,))
            written[0] = n
            time.sleep(WRITE_PAUSE)


def test_a_bare_kafka_uri_delivers_exactly_once_across_kills(dbs: Dbs, tmp_path: Path, own_kafka: LocalKafka,
                                                             spark_server: str) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE ledger (id bigint PRIMARY KEY, v text NOT NULL)")
        c.execute("CREATE TABLE counters (id int PRIMARY KEY, version int NOT NULL)")
        c.execute("INSERT INTO counters SELECT g, 0 FROM generate_series(0, %s) g", (COUNTERS - 1,))
    state = str(tmp_path / "state")
    base = ["run", "--name", dbs.name, "--state", state]
    first = changefeed_cli(*base, "--source", dbs.source, "--sink", f"kafka://{own_kafka.bootstrap}",
                           "--tables", "public.ledger,public.counters", "--available-now", "--master", spark_server)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Traceback" not in first.stderr and "error:" not in first.stderr, first.stderr[-3000:]

    written = [0]
    with writing(writer, dbs.source, written):
        kill_runs(base, ["sink_write:1", "before_sink_commit:1", "random"], tmp_path, random_after=(10, 16))
    final = changefeed_cli(*base, "--available-now", "--master", spark_server)
    assert final.returncode == 0, final.stderr[-3000:]

    from confluent_kafka.admin import AdminClient

    topics = set(AdminClient({"bootstrap.servers": own_kafka.bootstrap}).list_topics(timeout=10).topics)
    assert {"public.ledger", "public.counters", "_changefeed_progress"} <= topics, topics

    ledger = kafka_partitions(own_kafka.bootstrap, "public.ledger")
    ids = sorted(json.loads(r.key or b"")[0] for part in ledger for r in committed(part))
    assert ids == list(range(1, written[0] + 1)), f"{len(ids)} ids for {written[0]} rows, {len(set(ids))} distinct"

    versions: dict[int, list[int]] = defaultdict(list)
    counters = kafka_partitions(own_kafka.bootstrap, "public.counters")
    for part in counters:
        for r in committed(part):
            versions[json.loads(r.key or b"")[0]].append(json.loads(r.value or b"")["after"]["version"])
    with dbs.src() as c:
        source = dict(c.execute("SELECT id, version FROM counters").fetchall())
    for key, version in source.items():
        assert versions[key] == list(range(version + 1)), f"counter {key}: {versions[key]}"

    progress = read_partition(own_kafka.bootstrap, "_changefeed_progress", 0)
    aborted = [r for part in ledger + counters for r in part if r.outcome == "aborted"]
    aborted += [r for r in progress if r.outcome == "aborted"]
    assert aborted, "no kill left an aborted transaction in the log: the marker check went untested"
    assert not [r for part in ledger + counters for r in part if r.outcome == "open"], "a transaction was left open"

    records = [json.loads(r.value or b"") for r in committed(progress) if r.key == dbs.name.encode()
               and not json.loads(r.value or b"").get("claimed")]  # (a run's claim re-states the last batch)
    batches = [r["batch"] for r in records]
    assert batches == sorted(set(batches)), "a batch was committed twice"
    status = json.loads(changefeed_cli("status", "--name", dbs.name, "--state", state, "--json").stdout)
    assert parse_lsn(status["checkpoint_lsn"]) == records[-1]["progress"]["end_lsn"], status
