"""The webhook sink's batch writer: the batch's one writer task POSTs its messages.

At least once: the writer task posts the batch's messages in order (webhook.batch) and returns
once every request was acknowledged; the driver then records the batch in the feed's ledger
(sinks.message_writer), and only after that does Spark record the batch as done and the source
release its WAL. A crash anywhere before replays the batch with the same requests and
idempotency keys.
"""
from __future__ import annotations

import time

from changefeed.core.outbox import OutboxEvent
from changefeed.sinks.batch_input import BatchInput
from changefeed.sinks.message_writer import Delivered, MessageWriter
from changefeed.sinks.messages import MessageStream, outbox_spec
from changefeed.sinks.source_ledger import SourceLedger
from changefeed.sinks.webhook.batch import WebhookBatch
from changefeed.sinks.webhook.client import WebhookClient
from changefeed.sinks.webhook.cuts import Batch, RequestLog
from changefeed.sinks.webhook.options import WebhookOptions


class WebhookWriter(MessageWriter):
    """The options of message_options, and `source` (the feed's first source node, where its
    ledger, lease and requests' cuts are), `epoch` (the runner's lease term), `lease_s`."""

    def ledger(self) -> SourceLedger:
        return SourceLedger(self.options["source"], self.options["key"])

    def write(self, batch: BatchInput) -> Delivered:
        o = self.options
        began = time.time()
        opts = WebhookOptions.parse(o["uri"])
        text = o["format"] == "text"
        stream = MessageStream(self.formatter(), outbox=outbox_spec(o), event_record=OutboxEvent.json_record)
        client = WebhookClient(opts)
        try:
            log = (RequestLog(o["source"], o["feed"], o["key"], int(o["epoch"]), float(o["lease_s"]))
                   if o.get("epoch") else None)
            out = WebhookBatch(client, opts, o["feed"], log)
            begun = False
            for rb in batch.in_order():
                if not begun and (first := Batch.of(rb)) is not None:
                    out.begin(first)
                    begun = True
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
