"""One micro-batch delivered to a webhook: its messages cut into requests, posted in order.

A request goes out when it holds `flush_messages` messages, when its first message has waited
`flush_frequency` (checked as messages arrive), and at the end of the batch. Requests are posted
one after the other, each only once the one before it was acknowledged, so the receiver sees
changes in commit order (per-key order). Each request's idempotency key names the feed, the
batch and the positions of its messages in the batch: a retried request, and a batch replayed
after a crash and cut the same way (always, unless flush_frequency cut it), carries the same key.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable

from changefeed.core.envelope import resolved
from changefeed.sinks.ledger import FileLedger
from changefeed.sinks.webhook.client import WebhookClient, idempotency_key, request_body, resolved_body
from changefeed.sinks.webhook.options import WebhookOptions


class WebhookLedger(FileLedger):
    """The file ledger, plus a connection to the endpoint before the feed creates anything: a TCP
    connection and, for https, a TLS handshake with the certificate verified (no request is sent)."""

    def __init__(self, path: str, opts: WebhookOptions) -> None:
        super().__init__(path)
        self.opts = opts

    def check(self) -> None:
        WebhookClient(self.opts).check_reachable()


class WebhookBatch:
    def __init__(self, client: WebhookClient, opts: WebhookOptions, feed: str, batch_id: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.opts, self.feed, self.batch_id, self.clock = client, opts, feed, batch_id, clock
        self._pending: list[bytes] = []
        self._first_at = 0.0
        self.sent = 0  # messages acknowledged
        self.requests = 0

    def add(self, message: bytes) -> None:
        """Queue one message (a JSON document); post the request once it is due."""
        if not self._pending:
            self._first_at = self.clock()
        self._pending.append(message)
        waited = self.opts.flush_frequency_s and self.clock() - self._first_at >= self.opts.flush_frequency_s
        if len(self._pending) >= self.opts.flush_messages or waited:
            self.flush()

    def add_text(self, line: bytes) -> None:
        """A message that is not JSON (the text envelope) travels as a JSON string."""
        self.add(json.dumps(line.decode("utf-8", errors="replace"), ensure_ascii=False).encode())

    def flush(self) -> None:
        if not self._pending:
            return
        first, last = self.sent, self.sent + len(self._pending) - 1
        self.client.post(request_body(self._pending), idempotency_key(self.feed, self.batch_id, first, last),
                         f"batch {self.batch_id}, messages {first}-{last}")
        self.sent, self._pending = last + 1, []
        self.requests += 1

    def resolved(self, ts: int) -> None:
        """Post `{"resolved": ts}`: every change up to ts was delivered (sent after the batch's messages)."""
        self.flush()
        self.client.post(resolved_body(resolved(ts)), idempotency_key(self.feed, self.batch_id, -1, -1),
                         f"batch {self.batch_id}, resolved {ts}")
        self.requests += 1
