"""Shared fixtures: one pair of real PostgreSQL servers and one SparkSession per test session.

Each test gets its own source and sink databases on those servers (`dbs`), so tests stay
isolated without paying for new servers.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, settings

from changefeed.local.postgres import LocalPostgres

# Hypothesis: `ci` (set by CI=true, as .ci/run does) prints the blob that reproduces a failure and
# does not fail a pure property on a slow, busy machine's timing; a test's own @settings (the ones
# that start servers) still sets its number of examples.
settings.register_profile("ci", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "default"))

_counter = itertools.count()

# The pause of a test's writer between its transactions: a rate that a feed follows on a busy
# 2-core machine. Faster writers prove nothing more (the races are per transaction), but every
# catch-up after a kill replays what they wrote, which made the suite's kill tests long.
WRITE_PAUSE = 0.01

# The longest tests first (`make test` runs two pytest-xdist workers; one that runs dry takes the
# end of the other's queue, so short tests at the end even the two out): the end-to-end feeds, then
# those that start a Spark session, then the rest; in each, the tests marked slow first. Only the
# order changes; every test still runs.
_FIRST = ("tests/e2e/", "tests/spark/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> tuple[int, bool]:
        path = item.nodeid
        first = next((i for i, prefix in enumerate(_FIRST) if path.startswith(prefix)), len(_FIRST))
        return first, item.get_closest_marker("slow") is None  # the slow ones (a minute or more) first

    items.sort(key=rank)


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalPostgres, LocalPostgres]]:
    root = tmp_path_factory.mktemp("pg")
    slots = {"max_replication_slots": "64"}  # every test's feed has one while it runs (dbs drops them after)
    # the source can prepare transactions: feeds of several nodes decode them (core.distributed)
    source = LocalPostgres.start(root / "source", settings={**slots, "max_prepared_transactions": "64"})
    sink = LocalPostgres.start(root / "sink", settings=slots)
    yield source, sink
    source.stop("immediate")
    sink.stop("immediate")


@dataclass
class Dbs:
    source: str
    sink: str
    name: str  # a fresh name for the feed of this test

    def src(self) -> psycopg.Connection:
        return psycopg.connect(self.source, autocommit=True)

    def dst(self) -> psycopg.Connection:
        return psycopg.connect(self.sink, autocommit=True)


@pytest.fixture
def dbs(servers: tuple[LocalPostgres, LocalPostgres]) -> Iterator[Dbs]:
    """A fresh empty database on each server, and a fresh feed name. Afterwards the replication
    slots left in the source database are dropped: the shared server has a fixed number of them,
    and each one keeps WAL back for the rest of the session."""
    n = next(_counter)
    name = f"t{os.getpid()}_{n}"
    source, sink = servers
    for server in servers:
        with psycopg.connect(server.uri(), autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
    yield Dbs(source.uri(name), sink.uri(name), name)
    drop_slots(source.uri(), name)


def drop_slots(uri: str, database: str) -> None:
    """Drop the inactive replication slots of `database` (a slot a process still reads stays)."""
    with suppress(psycopg.Error), psycopg.connect(uri, autocommit=True) as c:
        c.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                  "WHERE database = %s AND NOT active", (database,))


@pytest.fixture(scope="session")
def spark() -> object:
    from changefeed.spark.job import spark_session

    return spark_session("local[2]")


@pytest.fixture(scope="session")
def spark_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Spark Connect server for this test process's feeds, as `changefeed spark-server` starts
    one: a feed started on it pays no JVM start of its own. Its output goes to server.log."""
    from changefeed.spark.connect import start_server, stop_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(tmp_path_factory.mktemp("spark-server") / "server.log", "ab") as out:
        proc = start_server("127.0.0.1", port, "local[2]", out=out)
    yield f"sc://127.0.0.1:{port}"
    stop_server(proc)


@pytest.fixture
def warm_spark(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The feeds this test starts run on the shared Spark Connect server (CHANGEFEED_MASTER), not
    on a driver of their own. For tests that stop their feeds rather than SIGKILL them (a killed
    runner's query runs on) and set no fault points (the server's workers do not see them).
    CHANGEFEED_TEST_OWN_SPARK=1 runs them on drivers of their own, as without the fixture."""
    if not os.environ.get("CHANGEFEED_TEST_OWN_SPARK"):
        monkeypatch.setenv("CHANGEFEED_MASTER", request.getfixturevalue("spark_server"))


def fingerprint(uri: str, table: str) -> tuple[int, str]:
    """(row count, md5 over the rows' text in key order): equal fingerprints = equal tables."""
    with psycopg.connect(uri) as c:
        row = c.execute(f"SELECT count(*), coalesce(md5(string_agg(x::text, '|' ORDER BY x::text)), '') "
                        f"FROM {table} x").fetchone()
    assert row is not None
    return int(row[0]), str(row[1])


def decoded(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Change rows of a window as two reads of it must agree on: pgoutput sends a table's
    Relation message again, unchanged, after a relcache invalidation that reaches the decoding
    backend while it decodes (autovacuum's ANALYZE of the table, at any moment), so a second
    read may hold one more `R` row, which also takes a `seq` number in its transaction. Such
    repeats are dropped and `seq` left out; any changed shape stays."""
    out, shapes = [], {}
    for row in rows:
        if row["op"] == "R":
            table = (row["schema"], row["table"])
            if shapes.get(table) == row["meta"]:
                continue
            shapes[table] = row["meta"]
        out.append({k: v for k, v in row.items() if k != "seq"})
    return out


def planned(checkpoint: Path, batch: int, end: dict[str, Any], committed: bool = True) -> None:
    """What Spark's offset and commit logs hold after planning (and committing) batch `batch`
    that ends at offset `end` (its JSON)."""
    for log in ("offsets", "commits"):
        (checkpoint / log).mkdir(parents=True, exist_ok=True)
    (checkpoint / "offsets" / str(batch)).write_text('v1\n{"batchWatermarkMs":0}\n' + json.dumps(end))
    if committed:
        (checkpoint / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}')


def wait_for(what: str, check: Callable[[], Any], log: Path, timeout: float = 180) -> Any:
    """Poll `check` until it returns something truthy (returned); past `timeout`, fail with the feed's log."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}; feed log:\n{log.read_text()[-3000:]}"
        time.sleep(0.3)
    return got


def assert_no_traceback(text: str) -> None:
    """No raw traceback reached the console; on failure, show the first one whole."""
    at = text.find("Traceback")
    assert at < 0, f"a traceback on the console:\n{text[max(0, at - 1500):at + 4000]}"


def changefeed_cli(*args: str, timeout: float = 600, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run `python -m changefeed ARGS` as its own process; returns the completed process."""
    return subprocess.run([sys.executable, "-m", "changefeed", *args], capture_output=True, text=True,
                          timeout=timeout, **kwargs)  # type: ignore[call-overload]


def status_of(name: str, state: Path | str) -> dict[str, Any]:
    """What `changefeed status --name NAME --state STATE --json` prints, read in this process: a
    poll costs no Python start of its own."""
    import json

    from changefeed.control.status import status
    from changefeed.spec.state import FeedState

    feed = FeedState(state, name)
    spec = feed.load()
    assert spec is not None, f"no feed {name} under {state}"
    return dict(json.loads(json.dumps(status(spec, feed).__dict__)))


def start_changefeed(*args: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start `python -m changefeed ARGS` in its own process group (so a test can SIGKILL all of it)."""
    out = open(log, "ab")
    return subprocess.Popen([sys.executable, "-m", "changefeed", *args], stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, **(env or {})})


def killed_by_fault(p: subprocess.Popen[bytes], log: Path, timeout: float = 300) -> None:
    """Wait for a feed started with `CHANGEFEED_KILL_AT` to die of it; if it does not in time, kill
    it and fail with the end of its log (what it was doing instead)."""
    try:
        code = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        pytest.fail(f"the feed did not reach its fault point in {timeout:.0f} s:\n{log.read_text()[-5000:]}")
    assert code == -signal.SIGKILL, log.read_text()[-3000:]


def moving_money(accounts: int, amount: int = 1) -> Callable[[str, threading.Event, list[int]], None]:
    """A `writing` worker: transaction n appends row n to `ledger` and moves `amount` from account
    n % accounts to account (7n + 1) % accounts; `written` = [n]."""
    def mover(uri: str, stop: threading.Event, written: list[int]) -> None:
        with psycopg.connect(uri, autocommit=True) as c:
            n = 0
            while not stop.is_set():
                n += 1
                with c.transaction():
                    c.execute("INSERT INTO ledger (id, v) VALUES (%s, %s)", (n, f"entry {n}"))
                    c.execute("UPDATE accounts SET balance = balance - %s WHERE id = %s", (amount, n % accounts))
                    c.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s",
                              (amount, (n * 7 + 1) % accounts))
                written[:] = [n]
                time.sleep(WRITE_PAUSE)
    return mover


def money_tables(dbs: Dbs, accounts: int, balance: int = 1000) -> None:
    """`moving_money`'s tables on the source: an empty `ledger`, and `accounts` accounts of `balance`."""
    with dbs.src() as c:
        c.execute("CREATE TABLE ledger (id bigint PRIMARY KEY, v text NOT NULL)")
        c.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        c.execute("INSERT INTO accounts SELECT g, %s FROM generate_series(0, %s) g", (balance, accounts - 1))


def kafka_sink(bootstrap: str, partitions: int) -> tuple[str, str, str]:
    """(A Kafka sink URI whose topics and progress topic are the caller's own, its topic prefix,
    its progress topic), the topics made with `partitions` partitions."""
    import uuid

    prefix, progress_topic = f"k{uuid.uuid4().hex[:8]}.", f"progress-{uuid.uuid4().hex[:8]}"
    return (f"kafka://{bootstrap}?topic_prefix={prefix}&progress_topic={progress_topic}"
            f"&topic_partitions={partitions}", prefix, progress_topic)


def replicated(uri: str) -> int:
    """The highest `ledger` id on the replica at `uri` (moving_money's rows; 0 before the table exists)."""
    with psycopg.connect(uri) as d:
        if d.execute("SELECT to_regclass('public.ledger') IS NULL").fetchone()[0]:  # type: ignore[index]
            return 0
        return int(d.execute("SELECT coalesce(max(id), 0) FROM ledger").fetchone()[0])  # type: ignore[index]


def most_sub_windows(uri: str, feed: str, epoch: int | None = None) -> int:
    """The most progress rows one batch of `feed` committed on the replica (of lease term `epoch`,
    if given): a followed batch of low-latency mode commits many sub-windows, a micro-batch one."""
    with psycopg.connect(uri) as d:
        if d.execute("SELECT to_regclass('changefeed.progress') IS NULL").fetchone()[0]:  # type: ignore[index]
            return 0
        return int(d.execute("SELECT coalesce(max(n), 0) FROM (SELECT count(*) n FROM changefeed.progress "
                             "WHERE feed = %s AND (%s::bigint IS NULL OR epoch = %s) GROUP BY batch_id) x",
                             (feed, epoch, epoch)).fetchone()[0])  # type: ignore[index]


def taken_over_while_frozen(dbs: Dbs, frozen: subprocess.Popen[bytes], logs: list[Path], fault_dir: Path,
                            rows: Callable[[], int], fence: Callable[[], Any] | None = None) -> tuple[int, Any]:
    """Once the runner `frozen` (log logs[0]) froze at its armed CHANGEFEED_STOP_AT point: wait for
    the standby (log logs[1]) to take the feed over and apply `rows` more, then wake the frozen
    one, which must stop with exit 2 (its lease lost). Returns the sink's fence as `fence()` reads
    it, (epoch, where it stands); by default the replica's (epoch, raised_at)."""
    wait_for("the runner to freeze", lambda: (fault_dir / ".stopped-groups").exists(), logs[0])
    frozen_at = rows()  # its sessions stay open, it renews nothing
    wait_for("the standby to take over", lambda: "taking the feed over" in logs[1].read_text(), logs[1], timeout=60)
    wait_for("new rows from the standby", lambda: rows() > frozen_at + 20, logs[1])
    if fence is None:
        with dbs.dst() as d:
            claimed = d.execute("SELECT epoch, raised_at FROM changefeed.fences WHERE feed = %s",
                                (dbs.name,)).fetchone()
    else:
        claimed = fence()
    assert claimed is not None and claimed[0] >= 2
    for group in (fault_dir / ".stopped-groups").read_text().split():
        os.killpg(int(group), signal.SIGCONT)
    code = frozen.wait(timeout=120)
    assert code == 2, f"the woken runner exited {code}:\n{logs[0].read_text()[-3000:]}"
    return int(claimed[0]), claimed[1]


@contextmanager
def writing(writer: Callable[[str, threading.Event, list[int]], None], uri: str, written: list[int]) -> Iterator[None]:
    """Run `writer(uri, stop, written)` in a thread for the block; stop it and wait for it after."""
    stop = threading.Event()
    w = threading.Thread(target=writer, args=(uri, stop, written))
    w.start()
    try:
        yield
    finally:
        stop.set()
        w.join()


def terminating(uri: str, stop: threading.Event, _: list[int]) -> None:
    """A `writing` worker: terminate the feed's backends on the source (its runner's, its readers')
    every 0.2 s until stopped."""
    with psycopg.connect(uri, autocommit=True) as c:
        while not stop.is_set():
            c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
                      "AND application_name LIKE 'changefeed%%' AND pid <> pg_backend_pid()")
            time.sleep(0.2)


def kill_runs(base: list[str], kills: list[str], tmp_path: Path, random_after: tuple[float, float]) -> None:
    """Run the feed (`base` args) once per kill point, each killed there by its fault point
    (CHANGEFEED_KILL_AT), or for "random" SIGKILLed after a random time in `random_after`."""
    import random
    import signal

    for i, point in enumerate(kills):
        fault_dir = tmp_path / f"faults{i}"
        fault_dir.mkdir()
        env = {} if point == "random" else {"CHANGEFEED_KILL_AT": point, "CHANGEFEED_FAULT_DIR": str(fault_dir)}
        p = start_changefeed(*base, log=tmp_path / f"run{i}.log", env=env)
        if point == "random":
            time.sleep(random.uniform(*random_after))
            os.killpg(p.pid, signal.SIGKILL)
        rc = p.wait(timeout=300)
        assert rc == -signal.SIGKILL, (point, (tmp_path / f"run{i}.log").read_text()[-3000:])
        time.sleep(0.5)  # let the killed group's sockets close


def processes() -> dict[int, tuple[int, str]]:
    """Every process now (from /proc): pid -> (parent pid, command line); one gone meanwhile is left out."""
    found: dict[int, tuple[int, str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        found[int(stat.parent.name)] = (parent, cmd)
    return found


def process_tree(root: int, procs: dict[int, tuple[int, str]] | None = None) -> dict[int, str]:
    """`root` and every process under it (as a service manager's control group holds them): pid ->
    command line, from `procs` (`processes()`, read now by default)."""
    procs = processes() if procs is None else procs
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in procs.items():
        children.setdefault(parent, []).append(pid)
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in procs:
            found[pid] = procs[pid][1]
        todo.extend(children.get(pid, []))
    return found


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kafka_partitions(bootstrap: str, topic: str) -> list[Any]:
    """Every record of each partition of `topic`, with its transaction's outcome (local_kafka.LogRecord)."""
    from confluent_kafka.admin import AdminClient

    from changefeed.local.kafka import read_partition

    meta = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10).topics[topic]
    return [read_partition(bootstrap, topic, p, timeout=60) for p in sorted(meta.partitions)]


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real Kafka-protocol broker (Tansu, in memory) for the session."""
    import gc

    from changefeed.local.kafka import LocalKafka

    broker = LocalKafka.start(tmp_path_factory.mktemp("kafka"))
    try:
        yield broker
    finally:
        gc.collect()  # destroy clients still in reference cycles while the broker is up
        broker.stop()


@dataclass
class Receiver:
    """What the endpoint got: `stored` are the requests it kept (acknowledged or "stored then
    failed"), in arrival order; `plan` maps a request number (1-based) to a fault."""

    plan: dict[int, str] = field(default_factory=dict)
    always: str = ""  # a fault for every request
    seen: int = 0
    stored: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    held: threading.Event = field(default_factory=threading.Event)  # a "hold" request is in flight

    def messages(self) -> list[tuple[str, dict[str, Any]]]:
        """(idempotency key, message) of every stored request, keys de-duplicated as a receiver would."""
        with self.lock:
            stored = list(self.stored)
        done: set[str] = set()
        out = []
        for key, body in stored:
            if key in done:
                continue
            done.add(key)
            out += [(key, m) for m in body.get("payload", [body])]
        return out


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    rec = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with rec.lock:
                rec.seen += 1
                fault = rec.always or rec.plan.get(rec.seen, "ok")
                rec.faults.append(fault)
                if fault in ("ok", "store_then_500"):
                    rec.stored.append((self.headers["Idempotency-Key"], body))
            if fault in ("hang", "hold"):
                if fault == "hold":
                    rec.held.set()  # the test kills the feed while this request waits
                time.sleep(3)  # past the client's timeout: it gives up and retries
                return
            if fault == "close":
                self.close_connection = True
                self.connection.shutdown(2)
                return
            status = {"ok": 200, "500": 500, "store_then_500": 500, "429": 429, "400": 400}[fault]
            reply = b'{"error": "bad payload: field x"}' if fault == "400" else b"{}"
            self.send_response(status)
            if fault == "429":
                self.send_header("Retry-After", "1")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield rec, f"webhook-http://127.0.0.1:{server.server_address[1]}/changes"
    server.shutdown()


def kill_group(p: subprocess.Popen[bytes]) -> None:
    """SIGKILL a runner started by start_changefeed, its whole process group (JVM, workers), and reap it."""
    with suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def kill_running(procs: list[subprocess.Popen[bytes]]) -> None:
    """kill_group each of `procs` still running (a test's clean-up)."""
    for p in procs:
        if p.poll() is None:
            kill_group(p)


def standby_starter(name: str, source: str, states: list[Path], logs: list[Path]
                    ) -> Callable[[int, dict[str, str]], subprocess.Popen[bytes]]:
    """kill_turns' `restart`: `run --standby` of feed `name` on host `host` (its own state folder
    and log), with only the name and the source."""
    def standby(host: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
        return start_changefeed("run", "--standby", "--name", name, "--state", str(states[host]), "--source", source,
                                log=logs[host], env=env)
    return standby


def turn_env(kills: list[str], turn: int, faults: Path) -> dict[str, str]:
    """The fault environment of the runner that is active in round `turn` of kill_turns: a
    "POINT:N" kills it there, armed once its round begins (a standby waiting); "random": none."""
    if turn >= len(kills) or kills[turn] == "random":
        return {}
    folder = faults / f"turn{turn}"
    folder.mkdir(parents=True, exist_ok=True)
    return {"CHANGEFEED_KILL_AT": kills[turn], "CHANGEFEED_FAULT_DIR": str(folder),
            "CHANGEFEED_FAULT_ARMED": str(folder / "armed")}


def kill_turns(kills: list[str], runners: list[subprocess.Popen[bytes]], logs: list[Path], faults: Path,
               restart: Callable[[int, dict[str, str]], subprocess.Popen[bytes]], landed: Callable[[], int],
               written: list[int], took_over: Callable[[int, str], None] | None = None) -> int:
    """Two runners of a feed, runners[0] active (started with turn_env(kills, 0, faults)) and
    runners[1] standing by (turn_env(kills, 1, faults)): end the active one once per round, at
    random (SIGKILL of its group) or at its round's fault point; each time the standby must take
    over and a row written after the end must land (landed() past written[0] at the end), then
    the ended host comes back as a standby (restart(host, env), its log emptied); took_over(turn,
    log text of the runner that took over) checks more. The index of the runner active at the end."""
    active = 0
    for turn, point in enumerate(kills):
        standby = 1 - active
        wait_for("the standby to wait", lambda: "standing by; active: pid " in logs[standby].read_text(),
                 logs[standby])
        if point == "random":
            time.sleep(random.uniform(0.5, 2.5))  # somewhere in its batches
            kill_group(runners[active])
        else:
            (faults / f"turn{turn}" / "armed").touch()
        assert runners[active].wait(timeout=180) == -signal.SIGKILL, (point, logs[active].read_text()[-3000:])
        at_end = written[0]
        wait_for("the standby to take over", lambda: "taking the feed over" in logs[standby].read_text(),
                 logs[standby], timeout=120)
        wait_for(f"rows written after end {turn + 1} ({point}) to land", lambda: landed() > at_end, logs[standby],
                 timeout=180)
        if took_over is not None:
            took_over(turn, logs[standby].read_text())
        logs[active].write_text("")  # the next standby's lines only
        runners[active] = restart(active, turn_env(kills, turn + 2, faults))
        active = standby
    return active


def followed_batches(dbs: Dbs, every: float, seconds: float = 3.0) -> tuple[list[Any], int]:
    """(A followed batch's record batches, postgres.follow, while a writer commits upserts and
    deletes to table t of publication p; the start of slot s, made at the first call)."""
    from changefeed.core.offsets import Offset
    from changefeed.postgres import slots
    from changefeed.postgres.connect import connect
    from changefeed.postgres.follow import Follower
    from changefeed.spec.definition import SourceNode

    with dbs.src() as c:
        c.execute("CREATE TABLE IF NOT EXISTS t (id bigint PRIMARY KEY, v text)")
        if c.execute("SELECT count(*) FROM pg_publication WHERE pubname = 'p'").fetchone() == (0,):
            c.execute("CREATE PUBLICATION p FOR TABLE t")
            slots.create_slot(c, "s")
        start = slots.slot_state(c, "s").confirmed_flush  # type: ignore[union-attr]
    stop = threading.Event()

    def write() -> None:
        with psycopg.connect(dbs.source, autocommit=True) as c:
            i = 0
            while not stop.is_set():
                i += 1
                c.execute("INSERT INTO t VALUES (%s, 'v') ON CONFLICT (id) DO UPDATE SET v = t.v || 'u'", (i % 300,))
                if i % 7 == 0:
                    c.execute("DELETE FROM t WHERE id = %s", ((i * 13) % 300,))
                time.sleep(WRITE_PAUSE)

    writer = threading.Thread(target=write)
    writer.start()
    threading.Timer(seconds - 1.0, stop.set).start()  # (the follower then cuts the last commits too)
    try:
        with connect(dbs.source, "source") as conn:
            node = SourceNode("n1", dbs.source, "s", "p")
            follower = Follower(conn, node, "source", start, 0, every=every, rows_per_batch=200,
                                offset_at=lambda lsn, ts: Offset({"n1": lsn}, ts, follow=1).to_json())
            batches = list(follower.windows(until=time.monotonic() + seconds))
    finally:
        stop.set()
        writer.join()
    return batches, start


def sub_window_ends(batches: list[Any]) -> list[int]:
    """The end LSNs the `P` rows of `batches` name, in order."""
    import pyarrow.compute as pc

    from changefeed.core import change as ch

    return [ch.Progress.from_meta(m).end_lsn for rb in batches
            for m in rb.filter(pc.equal(rb.column("op"), ch.PROGRESS)).column("meta").to_pylist()]
