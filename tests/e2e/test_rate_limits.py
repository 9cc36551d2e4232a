"""--snapshot-rate and --max-rate on a real feed: a snapshot read no faster than its rate (from the
replica's own record of when each chunk landed), a stream held to its --max-rate after an alter
on the running feed (from the replica's progress rows), then the limit taken back and the backlog
caught up: the replica equal to the source, nothing lost."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg
import pytest

from support.feeds import assert_no_traceback, changefeed_cli, kill_running, start_changefeed, wait_for
from support.servers import Dbs
from support.writers import writing

pytestmark = pytest.mark.timeout(600)
ROWS, SNAPSHOT_RATE, MAX_RATE = 24000, 2000, 150
BURST = 2 * SNAPSHOT_RATE  # what a feed's reads may take at once (spark.rates.SNAPSHOT_BURST_S)


def _touch(uri: str, stop: threading.Event, written: list[int]) -> None:
    """About a thousand single-row updates a second."""
    with psycopg.connect(uri, autocommit=True) as c:
        while not stop.is_set():
            written[0] += 1
            c.execute("UPDATE items SET n = n + 1 WHERE id = %s", (written[0] % ROWS,))
            if written[0] % 10 == 0:
                stop.wait(0.01)


def _rows(uri: str) -> list[tuple[object, ...]]:
    with psycopg.connect(uri) as c:
        return c.execute("SELECT id, n FROM items ORDER BY id").fetchall()


def test_rates_hold_and_change_on_a_running_feed(dbs: Dbs, tmp_path: Path) -> None:
    with psycopg.connect(dbs.source, autocommit=True) as c:
        c.execute("CREATE TABLE items (id int PRIMARY KEY, n bigint NOT NULL, pad text)")
        c.execute("INSERT INTO items SELECT g, 0, repeat('x', 100) FROM generate_series(0, %s - 1) g", (ROWS,))
    state, log = tmp_path / "state", tmp_path / "run.log"
    runner = start_changefeed("run", "--name", dbs.name, "--state", str(state), "--source", dbs.source,
                              "--sink", dbs.sink, "--tables", "public.items", "--snapshot-rate", str(SNAPSHOT_RATE),
                              "--snapshot-chunk-rows", "2000", "--snapshot-chunks-per-batch", "2",
                              "--snapshot-reads", "parallel", log=log)
    written = [0]
    try:
        wait_for("the snapshot", lambda: "snapshot public.items: done" in log.read_text(), log, timeout=240)
        with psycopg.connect(dbs.sink) as c:
            first, last, landed = c.execute(
                "SELECT extract(epoch FROM min(applied_at)), extract(epoch FROM max(applied_at)), sum(rows) "
                "FROM changefeed.snapshot_chunks WHERE feed = %s", (dbs.name,)).fetchone()
        assert landed == ROWS
        # the first batch's chunks were read before the first landed, the burst at once: the rest at the rate
        assert float(last) - float(first) >= (ROWS - 4000 - BURST) / SNAPSHOT_RATE * 0.9, (first, last)

        altered = changefeed_cli("alter", "--name", dbs.name, "--state", str(state), "--max-rate", str(MAX_RATE))
        assert altered.returncode == 0 and f"max rate {MAX_RATE} changes/s" in altered.stdout, altered.stderr
        with writing(_touch, dbs.source, written):
            time.sleep(6)  # (the alter taken in at the next batch, and a burst spent)
            began = time.time()
            time.sleep(12)
            with psycopg.connect(dbs.sink) as c:
                delivered = c.execute("SELECT coalesce(sum(changes), 0) FROM changefeed.progress WHERE feed = %s "
                                      "AND applied_at >= to_timestamp(%s)", (dbs.name, began)).fetchone()[0]
            assert written[0] > 5000  # the source wrote far more than the rate meanwhile
            rate = int(delivered) / (time.time() - began)
            assert 0 < rate <= MAX_RATE * 1.25, (delivered, rate)  # (a batch may end a transaction past its share)
        taken_back = changefeed_cli("alter", "--name", dbs.name, "--state", str(state), "--max-rate", "0")
        assert taken_back.returncode == 0, taken_back.stderr
        wait_for("the backlog caught up", lambda: _rows(dbs.sink) == _rows(dbs.source), log, timeout=180)
    finally:
        kill_running([runner])
    assert_no_traceback(log.read_text())


def test_no_snapshot_read_runs_much_above_the_rate_while_it_makes_up_for_lost_time(dbs: Dbs, tmp_path: Path) -> None:
    rows, rate, chunk = 100_000, 10_000, 25_000
    with psycopg.connect(dbs.source, autocommit=True) as c:
        c.execute("CREATE TABLE wide (id int PRIMARY KEY, pad text)")
        c.execute("INSERT INTO wide SELECT g, repeat('x', 50) FROM generate_series(1, %s) g", (rows,))
    done = changefeed_cli("run", "--name", dbs.name, "--state", str(tmp_path / "state"), "--source", dbs.source,
                          "--sink", dbs.sink, "--tables", "public.wide", "--snapshot-rate", str(rate),
                          "--snapshot-chunk-rows", str(chunk), "--snapshot-chunks-per-batch", "1",
                          "--snapshot-reads", "parallel", "--available-now")
    assert done.returncode == 0, done.stderr[-3000:]
    with psycopg.connect(dbs.sink) as c:  # each chunk's rows over its read's time (the task that read it)
        reads = c.execute(
            "SELECT s.rows, (r->>'ended')::float8 - (r->>'began')::float8 FROM changefeed.snapshot_chunks s "
            "JOIN changefeed.progress p ON p.feed = s.feed AND p.batch_id = s.batch_id, "
            "jsonb_array_elements(p.reads) r WHERE s.feed = %s AND (r->>'task')::bigint = s.read_task "
            "ORDER BY s.chunk_no", (dbs.name,)).fetchall()
    assert sum(n for n, _ in reads) == rows and len(reads) == rows // chunk, reads
    assert all(n / s <= rate * 1.15 for n, s in reads), [round(n / s) for n, s in reads]  # (the burst: ~1.1 x)
