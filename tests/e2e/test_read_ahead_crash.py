"""Read-ahead end to end: a feed with a backlog decodes each next window while the sink applies
the current one (postgres/read_ahead.py). Killed (SIGKILL, the whole feed) while a window is
read and the next one is being read ahead, then run again: replica == source, every row once,
each batch applied once, and no temporary slot of a read-ahead left on the source.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from support.feeds import changefeed_cli, kill_runs
from support.servers import Dbs, fingerprint

pytestmark = pytest.mark.timeout(600)

TXNS, ROWS = 30, 1000


def test_windows_read_ahead_survive_sigkill(dbs: Dbs, tmp_path: Path, spark_server: str) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text NOT NULL, n int NOT NULL DEFAULT 0)")
    state = str(tmp_path / "state")
    base = ["run", "--name", dbs.name, "--state", state, "--available-now", "--max-bytes-per-batch", "512kB"]
    first = changefeed_cli(*base, "--source", dbs.source, "--sink", dbs.sink, "--tables", "public.t",
                           "--master", spark_server)
    assert first.returncode == 0, first.stderr[-3000:]
    with dbs.src() as c:  # a backlog of ~20 windows: every batch after the first can be read ahead
        for i in range(TXNS):
            c.execute("INSERT INTO t (id, v) SELECT %s * 10000 + g, repeat(md5(g::text), 3) "
                      "FROM generate_series(1, %s) g", (i, ROWS))
            if i % 5 == 4:
                c.execute("UPDATE t SET n = n + 1 WHERE id %% 7 = %s", (i % 7,))

    kill_runs(base, ["read:4"], tmp_path, random_after=(0, 0))  # the 4th window: its next one is being read ahead
    final = changefeed_cli(*base, "--master", spark_server)
    assert final.returncode == 0, final.stderr[-3000:]

    assert fingerprint(dbs.source, "public.t") == fingerprint(dbs.sink, "public.t")
    with dbs.dst() as d:
        assert d.execute("SELECT count(*), count(DISTINCT id) FROM t").fetchone() == (TXNS * ROWS, TXNS * ROWS)
        batches = d.execute("SELECT batch_id, reads FROM changefeed.progress WHERE feed = %s ORDER BY end_lsn",
                            (dbs.name,)).fetchall()
    ids = [b for b, _ in batches]
    assert len(ids) == len(set(ids)) and ids == sorted(ids), "a batch was applied twice or out of order"
    ahead = [b for b, reads in batches if any(r.get("ahead") for r in reads or [])]
    assert len(ahead) >= 5, batches  # most windows of the final run came from a read-ahead
    with dbs.src() as c:
        for _ in range(50):  # the killed sessions end, and their temporary slots with them
            left = c.execute("SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE 'changefeed_ahead%%'")
            if not left.fetchall():
                break
            time.sleep(0.2)
        else:
            pytest.fail("a read-ahead's temporary slot outlived its session")
