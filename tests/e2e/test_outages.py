"""A running feed rides out outages by itself: the same process waits a fault out and carries on.

The source, or the replica, is a server of the test's own, crash-restarted (`pg_ctl stop -m
immediate`, started again seconds later) under a concurrent writer; or the feed's connections to
the source are terminated (`pg_terminate_backend`) again and again for a few seconds; or a TCP
proxy in front of a server (source, replica, Kafka broker) stalls or goes down; or a task fails
with an error changefeed has no type for. Meanwhile `status` says the feed is retrying, naming the
server and the failure, and `/metrics` has state `retrying`. Once the server is back, the feed
catches up by itself: the replica equals the source. The test servers commit asynchronously, so a
crashed source may take its last commits with it; the replica is compared with what survived (the
feed reads only flushed WAL, so it never has a row the source lost), and a crashed replica loses
only batches whose progress rows went with them (replayed).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest

from changefeed.local.postgres import LocalPostgres
from support.feeds import assert_no_traceback, changefeed_cli, start_changefeed, status_of, wait_for
from support.kafka import kafka_partitions
from support.servers import Dbs, fingerprint, free_port
from support.writers import WRITE_PAUSE, terminating, writing
from tcp_proxy import TcpProxy

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def writer(uri: str, stop: threading.Event, written: list[int]) -> None:
    """Inserts one row per transaction; through an outage it reconnects and goes on."""
    n = 0
    while not stop.is_set():
        try:
            with psycopg.connect(uri, autocommit=True, connect_timeout=2) as c:
                while not stop.is_set():
                    n += 1  # an insert cut off by an outage may have committed: never reuse its id
                    c.execute("INSERT INTO t (id, v) VALUES (%s, %s)", (n, f"row {n}"))
                    written[0] = n
                    time.sleep(WRITE_PAUSE)
        except psycopg.OperationalError:
            time.sleep(0.2)


def carried_on(feed: subprocess.Popen[bytes], log: Path) -> None:
    """The same feed process waited the fault out: still running, saying it carries on, no traceback."""
    assert feed.poll() is None, f"the feed process ended:\n{log.read_text()[-3000:]}"
    wait_for("the feed to say it carries on", lambda: "is back; carrying on" in log.read_text(), log, timeout=60)
    assert_no_traceback(log.read_text())


@contextmanager
def stopped_cleanly(feed: subprocess.Popen[bytes], log: Path) -> Iterator[None]:
    """Run the block, then stop the feed with SIGTERM: it exits 0."""
    try:
        yield
    finally:
        feed.send_signal(signal.SIGTERM)
        rc = feed.wait(timeout=120)
    assert rc == 0, log.read_text()[-3000:]


def rows_on(uri: str) -> int:
    try:
        return fingerprint(uri, "t")[0]
    except psycopg.errors.UndefinedTable:
        return 0  # the feed has not created it yet



@pytest.mark.usefixtures("warm_spark")
@pytest.mark.parametrize("fault", ["source crash-restart", "replica crash-restart", "backends terminated"])
def test_a_fault_is_waited_out(dbs: Dbs, tmp_path: Path, fault: str) -> None:
    """A crash-restart hits a server of the test's own (source or replica); `pg_terminate_backend`
    hits the feed's connections to the source (its readers' walsenders among them: this feed
    streams the WAL), again and again for 6 s."""
    own = LocalPostgres.start(tmp_path / "own") if "crash" in fault else None
    component = "sink" if fault.startswith("replica") else "source"
    try:
        uri = own.uri() if own and component == "source" else dbs.source
        sink = own.uri() if own and component == "sink" else dbs.sink
        with psycopg.connect(uri, autocommit=True) as c:
            c.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text NOT NULL)")
            c.execute("INSERT INTO t SELECT g, 'old ' || g FROM generate_series(-199, 0) g")
        state, log, port = tmp_path / "state", tmp_path / "feed.log", free_port()
        feed = start_changefeed("run", "--name", dbs.name, "--state", str(state), "--source", uri, "--sink", sink,
                                "--tables", "public.t", "--retry-max-backoff", "2s", "--metrics-port", str(port),
                                *(["--wal-reader", "stream"] if fault == "backends terminated" else []), log=log)

        def retrying() -> str | None:
            out = changefeed_cli("status", "--name", dbs.name, "--state", str(state), "--json")
            st = json.loads(out.stdout) if out.returncode == 0 else {}
            return st["state"] if "retrying" in st.get("state", "") else None

        with stopped_cleanly(feed, log):
            wait_for("the snapshot on the replica", lambda: rows_on(sink) >= 200, log)
            written = [0]
            with writing(writer, uri, written):
                wait_for("changes streaming", lambda: rows_on(sink) > 400, log)
                with ExitStack() as fault_lasts:
                    if own:
                        own.stop("immediate")
                    else:
                        fault_lasts.enter_context(writing(terminating, uri, [0]))
                    began = time.monotonic()
                    state_line = wait_for("status to say retrying", retrying, log, timeout=60)
                    assert f"the {component}" in state_line, state_line
                    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
                    assert 'changefeed_state{feed="%s",state="retrying"} 1' % dbs.name in metrics, metrics
                    assert f'component="{component}"' in metrics, metrics
                    time.sleep(max(0.0, 6 - (time.monotonic() - began)))
                if own:
                    own = LocalPostgres.start(tmp_path / "own", port=own.port)
                time.sleep(4)  # the writer goes on after the fault
            wait_for("the replica to equal the source",
                     lambda: fingerprint(sink, "t") == fingerprint(uri, "t"), log, timeout=240)
            carried_on(feed, log)
            wait_for("status without retrying", lambda: retrying() is None, log, timeout=60)
    finally:
        if own:
            own.stop("immediate")


def test_an_unforeseen_error_inside_a_task_is_retried(dbs: Dbs, tmp_path: Path) -> None:
    """A reading task fails once with an error changefeed has no type for (CHANGEFEED_FAIL_AT):
    the same process restarts the query from its checkpoint, after saying which part failed."""
    with psycopg.connect(dbs.source, autocommit=True) as c:
        c.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text NOT NULL)")
    state, log = tmp_path / "state", tmp_path / "feed.log"
    feed = start_changefeed("run", "--name", dbs.name, "--state", str(state), "--source", dbs.source,
                            "--sink", dbs.sink, "--tables", "public.t", "--retry-max-backoff", "2s", log=log,
                            # the 12th read: past the query's restart once the first batches' snapshot is read
                            env={"CHANGEFEED_FAIL_AT": "read:12", "CHANGEFEED_FAULT_DIR": str(tmp_path)})
    with stopped_cleanly(feed, log):
        written = [0]
        with writing(writer, dbs.source, written):
            wait_for("the fault", lambda: (tmp_path / ".fail-read").exists()
                     and (tmp_path / ".fail-read").stat().st_size >= 12, log)
            time.sleep(2)
        wait_for("the replica to equal the source",
                 lambda: fingerprint(dbs.sink, "t") == fingerprint(dbs.source, "t"), log, timeout=240)
        text = log.read_text()
        assert "failure(s) of the source: source: InjectedFault: fault injected at read" in text, text[-3000:]
        carried_on(feed, log)


@pytest.mark.usefixtures("warm_spark")
def test_a_definite_fault_while_running_ends_the_run(dbs: Dbs, tmp_path: Path) -> None:
    """The feed's slot dropped by hand while it runs: retrying cannot bring the WAL back, so the run
    ends with SlotLost (exit 2), its hint, no traceback, and `status` says failed."""
    with psycopg.connect(dbs.source, autocommit=True) as c:
        c.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text NOT NULL)")
        c.execute("INSERT INTO t SELECT g, 'old ' || g FROM generate_series(1, 100) g")
    state, log = tmp_path / "state", tmp_path / "feed.log"
    feed = start_changefeed("run", "--name", dbs.name, "--state", str(state), "--source", dbs.source,
                            "--sink", dbs.sink, "--tables", "public.t", log=log)
    try:
        wait_for("the snapshot on the replica", lambda: rows_on(dbs.sink) >= 100, log)

        def dropped() -> bool:
            with psycopg.connect(dbs.source, autocommit=True) as c:
                try:  # the slot is busy while a batch reads it
                    c.execute("SELECT pg_drop_replication_slot(%s)", (f"changefeed_{dbs.name}",))
                    return True
                except psycopg.errors.ObjectInUse:
                    return False
        wait_for("the slot to be dropped", dropped, log)
        rc = feed.wait(timeout=120)
    finally:
        if feed.poll() is None:
            feed.kill()
    text = log.read_text()
    assert rc == 2, text[-3000:]
    assert "changefeed: error:" in text and "replication slot" in text and "hint:" in text, text[-3000:]
    assert_no_traceback(text)
    status = json.loads(changefeed_cli("status", "--name", dbs.name, "--state", str(state), "--json").stdout)
    assert status["state"].startswith("failed"), status


@pytest.mark.usefixtures("warm_spark")
@pytest.mark.parametrize("path", ["source", "sink"])
def test_a_stalled_connection_is_found_and_cut(dbs: Dbs, tmp_path: Path, path: str) -> None:
    """The feed reaches the source (or the replica) through a TCP proxy that stops forwarding for
    a while without closing anything: the kernel still acknowledges, only the watchdog's probes can
    tell. The feed cuts the hung connections, retries, and carries on once the path flows again."""
    server = int(urlsplit(dbs.source if path == "source" else dbs.sink).port or 0)
    with TcpProxy(server) as proxy:
        def proxied(uri: str) -> str:
            return uri.replace(f":{server}/", f":{proxy.port}/")

        source, sink = (proxied(dbs.source), dbs.sink) if path == "source" else (dbs.source, proxied(dbs.sink))
        with psycopg.connect(dbs.source, autocommit=True) as c:
            c.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text NOT NULL)")
        state, log = tmp_path / "state", tmp_path / "feed.log"
        feed = start_changefeed("run", "--name", dbs.name, "--state", str(state), "--source", source,
                                "--sink", sink, "--tables", "public.t", "--retry-max-backoff", "2s", log=log)
        with stopped_cleanly(feed, log):
            written = [0]
            with writing(writer, dbs.source, written):
                wait_for("changes streaming", lambda: rows_on(dbs.sink) > 200, log)
                proxy.stall()
                wait_for("the stall to be found", lambda: "the connection stalled" in log.read_text(), log, timeout=60)
                out = changefeed_cli("status", "--name", dbs.name, "--state", str(state), "--json")
                assert "retrying" in json.loads(out.stdout)["state"], out.stdout
                time.sleep(5)  # the stall lasts on while the feed retries
                proxy.flow()
                time.sleep(3)
            wait_for("the replica to equal the source",
                     lambda: fingerprint(dbs.sink, "t") == fingerprint(dbs.source, "t"), log, timeout=240)
            assert feed.poll() is None, f"the feed process ended:\n{log.read_text()[-3000:]}"
            text = log.read_text()
            assert f"failure(s) of the {path}" in text, text[-3000:]
            assert_no_traceback(text)


@pytest.mark.usefixtures("warm_spark")
@pytest.mark.parametrize("fault", ["down", "stalled"])
def test_a_kafka_broker_out_of_reach_is_waited_out(dbs: Dbs, tmp_path: Path, fault: str) -> None:
    """The broker of the test's own is reached only through a TCP proxy (it advertises the proxy's
    port), which for 30 s goes down (closing every connection) or stalls (forwarding nothing, so
    requests in flight hang and arrive late), then comes back: the same feed process retries
    meanwhile and the topic then holds every row exactly once."""
    from changefeed.local.kafka import LocalKafka, committed

    broker_port = free_port()
    with TcpProxy(broker_port) as proxy, LocalKafka.start(tmp_path / "kafka", broker_port,
                                                          advertised_port=proxy.port) as broker:
        bootstrap = f"127.0.0.1:{proxy.port}"

        def ids() -> list[int]:
            return sorted(json.loads(r.key or b"")[0] for part in kafka_partitions(bootstrap, "public.t")
                          for r in committed(part))

        with psycopg.connect(dbs.source, autocommit=True) as c:  # rows for the snapshot, read before the writer starts
            c.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text NOT NULL)")
            c.execute("INSERT INTO t SELECT g, 'old ' || g FROM generate_series(-199, 0) g")
        state, log = tmp_path / "state", tmp_path / "feed.log"
        feed = start_changefeed("run", "--name", dbs.name, "--state", str(state), "--source", dbs.source,
                                "--sink", f"kafka://{bootstrap}?timeout=10s", "--tables", "public.t",
                                "--retry-max-backoff", "2s", log=log)
        with stopped_cleanly(feed, log):
            wait_for("the snapshot in the topic", lambda: len(ids()) >= 200, log)
            written = [0]
            with writing(writer, dbs.source, written):
                wait_for("changes in the topic", lambda: len(ids()) > 400, log)
                proxy.down() if fault == "down" else proxy.stall()
                began = time.monotonic()
                wait_for("status to say retrying", lambda: "retrying" in status_of(dbs.name, state)["state"], log,
                         timeout=90)
                time.sleep(max(0.0, 30 - (time.monotonic() - began)))
                proxy.up() if fault == "down" else proxy.flow()
                time.sleep(3)
            wait_for("every row in the topic", lambda: len(ids()) >= written[0] + 200, log, timeout=240)
            got = ids()
            if got != list(range(-199, written[0] + 1)):
                doubled = {i for i in got if got.count(i) > 1}
                found = [(p, r.offset, r.outcome, r.key)
                         for p, part in enumerate(kafka_partitions(bootstrap, "public.t"))
                         for r in part if json.loads(r.key or b"")[0] in doubled]
                progress = [(r.offset, r.outcome, r.value)
                            for part in kafka_partitions(bootstrap, "_changefeed_progress") for r in part]
                raise AssertionError(f"{len(got)} ids for {written[0]} rows; doubled {sorted(doubled)[:20]}: "
                                     f"{found[:20]}\nprogress: {progress}\n{log.read_text()[-5000:]}")
            assert broker.running
            carried_on(feed, log)  # (said at the report after the batch that landed)
            assert "failure(s) of the sink" in log.read_text() and "the sink is back" in log.read_text()


@pytest.mark.usefixtures("warm_spark")
def test_the_retention_budget_holds_while_retrying(dbs: Dbs, tmp_path: Path) -> None:
    """The replica is down for longer than --retention: the feed, retrying meanwhile, ends with
    RetentionExceeded (exit 2) instead of holding the source's WAL for ever."""
    own = LocalPostgres.start(tmp_path / "own")
    try:
        with psycopg.connect(dbs.source, autocommit=True) as c:
            c.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text NOT NULL)")
        state, log = tmp_path / "state", tmp_path / "feed.log"
        feed = start_changefeed("run", "--name", dbs.name, "--state", str(state), "--source", dbs.source,
                                "--sink", own.uri(), "--tables", "public.t", "--retention", "20s",
                                "--retry-max-backoff", "2s", "--snapshot-reads", "parallel", log=log)
        written = [0]
        with writing(writer, dbs.source, written):
            wait_for("changes streaming", lambda: rows_on(own.uri()) > 100, log)
            # past the query's restart after the snapshot (a fault inside that restart is another test's)
            wait_for("the snapshot phase to end", lambda: "without the shuffle" in log.read_text(), log)
            time.sleep(2)
            own.stop("immediate")
            began = time.monotonic()
            try:
                rc = feed.wait(timeout=120)
            finally:
                if feed.poll() is None:
                    os.kill(feed.pid, signal.SIGUSR1)  # where it waits, into its log
                    time.sleep(1)
                    feed.kill()
        text = log.read_text()
        assert rc == 2 and time.monotonic() - began >= 20, text[-3000:]
        assert "past its retention budget" in text and "more than --retention 20s" in text, text[-3000:]
        assert "retrying for" in text, text[-3000:]
        assert_no_traceback(text)
        status = json.loads(changefeed_cli("status", "--name", dbs.name, "--state", str(state), "--json").stdout)
        assert "retention budget" in status["state"], status
    finally:
        own.stop("immediate")


def test_a_failover_to_a_standby_that_has_the_slot_is_waited_out(dbs: Dbs, tmp_path: Path) -> None:
    """The failover set-up of docs/operations.md, for real (PostgreSQL 17+): the operator made the feed's slot
    with failover enabled before the first run, a hot standby synchronizes it, and `--source`
    names both servers with target_session_attrs=read-write. The primary crashes and the standby
    is promoted under a writer: the same feed process reaches the new primary, carries on from the
    synchronized slot, and the replica ends equal to the new primary."""
    slot = f"changefeed_{dbs.name}"
    primary = LocalPostgres.start(tmp_path / "primary")
    standby: LocalPostgres | None = None
    try:
        standby = primary.standby(tmp_path / "standby", "standby1")
        with psycopg.connect(primary.uri(), autocommit=True) as c:
            c.execute("ALTER SYSTEM SET synchronized_standby_slots = 'standby1'")
            c.execute("SELECT pg_reload_conf()")
            c.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text NOT NULL)")
            c.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, false, true)", (slot,))
            c.execute("INSERT INTO t SELECT g, 'old ' || g FROM generate_series(-199, 0) g")
        uri = (f"postgresql://postgres:{primary.password}@127.0.0.1:{primary.port},127.0.0.1:{standby.port}"
               "/postgres?target_session_attrs=read-write")
        state, log = tmp_path / "state", tmp_path / "feed.log"
        feed = start_changefeed("run", "--name", dbs.name, "--state", str(state), "--source", uri, "--sink", dbs.sink,
                                "--tables", "public.t", "--retry-max-backoff", "2s", log=log)

        def synced() -> bool:
            assert standby is not None
            with psycopg.connect(standby.uri(), autocommit=True) as c:
                row = c.execute("SELECT synced AND NOT temporary AND failover FROM pg_replication_slots "
                                "WHERE slot_name = %s", (slot,)).fetchone()
            return bool(row and row[0])

        with stopped_cleanly(feed, log):
            wait_for("the snapshot on the replica", lambda: rows_on(dbs.sink) >= 200, log)
            written = [0]
            with writing(writer, uri, written):
                wait_for("changes streaming", lambda: rows_on(dbs.sink) > 400, log)
                wait_for("the slot synchronized to the standby", synced, log, timeout=120)
                primary.stop("immediate")
                standby.promote()
                wait_for("the feed to retry", lambda: "failure(s) of the source" in log.read_text(), log, timeout=60)
                time.sleep(4)  # the writer goes on on the new primary
            new_primary = standby.uri()
            wait_for("the replica to equal the new primary",
                     lambda: fingerprint(dbs.sink, "t") == fingerprint(new_primary, "t"), log, timeout=240)
            assert fingerprint(new_primary, "t")[0] > 400 + 200
            carried_on(feed, log)
    finally:
        primary.stop("immediate")
        if standby is not None:
            standby.stop("immediate")
