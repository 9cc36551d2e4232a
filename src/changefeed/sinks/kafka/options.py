"""Kafka sink, options: `--sink kafka://HOST:PORT[,HOST:PORT]?OPTIONS`, topic names, client settings.

A topic per table (`topic_prefix` + the `topic_name` template), message key = the envelope's key,
value = the envelope. Delivery `exactly_once` (default) writes each micro-batch in one Kafka
transaction together with a progress record on `progress_topic`, read back as `progress_reader`
says (sinks.kafka.probe); `at_least_once` uses an idempotent producer without transactions.
Client settings pass through to librdkafka: any query parameter with a dot in its name
(`security.protocol=SASL_SSL`), or `kafka_config` holding a JSON object, or `@/path/to/file.json`
so secrets stay out of the URI, the feed definition and `ps`.
Stdlib only at import: it runs in Spark writer tasks and in the CLI's checks.
"""
from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from changefeed.errors import ConfigError
from changefeed.sinks.kafka.client import Timeouts, parse_step
from changefeed.sinks.uri_options import Option, any_text, boolean, choice, parse_query, whole
from changefeed.spec.secrets import mapped, secret_name

SCHEME = "kafka"
DELIVERIES = ("exactly_once", "at_least_once")
PROGRESS_READERS = ("auto", "consumer", "markers")
_EXAMPLE = "kafka://HOST:9092?topic_prefix=cdc.&delivery=exactly_once"
_TOPIC_CHARS = re.compile(r"[^A-Za-z0-9._-]")
MAX_TOPIC = 249
SECRET_KEYS = ("sasl.password", "ssl.key.password", "ssl.keystore.password", "sasl.oauthbearer.client.secret")
# librdkafka settings whose names have no dot (the others are told apart from sink options by theirs)
_PLAIN_CLIENT = ("acks", "retries", "partitioner", "debug", "log_level")
# settings the sink owns: exactly-once and per-key order depend on them
_OWNED = ("transactional.id", "enable.idempotence", "bootstrap.servers")


def sanitize_topic(name: str) -> str:
    """A valid Kafka topic name: characters outside [A-Za-z0-9._-] become `_`, at most 249 of them."""
    return _TOPIC_CHARS.sub("_", name)[:MAX_TOPIC] or "_"


def _check_template(name: str, template: str, allowed: tuple[str, ...]) -> str:
    try:
        used = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ConfigError(f"{name} {template!r} is not a valid template: {e}", "write {schema} and {table} "
                          "for the names, {{ and }} for braces") from None
    unknown = used - set(allowed)
    if unknown:
        raise ConfigError(f"{name} {template!r} uses unknown fields {sorted(unknown)}",
                          f"use only {', '.join('{' + a + '}' for a in allowed)}")
    return template


def _fix(name: str) -> str:
    return f"fix {name}= in the --sink URI"


def _count(name: str) -> Callable[[str], int]:
    """Partitions or replicas of a topic the sink creates: -1 (the broker's default) or >= 1; 0 has
    its own message, as no topic can have none."""
    number = whole(-1)

    def parse(text: str) -> int:
        value = number(text)
        if value == 0:
            raise ConfigError(f"{name} must be -1 (the broker's default) or >= 1, got 0", _fix(name))
        return value

    return parse


# the sink's own query options (the others are client settings); listed in this order in the hint
_OPTIONS: dict[str, Option] = {
    "topic_prefix": Option("topic_prefix", any_text, "any text"),
    "topic_name": Option("topic_name", lambda text: _check_template("topic_name", text, ("schema", "table")),
                         "a template naming {schema} and {table}"),
    "delivery": Option("delivery", choice(*DELIVERIES), f"one of {', '.join(DELIVERIES)}",
                       hint="exactly_once (transactions, the default) or at_least_once"),
    "tombstones": Option("tombstones", boolean, "true or false"),
    "resolved": Option("emit_resolved", boolean, "true or false"),
    "progress_topic": Option("progress_topic", any_text, "a Kafka topic name"),
    "progress_reader": Option("progress_reader", choice(*PROGRESS_READERS), f"one of {', '.join(PROGRESS_READERS)}",
                              hint="auto (a probe at start decides), consumer (the broker honours read_committed) "
                                   "or markers (it does not: read the transaction markers)"),
    "topic_partitions": Option("topic_partitions", _count("topic_partitions"), "a whole number >= -1"),
    "replication_factor": Option("replication_factor", _count("replication_factor"), "a whole number >= -1"),
    "create_topics": Option("create_topics", boolean, "true or false"),
    "timeout": Option("timeout_s", parse_step, "a duration between 1s and 15m"),
}


@dataclass(frozen=True)
class KafkaOptions:
    """Where and how the Kafka sink writes; `parse` reads them from the `--sink` URI."""

    bootstrap: str
    topic_prefix: str = ""
    topic_name: str = "{schema}.{table}"  # template; the prefix goes in front
    delivery: str = "exactly_once"
    tombstones: bool | None = None  # after a delete, also a null value; None: as the format does
    emit_resolved: bool = False  # resolved messages to every partition of the feed's topics
    progress_topic: str = "_changefeed_progress"
    progress_reader: str = "auto"  # how exactly once reads progress (sinks.kafka.probe); the driver resolves auto
    topic_partitions: int = -1  # for topics the sink creates; -1: the broker's default
    replication_factor: int = -1
    create_topics: bool = True
    timeout_s: float = 30.0  # one request or transaction step; the client's timeouts follow (kafka.client)
    client: tuple[tuple[str, str], ...] = field(default=())  # librdkafka settings passed through

    @classmethod
    def parse(cls, uri: str) -> KafkaOptions:
        parts = urlsplit(uri)
        if parts.scheme != SCHEME:
            raise ConfigError(f"a Kafka --sink URI starts with kafka://, got {parts.scheme or '<none>'!r}",
                              f"e.g. {_EXAMPLE}")
        hosts = [h for h in parts.netloc.split(",") if h]
        if not hosts or any("@" in h or not re.fullmatch(r"[^:/\s]+:[0-9]{1,5}", h) for h in hosts):
            raise ConfigError(f"the Kafka --sink URI needs HOST:PORT[,HOST:PORT...], got {parts.netloc!r}",
                              "credentials go in the client settings (sasl.username, sasl.password), "
                              f"e.g. {_EXAMPLE}")
        if parts.path not in ("", "/") or parts.fragment:
            raise ConfigError(f"the Kafka --sink URI has a path or fragment: {parts.path or '#' + parts.fragment}",
                              f"options go in the query: {_EXAMPLE}")
        client: dict[str, str] = {}

        def client_setting(name: str, value: str) -> None:
            """Names not in the table: librdkafka settings, passed through, or unknown."""
            if "." in name or name in _PLAIN_CLIENT:
                client[name] = value
            elif name == "kafka_config":
                client.update(_client_settings(value))
            else:
                raise ConfigError(f"unknown Kafka sink option {name!r}",
                                  f"options: {', '.join(_OPTIONS)}, kafka_config, and librdkafka settings "
                                  "(security.protocol=SSL, log_level=7, acks=all, ...)")

        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False)
        given = parse_query(pairs, _OPTIONS, hint=_fix, other=client_setting)
        owned = sorted(k for k in client if k in _OWNED)
        if owned:
            raise ConfigError(f"the Kafka sink sets {', '.join(owned)} itself",
                              "remove it from the --sink URI (the transactional id is changefeed-FEED)")
        opts = cls(",".join(hosts), **given, client=tuple(sorted(client.items())))
        if opts.delivery == "exactly_once" and opts.progress_reader == "markers":
            opts.check_markers("progress_reader=markers")
        if sanitize_topic(opts.progress_topic) != opts.progress_topic:
            raise ConfigError(f"progress_topic {opts.progress_topic!r} is not a valid Kafka topic name",
                              "use letters, digits, '.', '_' and '-' (at most 249)")
        return opts

    def check_markers(self, why: str) -> None:
        """A ConfigError if the marker reader (sinks.kafka.log) cannot connect with these settings;
        `why` says what chose that reader."""
        from changefeed.sinks.kafka.log import unsupported_settings

        cannot = unsupported_settings(self.client_config(resolved=False))
        if cannot:
            raise ConfigError(f"{why}: exactly once reads the transaction markers of the progress topic itself, "
                              f"and that reader cannot use {cannot}",
                              "on a broker that honours read_committed (Apache Kafka, Confluent, MSK, Redpanda) use "
                              "progress_reader=consumer (librdkafka reads progress with every setting); else change "
                              "that setting, or use delivery=at_least_once")

    def reading(self, reader: str) -> KafkaOptions:
        """These options with `progress_reader` resolved to `reader` (consumer or markers)."""
        return replace(self, progress_reader=reader)

    def client_config(self, resolved: bool = True) -> dict[str, str]:
        """What every client of the sink (producer, admin, progress reader) connects with.

        librdkafka's own log lines are off (`log_level` 0) unless the URI sets one: the sink reports
        what failed as a typed error, and stray lines would bury it. Connections are not sparse:
        with sparse ones a client that has just dropped its bootstrap connection for the broker
        the metadata named finds no broker up, and its first transactional or coordinator request
        waits for a retry timer (50 or 500 ms), which every batch's fresh producer would pay."""
        socket = {"socket.timeout.ms": str(self.timeouts.socket_ms)}  # a hung request ends within `timeout`
        client = mapped(dict(self.client), lambda k: f"the Kafka setting {k}") if resolved else dict(self.client)
        return {"log_level": "0", "enable.sparse.connections": "false", **socket, **client,
                "bootstrap.servers": self.bootstrap}

    @property
    def timeouts(self) -> Timeouts:
        return Timeouts.derive(self.timeout_s, dict(self.client), transactional=self.delivery == "exactly_once")

    def producer_config(self, feed: str) -> dict[str, Any]:
        config: dict[str, Any] = {
            "enable.idempotence": True,  # no duplicates or reordering from the producer's own retries
            "acks": "all",
            "partitioner": "murmur2_random",  # the Java client's: same key, same partition as other producers
            "queue.buffering.max.messages": 1_000_000,
            **self.client_config(),
            **self.timeouts.settings(),
        }
        if self.delivery == "exactly_once":
            config["transactional.id"] = transactional_id(feed)
        return config

    def check_client(self, feed: str) -> None:
        """Make the producer and the admin client from these options (librdkafka checks its settings
        when a client is made, before any request): a ConfigError naming the user's setting if refused."""
        from changefeed.sinks.kafka.client import check_settings

        for config, producer in ((self.client_config(), False), (self.producer_config(feed), True)):
            check_settings(config, self.refused, producer=producer)

    def refused(self, text: str) -> ConfigError:
        """librdkafka's refusal `text` of these options, naming the user's settings (kafka.client.refused)."""
        from changefeed.sinks.kafka.client import refused

        return refused(text, dict(self.client), self.timeout_s, SECRET_KEYS)

    def topic(self, schema: str, table: str) -> str:
        return sanitize_topic(self.topic_prefix + self.topic_name.format(schema=schema, table=table))

    def event_topic(self, name: str) -> str:
        """An outbox event's topic: its template's name, after the prefix."""
        return sanitize_topic(self.topic_prefix + name)

    def tombstones_for(self, fmt: str) -> bool:
        """Whether a delete is followed by a tombstone the sink adds (debezium makes its own)."""
        return bool(self.tombstones) and fmt != "debezium"

    def describe(self) -> str:
        """The options for messages: secrets left out."""
        shown = {k: ("***" if k in SECRET_KEYS or secret_name(k) else v) for k, v in self.client}
        return f"kafka://{self.bootstrap} ({self.delivery}; client settings {shown})"


def transactional_id(feed: str) -> str:
    return f"changefeed-{feed}"


def _client_settings(text: str) -> dict[str, str]:
    """`kafka_config`: a JSON object of librdkafka settings, or @PATH of a file holding one."""
    origin = "kafka_config"
    if text.startswith("@"):
        origin = f"kafka_config file {text[1:]}"
        try:
            text = Path(text[1:]).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read the {origin}: {e.strerror}", "point kafka_config=@PATH at a JSON file")
    try:
        settings = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"the {origin} is not JSON: {e}", 'e.g. kafka_config={"security.protocol":"SSL"}') from None
    if not isinstance(settings, Mapping):
        raise ConfigError(f"the {origin} must be a JSON object of librdkafka settings", 'e.g. {"acks": "all"}')
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in settings.items()}
