"""A partitioned table is captured by its root: changes to every partition arrive as the root's,
also in partitions created, and attached with rows, while the feed runs under writes (the runner
SIGKILLed after an attach); rows moved between partitions by an update of the partition key end
up right. A partition detached stops the feed naming it (its rows left without DELETEs); once the
replica is repaired the next run goes on."""
from __future__ import annotations

import os
import random
import signal
import threading
from pathlib import Path

import psycopg
import pytest

from support.feeds import assert_no_traceback, changefeed_cli, kill_running, start_changefeed, wait_for
from support.servers import Dbs
from support.writers import WRITE_PAUSE, writing

pytestmark = pytest.mark.timeout(600)
SPAN = 10000  # ids per partition


def _rows(uri: str) -> list[tuple[object, ...]]:
    with psycopg.connect(uri) as c:
        return c.execute("SELECT id, v FROM events ORDER BY id").fetchall()


def _writer(ranges: list[int]) -> object:
    """Upserts, deletes and partition-key updates (a row moved to another partition) in the
    partitions listed in `ranges` (their first ids), which the test changes as it goes."""
    def write(uri: str, stop: threading.Event, written: list[int]) -> None:
        rng = random.Random(3)
        with psycopg.connect(uri, autocommit=True) as c:
            while not stop.is_set():
                lows = list(ranges)
                i = rng.choice(lows) + rng.randrange(SPAN)
                with c.transaction():
                    c.execute("INSERT INTO events VALUES (%s, 'w') ON CONFLICT (id) DO UPDATE SET v = 'u'", (i,))
                    j = rng.choice(lows) + rng.randrange(SPAN)
                    c.execute("UPDATE events SET id = %s, v = 'moved' WHERE id = %s "
                              "AND NOT EXISTS (SELECT 1 FROM events WHERE id = %s)", (j, i, j))
                    c.execute("DELETE FROM events WHERE id = %s", (rng.choice(lows) + rng.randrange(SPAN),))
                written[0] += 1
                stop.wait(WRITE_PAUSE)
    return write


def test_a_partitioned_table_is_captured_by_its_root(dbs: Dbs, tmp_path: Path) -> None:
    with psycopg.connect(dbs.source, autocommit=True) as c:
        c.execute("CREATE TABLE events (id int PRIMARY KEY, v text) PARTITION BY RANGE (id)")
        c.execute("CREATE TABLE events_a PARTITION OF events FOR VALUES FROM (0) TO (10000)")
        c.execute("CREATE TABLE events_b PARTITION OF events FOR VALUES FROM (10000) TO (20000)")
        c.execute("INSERT INTO events SELECT g, 'old' FROM generate_series(0, 19999, 3) g")
    state, logs = tmp_path / "state", [tmp_path / f"run{i}.log" for i in range(3)]
    run = ["run", "--name", dbs.name, "--state", str(state)]
    runner = start_changefeed(*run, "--source", dbs.source, "--sink", dbs.sink, "--tables", "public.events",
                              log=logs[0])
    ranges, written = [0, SPAN], [0]
    try:
        with writing(_writer(ranges), dbs.source, written), psycopg.connect(dbs.source, autocommit=True) as c:
            wait_for("the snapshot and changes", lambda: "snapshot public.events: done" in logs[0].read_text()
                     and written[0] > 200, logs[0])
            c.execute("CREATE TABLE events_c PARTITION OF events FOR VALUES FROM (20000) TO (30000)")
            ranges.append(2 * SPAN)
            c.execute("CREATE TABLE events_d (LIKE events INCLUDING ALL)")
            c.execute("INSERT INTO events_d SELECT g, 'attached' FROM generate_series(30000, 39999, 2) g")
            c.execute("ALTER TABLE events ATTACH PARTITION events_d FOR VALUES FROM (30000) TO (40000)")
            ranges.append(3 * SPAN)
            wait_for("the attached partition seen", lambda: "partition holding rows joined public.events"
                     in logs[0].read_text(), logs[0], timeout=60)
            os.killpg(runner.pid, signal.SIGKILL)  # the snapshot it asked for not yet read, or partly
            runner.wait(timeout=60)
            runner = start_changefeed(*run, log=logs[1])
            at = written[0]
            wait_for("more changes", lambda: written[0] > at + 300, logs[1], timeout=120)
        wait_for("the replica equal to the source", lambda: _rows(dbs.sink) == _rows(dbs.source), logs[1],
                 timeout=120)
        assert any(v == "attached" for _, v in _rows(dbs.sink))  # rows that came with no INSERT in the WAL
        assert any(i >= 2 * SPAN and v != "attached" for i, v in _rows(dbs.sink))  # a created partition
        verified = changefeed_cli("verify", "--name", dbs.name, "--state", str(state))
        assert verified.returncode == 0, verified.stdout + verified.stderr

        with psycopg.connect(dbs.source, autocommit=True) as c:
            c.execute("ALTER TABLE events DETACH PARTITION events_a")
        assert runner.wait(timeout=120) == 2
        stopped = logs[1].read_text()
        assert "partition public.events_a (of public.events) left the captured table" in stopped, stopped[-2000:]
        assert_no_traceback(stopped)
        repaired = changefeed_cli("verify", "--name", dbs.name, "--state", str(state), "--repair")
        assert repaired.returncode == 1, repaired.stdout + repaired.stderr  # it differed, then was repaired
        ranges.remove(0)
        runner = start_changefeed(*run, log=logs[2])
        with writing(_writer(ranges), dbs.source, written):
            at = written[0]
            wait_for("changes after the detach", lambda: written[0] > at + 200, logs[2], timeout=120)
        wait_for("the replica equal again", lambda: _rows(dbs.sink) == _rows(dbs.source), logs[2], timeout=120)
        assert min(i for i, _ in _rows(dbs.sink)) >= SPAN
    finally:
        kill_running([runner])
    for log in logs:
        assert_no_traceback(log.read_text())
