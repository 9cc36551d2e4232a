"""The Kafka clients' settings: timeouts derived from one another, and librdkafka's refusals named by the user's option.

One sink option sets the pace, `timeout` (T): the longest one request or transaction step may take
(metadata, topic creation, the progress read, starting or committing a transaction). The client's
own timeouts follow from it, so that no value of T can give settings librdkafka refuses (it
requires, for a transactional producer, message.timeout.ms <= transaction.timeout.ms and
socket.timeout.ms <= transaction.timeout.ms + 100, and always message.timeout.ms > linger.ms):

* transaction.timeout.ms (X) = 4 T, within [60 s, 15 min]: how long a batch's transaction may stay
  open before the broker aborts it. 15 min is Apache Kafka's default `transaction.max.timeout.ms`,
  past which a broker refuses the producer;
* message.timeout.ms (D) = X: a message not acknowledged by then fails its batch;
* socket.timeout.ms = min(T, X, 5 min): a request without an answer is given up and retried;
* linger.ms = 20 (less if the user's message.timeout.ms is shorter).

A setting the --sink URI gives wins, and the others are derived around it (X grows to hold a
larger D, socket timeout or linger). What is still refused, settings the user gave that contradict
each other or a value out of range, is named by `refused` as the user's own setting. Stdlib only
at import: `KafkaOptions` uses it in Spark writer tasks.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from changefeed.errors import ConfigError, SinkError

STEP_MIN_S, STEP_MAX_S = 1.0, 900.0  # the documented range of `timeout`
TXN_MIN_MS, TXN_MAX_MS = 60_000, 900_000  # X's range when derived; 900 s: Kafka's transaction.max.timeout.ms
SOCKET_MAX_MS = 300_000  # librdkafka's upper bound of socket.timeout.ms
LINGER_MS = 20
# librdkafka's names for one property: the user may give either
_ALIASES = {"delivery.timeout.ms": "message.timeout.ms", "queue.buffering.max.ms": "linger.ms",
            "request.required.acks": "acks", "max.in.flight.requests.per.connection": "max.in.flight",
            "compression.codec": "compression.type", "metadata.broker.list": "bootstrap.servers",
            "sasl.mechanisms": "sasl.mechanism"}
_DERIVED = ("transaction.timeout.ms", "message.timeout.ms", "socket.timeout.ms", "linger.ms")


def canonical(name: str) -> str:
    return _ALIASES.get(name, name)


def _given_ms(client: Mapping[str, str], name: str) -> int | None:
    """The user's value of `name` (under any alias) in ms; None if not given or not a number
    (librdkafka then says what is wrong with it)."""
    for key, value in client.items():
        if canonical(key) == name:
            text = str(value).strip()
            return int(text) if re.fullmatch(r"[0-9]+", text) else None
    return None


@dataclass(frozen=True)
class Timeouts:
    """The client's timeouts in ms, and which of them the user set (those are left to librdkafka as given)."""

    step_ms: int
    transaction_ms: int | None  # None: no transactions (at_least_once)
    delivery_ms: int
    socket_ms: int
    linger_ms: int
    given: frozenset[str]

    @classmethod
    def derive(cls, step_s: float, client: Mapping[str, str], *, transactional: bool) -> Timeouts:
        step = int(step_s * 1000)
        user = {name: _given_ms(client, name) for name in _DERIVED}
        given = frozenset(k for k in _DERIVED if any(canonical(c) == k for c in client))
        linger = user["linger.ms"]
        if linger is None:  # below the user's delivery timeout, if a short one is set
            linger = min(LINGER_MS, (user["message.timeout.ms"] or LINGER_MS + 1) - 1)
        floor = max(min(max(4 * step, TXN_MIN_MS), TXN_MAX_MS),  # what T alone asks for
                    user["message.timeout.ms"] or 0,  # room for the user's own values
                    (user["socket.timeout.ms"] or 0) - 100,
                    linger + 1000)
        txn = (user["transaction.timeout.ms"] or floor) if transactional else None
        delivery = user["message.timeout.ms"] or (txn if txn is not None else floor)
        socket = user["socket.timeout.ms"] or min(step, txn or SOCKET_MAX_MS, SOCKET_MAX_MS)
        return cls(step, txn, delivery, socket, linger, given)

    def settings(self) -> dict[str, Any]:
        """The derived settings the producer gets (those the user gave stay as given)."""
        derived: dict[str, Any] = {"message.timeout.ms": self.delivery_ms, "socket.timeout.ms": self.socket_ms,
                                   "linger.ms": self.linger_ms}
        if self.transaction_ms is not None:
            derived["transaction.timeout.ms"] = self.transaction_ms
        return {k: v for k, v in derived.items() if k not in self.given}

    def describe(self) -> str:
        txn = f"transaction.timeout.ms={self.transaction_ms}, " if self.transaction_ms is not None else ""
        return (f"{txn}message.timeout.ms={self.delivery_ms}, socket.timeout.ms={self.socket_ms}, "
                f"linger.ms={self.linger_ms}")


def parse_step(text: str) -> float:
    """The `timeout` option: a duration within [1 s, 15 min]."""
    from changefeed.spec.units import parse_duration

    try:
        seconds = parse_duration(text)
    except ConfigError:
        seconds = -1.0
    if not STEP_MIN_S <= seconds <= STEP_MAX_S:
        raise ConfigError(f"timeout must be between 1s and 15m, got {text!r}",
                          "e.g. timeout=30s (the default); the client's other timeouts follow from it")
    return seconds


def refused(text: str, client: Mapping[str, str], step_s: float, secrets: tuple[str, ...]) -> ConfigError:
    """librdkafka's refusal of the sink's settings as an error that names what the user gave.

    librdkafka names the properties it objects to in backquotes or double quotes; those the user
    set (under any alias) are named with their values, and the derived timeouts by `timeout`."""
    text = text.strip()
    named = {canonical(n) for n in re.findall(r'[`"]([A-Za-z][A-Za-z0-9_.]*)[`"]', text)}
    mine = [k for k in client if canonical(k) in named]
    if mine:
        shown = ", ".join(f"{k}={'***' if k in secrets else client[k]}" for k in mine)
        return ConfigError(f"the Kafka client refuses the --sink URI's {shown}: {text}",
                           f"change or remove {', '.join(mine)} in the --sink URI (or its kafka_config)")
    if named & set(_DERIVED):
        return ConfigError(f"the Kafka client refuses the timeouts derived from timeout={step_s:g}s: {text}",
                           "choose another timeout= (1s to 15m), or set the timeout named above in the --sink URI")
    raise SinkError(f"the Kafka client refuses settings changefeed made itself: {text}",
                    "this is a bug in changefeed: report it with the --sink URI (passwords removed)")


def check_settings(config: Mapping[str, Any], refusal: Callable[[str], ConfigError], *, producer: bool) -> None:
    """Make a librdkafka client from `config` and drop it: librdkafka's refusal becomes `refusal(text)`."""
    from confluent_kafka import KafkaException, Producer
    from confluent_kafka.admin import AdminClient

    try:
        Producer(dict(config)) if producer else AdminClient(dict(config))
    except KafkaException as e:
        raise refusal(e.args[0].str()) from None
