"""The Kafka sink's batch writer: the batch's one writer task writes it to Kafka.

Exactly once: the writer task delivers the whole batch in one Kafka transaction with its progress
record, or skips it when the progress topic shows it committed (kafka.batch); a one-node feed's
batch read again from an earlier position leaves out the changes committed before the recorded
end. In low-latency mode (`follow_end`) a followed batch commits a transaction per sub-window
(kafka.followed). The driver then records the batch in the feed's ledger file
(sinks.message_writer).
"""
from __future__ import annotations

import time

from changefeed import faults
from changefeed.core.envelope import resolved
from changefeed.errors import SinkError
from changefeed.sinks.batch_input import BatchInput, unsent
from changefeed.sinks.kafka.batch import KafkaBatch
from changefeed.sinks.kafka.followed import deliver_followed
from changefeed.sinks.kafka.options import KafkaOptions
from changefeed.sinks.message_writer import Delivered, MessageWriter
from changefeed.sinks.messages import MessageStream, outbox_spec


class KafkaWriter(MessageWriter):
    """Options: those of MessageWriter, and topics (the tables' topics, for resolved messages)."""

    def write(self, batch: BatchInput) -> Delivered:
        o = self.options
        began = time.time()
        if not batch.task.query_id:
            raise SinkError("the Kafka sink runs only inside a streaming query", "start it with changefeed run")
        opts = KafkaOptions.parse(o["uri"]).reading(o.get("progress_reader") or "auto")  # resolved by the driver
        stream = MessageStream(self.formatter(), opts.topic, opts.tombstones_for(o["format"]), outbox_spec(o),
                               event_topic=opts.event_topic)
        out = KafkaBatch(opts, o["key"], batch.task.query_id, batch.task.batch_id,
                         epoch=int(o["epoch"]) if o.get("epoch") else None)
        topics = [t for t in o["topics"].split(",") if t] if opts.emit_resolved else None
        if o.get("follow_end"):
            return Delivered(deliver_followed(batch, stream, out, topics), began, time.time())
        done = out.open()
        if done is not None:  # committed before a crash: Spark replays it, Kafka has it
            return Delivered(done.progress, began, time.time())
        recorded = out.recorded_end if not batch.multi_node else 0  # (a WAL position on one node only)
        try:
            for rb in batch.in_order():
                for part in stream.parts(unsent(rb, recorded)):
                    out.send_part(part)
            progress = stream.progress()
            if topics is not None:
                out.resolved(topics, resolved(progress.resolved_ts))
            faults.reach("before_sink_commit")
            out.close(progress)
            faults.reach("after_sink_commit")
        except BaseException:
            out.abort()
            raise
        return Delivered(progress, began, time.time())
