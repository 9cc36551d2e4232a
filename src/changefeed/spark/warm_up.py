"""Python workers started, with the feed's modules imported, before its batches need them.

Spark runs a Python data source's streaming commit on the driver, in a Python worker of a pool
of its own (keyed by the worker's module), started by the first commit that needs one: a daemon
process, pyspark's SQL modules, then the sink's. On a feed's own Spark that start fell between
its first batch's write and its commit, on the way to every later batch (bench/README.md). A
tiny query through a sink of the same kind, run beside the feed's start, leaves a worker of that
pool behind, idle, with the sink's modules loaded, for the feed's first commit to take.

Only ever a speed-up: a warm-up that fails, or is late, leaves the feed's batches to start their
workers as they always could."""
from __future__ import annotations

import importlib
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSource, DataSourceStreamWriter, WriterCommitMessage

if TYPE_CHECKING:
    from changefeed.spec.definition import FeedSpec

WARM_S = 120.0  # a warm-up query still running after this is stopped


def feed_modules(spec: FeedSpec) -> list[str]:
    """What a feed's writer tasks and commits import: its reader and its sinks' writers."""
    from changefeed.sinks.registry import sink_of

    return ["changefeed.spark.reads", "changefeed.spark.writer",
            *(f"changefeed.sinks.{sink_of(t.uri).name}.writer" for t in spec.sink_targets)]


def _load(modules: str) -> None:
    for name in modules.split(","):
        importlib.import_module(name)


def warm_workers(spark: Any, spec: FeedSpec) -> None:
    """Run one small job whose tasks import what the feed's tasks will, so that the Python workers
    Spark keeps for later tasks have it loaded: a standby does this while it waits, and its first
    batch after a takeover does not pay the imports. Once per session (a standby that waits on
    after another took the turn has them loaded)."""
    from changefeed.sinks.base import task_slots

    if getattr(spark, "_changefeed_warm", False):
        return
    modules, slots = ",".join(feed_modules(spec)), task_slots(spark)

    def load(batches: Any) -> Any:
        _load(modules)
        yield from batches

    try:
        spark.range(slots, numPartitions=slots).mapInArrow(load, "id long").collect()
    except Exception:  # noqa: BLE001 (only a speed-up: the feed's own tasks import, and report, what fails)
        return
    spark._changefeed_warm = True


class _Warmed(WriterCommitMessage):
    pass


class _WarmWriter(DataSourceStreamWriter):
    def __init__(self, modules: str) -> None:
        self.modules = modules

    def write(self, iterator: Iterator[Any]) -> _Warmed:
        _load(self.modules)
        for _ in iterator:
            pass
        return _Warmed()

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        _load(self.modules)


class WarmSink(DataSource):
    """`changefeed-warm`: a sink that writes nothing; its tasks and its commit import `modules`."""

    @classmethod
    def name(cls) -> str:
        return "changefeed-warm"

    def schema(self) -> str:
        return "value long"

    def streamWriter(self, schema: Any, overwrite: bool) -> _WarmWriter:
        return _WarmWriter(self.options["modules"])


def warm_commit(spark: Any, spec: FeedSpec, checkpoint: Path) -> threading.Thread | None:
    """Start, in a thread of its own, one batch of one row through `changefeed-warm` on the feed's
    own Spark session, with its checkpoint in `checkpoint` (made anew, removed at its end; a
    process killed meanwhile leaves it for the next run to replace); None once the session had
    one, and on a Spark Connect server (no driver of the feed's own: the server's pool of workers
    is shared, warm from earlier feeds). The thread ends with the query."""
    if getattr(spark, "_jsparkSession", None) is None or getattr(spark, "_changefeed_commit_warm", False):
        return None
    spark._changefeed_commit_warm = True
    thread = threading.Thread(target=_warm_query, args=(spark, ",".join(feed_modules(spec)), checkpoint),
                              name="changefeed-warm-commit", daemon=True)
    thread.start()
    return thread


def _warm_query(spark: Any, modules: str, checkpoint: Path) -> None:
    try:
        shutil.rmtree(checkpoint, ignore_errors=True)  # (left by a run killed while it ran)
        # (a query started from another thread looks its sink up in the thread's active session)
        spark._jvm.org.apache.spark.sql.SparkSession.setActiveSession(spark._jsparkSession)
        spark.dataSource.register(WarmSink)
        query = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", 1).load().select("value")
                 .writeStream.format("changefeed-warm").option("modules", modules)
                 .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
        if not query.awaitTermination(WARM_S):
            query.stop()
    except Exception:  # noqa: BLE001 (only a speed-up; Spark stopped under it when a short run ends)
        pass
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)
