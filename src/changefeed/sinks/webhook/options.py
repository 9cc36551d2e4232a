"""Webhook sink, its `--sink` URI: where to POST, how to batch and retry, and how requests prove
where they come from (HTTP Basic credentials in the URL, extra headers, a Standard Webhooks
signing secret: each a secret that may be given by reference, see secrets.py, and is resolved only
when a client is made, in the writer task)."""
from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import unquote_plus, urlsplit

from changefeed.errors import ConfigError
from changefeed.sinks.uri_options import Option, boolean, duration, parse_query, whole, whole_or_inf

SCHEMES = ("webhook-http", "webhook-https")
_EXAMPLE = "webhook-https://HOST/PATH?flush_messages=500&retry_max=inf&timeout=10s"


# query parameter -> the field it sets, its parser, what is allowed, and a check that values set in code get too
_OPTIONS: dict[str, Option] = {
    "flush_messages": Option("flush_messages", whole(), "a whole number >= 1", lambda v: v >= 1),
    "flush_frequency": Option("flush_frequency_s", duration, "a duration >= 0 such as 500ms, 1s or 2m (0: off)",
                              lambda v: v >= 0),
    "retry_max": Option("retry_max", whole_or_inf(), "a whole number >= 0 or inf", lambda v: v is None or v >= 0),
    "retry_backoff": Option("retry_backoff_s", duration, "a duration > 0 such as 10ms, 500ms or 1s", lambda v: v > 0),
    "retry_max_backoff": Option("retry_max_backoff_s", duration, "a duration > 0 such as 10s or 1m",
                                lambda v: v > 0),
    "timeout": Option("timeout_s", duration, "a duration > 0 such as 500ms, 30s or 1m", lambda v: v > 0),
    "insecure_tls_skip_verify": Option("insecure_tls_skip_verify", boolean, "true or false",
                                       lambda v: isinstance(v, bool)),
    "resolved": Option("emit_resolved", boolean, "true or false", lambda v: isinstance(v, bool)),
}


def _show(value: Any) -> str:
    """A default as it would be written in the URI."""
    if value is None:
        return "inf"
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}s" if isinstance(value, float) else str(value)


def _redact(url: str) -> str:
    """`url` with its user:password (if any) replaced by ***; string-based so it works on bad URLs too."""
    scheme, sep, rest = url.partition("://")
    netloc_end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    netloc = rest[:netloc_end]
    if "@" not in netloc:
        return url
    return f"{scheme}{sep}***@{netloc.rpartition('@')[2]}{rest[netloc_end:]}"


@dataclass(frozen=True, repr=False)
class WebhookOptions:
    """Where and how a webhook sink POSTs; `parse` reads them from the `--sink` URI."""

    url: str  # the real http(s) URL to POST to, our options removed from its query
    flush_messages: int = 1000  # most messages per request
    flush_frequency_s: float = 0.0  # >0: a request also goes out once its first message waited this long
    retry_max: int | None = 10  # retries after the first attempt; None: retry forever ("inf")
    retry_backoff_s: float = 0.5  # first backoff; doubles each retry ...
    retry_max_backoff_s: float = 30.0  # ... up to this; full jitter (uniform in [0, backoff])
    timeout_s: float = 30.0  # per socket operation (connect, send, each wait for the answer)
    insecure_tls_skip_verify: bool = False  # for tests / self-signed endpoints only
    emit_resolved: bool = False  # the sink also POSTs resolved messages
    headers: tuple[tuple[str, str], ...] = ()  # extra request headers (name, value as written: may be a reference)
    signing_secret: str = ""  # Standard Webhooks secret `whsec_<base64>` (as written: may be a reference)

    def __post_init__(self) -> None:
        """Values set in code get the same checks as values parsed from a URI."""
        for param, option in _OPTIONS.items():
            value = getattr(self, option.field)
            if not option.check(value):
                raise option.refuse(param, value, self._default_hint)
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"the webhook URL must be http(s)://HOST[:PORT]/PATH, got {self.redacted_url()}",
                              f"e.g. {_EXAMPLE}")
        if self.insecure_tls_skip_verify and parts.scheme != "https":
            raise ConfigError("insecure_tls_skip_verify=true applies to webhook-https only, the URL is http",
                              "remove insecure_tls_skip_verify, or use webhook-https://")
        for name, _ in self.headers:
            if not _TOKEN.fullmatch(name) or name.lower() in _OWN_HEADERS:
                raise ConfigError(f"header {name!r} cannot be set in the --sink URI",
                                  "header=NAME:VALUE with a header name of letters, digits and -, other than "
                                  f"{', '.join(sorted(_OWN_HEADERS))}, e.g. header=Authorization:Bearer%20${{TOKEN}}")
        if self.signing_secret and "${" not in self.signing_secret:
            signing_key(self.signing_secret)

    def resolved_headers(self) -> dict[str, str]:
        """The extra headers with their references resolved (in the writer task)."""
        from changefeed.spec.secrets import resolve

        return {name: resolve(value, f"the --sink header {name}") for name, value in self.headers}

    def signing_key(self) -> bytes | None:
        """The key the requests are signed with, None without signing_secret."""
        from changefeed.spec.secrets import resolve

        return signing_key(resolve(self.signing_secret, "the --sink signing_secret")) if self.signing_secret else None

    @staticmethod
    def _default_hint(param: str) -> str:
        field = _OPTIONS[param].field
        default = next(f.default for f in fields(WebhookOptions) if f.name == field)
        return f"fix or remove {param}= in the --sink URI (default: {_show(default)})"

    @classmethod
    def parse(cls, uri: str) -> WebhookOptions:
        """`webhook-https://[user:pass@]host[:port]/path?query` -> options; ours leave the query,
        the endpoint's own parameters stay, in order."""
        if re.search(r"[\x00-\x20\x7f]", uri):
            raise ConfigError(f"the --sink URI contains a space or control character: {_redact(uri)!r}",
                              "percent-encode it (a space is %20)")
        try:
            parts = urlsplit(uri)
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError as e:
            raise ConfigError(f"the --sink URI {_redact(uri)} is not a valid URL: {e}", f"e.g. {_EXAMPLE}") from None
        if parts.scheme not in SCHEMES:
            raise ConfigError(f"a webhook --sink URI starts with webhook-https:// or webhook-http://, "
                              f"got scheme {parts.scheme or '<none>'!r}", f"e.g. {_EXAMPLE}")
        if not parts.hostname:
            raise ConfigError(f"the --sink URI {_redact(uri)} has no host", f"e.g. {_EXAMPLE}")
        if parts.fragment:
            raise ConfigError(f"the --sink URI {_redact(uri)} has a #fragment, which HTTP never sends",
                              "remove it, or percent-encode a # in a value as %23")
        values, kept = _split_query(parts.query)
        url = f"{parts.scheme.removeprefix('webhook-')}://{parts.netloc}{parts.path}"
        return cls(url=url + (f"?{'&'.join(kept)}" if kept else ""), **values)

    def redacted_url(self) -> str:
        """The URL with any user:password replaced by ***: for messages and logs."""
        return _redact(self.url)

    def __repr__(self) -> str:  # never the password, a header's value or the signing secret
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                          if f.name not in ("url", "headers", "signing_secret"))
        hidden = f", headers={[n for n, _ in self.headers]}, signed={bool(self.signing_secret)}"
        return f"WebhookOptions(url={self.redacted_url()!r}, {shown}{hidden})"


_TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")
_OWN_HEADERS = frozenset({"content-type", "content-length", "host", "user-agent", "idempotency-key", "webhook-id",
                          "webhook-timestamp", "webhook-signature", "connection", "transfer-encoding"})


def signing_key(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret `whsec_<base64>` (ConfigError, never showing it)."""
    raw = secret.removeprefix("whsec_")
    try:
        key = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if not secret.startswith("whsec_") or not 24 <= len(key) <= 64:
        raise ConfigError("the --sink signing_secret is not a Standard Webhooks secret: whsec_ and 24 to 64 bytes in "
                          "base64", "generate one (e.g. python -c \"import base64,os; print('whsec_' + "
                          "base64.b64encode(os.urandom(32)).decode())\") and give the receiver the same; better "
                          "by reference: signing_secret=${WEBHOOK_SECRET}")
    return key


def _split_query(query: str) -> tuple[dict[str, Any], list[str]]:
    """Our options (parsed, by field) and the endpoint's own query parameters (as written)."""
    parts = query.split("&")
    pairs = [(unquote_plus(name), unquote_plus(value)) for name, _, value in (p.partition("=") for p in parts)]
    values: dict[str, Any] = {}
    headers: list[tuple[str, str]] = []

    def own(name: str, value: str) -> None:
        """`header` (repeatable) and `signing_secret`; any other name is the endpoint's."""
        if name == "header":
            header, sep, value = value.partition(":")
            if not sep:
                raise ConfigError("header takes NAME:VALUE, got a value without ':'",
                                  "e.g. header=Authorization:Bearer%20${TOKEN} in the --sink URI")
            headers.append((header.strip(), value.strip()))
        elif name == "signing_secret":
            values["signing_secret"] = value

    values.update(parse_query(pairs, _OPTIONS, hint=WebhookOptions._default_hint, other=own, once=True))
    if headers:
        values["headers"] = tuple(headers)
    ours = {*_OPTIONS, "header", "signing_secret"}
    kept = [part for part, (name, _) in zip(parts, pairs, strict=True) if part and name not in ours]
    return values, kept
