"""Webhook sink, HTTP core: request bodies and keys, and a retrying client (options: options.py).

Delivery is at least once: a request whose answer got lost is sent again, with the same body and
the same `Idempotency-Key`, so an endpoint that remembers keys can drop the repeat. With a
`signing_secret` every attempt is signed by the Standard Webhooks scheme: `webhook-id` (the
idempotency key, the same on every retry), `webhook-timestamp` (the attempt's, Unix seconds) and
`webhook-signature` (`v1,` and the base64 HMAC-SHA256 of `id.timestamp.body`). Failures that
may pass (5xx, 408, 429, timeouts, dropped connections) are retried with capped exponential
backoff and full jitter; answers that will not change (other 4xx, 3xx, a certificate the client
does not trust) fail at once with `SinkError`, so the operator hears about them without waiting
out the retries. Stdlib only and nothing at import: it runs inside Spark writer tasks.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import itertools
import json
import random
import re
import ssl
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Self
from urllib.parse import unquote, urlsplit

from changefeed import __version__
from changefeed.core.backoff import full_jitter
from changefeed.errors import ConnectionFailed, SinkError, TransientError
from changefeed.sinks.webhook.options import WebhookOptions, _redact, _show
from changefeed.spec.secrets import resolve

USER_AGENT = f"changefeed/{__version__}"
EXCERPT_CHARS = 200  # of a response body, in error messages
STOP_POLL_S = 0.05  # how often a retry wait asks should_stop()


def request_body(messages: Sequence[bytes]) -> bytes:
    """`{"payload":[<message>,...],"length":N}`. Each message is already a JSON document (the
    envelope wrote it) and is embedded as is: decoding and encoding it again would cost as much
    as formatting it did."""
    return b'{"payload":[' + b",".join(messages) + b'],"length":' + str(len(messages)).encode() + b"}"


def resolved_body(message: bytes) -> bytes:
    """A resolved message (`{"resolved":"<ts>"}`) is a request's whole body. Checked to be JSON
    (ValueError if not: a bug in the caller), being small and rare."""
    json.loads(message)
    return message


def idempotency_key(feed: str, batch: str, first: int, last: int, body: bytes = b"") -> str:
    """The key of one request: `{feed}-{batch}-{first}-{last}-{hash}`, the (0-based, inclusive)
    positions of the messages it carries within the batch named `batch` (by its first change's
    position, webhook.cuts.Batch) and a hash of its body; `{feed}-{ts}-resolved` for a resolved
    message (first = last = -1, `batch` its resolved ts). The same request always gets the same
    key: on a retry, and when its batch is sent again, cut as before (webhook.cuts). A request
    sent again with other content (a snapshot chunk read again, a batch that reaches further)
    gets another key, so a receiver that drops repeated keys never drops a change it did not get.
    Feed names have no `-`."""
    if first == last == -1:
        return f"{feed}-{batch}-resolved"
    if not 0 <= first <= last:
        raise ValueError(f"message positions must be 0 <= first <= last, got {first}-{last}")
    return f"{feed}-{batch}-{first}-{last}-{hashlib.blake2b(body, digest_size=8).hexdigest()}"


def backoff_delays(opts: WebhookOptions, rng: Callable[[], float] = random.random) -> Iterator[float]:
    """The delays before retry 1, 2, ...: `core.backoff.full_jitter` from retry_backoff up to
    retry_max_backoff (full jitter: retrying writers spread out instead of hitting a recovering
    endpoint together). `retry_max` of them, or endlessly for None."""
    attempts = itertools.count(1) if opts.retry_max is None else range(1, opts.retry_max + 1)
    for n in attempts:
        yield full_jitter(n, opts.retry_backoff_s, opts.retry_max_backoff_s, rng)


def _retry_after(header: str | None) -> float | None:
    """Retry-After in (possibly fractional) seconds; the HTTP-date form is ignored (plain backoff)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*", header or "")
    return float(m.group(1)) if m else None


def _excerpt(data: bytes) -> str:
    text = " ".join(data[: EXCERPT_CHARS * 4].decode("utf-8", errors="replace").split())
    return (text[:EXCERPT_CHARS] + "...") if len(text) > EXCERPT_CHARS else text or "<empty body>"


@dataclass(frozen=True)
class _Failure:
    """One attempt that may pass when repeated."""

    what: str  # for messages: the status and body excerpt, or the exception
    retry_after: float | None = None
    stale: bool = False  # a kept-alive connection the server had closed: re-send at once, once


# A connection the server closed while it sat idle fails the next request in one of these ways.
_STALE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, http.client.RemoteDisconnected)


def _describe(e: BaseException, timeout_s: float) -> str:
    if isinstance(e, TimeoutError):
        return f"no answer within the timeout ({timeout_s:g}s)"
    if isinstance(e, http.client.RemoteDisconnected):
        return "the server closed the connection without answering"
    return f"{type(e).__name__}: {e}"


class WebhookClient:
    """POSTs request bodies to one endpoint over one kept-alive connection, retrying what may pass.

    One per writer task (not thread-safe). `sleep`, `rng` and `should_stop` are for tests and
    for the task to give up promptly when the query stops. `attempts` and `retries` count HTTP
    attempts and backoff waits over the client's life, for tests and metrics."""

    def __init__(self, opts: WebhookOptions, *, sleep: Callable[[float], None] = time.sleep,
                 rng: Callable[[], float] = random.random, should_stop: Callable[[], bool] = lambda: False) -> None:
        self.opts = opts
        self._sleep, self._rng, self._should_stop = sleep, rng, should_stop
        parts = urlsplit(opts.url)
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname or "", parts.port
        query = resolve(parts.query, "the --sink URL's query", in_uri=True)  # the endpoint's own, maybe secret
        self._target = (parts.path or "/") + (f"?{query}" if query else "")
        self._headers = {"Content-Type": "application/json", "User-Agent": USER_AGENT}
        if parts.username is not None or parts.password is not None:
            password = resolve(unquote(parts.password or ""), "the --sink URL's password")
            user_pass = f"{unquote(parts.username or '')}:{password}".encode()
            self._headers["Authorization"] = "Basic " + base64.b64encode(user_pass).decode("ascii")
        self._headers.update(opts.resolved_headers())
        self._signing = opts.signing_key()
        self._tls: ssl.SSLContext | None = None
        self._conn: http.client.HTTPConnection | None = None
        self.attempts = 0
        self.retries = 0

    def post(self, body: bytes, key: str, describe: str) -> None:
        """Deliver one request; return once the endpoint answered 2xx. Every attempt sends the same
        body and key. `describe` (e.g. "batch 12, messages 0-999") goes into error messages.

        SinkError: the endpoint refused it (3xx, 4xx other than 408/429) or its certificate is not
        trusted. TransientError: retries ran out, or should_stop() turned true while waiting."""
        delays = backoff_delays(self.opts, self._rng)
        attempts = 0
        while True:
            attempts += 1
            failure = self._attempt(body, key, describe)
            if failure is None:
                return
            if failure.stale:
                continue  # the next attempt is on a fresh connection, so this happens once at most
            delay = next(delays, None)
            if delay is None:
                raise self._exhausted(failure, attempts, describe)
            if failure.retry_after is not None:
                delay = min(self.opts.retry_max_backoff_s, max(failure.retry_after, delay))
            self._wait(delay, failure, attempts, describe)
            self.retries += 1

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self._https:
                self._conn = http.client.HTTPSConnection(self._host, self._port, timeout=self.opts.timeout_s,
                                                         context=self._tls_context())
            else:
                self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self.opts.timeout_s)
        return self._conn

    def _tls_context(self) -> ssl.SSLContext:
        """Made on first use (it reads the system's trusted certificates, honouring SSL_CERT_FILE)."""
        if self._tls is None:
            self._tls = ssl.create_default_context()
            if self.opts.insecure_tls_skip_verify:
                self._tls.check_hostname = False
                self._tls.verify_mode = ssl.CERT_NONE
        return self._tls

    def _attempt(self, body: bytes, key: str, describe: str) -> _Failure | None:
        """One POST: None when acknowledged, a _Failure worth retrying, or SinkError."""
        self.attempts += 1
        # http.client drops the socket itself when an answer said Connection: close.
        reused = self._conn is not None and self._conn.sock is not None
        try:
            conn = self._connection()
            conn.request("POST", self._target, body=body, headers={**self._headers, **self._signed(key, body),
                                                                    "Idempotency-Key": key})
            response = conn.getresponse()
            data = response.read()  # all of it, so the connection can carry the next request
        except ssl.SSLCertVerificationError as e:
            self.close()
            raise self._untrusted(e, describe) from None
        except (OSError, http.client.HTTPException) as e:
            self.close()
            return _Failure(_describe(e, self.opts.timeout_s), stale=reused and isinstance(e, _STALE))
        status = response.status
        if 200 <= status < 300:
            return None
        self.close()  # a fresh connection for the retry (a load balancer may pick a healthy backend)
        what = f"HTTP {status} {response.reason}: {_excerpt(data)}"
        if status in (408, 429) or 500 <= status < 600:
            return _Failure(what, retry_after=_retry_after(response.getheader("Retry-After")))
        raise SinkError(f"webhook {self.opts.redacted_url()} refused {describe}: {what}",
                        self._refused_hint(status, response.getheader("Location")))

    def _signed(self, key: str, body: bytes) -> dict[str, str]:
        """The Standard Webhooks headers of one attempt (none without a signing secret)."""
        if self._signing is None:
            return {}
        stamp = str(int(time.time()))
        digest = hmac.new(self._signing, f"{key}.{stamp}.".encode() + body, hashlib.sha256).digest()
        return {"webhook-id": key, "webhook-timestamp": stamp,
                "webhook-signature": "v1," + base64.b64encode(digest).decode("ascii")}

    def check_reachable(self) -> None:
        """Connect, and for https complete the TLS handshake with the certificate verified, without
        sending a request: what `run` checks before it creates anything."""
        try:
            self._connection().connect()
        except ssl.SSLCertVerificationError as e:
            raise self._untrusted(e, "the start-up check") from None
        except ssl.SSLError as e:
            raise SinkError(f"webhook {self.opts.redacted_url()}: the TLS handshake failed: {e}",
                            "check that the endpoint speaks https at this port (webhook-http:// is plain "
                            "HTTP)") from None
        except OSError as e:
            why = _describe(e, self.opts.timeout_s)
            raise ConnectionFailed(f"cannot reach webhook {self.opts.redacted_url()}: {why}",
                                   "check the host and port of the --sink URI and that the endpoint is up; "
                                   "nothing was created") from None
        finally:
            self.close()

    def _untrusted(self, e: ssl.SSLCertVerificationError, describe: str) -> SinkError:
        return SinkError(
            f"webhook {self.opts.redacted_url()}: TLS certificate verification failed for {describe}: "
            f"{e.verify_message or e}",
            "give the endpoint a certificate a trusted CA signed, or trust its CA (SSL_CERT_FILE=ca.pem); "
            "for tests only, insecure_tls_skip_verify=true in the --sink URI turns verification off")

    @staticmethod
    def _refused_hint(status: int, location: str | None) -> str:
        then = ("then run the feed again: it re-sends this batch from its checkpoint, with the same "
                "idempotency keys")
        if 300 <= status < 400:
            return f"the endpoint redirects (to {_redact(location or '?')}): put the final URL in --sink, {then}"
        if status in (401, 403):
            return (f"check the credentials (user:password@, header=, signing_secret= in the --sink URI: the "
                    f"receiver must know the same secret) and the endpoint's access rules, {then}")
        if status == 413:
            return f"the request is too large for the endpoint: lower flush_messages in the --sink URI, {then}"
        return f"fix the endpoint or its configuration, {then}"

    def _wait(self, delay: float, failure: _Failure, attempts: int, describe: str) -> None:
        """Sleep `delay` in small steps, giving up as soon as should_stop() says so."""
        while True:
            if self._should_stop():
                raise TransientError(
                    f"stopped while retrying {describe} to webhook {self.opts.redacted_url()} after "
                    f"{attempts} attempt(s); last failure: {failure.what}",
                    "the feed re-sends this request from its checkpoint when it runs again")
            if delay <= 0:
                return
            step = min(delay, STOP_POLL_S)
            self._sleep(step)
            delay -= step

    def _exhausted(self, failure: _Failure, attempts: int, describe: str) -> TransientError:
        return TransientError(
            f"webhook {self.opts.redacted_url()} did not take {describe} after {attempts} attempt(s); "
            f"last failure: {failure.what}",
            "run the feed again: it re-sends from its checkpoint, with the same idempotency keys; to ride out "
            f"longer outages raise retry_max (now {_show(self.opts.retry_max)}) or set retry_max=inf in the --sink URI")
