"""A batch whose writer task is cancelled mid-input commits nothing (real Spark session, real replica).

When a streaming query stops while its writer task reads, Spark can close the Python writer's input
cleanly between two input partitions, so the writer sees a normal end of input. The sink must see
from the `P` rows that partitions are missing and commit nothing: here a batch of two partitions, the
first whole (with its `P` row) and the second still streaming rows when the query is stopped.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from pyspark import cloudpickle

from changefeed.core import change as ch
from changefeed.sinks import postgres_replica as replica
from changefeed.spark import source as feed_source

from conftest import Dbs

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
        yield from feed_source._push_through()
        return
    chunks = int(options.get("chunks") or 0)
    yield ch.pack(_rows(ch.RELATION, range(0, 1), SHAPE.to_meta()))
    n = 0
    while not chunks or n < chunks:
        n += 1
        yield ch.pack(_rows("c", range(n * CHUNK_ROWS, (n + 1) * CHUNK_ROWS)))
        yield from feed_source._push_through()
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


def _start(spark: Any, dbs: Dbs, tmp: Path, chunks: int) -> Any:
    tmp.mkdir()
    return (spark.readStream.format("changefeed-two-partition-probe").option("dir", str(tmp))
            .option("chunks", str(chunks)).load().coalesce(1)
            .writeStream.format("changefeed-postgres").option("uri", dbs.sink).option("feed", dbs.name)
            .option("checkpointLocation", str(tmp / "checkpoint")).start())


def _writers_gone(dbs: Dbs) -> None:
    """Wait until no sink writer is connected: a cancelled task's writer may still be finishing."""
    deadline = time.monotonic() + 60
    with psycopg.connect(dbs.sink, autocommit=True) as d:
        while d.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'changefeed' "
                        "AND datname = current_database()").fetchone() != (0,):
            assert time.monotonic() < deadline, "the sink's writer task never ended"
            time.sleep(0.2)


def _sink_state(dbs: Dbs) -> tuple[list[Any], int]:
    with dbs.dst() as d:
        progress = d.execute("SELECT batch_id, changes FROM changefeed.progress WHERE feed = %s",
                             (dbs.name,)).fetchall()
        return progress, d.execute("SELECT count(*) FROM cut").fetchone()[0]  # type: ignore[index]


def test_stopped_mid_batch_commits_nothing_and_a_whole_batch_commits(spark: Any, dbs: Dbs, tmp_path: Path) -> None:
    _register(spark)
    with dbs.dst() as d:
        replica.ensure_meta(d)
        d.execute("CREATE TABLE cut (id integer PRIMARY KEY, v text)")
    query = _start(spark, dbs, tmp_path / "stopped", chunks=0)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "stopped" / "streaming").exists():
            assert query.isActive and time.monotonic() < deadline, "the probe never streamed its second partition"
            time.sleep(0.1)
        time.sleep(1)  # the writer task holds the first partition's P row and some of the second's rows
    finally:
        query.stop()
    _writers_gone(dbs)
    assert _sink_state(dbs) == ([], 0), "a batch cut short by a stopped query was committed"
    # The same probe, with the second partition whole: the sink commits the batch.
    query = _start(spark, dbs, tmp_path / "whole", chunks=3)
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    assert _sink_state(dbs) == ([(0, 1 + 3 * CHUNK_ROWS)], 1 + 3 * CHUNK_ROWS)
