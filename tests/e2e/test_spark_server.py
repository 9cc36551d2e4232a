"""Feeds on a warm Spark: `changefeed spark-server` runs a Spark Connect server, and `run --master
sc://HOST:PORT` runs a feed on it. The same exactly-once replica; a runner SIGKILLed there leaves
its query running until the feed starts again on that server, which stops the old run first; the
server going away mid-run is waited out (a new session once it is back); none at the address is
a clear error. Feeds started on the server one after another share its Python workers."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from support.feeds import assert_no_traceback, changefeed_cli, process_tree, processes, start_changefeed, wait_for
from support.servers import Dbs, fingerprint

pytestmark = pytest.mark.timeout(600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`changefeed spark-server` in a process of its own."""

    def __init__(self, port: int, log: Path) -> None:
        self.port, self.log = port, log
        self.master = f"sc://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "changefeed", "spark-server", "--port", str(port),
                                      "--master", "local[2]"], stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            wait_for("the Spark Connect server ready", lambda: "Spark Connect server ready" in log.read_text(), log)
        except BaseException:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the command and its JVM
            raise
        assert f"--master {self.master}" in log.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)  # the command, not its group: it stops its JVM itself
        return self.proc.wait(timeout=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(free_port(), tmp_path_factory.mktemp("spark-server") / "server.log")
    yield s
    assert s.stop() == 0, s.log.read_text()[-3000:]
    with pytest.raises(OSError):  # the JVM went with it
        socket.create_connection(("127.0.0.1", s.port), timeout=2).close()


def _table(dbs: Dbs) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL)")
        c.execute("INSERT INTO t SELECT g, 0 FROM generate_series(1, 2000) g")


def _same(dbs: Dbs) -> bool:
    """The replica's table equals the source's (False while it is not created yet)."""
    try:
        return fingerprint(dbs.sink, "t") == fingerprint(dbs.source, "t")
    except psycopg.errors.UndefinedTable:
        return False


def _base(dbs: Dbs, tmp_path: Path, master: str) -> list[str]:
    return ["run", "--name", dbs.name, "--state", str(tmp_path / "state"), "--source", dbs.source,
            "--sink", dbs.sink, "--tables", "public.t", "--master", master]


def _bump(dbs: Dbs, ids: range) -> None:
    with dbs.src() as c:
        for i in ids:
            c.execute("UPDATE t SET v = v + 1 WHERE id = %s", (i,))


def _sink_sum(dbs: Dbs) -> int:
    with dbs.dst() as c:
        row = c.execute("SELECT coalesce(sum(v), 0) FROM t").fetchone()
    assert row is not None
    return int(row[0])


def test_a_killed_runner_s_query_runs_on_until_the_feed_starts_again(server: Server, dbs: Dbs,
                                                                     tmp_path: Path) -> None:
    _table(dbs)
    base, log = _base(dbs, tmp_path, server.master), tmp_path / "run1.log"
    p = start_changefeed(*base, log=log)
    try:
        wait_for("the snapshot", lambda: _same(dbs), log)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert f"on the Spark Connect server {server.master}" in log.read_text()
    spark_log = tmp_path / "state" / dbs.name / "spark.log"
    assert not spark_log.exists() or "starts Spark" not in spark_log.read_text()  # no JVM of its own
    _bump(dbs, range(1, 51))  # the orphaned query is still delivering: what the docs warn of
    wait_for("the orphaned query to deliver", lambda: _sink_sum(dbs) == 50, log)

    done = changefeed_cli(*base, "--available-now")  # stops the old run on the server first
    assert done.returncode == 0, done.stdout + done.stderr
    assert_no_traceback(done.stdout + done.stderr)
    _bump(dbs, range(51, 101))  # nobody runs the feed now: nothing may arrive
    time.sleep(5)
    assert _sink_sum(dbs) == 50

    again = changefeed_cli(*base, "--available-now")
    assert again.returncode == 0, again.stdout + again.stderr
    assert fingerprint(dbs.sink, "t") == fingerprint(dbs.source, "t")
    assert _sink_sum(dbs) == 100  # each change once


def _python_daemons(root: int) -> set[int]:
    """The pids of Spark's Python daemons (`pyspark.daemon`, each the parent of its workers) among
    the processes under `root`."""
    procs = processes()
    tree = process_tree(root, procs)
    return {pid for pid, cmd in tree.items()
            if "pyspark.daemon" in cmd and "pyspark.daemon" not in tree.get(procs[pid][0], "")}


def test_feeds_started_one_after_another_share_the_server_s_python_workers(server: Server, dbs: Dbs,
                                                                            tmp_path: Path) -> None:
    """Every Python call Spark makes for a feed (finding the source, planning, reading, writing,
    the sink's commit) runs in a pool of Python workers, one pool per daemon. The server keeps one
    pool for all sessions, so a feed started again (a new session) starts no daemon of its own,
    as each did when Spark Connect's own server class kept a pool per session."""
    _table(dbs)
    base = [*_base(dbs, tmp_path, server.master), "--available-now"]
    first = changefeed_cli(*base)
    assert first.returncode == 0, first.stdout + first.stderr
    daemons = _python_daemons(server.proc.pid)
    assert daemons, "no Python daemon under the server"
    for ids in (range(1, 11), range(11, 21)):
        _bump(dbs, ids)
        again = changefeed_cli(*base)
        assert again.returncode == 0, again.stdout + again.stderr
        assert _python_daemons(server.proc.pid) == daemons
    assert fingerprint(dbs.sink, "t") == fingerprint(dbs.source, "t")
    assert _sink_sum(dbs) == 20


def test_a_server_gone_mid_run_is_waited_out(dbs: Dbs, tmp_path: Path) -> None:
    _table(dbs)
    port = free_port()
    servers = [Server(port, tmp_path / "server1.log")]
    log = tmp_path / "run.log"
    feed = start_changefeed(*_base(dbs, tmp_path, servers[0].master), "--retry-max-backoff", "2s", log=log)
    try:
        wait_for("the snapshot", lambda: _same(dbs), log)
        assert servers[0].stop() == 0
        _bump(dbs, range(1, 101))
        wait_for("the fault reported", lambda: "Spark Connect server" in log.read_text()
                 and "next attempt in" in log.read_text(), log)
        assert feed.poll() is None, log.read_text()[-3000:]
        servers.append(Server(port, tmp_path / "server2.log"))
        wait_for("the changes made while it was away", lambda: _sink_sum(dbs) == 100, log)
        # (said at the runner's next look after a batch landed: the catch-up may have been that batch)
        wait_for("the feed to say it carries on", lambda: "carrying on" in log.read_text(), log, timeout=60)
        feed.send_signal(signal.SIGTERM)
        assert feed.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if feed.poll() is None:
            os.killpg(feed.pid, signal.SIGKILL)
        for server in servers:
            server.stop()
    text = log.read_text()
    assert "carrying on" in text
    assert_no_traceback(text)
    assert fingerprint(dbs.sink, "t") == fingerprint(dbs.source, "t")


def test_no_server_at_the_address_is_a_clear_error(dbs: Dbs, tmp_path: Path) -> None:
    _table(dbs)
    out = changefeed_cli(*_base(dbs, tmp_path, f"sc://127.0.0.1:{free_port()}"), "--available-now")
    assert out.returncode == 75, out.stdout + out.stderr
    assert "the Spark Connect server at sc://127.0.0.1:" in out.stderr and "did not answer" in out.stderr
    assert "changefeed spark-server" in out.stderr
    assert_no_traceback(out.stdout + out.stderr)
