"""A Kafka sink's table topic read back as the rows a consumer holds (for `verify`).

Each partition is read up to a high watermark taken while the feed waited at the verification's
point, committed and non-transactional records only, by the reader the feed's progress uses
(`reading`: a read_committed consumer, sinks.kafka.progress, where the broker honours it, else
the transaction markers, sinks.kafka.log), and folded as the json and debezium
envelopes ask a consumer to (core.envelope): per key, an `after` merged into the row held (a
TOASTed value left unchanged is left out of it), a delete (after null) or tombstone removes it, a
truncate removes every row last changed before it (by commit timestamp: partitions have no order
among themselves). A table without a key is folded by whole rows: `before` removes, `after` adds.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from changefeed.sinks.kafka import progress
from changefeed.sinks.kafka.log import LogRecord, PartitionReader, committed, unsupported_settings
from changefeed.sinks.kafka.options import KafkaOptions

Rows = dict[str, dict[str, Any]]  # key (JSON list of the key values) -> column -> value


def reading(opts: KafkaOptions, feed: str) -> KafkaOptions:
    """`opts` with the reader verify uses: the feed's progress reader (sinks.kafka.probe); an
    at-least-once feed writes no transactions, so the markers where they can connect, else a consumer."""
    if opts.delivery != "exactly_once":
        return opts.reading("markers" if unsupported_settings(opts.client_config(resolved=False)) is None
                            else "consumer")
    from changefeed.sinks.kafka.probe import resolve

    return resolve(opts, feed)


def high_marks(opts: KafkaOptions, topic: str) -> dict[int, int]:
    """Per partition of `topic`: its high watermark now ({} if the topic does not exist)."""
    from confluent_kafka.admin import AdminClient

    meta = AdminClient({**opts.client_config()}).list_topics(topic, timeout=opts.timeout_s).topics.get(topic)
    if meta is None or meta.error is not None:
        return {}
    out = {}
    for p in sorted(meta.partitions):
        if opts.progress_reader == "consumer":
            out[p] = progress.offsets(opts.client_config(), topic, p, timeout=opts.timeout_s)[1]
            continue
        with PartitionReader(opts.client_config(), topic, p, timeout=opts.timeout_s) as reader:
            out[p] = reader.offsets()[1]
    return out


def read_rows(opts: KafkaOptions, topic: str, upto: Mapping[int, int], fmt: str, key: Sequence[str]) -> Rows:
    """The rows a consumer of `topic` holds once it has read each partition up to `upto`."""
    held: dict[str, tuple[int, dict[str, Any]]] = {}  # key -> (commit ts of its last change, row)
    truncated: list[int] = []
    for partition, high in upto.items():
        for record in _committed(opts, topic, partition, high):
            fold(held, truncated, record.key, record.value, fmt, key)
    for ts in truncated:
        held = {k: v for k, v in held.items() if v[0] >= ts}
    return {k: row for k, (_, row) in held.items()}


def _committed(opts: KafkaOptions, topic: str, partition: int, high: int) -> list[LogRecord]:
    if opts.progress_reader == "consumer":
        first = progress.offsets(opts.client_config(), topic, partition, timeout=opts.timeout_s)[0]
        return progress.read_partition(opts.client_config(), topic, partition, first, high, timeout=opts.timeout_s)
    with PartitionReader(opts.client_config(), topic, partition, timeout=opts.timeout_s) as reader:
        first, _ = reader.offsets()
        return committed(reader.read(first, high))


def fold(held: dict[str, tuple[int, dict[str, Any]]], truncated: list[int], key: bytes | None,
         value: bytes | None, fmt: str, key_columns: Sequence[str]) -> None:
    """One record into `held` (see the module doc); truncates are collected in `truncated`."""
    if value is None:  # a tombstone after a delete
        if key is not None:
            held.pop(_key(key, fmt, key_columns), None)
        return
    event = json.loads(value)
    if "resolved" in event or event.get("op") == "m":
        return
    ts = _ts(event, fmt)
    if event.get("op") == "t":
        truncated.append(ts)
        return
    if not key_columns:  # a table without a key (REPLICA IDENTITY FULL): a row is known by all its values
        if event.get("before") is not None:
            copies = _copies(held, row_identity(event["before"]))
            if copies:
                held.pop(copies[-1])
        if event.get("after") is not None:
            held[bag_key(held, row_identity(event["after"]))] = (ts, event["after"])
        return
    if key is None:
        return
    k = _key(key, fmt, key_columns)
    if event.get("after") is None:
        held.pop(k, None)
    else:
        held[k] = (ts, {**held.get(k, (0, {}))[1], **event["after"]})


def row_identity(row: Mapping[str, Any]) -> str:
    """What tells a row of a table without a key from the others: all its values."""
    return json.dumps(row, sort_keys=True)


def bag_key(held: Mapping[str, Any], identity: str) -> str:
    """The key of one more copy of a row of a table without a key (it may hold equal rows): its
    identity and how many copies came before it."""
    return f"{identity}#{len(_copies(held, identity))}"


def _copies(held: Mapping[str, Any], identity: str) -> list[str]:
    n = 0
    while f"{identity}#{n}" in held:
        n += 1
    return [f"{identity}#{i}" for i in range(n)]


def _key(key: bytes, fmt: str, columns: Sequence[str]) -> str:
    values = json.loads(key)
    return json.dumps([values[c] for c in columns] if fmt == "debezium" else values)


def _ts(event: dict[str, Any], fmt: str) -> int:
    """The change's commit timestamp: json's `updated` (HLC), debezium's source commit time (µs)."""
    if fmt == "debezium":
        return int((event.get("source") or {}).get("ts_us") or 0)
    return int(event.get("updated") or 0)
