"""The webhook sink: each change POSTed as JSON (or text) to an HTTP endpoint, at least once.

`client` holds the options and the HTTP client, `batch` a batch's requests, `writer` the batch writer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..base import BatchWriter, Sink, ledger_path
from ..message_writer import message_options

if TYPE_CHECKING:
    from ...config import FeedSpec, FeedState
    from ..ledger import Ledger


class WebhookSink(Sink):
    name = "webhook"
    messages = True  # delivers in arrival order: snapshot chunk rows must come after their window's changes

    def validate(self, uri: str) -> None:
        from .options import WebhookOptions

        WebhookOptions.parse(uri)

    def open_ledger(self, spec: "FeedSpec", state: "FeedState") -> "Ledger":
        from .batch import WebhookLedger
        from .options import WebhookOptions

        return WebhookLedger(ledger_path(state), WebhookOptions.parse(spec.sink))

    def writer_options(self, spec: "FeedSpec", state: "FeedState") -> dict[str, str]:
        return message_options(spec, state)

    def writer(self, options: dict[str, str]) -> BatchWriter:
        from .writer import WebhookWriter

        return WebhookWriter(options)


SINK = WebhookSink()
