"""A batch whose writer task is cancelled mid-input commits nothing (real Spark session, real replica
and Kafka-protocol broker).

When a streaming query stops while its writer task reads, Spark can close the Python writer's input
cleanly between two input partitions, so the writer sees a normal end of input. The sink must see
from the `P` rows that partitions are missing and commit nothing: here a batch of two partitions, the
first whole (with its `P` row) and the second still streaming rows when the query is stopped.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from pyspark import cloudpickle

from changefeed.core import change as ch
from changefeed.sinks.replica import ledger
from changefeed.spark import reads as feed_reads
from support.servers import Dbs

pytestmark = pytest.mark.timeout(300)

SHAPE = ch.TableShape("public", "cut", ("id", "v"), ("integer", "text"), ("id",), "d")
CHUNK_ROWS = 1000
END_LSN = 1 << 20


def _rows(op: str, ids: range, meta: str | None = None) -> Any:
    n = len(ids)
    cols: dict[str, list[Any]] = {name: [None] * n for name in ch.NAMES}
    cols.update(op=[op] * n, schema=["public"] * n, table=["cut"] * n, lsn=[END_LSN - 1] * n, seq=list(ids),
                xid=[7] * n, commit_time=[0] * n, commit_ts=[1] * n, after=[f"{i}\tv{i}".encode() for i in ids],
                meta=[meta] * n)
    return ch.record_batch(cols)


def _progress(part: int, rows: int) -> Any:
    return ch.progress_batch(ch.Progress(END_LSN, 1, None, rows, part=part, parts=2))


def _read(options: dict[str, str], part: int) -> Any:
    """Partition 0: one insert and its `P` row. Partition 1: chunks of inserts, endless unless
    `chunks` is given (then that many, and its `P` row)."""
    if part == 0:
        yield ch.pack(pa.concat_batches([_rows(ch.RELATION, range(0, 1), SHAPE.to_meta()), _rows("c", range(0, 1)),
                                         _progress(0, 1)]))
        yield from feed_reads.push_through()
        return
    chunks = int(options.get("chunks") or 0)
    yield ch.pack(_rows(ch.RELATION, range(0, 1), SHAPE.to_meta()))
    n = 0
    while not chunks or n < chunks:
        n += 1
        yield ch.pack(_rows("c", range(n * CHUNK_ROWS, (n + 1) * CHUNK_ROWS)))
        yield from feed_reads.push_through()
        if n == 5:
            (Path(options["dir"]) / "streaming").touch()
        time.sleep(0.01)
    yield ch.pack(_progress(1, chunks * CHUNK_ROWS))


def _register(spark: Any) -> None:
    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

    class Reader(DataSourceStreamReader):
        def __init__(self, options: dict[str, str]) -> None:
            self.options = options

        def initialOffset(self) -> dict[str, int]:
            return {"batch": 0}

        def latestOffset(self) -> dict[str, int]:
            return {"batch": 1}

        def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
            return [InputPartition(0), InputPartition(1)] if start != end else []

        def read(self, partition: InputPartition) -> Any:
            yield from _read(self.options, partition.value)  # type: ignore[attr-defined]

        def commit(self, end: dict[str, int]) -> None:
            pass

    class TwoPartitionProbe(DataSource):
        @classmethod
        def name(cls) -> str:
            return "changefeed-two-partition-probe"

        def schema(self) -> str:
            return ch.PACKED_DDL

        def streamReader(self, schema: Any) -> Reader:
            return Reader(dict(self.options))

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    spark.dataSource.register(TwoPartitionProbe)  # type: ignore[attr-defined]


class ReplicaTarget:
    """The batch goes to a PostgreSQL replica (sinks.replica)."""

    def __init__(self, dbs: Dbs, tmp: Path, kafka: Any = None) -> None:
        self.dbs = dbs
        with dbs.dst() as d:
            ledger.ensure_meta(d)
            d.execute("CREATE TABLE cut (id integer PRIMARY KEY, v text)")

    def writer(self, stream: Any) -> Any:
        return stream.format("changefeed-sink").option("targets", json.dumps([
            {"name": "replica", "sink": "replica", "uri": self.dbs.sink, "feed": self.dbs.name, "key": self.dbs.name}]))

    def wait_for_writer(self) -> None:
        """Until no sink writer is connected: a cancelled task's writer may still be finishing."""
        deadline = time.monotonic() + 60
        with psycopg.connect(self.dbs.sink, autocommit=True) as d:
            while d.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'changefeed' "
                            "AND datname = current_database()").fetchone() != (0,):
                assert time.monotonic() < deadline, "the sink's writer task never ended"
                time.sleep(0.2)

    def committed(self) -> tuple[list[tuple[int, int]], int]:
        """(batch id, changes) of each committed batch, and the rows the target holds."""
        with self.dbs.dst() as d:
            progress = d.execute("SELECT batch_id, changes FROM changefeed.progress WHERE feed = %s",
                                 (self.dbs.name,)).fetchall()
            return progress, d.execute("SELECT count(*) FROM cut").fetchone()[0]  # type: ignore[index]


class KafkaTarget:
    """The batch goes to Kafka in one transaction (sinks.kafka)."""

    def __init__(self, dbs: Dbs, tmp: Path, kafka: Any) -> None:
        from changefeed.sinks.kafka.options import KafkaOptions

        self.kafka, self.feed, self.ledger = kafka, dbs.name, tmp / "ledger"
        self.uri = (f"kafka://{kafka.bootstrap}?topic_prefix={dbs.name}&progress_topic={dbs.name}_progress"
                    "&timeout=10s&topic_partitions=1")
        self.opts = KafkaOptions.parse(self.uri)
        self.topic = self.opts.topic("public", "cut")

    def writer(self, stream: Any) -> Any:
        return stream.format("changefeed-sink").option("targets", json.dumps([
            {"name": "kafka", "sink": "kafka", "uri": self.uri, "feed": self.feed, "key": self.feed, "format": "json",
             "diff": "false", "database": "src", "ledger": str(self.ledger), "outbox": "", "topics": self.topic}]))

    def wait_for_writer(self) -> None:
        """Until the cancelled writer has ended its transaction (its messages are no longer open)."""
        from changefeed.local.kafka import read_partition

        deadline = time.monotonic() + 60
        while not (records := read_partition(self.kafka.bootstrap, self.topic)) or any(
                r.outcome == "open" for r in records):
            assert time.monotonic() < deadline, "the sink's writer task never ended its transaction"
            time.sleep(0.5)

    def committed(self) -> tuple[list[tuple[int, int]], int]:
        from changefeed.local.kafka import committed, read_partition
        from changefeed.sinks.kafka.batch import committed_progress

        done = committed_progress(self.opts, self.feed)
        batches = [(done.batch, done.progress.changes)] if done else []
        self.wait_for_writer()  # (the data topic's commit marker may come after the progress topic's)
        return batches, len(committed(read_partition(self.kafka.bootstrap, self.topic)))


def _start(spark: Any, target: Any, tmp: Path, chunks: int) -> Any:
    tmp.mkdir()
    stream = (spark.readStream.format("changefeed-two-partition-probe").option("dir", str(tmp))
              .option("chunks", str(chunks)).load().coalesce(1).writeStream)
    return target.writer(stream).option("checkpointLocation", str(tmp / "checkpoint")).start()


@pytest.mark.parametrize("sink", ["replica", "kafka"])
def test_stopped_mid_batch_commits_nothing_and_a_whole_batch_commits(spark: Any, dbs: Dbs, tmp_path: Path,
                                                                      request: pytest.FixtureRequest,
                                                                      sink: str) -> None:
    _register(spark)
    target = (ReplicaTarget(dbs, tmp_path) if sink == "replica"
              else KafkaTarget(dbs, tmp_path, request.getfixturevalue("kafka")))
    query = _start(spark, target, tmp_path / "stopped", chunks=0)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "stopped" / "streaming").exists():
            assert query.isActive and time.monotonic() < deadline, "the probe never streamed its second partition"
            time.sleep(0.1)
        time.sleep(1)  # the writer task holds the first partition's P row and some of the second's rows
    finally:
        query.stop()
    target.wait_for_writer()
    assert target.committed() == ([], 0), "a batch cut short by a stopped query was committed"
    # The same probe, with the second partition whole: the sink commits the batch.
    query = _start(spark, target, tmp_path / "whole", chunks=3)
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    assert target.committed() == ([(0, 1 + 3 * CHUNK_ROWS)], 1 + 3 * CHUNK_ROWS)
