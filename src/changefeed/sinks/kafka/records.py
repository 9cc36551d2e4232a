"""Kafka's record batches (message format v2) as stored in a partition, decompressed: the marker reader's bytes.

A Fetch answer holds whole record batches; each one's attributes name its codec (bits 0-2) and
whether it is transactional (bit 4) or a control batch of COMMIT / ABORT markers (bit 5). The
records of a compressed batch are one compressed block, decoded here with `cramjam` (a kept
binding of the Rust gzip, snappy, lz4 and zstd libraries) rather than by hand:

* 1 gzip: a gzip stream;
* 2 snappy: raw snappy (librdkafka writes this), or the xerial framing the Java client writes
  (a 16-byte header, then blocks each prefixed with its big-endian length);
* 3 lz4: an LZ4 frame (format v2 batches always have a correct frame header; the broken header
  checksum of Kafka 0.8-0.10 belongs to message format v0 only);
* 4 zstd: a zstd frame.

Anything else is CorruptLog, which names the codec.
"""
from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import cramjam

from changefeed.errors import SinkError

CODECS = {0: "none", 1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}
TRANSACTIONAL, CONTROL = 0x10, 0x20  # attribute bits
_XERIAL = b"\x82SNAPPY\x00"


class CorruptLog(SinkError):
    """The broker returned bytes that are not Kafka record batches this reader understands."""


class Buf:
    """A cursor over bytes, reading Kafka's big-endian numbers, zigzag varints and sized fields."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise EOFError
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def num(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.take(1)[0]
            result |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return (result >> 1) ^ -(result & 1)

    def varbytes(self) -> bytes | None:
        n = self.varint()
        return None if n < 0 else self.take(n)

    def string(self) -> str | None:
        n = self.num(">h")
        return None if n < 0 else self.take(n).decode()

    def bytes32(self) -> bytes:
        return self.take(max(self.num(">i"), 0))


def decompress(codec: int, payload: bytes) -> bytes:
    """The records block of a batch compressed with `codec` (the attributes' bits 0-2), decoded."""
    if codec == 0:
        return payload
    if codec == 1:
        return bytes(cramjam.gzip.decompress(payload))
    if codec == 2:
        if not payload.startswith(_XERIAL):
            return bytes(cramjam.snappy.decompress_raw(payload))
        blocks, b = [], Buf(payload)
        b.take(16)  # magic, version, compatible version
        while b.pos < len(payload):
            blocks.append(bytes(cramjam.snappy.decompress_raw(b.take(b.num(">i")))))
        return b"".join(blocks)
    if codec == 3:
        return bytes(cramjam.lz4.decompress(payload))
    if codec == 4:
        return bytes(cramjam.zstd.decompress(payload))
    raise ValueError(f"unknown codec {codec}")


Batch = tuple[int, int, int, int, int, list[tuple[int, Buf]]]


def batches(data: bytes) -> Iterator[Batch]:
    """(base offset, last offset, attributes, producer id, epoch, [(offset, record)]) per complete v2
    batch of a Fetch answer; each record's cursor stands at its key (a control record's: its type)."""
    r = Buf(data)
    while len(data) - r.pos >= 12:
        base, length = r.num(">q"), r.num(">i")
        if len(data) - r.pos < length:
            return  # a partial batch at the end of the response
        b = Buf(r.take(length))
        b.num(">i")  # partition leader epoch
        if b.num(">b") != 2:
            raise CorruptLog("the broker returned a record batch older than format v2",
                             "use a broker of Kafka 0.11 or later (message format v2)")
        b.take(4)  # crc
        attributes, last_delta = b.num(">h"), b.num(">i")
        b.take(16)  # timestamps
        producer_id, epoch = b.num(">q"), b.num(">h")
        b.num(">i")  # base sequence
        count = b.num(">i")
        codec = attributes & 0x07
        try:
            p = Buf(decompress(codec, b.data[b.pos:]))
        except (cramjam.DecompressionError, ValueError, EOFError) as e:
            raise CorruptLog(f"the record batch at offset {base} does not decode as {CODECS.get(codec, codec)}: {e}",
                             "the batch is damaged or its codec unknown; read the topic with a Kafka consumer to "
                             "compare") from None
        records = []
        for _ in range(count):
            rec = Buf(p.take(p.varint()))
            rec.num(">b")
            rec.varint()  # timestamp delta
            records.append((base + rec.varint(), rec))
        yield base, base + last_delta, attributes, producer_id, epoch, records
