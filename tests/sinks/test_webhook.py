"""The webhook sink's HTTP core against a real HTTP(S) server on 127.0.0.1 with a scripted fault plan.

The server takes one action per request from its plan (then answers ok), records every request
it saw (`requests`) and, separately, the ones it kept (`stored`: answered ok, or kept and then
answered 500), so tests can tell "delivered once" from "seen once". No HTTP mocks.
"""
from __future__ import annotations

import base64
import itertools
import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import changefeed
from changefeed.errors import ConfigError, SinkError, TransientError
from changefeed.sinks.webhook.client import WebhookClient, backoff_delays, idempotency_key, request_body, resolved_body
from changefeed.sinks.webhook.options import SCHEMES, WebhookOptions

pytestmark = pytest.mark.timeout(60)

HANG_S = 1.0  # a "hang" answers this late; the client under test times out after HANG_TIMEOUT_S
HANG_TIMEOUT_S = 0.4
FAST: dict[str, Any] = {"retry_backoff_s": 0.01, "retry_max_backoff_s": 0.05, "timeout_s": 5.0}


@dataclass
class Received:
    path: str
    query: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    port: int  # the client's port: one per connection
    at: float  # time.monotonic() when the request was read

    @property
    def key(self) -> str:
        return self.headers["idempotency-key"]


class FaultServer:
    """ThreadingHTTPServer in a background thread; `plan` holds the actions for the next requests.

    Actions: ok, ok_drop (answer ok, then close the kept-alive connection without saying so),
    <status> (e.g. 500, 503, 429, 408, 400, 401, 404, 301), <status>+ra=<seconds> (with Retry-After),
    hang (answer ok after HANG_S), store_then_500, close (drop the connection without answering)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.plan: list[str] = []
        self.requests: list[Received] = []
        self.stored: list[Received] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.handle_error = lambda *_: None  # type: ignore[method-assign]  # clients that gave up: expected
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def uri(self, query: str = "", scheme: str = "webhook-http", userinfo: str = "", path: str = "/hook") -> str:
        return f"{scheme}://{userinfo}127.0.0.1:{self.port}{path}" + (f"?{query}" if query else "")

    def options(self, query: str = "", userinfo: str = "", **kw: Any) -> WebhookOptions:
        """Options parsed from this server's URI, with FAST retries unless `kw` says otherwise."""
        return replace(WebhookOptions.parse(self.uri(query, userinfo=userinfo)), **{**FAST, **kw})

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _next(self) -> str:
        with self.lock:
            return self.plan.pop(0) if self.plan else "ok"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive
            disable_nagle_algorithm = True  # headers and body go out in two writes: no delayed-ACK stalls

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                parts = urlsplit(self.path)
                got = Received(parts.path, parts.query, {k.lower(): v for k, v in self.headers.items()}, body,
                               self.client_address[1], time.monotonic())
                action = server._next()
                with server.lock:
                    server.requests.append(got)
                    if action in ("ok", "ok_drop", "store_then_500"):
                        server.stored.append(got)
                if action == "close":
                    self.close_connection = True
                    return
                if action == "hang":
                    time.sleep(HANG_S)
                    action = "ok"
                status, _, retry_after = action.partition("+ra=")
                status = {"ok": "200", "ok_drop": "200", "store_then_500": "500"}.get(status, status)
                answer = b'{"ok":true}' if status == "200" else f"fault {status}: ".encode() + b"x" * 500
                self.send_response(int(status))
                self.send_header("Content-Type", "application/json" if status == "200" else "text/plain")
                self.send_header("Content-Length", str(len(answer)))
                if retry_after:
                    self.send_header("Retry-After", retry_after)
                if status.startswith("3"):
                    self.send_header("Location", "https://elsewhere.example/hook")
                self.end_headers()
                self.wfile.write(answer)
                if action == "ok_drop":
                    self.close_connection = True

        return Handler


@pytest.fixture
def server() -> Iterator[FaultServer]:
    s = FaultServer()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if not shutil.which("openssl"):
        pytest.skip("the openssl CLI is not installed")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


@pytest.fixture
def tls_server(self_signed: tuple[Path, Path]) -> Iterator[FaultServer]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(*self_signed)
    s = FaultServer(tls=ctx)
    yield s
    s.stop()


def post(client: WebhookClient, body: bytes = b'{"payload":[{"a":1}],"length":1}', key: str = "f-1-0-0") -> None:
    client.post(body, key, "batch 1, messages 0-0")


# --- options ---------------------------------------------------------------------------------------

def test_parse_maps_schemes_extracts_options_and_keeps_the_endpoints_query() -> None:
    o = WebhookOptions.parse("webhook-https://hooks.example:8443/in/x?a=1&flush_messages=5&flush_frequency=250ms"
                             "&b=two+words&retry_max=inf&retry_backoff=20ms&retry_max_backoff=2m&timeout=3s"
                             "&insecure_tls_skip_verify=true&resolved=true&c=%26")
    assert o == WebhookOptions(url="https://hooks.example:8443/in/x?a=1&b=two+words&c=%26", flush_messages=5,
                               flush_frequency_s=0.25, retry_max=None, retry_backoff_s=0.02, retry_max_backoff_s=120.0,
                               timeout_s=3.0, insecure_tls_skip_verify=True, emit_resolved=True)
    assert WebhookOptions.parse("webhook-http://h/p").url == "http://h/p"
    assert WebhookOptions.parse("WEBHOOK-HTTP://h?retry_max=0").url == "http://h"
    assert WebhookOptions.parse("webhook-http://h/p?retry_max=0").retry_max == 0
    assert SCHEMES == ("webhook-http", "webhook-https")


def test_parse_defaults() -> None:
    assert WebhookOptions.parse("webhook-https://h/p") == WebhookOptions(
        url="https://h/p", flush_messages=1000, flush_frequency_s=0.0, retry_max=10, retry_backoff_s=0.5,
        retry_max_backoff_s=30.0, timeout_s=30.0, insecure_tls_skip_verify=False, emit_resolved=False)


@pytest.mark.parametrize("uri, words", [
    ("webhook-https://h/?flush_messages=x", ["flush_messages", "'x'", "whole number >= 1"]),
    ("webhook-https://h/?flush_messages=0", ["flush_messages", "'0'", ">= 1"]),
    ("webhook-https://h/?flush_messages=-3", ["flush_messages", "'-3'"]),
    ("webhook-https://h/?flush_messages=", ["flush_messages", "''"]),
    ("webhook-https://h/?flush_frequency=soon", ["flush_frequency", "'soon'", "duration"]),
    ("webhook-https://h/?retry_max=-1", ["retry_max", "'-1'", "inf"]),
    ("webhook-https://h/?retry_max=1.5", ["retry_max", "'1.5'"]),
    ("webhook-https://h/?retry_backoff=0", ["retry_backoff", "'0'", "> 0"]),
    ("webhook-https://h/?retry_backoff=fast", ["retry_backoff", "'fast'"]),
    ("webhook-https://h/?retry_max_backoff=0ms", ["retry_max_backoff", "'0ms'"]),
    ("webhook-https://h/?timeout=0s", ["timeout", "'0s'"]),
    ("webhook-https://h/?timeout=-1s", ["timeout", "'-1s'"]),
    ("webhook-https://h/?insecure_tls_skip_verify=yes", ["insecure_tls_skip_verify", "'yes'", "true or false"]),
    ("webhook-https://h/?resolved=1", ["resolved", "'1'", "true or false"]),
    ("webhook-https://h/?resolved=true&resolved=false", ["resolved", "twice"]),
    ("webhook-http://h/?insecure_tls_skip_verify=true", ["insecure_tls_skip_verify", "http"]),
    ("webhook-ftp://h/", ["webhook-https://", "'webhook-ftp'"]),
    ("https://h/", ["webhook-https://", "'https'"]),
    ("h/path", ["webhook-https://", "<none>"]),
    ("webhook-https:///path", ["no host"]),
    ("webhook-https://h:99999/", ["not a valid URL", "65535"]),
    ("webhook-https://h:port/", ["not a valid URL"]),
    ("webhook-https://h/a b", ["space"]),
    ("webhook-https://h/p#frag", ["fragment"]),
])
def test_parse_errors_name_the_parameter_and_the_bad_value(uri: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        WebhookOptions.parse(uri)
    assert e.value.exit_code == 64 and e.value.hint
    for word in words:
        assert word in e.value.message


def test_options_set_in_code_are_checked_too() -> None:
    with pytest.raises(ConfigError, match="flush_messages"):
        WebhookOptions(url="https://h/", flush_messages=0)
    with pytest.raises(ConfigError, match="http"):
        WebhookOptions(url="ftp://h/")


def test_credentials_are_redacted_everywhere() -> None:
    o = WebhookOptions.parse("webhook-https://alice:s3cret@h:1/p?timeout=1s")
    assert o.url == "https://alice:s3cret@h:1/p"  # the real URL, for the client
    assert o.redacted_url() == "https://***@h:1/p"
    assert "s3cret" not in repr(o)
    with pytest.raises(ConfigError) as e:
        WebhookOptions.parse("webhook-https://alice:s3cret@h:1/p?timeout=never")
    assert "s3cret" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        WebhookOptions.parse("webhook-https://alice:s3cret@h:port/p")
    assert "s3cret" not in str(e.value)


@settings(deadline=None)
@given(st.lists(st.tuples(st.from_regex(r"[a-z]{1,6}", fullmatch=True),
                          st.from_regex(r"[a-z0-9%+]{0,6}", fullmatch=True)), max_size=6),
       st.integers(1, 10_000))
def test_the_endpoints_own_parameters_stay_in_order(params: list[tuple[str, str]], flush: int) -> None:
    own = [f"{k}={v}" for k, v in params if k not in ("timeout", "resolved")]
    mixed = list(own)
    mixed.insert(len(mixed) // 2, f"flush_messages={flush}")
    o = WebhookOptions.parse("webhook-https://h/p?" + "&".join(mixed))
    assert o.url == "https://h/p" + ("?" + "&".join(own) if own else "")
    assert o.flush_messages == flush


# --- bodies, keys, backoff -------------------------------------------------------------------------

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                           max_leaves=8)


@settings(deadline=None)
@given(st.lists(json_values, max_size=20))
def test_request_body_embeds_the_messages_as_json(values: list[object]) -> None:
    body = request_body([json.dumps(v, ensure_ascii=False).encode() for v in values])
    assert json.loads(body) == {"payload": values, "length": len(values)}


def test_request_body_embeds_objects_not_strings() -> None:
    body = request_body([b'{"after":{"id":1}}', b'{"after":{"id":2}}'])
    assert body == b'{"payload":[{"after":{"id":1}},{"after":{"id":2}}],"length":2}'


def test_resolved_body_is_the_message_itself() -> None:
    assert resolved_body(b'{"resolved":"1700000000000000000.0000000000"}') == \
        b'{"resolved":"1700000000000000000.0000000000"}'
    with pytest.raises(ValueError):
        resolved_body(b'{"resolved":')


def test_idempotency_keys_are_deterministic_and_distinct() -> None:
    key = idempotency_key("orders", "1A.7.0", 0, 999, b"body")
    assert key == idempotency_key("orders", "1A.7.0", 0, 999, b"body") and key.startswith("orders-1A.7.0-0-999-")
    keys = {idempotency_key("orders", b, first, last, body) for b in ("1.2.0", "2.2.0")
            for first, last in ((0, 0), (0, 1), (1, 1)) for body in (b"x", b"y")}
    keys |= {idempotency_key("orders", "1.2.0", -1, -1), idempotency_key("other", "1.2.0", 0, 0, b"x")}
    assert len(keys) == 14  # another body (a chunk read again) is another key: a receiver never drops it
    assert idempotency_key("orders", "7", -1, -1) == "orders-7-resolved"
    with pytest.raises(ValueError):
        idempotency_key("orders", "7", 5, 4)


def _opts(retry_max: int | None, backoff: float, cap: float) -> WebhookOptions:
    return WebhookOptions(url="http://h/", retry_max=retry_max, retry_backoff_s=backoff, retry_max_backoff_s=cap)


@settings(deadline=None)
@given(st.integers(0, 60), st.floats(0.001, 10), st.floats(0.001, 100), st.floats(0, 1, exclude_max=True))
def test_backoff_doubles_up_to_the_cap_with_full_jitter(retry_max: int, backoff: float, cap: float, r: float) -> None:
    delays = list(backoff_delays(_opts(retry_max, backoff, cap), rng=lambda: r))
    assert len(delays) == retry_max
    for n, d in enumerate(delays, start=1):
        assert 0 <= d <= cap
        assert d == pytest.approx(r * min(cap, backoff * 2 ** (n - 1)))


@settings(max_examples=20, deadline=None)
@given(st.floats(0.001, 10), st.floats(0.001, 100))
def test_backoff_forever_stays_bounded(backoff: float, cap: float) -> None:
    delays = list(itertools.islice(backoff_delays(_opts(None, backoff, cap), rng=lambda: 1.0), 3000))
    assert len(delays) == 3000 and max(delays) <= cap and delays[-1] == cap


def test_backoff_jitter_uses_the_rng() -> None:
    rolls = iter([0.0, 0.5, 0.25])
    assert list(backoff_delays(_opts(3, 1.0, 30.0), rng=lambda: next(rolls))) == [0.0, 1.0, 1.0]


# --- delivery ----------------------------------------------------------------------------------------

def test_headers_path_and_body_on_the_wire(server: FaultServer) -> None:
    opts = WebhookOptions.parse(server.uri("token=abc&flush_messages=10&x=%2F", userinfo="bob:pa%3Ass@"))
    body = request_body([b'{"a":1}'])
    with WebhookClient(opts) as client:
        client.post(body, "f-3-0-0", "batch 3, messages 0-0")
    (got,) = server.requests
    assert (got.path, got.query, got.body, got.key) == ("/hook", "token=abc&x=%2F", body, "f-3-0-0")
    assert got.headers["content-type"] == "application/json"
    assert got.headers["user-agent"] == f"changefeed/{changefeed.__version__}"
    assert got.headers["authorization"] == "Basic " + base64.b64encode(b"bob:pa:ss").decode()


@pytest.mark.parametrize("fault", ["500", "502", "503", "429", "408", "hang", "close", "503+ra=0", "429+ra=0.01"])
def test_a_retryable_fault_then_ok_delivers_once_with_the_same_key_and_body(server: FaultServer, fault: str) -> None:
    server.plan = [fault, fault, "ok"]
    client = WebhookClient(server.options(timeout_s=HANG_TIMEOUT_S) if fault == "hang" else server.options())
    body = request_body([b'{"n":1}', b'{"n":2}'])
    client.post(body, "f-5-0-1", "batch 5, messages 0-1")
    assert (client.attempts, client.retries) == (3, 2)
    assert len(server.stored) == 1
    assert {(r.key, r.body) for r in server.requests} == {("f-5-0-1", body)}
    assert len(server.requests) == 3
    client.close()


def test_stored_then_500_is_repeated_only_with_the_same_key(server: FaultServer) -> None:
    server.plan = ["store_then_500", "ok"]
    with WebhookClient(server.options()) as client:
        post(client, key="f-9-0-0")
    assert [r.key for r in server.stored] == ["f-9-0-0", "f-9-0-0"]
    assert len({r.body for r in server.stored}) == 1  # an endpoint that dedupes by key keeps one


def test_retry_after_is_honoured(server: FaultServer) -> None:
    server.plan = ["503+ra=0.2", "429+ra=0.2", "ok"]
    with WebhookClient(server.options(retry_max_backoff_s=1.0)) as client:
        post(client)
    a, b, c = (r.at for r in server.requests)
    assert b - a >= 0.18 and c - b >= 0.18


def test_waits_follow_the_backoff_and_retry_after_capped(server: FaultServer) -> None:
    """With a recording sleep: each wait is the backoff delay, or Retry-After if longer, at most the cap."""
    server.plan = ["500", "500", "500", "503+ra=0.3", "429+ra=9", "ok"]
    slept: list[float] = []
    opts = server.options(retry_backoff_s=0.1, retry_max_backoff_s=0.5)
    with WebhookClient(opts, sleep=slept.append, rng=lambda: 0.5) as client:
        post(client)
    # backoff steps 0.1, 0.2, 0.4, 0.5, 0.5 at half jitter; Retry-After 0.3 wins once, 9 is capped at 0.5
    assert sum(slept) == pytest.approx(0.05 + 0.1 + 0.2 + 0.3 + 0.5)
    assert max(slept) <= 0.05 + 1e-9  # small steps, so should_stop is asked often
    assert client.retries == 5


def test_retries_exhausted_is_transient_and_says_what_and_where(server: FaultServer) -> None:
    server.plan = ["503"] * 10
    opts = server.options("retry_max=2", userinfo="alice:s3cret@")
    with WebhookClient(opts) as client, pytest.raises(TransientError) as e:
        client.post(b"{}", "f-12-0-999", "batch 12, messages 0-999")
    text = str(e.value)
    assert client.attempts == 3 and len(server.requests) == 3
    for word in ("HTTP 503", "fault 503", "batch 12, messages 0-999", "3 attempt", "***@127.0.0.1", "retry_max"):
        assert word in text
    assert "s3cret" not in text and "x" * 201 not in text
    assert server.requests[0].headers["authorization"] == "Basic " + base64.b64encode(b"alice:s3cret").decode()


def test_retry_max_zero_tries_once(server: FaultServer) -> None:
    server.plan = ["500"]
    with WebhookClient(server.options(retry_max=0)) as client, pytest.raises(TransientError, match="1 attempt"):
        post(client)
    assert len(server.requests) == 1


def test_a_refused_connection_is_retried_then_transient() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = WebhookOptions(url=f"http://127.0.0.1:{port}/", retry_max=2, **FAST)
    with WebhookClient(opts) as client, pytest.raises(TransientError, match="(?i)refused"):
        post(client)
    assert (client.attempts, client.retries) == (3, 2)


@pytest.mark.parametrize("status", ["400", "401", "403", "404", "413", "301"])
def test_a_refusal_is_a_sink_error_at_once(server: FaultServer, status: str) -> None:
    server.plan = [status]
    opts = server.options(userinfo="alice:s3cret@")
    with WebhookClient(opts) as client, pytest.raises(SinkError) as e:
        post(client)
    assert client.attempts == 1 and len(server.requests) == 1
    text = str(e.value)
    assert f"HTTP {status}" in text and f"fault {status}: xxx" in text and "batch 1, messages 0-0" in text
    assert "s3cret" not in text and "x" * 201 not in text
    assert "same idempotency keys" in e.value.hint


def test_should_stop_ends_a_retry_wait_promptly(server: FaultServer) -> None:
    server.plan = ["500"] * 10
    stop_at = time.monotonic() + 0.2
    opts = server.options(retry_max=None, retry_backoff_s=30.0, retry_max_backoff_s=30.0)
    client = WebhookClient(opts, rng=lambda: 1.0, should_stop=lambda: time.monotonic() > stop_at)
    start = time.monotonic()
    with pytest.raises(TransientError, match="stopped while retrying") as e:
        post(client)
    assert time.monotonic() - start < 10  # the wait was 30 s
    assert "HTTP 500" in str(e.value)
    client.close()


def test_one_connection_carries_many_posts(server: FaultServer) -> None:
    with WebhookClient(server.options()) as client:
        for i in range(5):
            post(client, key=f"f-1-{i}-{i}")
    assert client.attempts == 5 and len({r.port for r in server.requests}) == 1


def test_a_kept_alive_connection_the_server_closed_is_replaced_without_a_retry(server: FaultServer) -> None:
    server.plan = ["ok_drop", "ok"]
    with WebhookClient(server.options(retry_max=0)) as client:
        post(client, key="f-1-0-0")
        post(client, key="f-1-1-1")  # the first try hits the closed connection
    assert client.retries == 0 and [r.key for r in server.stored] == ["f-1-0-0", "f-1-1-1"]
    assert len({r.port for r in server.requests}) == 2


# --- TLS ---------------------------------------------------------------------------------------------

def test_https_with_an_untrusted_certificate_is_a_sink_error(tls_server: FaultServer) -> None:
    opts = WebhookOptions.parse(tls_server.uri("retry_max=5&retry_backoff=10ms", scheme="webhook-https"))
    with WebhookClient(opts) as client, pytest.raises(SinkError) as e:
        post(client)
    assert client.attempts == 1 and "certificate verification failed" in e.value.message
    assert "insecure_tls_skip_verify=true" in e.value.hint and "tests only" in e.value.hint


def test_https_insecure_skip_verify_delivers(tls_server: FaultServer) -> None:
    tls_server.plan = ["500", "ok"]
    opts = WebhookOptions.parse(tls_server.uri("insecure_tls_skip_verify=true&retry_backoff=10ms",
                                               scheme="webhook-https"))
    with WebhookClient(opts) as client:
        post(client)
        post(client)
    assert len(tls_server.stored) == 2 and client.attempts == 3


def test_https_with_a_trusted_certificate_delivers(tls_server: FaultServer, self_signed: tuple[Path, Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(self_signed[0]))
    with WebhookClient(WebhookOptions.parse(tls_server.uri(scheme="webhook-https"))) as client:
        post(client)
    assert len(tls_server.stored) == 1


def test_a_tls_handshake_failure_is_retried() -> None:
    """A server that answers the TLS hello in plain HTTP fails the handshake, not the certificate
    check: retryable (a proxy or endpoint mid-restart can do that)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer_in_plain_text() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    threading.Thread(target=answer_in_plain_text, daemon=True).start()
    opts = WebhookOptions(url=f"https://127.0.0.1:{listener.getsockname()[1]}/", retry_max=1, **FAST)
    with listener, WebhookClient(opts) as client, pytest.raises(TransientError, match="SSL"):
        post(client)
    assert client.attempts == 2
