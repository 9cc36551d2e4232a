"""A running feed rides out outages by itself: the same process waits a fault out and carries on.

The source, or the replica, is a server of the test's own, crash-restarted (`pg_ctl stop -m
immediate`, started again seconds later) under a concurrent writer; or the feed's connections to
the source are terminated (`pg_terminate_backend`) again and again for a few seconds. Meanwhile `status` says the
feed is retrying, naming the server and the failure, and `/metrics` has state `retrying`. Once the
server is back, the feed catches up by itself: the replica equals the source. The test servers
commit asynchronously, so a crashed source may take its last commits with it; the replica is
compared with what survived (the feed reads only flushed WAL, so it never has a row the source
lost), and a crashed replica loses only batches whose progress rows went with them (replayed).
"""
from __future__ import annotations

import json
import signal
import socket
import threading
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import psycopg
import pytest
from conftest import Dbs, changefeed_cli, fingerprint, start_changefeed, wait_for, writing

from changefeed.local_postgres import LocalPostgres

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def writer(uri: str, stop: threading.Event, written: list[int]) -> None:
    """Inserts one row per transaction; through an outage it reconnects and goes on."""
    n = 0
    while not stop.is_set():
        try:
            with psycopg.connect(uri, autocommit=True, connect_timeout=2) as c:
                while not stop.is_set():
                    c.execute("INSERT INTO t (id, v) VALUES (%s, %s)", (n + 1, f"row {n + 1}"))
                    n += 1
                    written[0] = n
                    time.sleep(0.002)
        except psycopg.OperationalError:
            time.sleep(0.2)


def rows_on(uri: str) -> int:
    try:
        return fingerprint(uri, "t")[0]
    except psycopg.errors.UndefinedTable:
        return 0  # the feed has not created it yet


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def terminating(uri: str, stop: threading.Event, _: list[int]) -> None:
    """Terminate the feed's backends on the source (its runner's, its readers') every 0.2 s."""
    with psycopg.connect(uri, autocommit=True) as c:
        while not stop.is_set():
            c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
                      "AND application_name LIKE 'changefeed%%' AND pid <> pg_backend_pid()")
            time.sleep(0.2)


@pytest.mark.parametrize("fault", ["source crash-restart", "replica crash-restart", "backends terminated"])
def test_a_fault_is_waited_out(dbs: Dbs, tmp_path: Path, fault: str) -> None:
    """A crash-restart hits a server of the test's own (source or replica); `pg_terminate_backend`
    hits the feed's connections to the source, again and again for 6 s."""
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
                                log=log)

        def retrying() -> str | None:
            out = changefeed_cli("status", "--name", dbs.name, "--state", str(state), "--json")
            st = json.loads(out.stdout) if out.returncode == 0 else {}
            return st["state"] if "retrying" in st.get("state", "") else None

        try:
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
            assert feed.poll() is None, f"the feed process ended:\n{log.read_text()[-3000:]}"
            wait_for("the feed to say it carries on", lambda: "is back; carrying on" in log.read_text(), log,
                     timeout=60)
            assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
            wait_for("status without retrying", lambda: retrying() is None, log, timeout=60)
        finally:
            feed.send_signal(signal.SIGTERM)
            rc = feed.wait(timeout=120)
        assert rc == 0, log.read_text()[-3000:]
    finally:
        if own:
            own.stop("immediate")
