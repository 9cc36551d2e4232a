"""One table split over three feeds by disjoint key ranges (`--where` on the key), all writing
into one replica table, started together and running side by side under a writer whose updates
also move keys from one range to another: the replica ends equal to the source, and `verify` of
each feed agrees. A TRUNCATE that one feed applies long after another (paused meanwhile, while
rows arrived in the other's range) empties only its own range."""
from __future__ import annotations

import random
import threading
from pathlib import Path

import psycopg
import pytest

from support.feeds import assert_no_traceback, changefeed_cli, kill_running, start_changefeed, wait_for
from support.servers import Dbs
from support.writers import WRITE_PAUSE, writing

pytestmark = pytest.mark.timeout(900)
ROWS = 30000
RANGES = {"a": "id < 10000", "b": "id >= 10000 AND id < 20000", "c": "id >= 20000"}


def _writes(uri: str, stop: threading.Event, written: list[int]) -> None:
    rng = random.Random(5)
    with psycopg.connect(uri, autocommit=True) as c:
        n = ROWS
        while not stop.is_set():
            n += 1
            with c.transaction():
                c.execute("INSERT INTO items VALUES (%s, 'new', 0) ON CONFLICT (id) DO NOTHING", (rng.randrange(n),))
                old, new = rng.randrange(ROWS), rng.randrange(ROWS)  # (mostly into another range)
                c.execute("UPDATE items SET id = %s, moved = moved + 1 WHERE id = %s "
                          "AND NOT EXISTS (SELECT 1 FROM items WHERE id = %s)", (new, old, new))
                c.execute("UPDATE items SET v = 'changed' WHERE id = %s", (rng.randrange(ROWS),))
                c.execute("DELETE FROM items WHERE id = %s", (rng.randrange(n),))
            written[0] += 1
            stop.wait(WRITE_PAUSE)


def _rows(uri: str) -> list[tuple[object, ...]]:
    with psycopg.connect(uri) as c:
        return c.execute("SELECT id, v, moved FROM items ORDER BY id").fetchall()


def test_three_key_range_feeds_fill_one_replica_table(dbs: Dbs, tmp_path: Path) -> None:
    with psycopg.connect(dbs.source, autocommit=True) as c:
        c.execute("CREATE TABLE items (id bigint PRIMARY KEY, v text, moved int NOT NULL DEFAULT 0)")
        c.execute("INSERT INTO items SELECT g, 'old', 0 FROM generate_series(0, %s - 1, 2) g", (ROWS,))
    state = tmp_path / "state"
    feeds = {part: f"{dbs.name}_{part}" for part in RANGES}
    logs = {part: tmp_path / f"{part}.log" for part in [*RANGES, "a2"]}
    runners = []
    written = [0]
    try:
        with writing(_writes, dbs.source, written):
            for part, predicate in RANGES.items():
                runners.append(start_changefeed("run", "--name", feeds[part], "--state", str(state),
                                                "--source", dbs.source, "--sink", dbs.sink, "--tables", "public.items",
                                                "--where", f"public.items={predicate}", log=logs[part]))
            for part in RANGES:
                wait_for(f"feed {part}'s snapshot", lambda: "snapshot public.items: done" in logs[part].read_text(),
                         logs[part], timeout=300)
            at = written[0]
            wait_for("changes on top", lambda: written[0] > at + 500, logs["a"], timeout=120)
        wait_for("the replica equal to the source", lambda: _rows(dbs.sink) == _rows(dbs.source), logs["a"],
                 timeout=180)
        assert sum(m for _, _, m in _rows(dbs.sink)) > 100  # keys did move
        for part in RANGES:
            verified = changefeed_cli("verify", "--name", feeds[part], "--state", str(state))
            assert verified.returncode == 0, verified.stdout + verified.stderr

        paused = changefeed_cli("pause", "--name", feeds["a"], "--state", str(state))
        assert paused.returncode == 0, paused.stdout + paused.stderr
        assert runners[0].wait(timeout=120) == 0
        with psycopg.connect(dbs.source, autocommit=True) as c:
            c.execute("TRUNCATE items")
            c.execute("INSERT INTO items SELECT g, 'after', 0 FROM generate_series(5000, 25000, 10) g")
        wait_for("feed b and c past the TRUNCATE", lambda: len([r for r in _rows(dbs.sink) if r[1] == "after"])
                 == len(range(10000, 25001, 10)), logs["b"], timeout=120)
        runners[0] = start_changefeed("resume", "--name", feeds["a"], "--state", str(state), log=logs["a2"])
        wait_for("feed a past the TRUNCATE", lambda: _rows(dbs.sink) == _rows(dbs.source), logs["a2"], timeout=180)
    finally:
        kill_running(runners)
    for log in logs.values():
        assert_no_traceback(log.read_text())
