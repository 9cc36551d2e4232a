"""How long a row takes inside one long-lived Spark task, from the Python worker that reads it to
the one that writes it: the part of the low-latency design of issue 42 that Spark adds to
bench/latency_floor.py's figures (see bench/README.md, spark_transit.py).

A toy streaming source with one input partition per micro-batch whose read lasts --task-seconds
and yields one small packed row every --every-ms, stamped with the wall time it was yielded, each
followed by the feed's push-through rows (core.change.push_through); the toy sink's writer task
notes when each arrives. The session is the feed's own (spark.job.spark_session: the same Arrow
batch size and buffers). Prints the transit's median, p99 and max over the batches after the first.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)


class Stamped(DataSource):
    @classmethod
    def name(cls) -> str:
        return "transit_source"

    def schema(self) -> str:
        return "rows int, changes binary"

    def streamReader(self, schema: Any) -> "StampedReader":
        return StampedReader(float(self.options["task_seconds"]), float(self.options["every_ms"]) / 1000,
                             int(self.options["push"]))


class StampedReader(DataSourceStreamReader):
    def __init__(self, seconds: float, every: float, push: int) -> None:
        self.seconds, self.every, self.push, self.n = seconds, every, push, 0

    def initialOffset(self) -> dict[str, int]:
        return {"n": 0}

    def latestOffset(self) -> dict[str, int]:
        self.n += 1
        return {"n": self.n}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        return [InputPartition(end["n"])]

    def commit(self, end: dict[str, int]) -> None:
        pass

    def read(self, partition: InputPartition) -> Iterator[Any]:
        import pyarrow as pa

        from changefeed.core import change as ch

        push = ch.push_through(int(os.environ.get("SPARK_BUFFER_SIZE") or 65536) + 1)
        push = (push * self.push)[:self.push] if self.push else push
        until = time.time() + self.seconds
        while (now := time.time()) < until:
            stamp = pa.RecordBatch.from_arrays([pa.array([now], pa.float64())], names=["stamp"])
            yield ch.pack(stamp)
            yield from push
            time.sleep(max(0.0, self.every - (time.time() - now)))


class Noted(WriterCommitMessage):
    def __init__(self, transit: list[float]) -> None:
        self.transit = transit


class TransitSink(DataSource):
    @classmethod
    def name(cls) -> str:
        return "transit_sink"

    def streamWriter(self, schema: Any, overwrite: bool) -> "TransitWriter":
        return TransitWriter(self.options["out"])


class TransitWriter(DataSourceStreamArrowWriter):
    def __init__(self, out: str) -> None:
        self.out = out

    def write(self, iterator: Iterator[Any]) -> Noted:
        from changefeed.core import change as ch

        transit = []
        for packed in iterator:
            for rb in ch.unpack(packed):
                transit += [time.time() - s for s in rb.column("stamp").to_pylist()]
        return Noted(transit)

    def commit(self, messages: list[Any], batchId: int) -> None:
        with open(self.out, "a") as f:
            f.write(json.dumps({"batch": batchId, "transit": [t for m in messages for t in m.transit]}) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task-seconds", type=float, default=10.0, help="how long each batch's read lasts")
    ap.add_argument("--every-ms", type=float, default=20.0, help="a row this often")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--push", type=int, default=0, help="push-through rows after each row (0: the feed's)")
    args = ap.parse_args()
    from changefeed.spark.job import spark_session

    work = Path(tempfile.mkdtemp(prefix="spark-transit-"))
    spark = spark_session("local[2]", log=work / "spark.log")
    spark.dataSource.register(Stamped)
    spark.dataSource.register(TransitSink)
    out = work / "transit.jsonl"
    query = (spark.readStream.format("transit_source").option("task_seconds", str(args.task_seconds))
             .option("every_ms", str(args.every_ms)).option("push", str(args.push)).load()
             .writeStream.format("transit_sink").option("out", str(out))
             .option("checkpointLocation", str(work / "checkpoint")).start())
    while not out.exists() or len(out.read_text().splitlines()) < args.batches:
        if query.exception() is not None:
            raise SystemExit(str(query.exception()))
        time.sleep(0.5)
    query.stop()
    batches = [json.loads(line) for line in out.read_text().splitlines()]
    ms = sorted(t * 1000 for b in batches[1:] for t in b["transit"])
    print(f"{len(ms)} rows over {len(batches) - 1} batches after the first, one every {args.every_ms:.0f} ms in "
          f"tasks of {args.task_seconds:.0f} s: transit median {statistics.median(ms):.2f} ms, "
          f"p99 {ms[int(0.99 * len(ms))]:.2f} ms, max {ms[-1]:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
