"""Read a Kafka partition with each record's transaction outcome: the marker reader.

The exactly-once sink must know which progress records were committed. A `read_committed`
consumer says so on brokers that list aborted transactions in their Fetch answers (Apache Kafka
and its kin: sinks.kafka.progress), but not on every broker that speaks the protocol (Tansu hands
aborted records to `read_committed` consumers), and a consumer cannot tell "aborted" from "not
there". For those brokers (found by sinks.kafka.probe, or named by `progress_reader=markers`) this
module reads the partition at the protocol level (ListOffsets v1 for the log start, Fetch v4,
read_uncommitted) and sets each record's outcome from the COMMIT / ABORT control markers that
follow it: the rule every broker must keep. It finds the partition's leader through librdkafka's
metadata, and connects with the sink's own settings: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL
with PLAIN or SCRAM-SHA-256/512 (`unsupported_settings` names what it cannot do). Record batches
may be compressed with any codec Kafka has (sinks.kafka.records).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import os
import socket
import ssl
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from changefeed.errors import ConfigError, TransientError
from changefeed.sinks.kafka.records import CONTROL, TRANSACTIONAL, Buf, batches

Outcome = Literal["committed", "aborted", "open", "none"]
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_CLIENT_ID = b"changefeed-progress"
_MAX_BYTES = 8 << 20


@dataclass
class LogRecord:
    """One data record as stored, with the outcome of its transaction ("none": not transactional)."""

    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    producer_id: int
    producer_epoch: int
    outcome: Outcome


def committed(records: list[LogRecord]) -> list[LogRecord]:
    """What a `read_committed` consumer should see: non-transactional and committed records."""
    return [r for r in records if r.outcome in ("committed", "none")]


def unsupported_settings(config: Mapping[str, str]) -> str | None:
    """Why this reader cannot connect with `config` (a login or key store only librdkafka has), None if it can."""
    protocol = str(config.get("security.protocol", "plaintext")).lower()
    if protocol not in ("plaintext", "ssl", "sasl_plaintext", "sasl_ssl"):
        return f"security.protocol={protocol} is not one of PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL"
    if protocol.startswith("sasl"):
        mechanism = str(config.get("sasl.mechanism", config.get("sasl.mechanisms", "GSSAPI"))).upper()
        if mechanism not in SASL_MECHANISMS:
            return f"sasl.mechanism={mechanism} (the marker reader speaks {', '.join(SASL_MECHANISMS)})"
    for key in ("ssl.keystore.location", "ssl.certificate.pem", "ssl.key.pem", "ssl.engine.location"):
        if key in config:
            return f"{key} (the marker reader takes ssl.ca.location, ssl.certificate.location, ssl.key.location)"
    return None


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack(">h", len(data)) + data


# --- SASL ----------------------------------------------------------------------------------------------------------

def scram(mechanism: str, user: str, password: str, exchange: Callable[[bytes], bytes], *,
          nonce: str | None = None) -> None:
    """The client side of SCRAM (RFC 5802) over `exchange` (send a message, return the answer)."""
    algo = "sha256" if mechanism.upper().endswith("256") else "sha512"
    nonce = nonce or base64.b64encode(os.urandom(18)).decode()
    name = user.replace("=", "=3D").replace(",", "=2C")
    bare = f"n={name},r={nonce}"
    first = exchange(f"n,,{bare}".encode()).decode()
    attrs = dict(part.split("=", 1) for part in first.split(",") if "=" in part)
    if "e" in attrs or not attrs.get("r", "").startswith(nonce) or "s" not in attrs or "i" not in attrs:
        raise _auth_failed(f"the broker's SCRAM challenge is not usable: {first!r}")
    salted = hashlib.pbkdf2_hmac(algo, password.encode(), base64.b64decode(attrs["s"]), int(attrs["i"]))
    client_key = hmac.digest(salted, b"Client Key", algo)
    without_proof = f"c=biws,r={attrs['r']}"
    message = f"{bare},{first},{without_proof}".encode()
    signature = hmac.digest(hashlib.new(algo, client_key).digest(), message, algo)
    proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
    final = exchange(f"{without_proof},p={base64.b64encode(proof).decode()}".encode()).decode()
    expected = base64.b64encode(hmac.digest(hmac.digest(salted, b"Server Key", algo), message, algo)).decode()
    if final != f"v={expected}":
        raise _auth_failed(f"the broker's SCRAM signature does not match: {final!r}")


def _auth_failed(what: str) -> Exception:
    from changefeed.errors import AuthenticationFailed

    return AuthenticationFailed(f"Kafka marker reader: {what}", "check sasl.username / sasl.password and "
                                "sasl.mechanism in the --sink URI")


def _tls(config: Mapping[str, str]) -> ssl.SSLContext:
    ca = config.get("ssl.ca.location")
    context = ssl.create_default_context(cafile=ca if ca and not os.path.isdir(ca) else None,
                                         capath=ca if ca and os.path.isdir(ca) else None)
    if "ssl.certificate.location" in config:
        context.load_cert_chain(config["ssl.certificate.location"], config.get("ssl.key.location"),
                                config.get("ssl.key.password"))
    if str(config.get("ssl.endpoint.identification.algorithm", "https")).lower() == "none":
        context.check_hostname = False
    if str(config.get("enable.ssl.certificate.verification", "true")).lower() == "false":
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


# --- one broker connection -----------------------------------------------------------------------------------------

class _Connection:
    """Requests to one broker, with the header v1 / response header v0 of non-flexible API versions."""

    def __init__(self, host: str, port: int, config: Mapping[str, str], timeout: float) -> None:
        self.correlation = 0
        protocol = str(config.get("security.protocol", "plaintext")).lower()
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            if protocol in ("ssl", "sasl_ssl"):
                sock = _tls(config).wrap_socket(sock, server_hostname=host)
            self.sock = sock
            if protocol.startswith("sasl"):
                self._authenticate(config)
        except BaseException:
            sock.close()
            raise

    def close(self) -> None:
        self.sock.close()

    def request(self, api: int, version: int, body: bytes) -> Buf:
        self.correlation += 1
        header = struct.pack(">hhih", api, version, self.correlation, len(_CLIENT_ID)) + _CLIENT_ID
        self.sock.sendall(struct.pack(">i", len(header) + len(body)) + header + body)
        answer = Buf(self._recv(struct.unpack(">i", self._recv(4))[0]))
        if answer.num(">i") != self.correlation:
            raise TransientError("the Kafka broker answered out of order", "run the feed again")
        return answer

    def _recv(self, n: int) -> bytes:
        chunks = []
        while n:
            chunk = self.sock.recv(min(n, 1 << 20))
            if not chunk:
                raise ConnectionError("the broker closed the connection")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def _authenticate(self, config: Mapping[str, str]) -> None:
        mechanism = str(config.get("sasl.mechanism", config.get("sasl.mechanisms", "GSSAPI"))).upper()
        answer = self.request(17, 1, _string(mechanism))  # SaslHandshake v1
        if answer.num(">h"):
            offered = [answer.string() for _ in range(answer.num(">i"))]
            raise _auth_failed(f"the broker does not offer SASL {mechanism} (it offers {offered})")
        user, password = str(config.get("sasl.username", "")), str(config.get("sasl.password", ""))
        if mechanism == "PLAIN":
            self._sasl_step(f"\0{user}\0{password}".encode())
        else:
            scram(mechanism, user, password, self._sasl_step)

    def _sasl_step(self, data: bytes) -> bytes:
        answer = self.request(36, 0, struct.pack(">i", len(data)) + data)  # SaslAuthenticate v0
        error, message = answer.num(">h"), answer.string()
        if error:
            raise _auth_failed(f"authentication refused (Kafka error {error}: {message})")
        return answer.bytes32()


# --- reading a partition ---------------------------------------------------------------------------------------------

_BROKER_DOWN = "the broker may be down; the feed resumes from its checkpoint when run again"


class PartitionReader:
    """Reads one partition from its leader; `with PartitionReader(...) as r: r.offsets(); r.read(a, b)`."""

    def __init__(self, config: Mapping[str, str], topic: str, partition: int = 0, *, timeout: float = 10.0) -> None:
        self.config, self.topic, self.partition, self.timeout = config, topic, partition, timeout
        host, port = self._leader()
        try:
            self.conn = _Connection(host, port, config, timeout)
        except OSError as e:
            raise TransientError(f"cannot read {topic}[{partition}] from its leader {host}:{port}: {e}",
                                 _BROKER_DOWN) from None

    def __enter__(self) -> PartitionReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.conn.close()

    def _leader(self) -> tuple[str, int]:
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

        try:
            meta = AdminClient(dict(self.config)).list_topics(self.topic, timeout=self.timeout)
        except KafkaException as e:
            raise TransientError(f"cannot read the metadata of {self.topic}: {e.args[0].str()}",
                                 _BROKER_DOWN) from None
        t = meta.topics.get(self.topic)
        p = t.partitions.get(self.partition) if t is not None and t.error is None else None
        if p is None or p.leader < 0 or p.leader not in meta.brokers:
            raise TransientError(f"{self.topic}[{self.partition}] has no leader now",
                                 "the cluster may be electing one; run the feed again")
        broker = meta.brokers[p.leader]
        return str(broker.host), broker.port  # (confluent_kafka types host as None, its value before it is set)

    def offsets(self) -> tuple[int, int]:
        """(log start offset, high watermark).

        The high watermark comes from a Fetch, not from ListOffsets: Tansu's ListOffsets counts a
        compressed batch as one offset."""
        first = self._log_start()
        error, high, _ = self._fetch(first, max_bytes=1)
        self._check(error, "reading the high watermark")
        return first, high

    def _log_start(self) -> int:
        body = (struct.pack(">ii", -1, 1) + _string(self.topic) + struct.pack(">iiq", 1, self.partition, -2))
        answer = self.conn.request(2, 1, body)  # ListOffsets v1
        for _ in range(answer.num(">i")):
            answer.string()
            for _ in range(answer.num(">i")):
                answer.num(">i")
                error, _, offset = answer.num(">h"), answer.num(">q"), answer.num(">q")
                self._check(error, "listing offsets")
                return int(offset)
        raise TransientError(f"the broker listed no offsets for {self.topic}[{self.partition}]", "run the feed again")

    def _fetch(self, offset: int, max_bytes: int = _MAX_BYTES) -> tuple[int, int, bytes]:
        """One Fetch v4, read_uncommitted: (error, high watermark, record batches)."""
        body = (struct.pack(">iiiib", -1, 50, 1, max_bytes, 0) + struct.pack(">i", 1) + _string(self.topic)
                + struct.pack(">iiqi", 1, self.partition, offset, max_bytes))
        answer = self.conn.request(1, 4, body)
        answer.num(">i")  # throttle
        for _ in range(answer.num(">i")):
            answer.string()
            for _ in range(answer.num(">i")):
                answer.num(">i")
                error, high = answer.num(">h"), answer.num(">q")
                answer.num(">q")  # last stable offset
                for _ in range(max(answer.num(">i"), 0)):
                    answer.take(16)  # aborted transactions: the markers below say the same
                return error, high, answer.bytes32()
        raise TransientError(f"the broker answered a Fetch of {self.topic} with no partition", "run the feed again")

    def _check(self, error: int, doing: str) -> None:
        if error:
            raise TransientError(f"Kafka error {error} {doing} of {self.topic}[{self.partition}]",
                                 "the cluster may be moving the partition; run the feed again")

    def read(self, start: int, end: int) -> list[LogRecord]:
        """The data records at offsets [start, end), each with its outcome as of the markers up to `end`
        (a transaction whose marker lies beyond `end` reads as "open")."""
        deadline = time.monotonic() + self.timeout
        out: list[LogRecord] = []
        pending: dict[int, list[LogRecord]] = {}
        offset = start
        while offset < end:
            error, _, data = self._fetch(offset)
            self._check(error, f"fetching at {offset}")
            progressed = False
            for _, last, attributes, producer_id, epoch, records in batches(data):
                if last < offset:
                    continue
                progressed = True
                offset = last + 1
                if attributes & CONTROL:  # a control batch: COMMIT (type 1) or ABORT (type 0)
                    key = records[0][1].varbytes() if records else None
                    kind = struct.unpack(">hh", key)[1] if key and len(key) >= 4 else -1
                    for done in pending.pop(producer_id, []):
                        done.outcome = "committed" if kind == 1 else "aborted"
                    continue
                transactional = bool(attributes & TRANSACTIONAL)
                for at, buf in records:
                    key, value = buf.varbytes(), buf.varbytes()
                    headers = [((buf.varbytes() or b"").decode(), buf.varbytes()) for _ in range(buf.varint())]
                    if not start <= at < end:
                        continue
                    record = LogRecord(at, key, value, headers, producer_id, epoch,
                                       "open" if transactional else "none")
                    out.append(record)
                    if transactional:
                        pending.setdefault(producer_id, []).append(record)
            if not progressed:
                if time.monotonic() > deadline:
                    raise TransientError(f"reading {self.topic}[{self.partition}] stalled at offset {offset} "
                                         f"(end {end})", "the broker may be overloaded; run the feed again")
                time.sleep(0.05)
        return out


def read_partition(config: Mapping[str, str], topic: str, partition: int = 0, *, start: int = 0,
                   timeout: float = 10.0) -> list[LogRecord]:
    """Every data record of `topic`/`partition` from `start` to the high watermark, with its outcome."""
    with PartitionReader(config, topic, partition, timeout=timeout) as reader:
        first, high = reader.offsets()
        return reader.read(max(start, first), high)


def last_committed(config: Mapping[str, str], topic: str, partition: int, match: Callable[[LogRecord], bool], *,
                   window: int = 1000, timeout: float = 10.0) -> LogRecord | None:
    """The last committed (or non-transactional) record of the partition that `match`es, None if none does.

    Reads the tail `window` offsets first, then twice as far back each time nothing matches: the
    progress topic is compacted and its newest records are the ones asked for.
    """
    with PartitionReader(config, topic, partition, timeout=timeout) as reader:
        first, high = reader.offsets()
        return search_back(first, high, window, lambda start, end: [
            r for r in committed(reader.read(start, high)) if r.offset < end and match(r)])


def search_back(first: int, high: int, window: int,
                found_in: Callable[[int, int], list[LogRecord]]) -> LogRecord | None:
    """The last of `found_in(start, end)` over [first, high): the tail `window` offsets first, then
    twice as far back each time it finds nothing (both progress readers search this way)."""
    if window < 1:
        raise ConfigError("the progress read window must be >= 1", "pass a positive window")
    start, seen = max(first, high - window), high
    while True:
        found = found_in(start, seen)
        if found:
            return found[-1]
        if start <= first:
            return None
        window *= 2
        seen, start = start, max(first, start - window)
