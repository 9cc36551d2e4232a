"""`changefeed-kafka` PySpark streaming sink: the batch's one writer task writes it to Kafka.

Exactly once: the writer task delivers the whole batch in one Kafka transaction with its progress
record, or skips it when the progress topic shows it committed (sinks.kafka_batch). The driver
then records it in the feed's ledger file (spark.message_writer).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from pyspark import TaskContext
from pyspark.sql.datasource import DataSource

from .. import faults
from ..core.envelope import resolved
from ..errors import SinkError, carried
from ..sinks.kafka import KafkaOptions
from ..sinks.kafka_batch import KafkaBatch
from ..sinks.messages import MessageStream, outbox_spec
from .message_writer import Delivered, MessageWriter
from .sink import batch_id


class KafkaSink(DataSource):
    """Options: those of spark.message_writer.MessageWriter, and topics (the tables' topics, for
    resolved messages)."""

    @classmethod
    def name(cls) -> str:
        return "changefeed-kafka"

    def streamWriter(self, schema: Any, overwrite: bool) -> "KafkaStreamWriter":
        return KafkaStreamWriter(dict(self.options))


def query_id() -> str:
    """Spark's id of the streaming query: kept in its checkpoint, so the same after every restart."""
    ctx = TaskContext.get()
    query = ctx.getLocalProperty("sql.streaming.queryId") if ctx is not None else None
    if not query:
        raise SinkError("the Kafka sink runs only inside a streaming query", "start it with changefeed run")
    return str(query)


class KafkaStreamWriter(MessageWriter):
    @carried("sink")
    def write(self, iterator: Iterator[Any]) -> Delivered:
        o = self.options
        began = time.time()
        opts = KafkaOptions.parse(o["uri"])
        stream = MessageStream(self.formatter(), opts.topic, opts.tombstones_for(o["format"]), outbox_spec(o),
                               event_topic=opts.event_topic)
        out = KafkaBatch(opts, o["feed"], query_id(), batch_id())
        done = out.open()
        if done is not None:  # committed before a crash: Spark replays it, Kafka has it
            return Delivered(done.progress, began, time.time())
        try:
            for rb in self.batches(iterator):
                for message in stream.messages(rb):
                    out.send(message.topic, message.record)
                    if out.sent % 1000 == 0:
                        faults.reach("sink_write")  # crash tests: in the middle of a transaction
            progress = stream.progress()
            if opts.emit_resolved:
                out.resolved([t for t in o["topics"].split(",") if t], resolved(progress.resolved_ts))
            faults.reach("before_sink_commit")
            out.close(progress)
            faults.reach("after_sink_commit")
        except BaseException:
            out.abort()
            raise
        return Delivered(progress, began, time.time())

    def abort(self, messages: list[Delivered | None], batchId: int) -> None:
        """Nothing to undo: a failed task aborted its transaction (or the next one's fencing does)."""
