"""What every sink is: one `Sink` per package `sinks/NAME/`, found by URI scheme (sinks.registry).

A sink has two halves. The control plane (create, run, status, remove) uses the `Sink` itself: it
checks the URI, opens the sink's `Ledger` (how far the sink is, sinks.ledger), and names the
options its Spark writer needs. The data path (spark.writer, the one generic Spark sink) builds
the sink's `BatchWriter` from those options: `write` runs on each writer task of a micro-batch
with the batch's rows (sinks.batch_input) and returns a picklable result; `commit` runs once on
the driver with every task's result, after all tasks wrote and before Spark records the batch as
done. A sink whose tasks commit on their own (the replica, Kafka) has little to do there; one that
writes in parallel (Delta) commits there, once, with everything the tasks wrote.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from changefeed.sinks.batch_input import BatchInput

if TYPE_CHECKING:
    from changefeed.sinks.ledger import Ledger
    from changefeed.spec.definition import FeedSpec
    from changefeed.spec.state import FeedState


class BatchWriter(Protocol):
    def write(self, batch: "BatchInput") -> Any:
        """On a writer task: deliver this task's share of the batch; return what `commit` needs."""

    def commit(self, results: list[Any], batch_id: int) -> None:
        """On the driver, once every task's `write` returned."""

    def abort(self, results: list[Any], batch_id: int) -> None:
        """On the driver, when the batch failed: leave nothing a replay would not overwrite or skip."""


class Recorded(Protocol):
    """How far a sink recorded a one-node feed: the end LSN of its last committed batch or
    sub-window (0: none). Asked now and then from a followed batch's read task, which confirms it
    to the slot as it follows (spark.follow); `close` frees what the asking holds."""

    def __call__(self) -> int: ...

    def close(self) -> None: ...


class Sink:
    """A kind of sink. Subclasses set the class attributes and override what differs."""

    name = ""
    messages = False  # delivers formatted messages (--format), not rows
    parallel_reads = False  # the arrival order of a batch's input partitions at its writer does not matter
    in_parts = False  # a batch shows at its destination in parts before it is recorded (spark.checkpoint.resume)
    # --snapshot-chunks-per-batch auto, chunks read in one task: how many times --max-bytes-per-batch
    # of rows a batch carries (core.snapshot.auto_chunks). More where the writer applies the rows
    # as they stream, holding neither them nor a transaction that times out.
    snapshot_budget = 1

    def validate(self, uri: str) -> None:
        """Check the URI and its options without connecting (ConfigError)."""

    def resumable(self, uri: str) -> bool:
        """Whether the sink at `uri` records each batch's end offset with the batch
        (Ledger.resume_offset) and fences earlier lease terms: a runner without the feed's
        checkpoint (a standby taking over) can start from it."""
        return False

    def check_feed(self, spec: "FeedSpec") -> None:
        """Refuse (ConfigError) a feed this sink cannot serve (its URI is valid)."""

    def needs_key(self, uri: str) -> bool:
        """Whether this sink applies changes by key, so that a table without one (captured under
        REPLICA IDENTITY FULL) cannot go to it. Message sinks and a change log only append."""
        return False

    def open_ledger(self, spec: "FeedSpec", state: "FeedState") -> "Ledger":
        raise NotImplementedError

    def writer_options(self, spec: "FeedSpec", state: "FeedState") -> dict[str, str]:
        """Options the Spark writer passes on to `writer`, beyond the ones every sink gets."""
        return {}

    def writer(self, options: dict[str, str]) -> BatchWriter:
        raise NotImplementedError

    def recorded(self, options: dict[str, str]) -> Recorded | None:
        """On an executor, from the writer's `options`: how far the sink recorded the feed, for a
        feed in low-latency mode (None: the sink cannot say; its slot moves at batch ends only)."""
        return None

    def plan(self, changes: Any, spec: "FeedSpec", parallel_reads: bool) -> Any:
        """The batch's packed change rows (a Spark DataFrame, one partition per WAL window or
        snapshot chunk) as this sink's writer tasks take them. By default all in one task, which
        applies or delivers the batch in one place: with `parallel_reads` (and always on a feed
        of several nodes, one task per node's window) the input partitions are read by tasks of
        their own and shuffled to it; without, that task reads them itself, one after the other,
        and no shuffle is paid for."""
        return changes.repartition(1) if parallel_reads or spec.multi_node else changes.coalesce(1)

    @property
    def takes_rows_as_read(self) -> bool:
        """Whether the writer task takes the batch's packed rows as the read yields them (`plan`
        as here), so that a snapshot chunk may travel as a reference the writer reads itself."""
        return type(self).plan is Sink.plan

    def beside(self, packed: Iterator[Any], options: dict[str, str]) -> Iterator[Any]:
        """The batch's packed rows (one task's, all of them) as this sink's writer takes them when it
        writes beside other sinks in one task (sinks.fan_out): as `plan` shapes them, in that task."""
        return packed

    def __repr__(self) -> str:
        return f"<sink {self.name}>"


def ledger_path(spec: "FeedSpec", state: "FeedState") -> str:
    """Where a sink without a place of its own keeps its ledger (sinks.ledger.FileLedger): one file
    per sink of the feed (spec.sinks: a named sink's key is FEED.NAME)."""
    named = spec.key.removeprefix(spec.name)
    return str(state.dir / f"delivered{named}.jsonl")


def task_slots(spark: Any) -> int:
    """How many tasks `spark` runs at once (Spark's default parallelism). A Spark Connect session
    has no SparkContext to ask: there it is the partition count of a range Spark splits by that
    default, one small job, asked once per session."""
    if not _is_connect(spark):
        return int(spark.sparkContext.defaultParallelism)
    if not hasattr(spark, "_changefeed_task_slots"):
        from pyspark.sql import functions as F

        row = spark.range(0, 1 << 16).withColumn("p", F.spark_partition_id()).agg(F.max("p").alias("p")).first()
        spark._changefeed_task_slots = int(row["p"]) + 1
    return int(spark._changefeed_task_slots)


def _is_connect(spark: Any) -> bool:
    return type(spark).__module__.startswith("pyspark.sql.connect")
