"""The webhook sink: each change POSTed as JSON (or text) to an HTTP endpoint, at least once.

`client` holds the options and the HTTP client, `batch` a batch's requests, `writer` the batch writer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from changefeed.sinks.base import BatchWriter, Sink, ledger_path
from changefeed.sinks.message_writer import message_options

if TYPE_CHECKING:
    from changefeed.sinks.ledger import Ledger
    from changefeed.spec.definition import FeedSpec
    from changefeed.spec.state import FeedState


class WebhookSink(Sink):
    name = "webhook"
    messages = True  # delivers in arrival order: snapshot chunk rows must come after their window's changes
    in_parts = True  # request by request, each acknowledged before the batch is recorded

    def validate(self, uri: str) -> None:
        from changefeed.sinks.webhook.options import WebhookOptions

        WebhookOptions.parse(uri)

    def open_ledger(self, spec: "FeedSpec", state: "FeedState") -> "Ledger":
        from changefeed.sinks.webhook.batch import WebhookLedger
        from changefeed.sinks.webhook.options import WebhookOptions

        return WebhookLedger(spec.sources[0].uri, spec.key, ledger_path(spec, state), WebhookOptions.parse(spec.sink))

    def resumable(self, uri: str) -> bool:
        return True  # its ledger is on the source; each request checks the lease (webhook.cuts)

    def writer_options(self, spec: "FeedSpec", state: "FeedState") -> dict[str, str]:
        return {**message_options(spec, state), "source": spec.sources[0].uri, "lease_s": str(spec.lease_s)}

    def writer(self, options: dict[str, str]) -> BatchWriter:
        from changefeed.sinks.webhook.writer import WebhookWriter

        return WebhookWriter(options)


SINK = WebhookSink()
