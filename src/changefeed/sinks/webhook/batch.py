"""One micro-batch delivered to a webhook: its messages cut into requests, posted in order.

A request goes out when it holds `flush_messages` messages, when its first message has waited
`flush_frequency` (checked as messages arrive), and at the end of the batch. Requests are posted
one after the other, each only once the one before it was acknowledged, so the receiver sees
changes in commit order (per-key order). Each request's idempotency key names the feed, the
batch (by its first change's position, webhook.cuts.Batch) and the positions of its messages in
the batch. Before each request the runner's lease is checked and the cut recorded (webhook.cuts):
a retried request, and a batch sent again after a crash or by the runner that took the feed over,
is cut where it was before and carries the same key.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from changefeed import faults
from changefeed.core.envelope import resolved
from changefeed.sinks.source_ledger import SourceLedger
from changefeed.sinks.webhook.client import WebhookClient, idempotency_key, request_body, resolved_body
from changefeed.sinks.webhook.cuts import Batch, RequestLog, ensure
from changefeed.sinks.webhook.options import WebhookOptions


class WebhookLedger(SourceLedger):
    """The ledger on the source, plus a connection to the endpoint before the feed creates anything:
    a TCP connection and, for https, a TLS handshake with the certificate verified (no request is
    sent); `prepare` makes the table of the requests' cuts too."""

    def __init__(self, uri: str, feed: str, legacy: str, opts: WebhookOptions) -> None:
        super().__init__(uri, feed, legacy)
        self.opts = opts

    def check(self) -> None:
        WebhookClient(self.opts).check_reachable()

    def prepare(self, tables: list[Any]) -> None:
        super().prepare(tables)
        ensure(self.uri)


class WebhookBatch:
    """One batch's requests. `log` (None: no lease to check, e.g. a test) checks the lease and
    records each request's cut before it goes out."""

    def __init__(self, client: WebhookClient, opts: WebhookOptions, feed: str, log: RequestLog | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.opts, self.feed, self.log, self.clock = client, opts, feed, log, clock
        self.batch, self.begun = Batch(0, 0, 0), False  # until `begin`
        self._cuts: list[int] = []  # where the batch's requests were cut before, by request
        self._pending: list[bytes] = []
        self._first_at = 0.0
        self.sent = 0  # messages acknowledged
        self.requests = 0

    @property
    def pending(self) -> int:
        """Messages queued and not posted yet."""
        return len(self._pending)

    def begin(self, batch: Batch) -> None:
        """Before the first message: the batch's identity, and the cuts made when it was sent before."""
        self.batch, self.begun = batch, True
        self._cuts = self.log.cuts(batch) if self.log is not None else []

    def add(self, message: bytes) -> None:
        """Queue one message (a JSON document); post the request once it is due (where it was cut
        before, if the batch was sent before)."""
        if not self._pending:
            self._first_at = self.clock()
        self._pending.append(message)
        if self.requests < len(self._cuts):
            if self.sent + len(self._pending) - 1 >= self._cuts[self.requests]:
                self.flush()
            return
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
        faults.reach("webhook_request")
        if self.log is not None:
            self.log.admit(self.batch, self.requests, last)
        body = request_body(self._pending)
        self.client.post(body, idempotency_key(self.feed, self.batch.key, first, last, body),
                         f"batch {self.batch.key}, messages {first}-{last}")
        self.sent, self._pending = last + 1, []
        self.requests += 1

    def window_end(self) -> bool:
        """A sub-window ended (low-latency mode): post what is queued, unless the cuts of an
        earlier attempt of the batch still say where its requests end (the same keys again).
        Whether a request went out."""
        if self.requests < len(self._cuts) or not self._pending:
            return False
        self.flush()
        return True

    def resolved(self, ts: int) -> None:
        """Post `{"resolved": ts}`: every change up to ts was delivered (sent after the batch's messages)."""
        self.flush()
        if self.log is not None:
            self.log.admit(self.batch, None, -1)
        self.client.post(resolved_body(resolved(ts)), idempotency_key(self.feed, str(ts), -1, -1),
                         f"resolved {ts}")
        self.requests += 1
