"""The lease with a real runner: each run takes the feed's lease in a new term and claims the replica
for it; a runner frozen (SIGSTOP) while another term claims the feed lands nothing once woken
(SIGCONT) and stops with its message; a clean stop ends the lease at once."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psycopg
import pytest

from changefeed.postgres import lease
from changefeed.sinks.replica import ledger as replica_ledger
from support.feeds import assert_no_traceback, changefeed_cli, start_changefeed, wait_for
from support.servers import Dbs, fingerprint
from support.writers import WRITE_PAUSE

pytestmark = pytest.mark.timeout(600)


def writer(uri: str, stop: threading.Event) -> None:
    with psycopg.connect(uri, autocommit=True) as c:
        n = 0
        while not stop.is_set():
            n += 1
            c.execute("INSERT INTO t VALUES (%s, 'v')", (n,))
            time.sleep(WRITE_PAUSE)


def count(uri: str) -> int:
    with psycopg.connect(uri) as c:
        if c.execute("SELECT to_regclass('public.t') IS NULL").fetchone()[0]:  # type: ignore[index]
            return 0  # not made yet
        return int(c.execute("SELECT count(*) FROM t").fetchone()[0])  # type: ignore[index]


def test_a_frozen_runner_whose_feed_was_taken_over_lands_nothing_when_woken(dbs: Dbs, tmp_path: Path) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text)")
    state, log = str(tmp_path / "state"), tmp_path / "run.log"
    stop = threading.Event()
    w = threading.Thread(target=writer, args=(dbs.source, stop))
    w.start()
    feed = start_changefeed("run", "--name", dbs.name, "--state", state, "--source", dbs.source, "--sink", dbs.sink,
                            "--tables", "public.t", "--lease", "3s", log=log)
    try:
        wait_for("rows on the replica", lambda: count(dbs.sink) > 100, log)
        with dbs.src() as c:
            held = lease.current(c, dbs.name)
        assert held is not None and held.epoch == 1 and f"pid {feed.pid} " in held.holder + " ", held
        os.killpg(feed.pid, signal.SIGSTOP)  # frozen: its sessions stay open, it renews nothing
        wait_for("the lease to end unrenewed", lambda: _lease(dbs).free, log, timeout=30)
        with dbs.src() as c:  # a standby takes the feed over: a new term, the replica claimed for it
            taken = lease.take(c, dbs.name, 60.0, "the standby")
        assert taken == 2
        with dbs.dst() as d:
            replica_ledger.raise_fence(d, dbs.name, taken, "the standby")
            claimed_at = d.execute("SELECT raised_at FROM changefeed.fences WHERE feed = %s",
                                   (dbs.name,)).fetchone()[0]  # type: ignore[index]
        os.killpg(feed.pid, signal.SIGCONT)
        assert feed.wait(timeout=120) == 2, log.read_text()[-3000:]
    finally:
        stop.set()
        w.join()
        if feed.poll() is None:
            os.killpg(feed.pid, signal.SIGKILL)
    text = log.read_text()
    assert "term 1" in text and "the standby (term 2)" in text, text[-3000:]
    assert_no_traceback(text)
    with dbs.dst() as d:
        late = d.execute("SELECT count(*) FROM changefeed.progress WHERE feed = %s AND applied_at > %s",
                         (dbs.name, claimed_at)).fetchone()[0]  # type: ignore[index]
    assert late == 0  # nothing of the old term landed after the claim
    status = changefeed_cli("status", "--name", dbs.name, "--state", state, "--json")
    assert "term 2" in status.stdout, status.stdout

    # The next run (it holds the feed's session lock: no live runner holds the feed) takes the lease
    # in term 3, carries on, and its clean stop ends the lease at once.
    final = changefeed_cli("run", "--name", dbs.name, "--state", state, "--available-now")
    assert final.returncode == 0, final.stderr[-3000:]
    assert fingerprint(dbs.source, "public.t") == fingerprint(dbs.sink, "public.t")
    after = _lease(dbs)
    assert after.epoch == 3 and after.free, after
    with dbs.dst() as d:
        assert d.execute("SELECT epoch FROM changefeed.fences WHERE feed = %s", (dbs.name,)).fetchone() == (3,)
    removed = changefeed_cli("remove", "--name", dbs.name, "--state", state)
    assert removed.returncode == 0, removed.stderr
    assert _lease_or_none(dbs) is None


def _lease_or_none(dbs: Dbs) -> lease.Lease | None:
    with dbs.src() as c:
        return lease.current(c, dbs.name)


def _lease(dbs: Dbs) -> lease.Lease:
    held = _lease_or_none(dbs)
    assert held is not None
    return held
