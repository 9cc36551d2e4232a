"""The webhook sink's batch writer: the batch's one writer task POSTs its messages.

At least once: the writer task posts the batch's messages in order (webhook.batch) and returns
once every request was acknowledged; the driver then records the batch in the feed's ledger
(sinks.message_writer), and only after that does Spark record the batch as done and the source
release its WAL. A crash anywhere before replays the batch with the same requests and
idempotency keys.

In low-latency mode (`follow_end`, core.followed) a followed batch posts what it holds at the
end of each sub-window rather than waiting for `flush_messages` or the batch's end, and its
resolved messages go out at most once a second, each right after a sub-window's request. A
replay cuts its requests where they were cut before (webhook.cuts), so they carry the same keys;
one that ends before the point the attempt before it had posted posts the rest in a request of
its own (at least once: the receiver may get those messages twice, under another key).
"""
from __future__ import annotations

import time
from typing import Any

from changefeed.core import change as ch
from changefeed.core import followed
from changefeed.core.outbox import OutboxEvent
from changefeed.errors import IncompleteBatch
from changefeed.sinks import handoff
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
            if o.get("follow_end"):
                return Delivered(deliver_followed(batch, stream, out, text, opts.emit_resolved), began, time.time())
            for rb in batch.in_order():
                _add(out, stream, rb, text)
            out.flush()
            progress = stream.progress()
            if opts.emit_resolved:
                out.resolved(progress.resolved_ts)
        finally:
            client.close()
        return Delivered(progress, began, time.time())


def _add(out: WebhookBatch, stream: MessageStream, rb: Any, text: bool) -> None:
    """Queue the messages of one record batch (the batch begun at its first change)."""
    if not out.begun and (first := Batch.of(rb)) is not None:
        out.begin(first)
    for message in stream.messages(rb):
        if message.record.value is None:
            continue  # a tombstone is for Kafka's log compaction
        (out.add_text if text and not message.event else out.add)(message.record.value)


def deliver_followed(batch: BatchInput, stream: MessageStream, out: WebhookBatch, text: bool,
                     emit_resolved: bool) -> ch.BatchProgress | None:
    """A batch of a feed in low-latency mode: each whole sub-window posted as it ends. Returns the
    progress of every sub-window (None: none came)."""
    parts: list[ch.BatchProgress] = []
    resolved_at, closed = float("-inf"), False
    for rb in batch.in_order():
        _add(out, stream, rb, text)
        closed = handoff.ends_with_progress(rb) and stream.whole()
        if not closed:
            continue
        posted = out.window_end()
        parts.append(stream.take_progress())
        if not emit_resolved:
            continue
        if not (parts[-1].offset or {}).get("follow"):  # a batch in micro-batches (a snapshot's): at its end
            out.resolved(parts[-1].resolved_ts)
        elif posted and time.monotonic() - resolved_at >= followed.RESOLVED_S:
            # only right after a request of this attempt: an attempt read again posts none until it
            # passed the cuts of the one before, so a resolved message never comes after a later one
            out.resolved(parts[-1].resolved_ts)
            resolved_at = time.monotonic()
    if out.pending and not closed:
        raise IncompleteBatch(f"the followed batch's input ended with {out.pending} messages no sub-window "
                              "closed: its task was cut short, and they are not posted",
                              "none: they are read again when the query runs next")
    # An attempt that ended before the point an earlier one had posted: the rest in one request
    # (under a key of its own; at least once, the receiver may see those messages again).
    out.flush()
    return followed.together(parts)
