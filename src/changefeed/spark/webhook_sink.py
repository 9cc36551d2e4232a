"""`changefeed-webhook` PySpark streaming sink: the batch's one writer task POSTs its messages.

At least once: the writer task posts the batch's messages in order (sinks.webhook_batch) and
returns once every request was acknowledged; the driver then records the batch in the feed's
ledger (spark.message_writer), and only after that does Spark record the batch as done and
the source release its WAL. A crash anywhere before replays the batch with the same requests
and idempotency keys.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from pyspark.sql.datasource import DataSource

from ..core.outbox import OutboxEvent
from ..errors import carried
from ..sinks.messages import MessageStream, outbox_spec
from ..sinks.webhook import WebhookClient, WebhookOptions
from ..sinks.webhook_batch import WebhookBatch
from .message_writer import Delivered, MessageWriter
from .sink import batch_id


class WebhookSink(DataSource):
    """Options: those of spark.message_writer.MessageWriter."""

    @classmethod
    def name(cls) -> str:
        return "changefeed-webhook"

    def streamWriter(self, schema: Any, overwrite: bool) -> "WebhookStreamWriter":
        return WebhookStreamWriter(dict(self.options))


class WebhookStreamWriter(MessageWriter):
    @carried("sink")
    def write(self, iterator: Iterator[Any]) -> Delivered:
        o = self.options
        began = time.time()
        opts = WebhookOptions.parse(o["uri"])
        text = o["format"] == "text"
        stream = MessageStream(self.formatter(), outbox=outbox_spec(o), event_record=OutboxEvent.json_record)
        client = WebhookClient(opts)
        try:
            out = WebhookBatch(client, opts, o["feed"], batch_id())
            for rb in self.batches(iterator):
                for message in stream.messages(rb):
                    if message.record.value is None:
                        continue  # a tombstone is for Kafka's log compaction
                    (out.add_text if text and not message.event else out.add)(message.record.value)
            out.flush()
            progress = stream.progress()
            if opts.emit_resolved:
                out.resolved(progress.resolved_ts)
        finally:
            client.close()
        return Delivered(progress, began, time.time())

    def abort(self, messages: list[Delivered | None], batchId: int) -> None:
        """Nothing to undo: what was posted stays posted; the replay re-sends it with the same keys."""
