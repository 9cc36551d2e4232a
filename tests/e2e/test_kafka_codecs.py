"""Kafka exactly once with compressed record batches: one feed whose producer compresses with lz4,
then zstd, then snappy, then lz4 again, SIGKILLed once in each of the first three runs while a
writer commits. Every change arrives exactly once among the committed records, and each restart
reads the progress its predecessor wrote with another codec.

The test broker (Tansu) leaks aborted records to read_committed consumers, so the probe at start
must choose the marker reader and say so; that reader then decodes the compressed progress and
data batches. One feed, with its codec changed between runs as an operator changing the sink's
`compression.type` would (the stored feed definition rewritten), keeps this to four feed starts:
the lz4 run is killed inside its first transaction (its records that reached the broker stay out),
the zstd run right after committing the replay of that batch (the snappy run must find it in the
zstd-compressed progress and skip it), the snappy run just before committing its second batch
(the last run aborts it and writes it again, reading the snappy progress).

The snapshot reads the table after the slot was made (the writer is already at work): a row
inserted in between arrives as a snapshot read (`r`) if the read saw it, else as a change (`c`);
the lz4 run's first batch, read again by the zstd run in a snapshot of its own that sees more,
may send a row both ways (core.judge). Every (row, op) must arrive once, every row at all, every
row from before the slot as a read.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from changefeed.local.kafka import LocalKafka, committed, read_partition
from changefeed.sinks.kafka.log import PartitionReader
from changefeed.sinks.kafka.records import CODECS, batches
from changefeed.spec.state import FeedState
from support.feeds import changefeed_cli, kill_runs
from support.kafka import kafka_partitions
from support.servers import Dbs
from support.writers import WRITE_PAUSE, writing

pytestmark = pytest.mark.timeout(600)
SNAPSHOT = 2100  # rows: the first batch sends over 2000 messages, which the sink_write fault point counts
RUNS = [("lz4", "sink_write:2"), ("zstd", "after_sink_commit:1"), ("snappy", "before_sink_commit:2")]
LEAKS = "kafka progress: broker leaks aborted records to read_committed consumers (probe), reading transaction markers"


def writer(uri: str, stop: threading.Event, written: list[int]) -> None:
    """Transaction n inserts ledger row SNAPSHOT + n."""
    with psycopg.connect(uri, autocommit=True) as c:
        while not stop.is_set():
            written[0] += 1
            c.execute("INSERT INTO ledger (id, v) VALUES (%s, %s)", (SNAPSHOT + written[0], f"entry {written[0]}"))
            time.sleep(WRITE_PAUSE)


def codecs_in(kafka: LocalKafka, topic: str, partitions: int) -> set[str]:
    """The codecs of the record batches stored in `topic` (control batches are never compressed)."""
    found = set()
    for p in range(partitions):
        with PartitionReader({"bootstrap.servers": kafka.bootstrap}, topic, p) as reader:
            found |= {CODECS[attributes & 7] for _, _, attributes, *_ in batches(reader._fetch(0)[2])}
    return found


def test_a_feed_delivers_exactly_once_through_kills_with_every_codec(dbs: Dbs, tmp_path: Path,
                                                                     kafka: LocalKafka, spark_server: str) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE ledger (id bigint PRIMARY KEY, v text NOT NULL)")
        c.execute("INSERT INTO ledger SELECT g, 'old ' || g FROM generate_series(1, %s) g", (SNAPSHOT,))
    prefix, progress_topic = f"k{uuid.uuid4().hex[:8]}.", f"progress-{uuid.uuid4().hex[:8]}"
    sink = (f"kafka://{kafka.bootstrap}?topic_prefix={prefix}&progress_topic={progress_topic}&topic_partitions=2"
            "&compression.type={codec}")
    state = FeedState(tmp_path / "state", dbs.name)
    base = ["run", "--name", dbs.name, "--state", str(tmp_path / "state")]
    created = changefeed_cli("create", *base[1:], "--source", dbs.source, "--sink", sink.format(codec="lz4"),
                             "--tables", "public.ledger")
    assert created.returncode == 0, created.stderr[-3000:]
    assert LEAKS in created.stdout, created.stdout  # the probe's verdict on the test broker, said at start

    def compress_with(codec: str) -> None:
        spec = state.load()
        assert spec is not None
        state.save(dataclasses.replace(spec, sink=sink.format(codec=codec)))

    written = [0]
    with writing(writer, dbs.source, written):
        for codec, kill_at in RUNS:
            compress_with(codec)
            (tmp_path / codec).mkdir()
            kill_runs(base, [kill_at], tmp_path / codec, random_after=(0, 0))
    compress_with("lz4")
    final = changefeed_cli(*base, "--available-now", "--master", spark_server)
    assert final.returncode == 0, final.stderr[-3000:]
    assert LEAKS in final.stdout

    topic = f"{prefix}public.ledger"
    changes = [(json.loads(r.key or b"")[0], json.loads(r.value or b"")["op"])
               for part in kafka_partitions(kafka.bootstrap, topic) for r in committed(part)]
    assert len(changes) == len(set(changes)), "a change was delivered twice"
    total = SNAPSHOT + written[0]
    inserts = {i for i, op in changes if op == "c"}  # the writer's rows the snapshot did not see, from the WAL
    read = {i for i, op in changes if op == "r"}  # the snapshot: every row from before the slot, some after it
    assert set(range(1, SNAPSHOT + 1)) <= read <= set(range(1, total + 1))
    assert sorted(inserts | read) == list(range(1, total + 1)), f"{len(inserts | read)} rows of {total}"
    assert not inserts & set(range(1, SNAPSHOT + 1))

    progress = [r for r in read_partition(kafka.bootstrap, progress_topic, 0) if r.key == dbs.name.encode()]
    batch_ids = [json.loads(r.value or b"")["batch"] for r in committed(progress)
                 if not json.loads(r.value or b"").get("claimed")]  # (each run's claim re-states the last batch)
    assert batch_ids == sorted(set(batch_ids)) and batch_ids[0] == 0, batch_ids  # none committed twice
    assert codecs_in(kafka, topic, 2) >= {"zstd", "snappy", "lz4"}  # committed by the zstd, snappy and last runs
    assert codecs_in(kafka, progress_topic, 1) >= {"zstd", "snappy", "lz4"}
