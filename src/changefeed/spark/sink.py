"""`changefeed-postgres` PySpark streaming sink: the batch's one writer task applies it atomically.

The query has one writer task per micro-batch (see `job.start_query`), so the task itself can
apply the whole batch in one target transaction and commit it: the progress row in that
transaction makes a retried task or a replayed batch a no-op, and the source advances its slot
only after Spark has seen the task succeed. Applying while reading needs the task to keep
taking input while the database merges: a thread applies chunks from a short queue.

The applier (numpy, Arrow, psycopg) is imported by `write` alone: Spark imports this module in
each of the Python processes it starts one after another to plan a query, where ~0.2 s each
of imports would only delay a feed's start.
"""
from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pyspark import TaskContext
from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter, WriterCommitMessage

from ..core import change as ch
from ..errors import SinkError, carried

if TYPE_CHECKING:
    from ..sinks import postgres_replica as replica

QUEUED_CHUNKS = 4  # chunks (up to ~64k changes each) read ahead while the database merges


class AppliedMessage(WriterCommitMessage):
    def __init__(self, applied: replica.Applied) -> None:
        self.applied = applied


class PostgresReplicaSink(DataSource):
    """Options: uri, feed, multi_node, resync (tables that follow any schema change, see
    core.schema_change), renamed (JSON [[old, new], ...]: tables renamed on the source)."""

    @classmethod
    def name(cls) -> str:
        return "changefeed-postgres"

    def streamWriter(self, schema: Any, overwrite: bool) -> "ReplicaStreamWriter":
        return ReplicaStreamWriter(dict(self.options))


def batch_id() -> int:
    """The micro-batch this writer task belongs to (Spark passes it as a task property)."""
    ctx = TaskContext.get()
    batch = ctx.getLocalProperty("streaming.sql.batchId") if ctx is not None else None
    if batch is None:
        raise SinkError("changefeed sinks run only inside a streaming query's micro-batch",
                        "start it with writeStream (changefeed run does)")
    return int(batch)


class ReplicaStreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, options: dict[str, str]) -> None:
        self.uri = options["uri"]
        self.feed = options["feed"]
        self.multi_node = options.get("multi_node") == "true"
        self.resync = frozenset(t for t in (options.get("resync") or "").split(",") if t)
        self.renamed = dict(json.loads(options.get("renamed") or "[]"))

    def write(self, iterator: Iterator[Any]) -> AppliedMessage:
        if self.multi_node:
            return self._write_merged(iterator)
        return self._write_streaming(iterator)

    def _write_merged(self, iterator: Iterator[Any]) -> AppliedMessage:
        """A batch of several nodes: read all its partitions, put their rows in one order (see
        core.merge), then apply them. The batch is held in memory meanwhile: at most about
        --max-bytes-per-batch of WAL per node, decoded."""
        from ..core import merge
        from ..postgres.connect import connect, lost_connection
        from ..sinks import postgres_replica as replica

        with carried("sink"):
            parts = merge.split(rb for packed in iterator for rb in ch.unpack(packed))
            progress = ch.BatchProgress.of([p.progress for p in parts])
            with connect(self.uri, "sink", autocommit=True) as conn, lost_connection("sink"):
                applier = replica.BatchApplier(conn, self.feed, batch_id(), in_stream_order=True,
                                               resync=self.resync, renamed=self.renamed)
                applier.begin()
                try:
                    if not applier.covers(progress):  # a batch applied before adds nothing
                        merge.refuse_truncate(parts)
                        for rb in merge.ordered(parts).to_batches(max_chunksize=65536):
                            applier.add(rb)
                    for p in parts:
                        applier.add(ch.progress_batch(p.progress))
                except BaseException:
                    applier.rollback()
                    raise
                return AppliedMessage(applier.commit())

    def commit(self, messages: list[AppliedMessage | None], batchId: int) -> None:
        """Nothing left to do: the writer task committed the batch on the replica."""

    def abort(self, messages: list[AppliedMessage | None], batchId: int) -> None:
        """Nothing to undo: a failed task rolled back; a committed one is skipped when replayed."""

    def _write_streaming(self, iterator: Iterator[Any]) -> AppliedMessage:
        """A one-node batch: applied while it is read (its rows come in commit order)."""
        from ..postgres.connect import connect, lost_connection
        from ..sinks import postgres_replica as replica

        chunks: queue.Queue[Any] = queue.Queue(QUEUED_CHUNKS)
        failed: list[BaseException] = []
        done = object()

        def apply() -> None:
            try:
                while (rb := chunks.get()) is not done:
                    applier.add(rb)
            except BaseException as e:  # noqa: BLE001 - handed to the task thread
                failed.append(e)
                while chunks.get() is not done:  # let the reader finish; its data is not needed
                    pass

        with carried("sink"), connect(self.uri, "sink", autocommit=True) as conn, lost_connection("sink"):
            applier = replica.BatchApplier(conn, self.feed, batch_id(), resync=self.resync,
                                           renamed=self.renamed)
            applier.begin()
            worker = threading.Thread(target=apply, name="changefeed-apply", daemon=True)
            worker.start()
            try:
                for packed in iterator:
                    if failed:
                        break
                    for rb in ch.unpack(packed):
                        chunks.put(rb)
            finally:
                chunks.put(done)
                worker.join()
            if failed:
                applier.rollback()
                raise failed[0]
            return AppliedMessage(applier.commit())
