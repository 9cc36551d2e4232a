"""Crash safety: SIGKILL the whole feed (driver, JVM, Python workers) at awkward moments.

A writer keeps committing (and bulk-loading: insert runs the replica COPYs straight into its
table) while the feed is killed again and again; afterwards one clean run must leave replica ==
source, every batch applied once, and every ledger row and bulk load present once. The feed reads
the WAL over the streaming replication protocol (`--wal-reader stream`): a kill after the sink's
commit and before the slot moves (`after_sink_commit`) leaves a stream that confirmed nothing.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg
import pytest

from support.feeds import changefeed_cli, kill_runs
from support.servers import Dbs, fingerprint
from support.writers import WRITE_PAUSE, writing

ACCOUNTS = 50


BULK_ROWS = 600  # one bulk transaction: an insert run long enough to be COPYed straight in
BULK_EVERY_S = 4.0


def writer(uri: str, stop: threading.Event, written: list[int]) -> None:
    """Each transaction appends ledger row n and moves money between two accounts; every
    BULK_EVERY_S one also bulk-loads BULK_ROWS rows (the replica COPYs such runs straight into the
    target). `written` holds [last ledger row, last bulk load]."""
    with psycopg.connect(uri, autocommit=True) as c:
        n, loads, last_load = 0, 0, time.monotonic()
        while not stop.is_set():
            n += 1
            with c.transaction():
                c.execute("INSERT INTO ledger (id, v) VALUES (%s, %s)", (n, f"entry {n}"))
                c.execute("UPDATE accounts SET balance = balance - 1 WHERE id = %s", (n % ACCOUNTS,))
                c.execute("UPDATE accounts SET balance = balance + 1 WHERE id = %s", ((n * 7) % ACCOUNTS,))
                bulk = time.monotonic() - last_load >= BULK_EVERY_S
                if bulk:
                    c.execute("INSERT INTO bulk SELECT %s * 1000 + g, md5(g::text) FROM generate_series(1, %s) g",
                              (loads + 1, BULK_ROWS))
            if bulk:
                loads, last_load = loads + 1, time.monotonic()
            written[:] = [n, loads]
            time.sleep(WRITE_PAUSE)


@pytest.mark.slow
def test_sigkill_at_awkward_moments_loses_and_duplicates_nothing(dbs: Dbs, tmp_path: Path, spark_server: str) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE ledger (id bigint PRIMARY KEY, v text NOT NULL)")
        c.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        c.execute("CREATE TABLE bulk (id bigint PRIMARY KEY, v text NOT NULL)")
        c.execute("INSERT INTO accounts SELECT g, 1000 FROM generate_series(0, %s) g", (ACCOUNTS - 1,))
    state = str(tmp_path / "state")
    base = ["run", "--name", dbs.name, "--state", state]
    first = changefeed_cli(*base, "--source", dbs.source, "--sink", dbs.sink,
                           "--tables", "public.ledger,public.accounts,public.bulk",
                           "--available-now", "--max-changes-per-batch", "400", "--wal-reader", "stream",
                           "--master", spark_server)
    assert first.returncode == 0, first.stderr

    written = [0, 0]
    kills = ["startup", "read:2", "insert_run:2", "before_sink_commit:2", "after_sink_commit:2", "random"]
    with writing(writer, dbs.source, written):
        kill_runs(base, kills, tmp_path, random_after=(12, 20))

    # The kill runs left a backlog behind: drain it in big batches (a restart may change the limit).
    final = changefeed_cli(*base, "--available-now", "--master", spark_server, "--max-changes-per-batch", "0")
    assert final.returncode == 0, final.stderr[-3000:]

    for table in ("public.ledger", "public.accounts", "public.bulk"):
        assert fingerprint(dbs.source, table) == fingerprint(dbs.sink, table), table
    with dbs.dst() as d:
        ids = [r[0] for r in d.execute("SELECT id FROM ledger ORDER BY id")]
        assert ids == list(range(1, written[0] + 1))  # every committed row, once, none missing
        loads = d.execute("SELECT id / 1000, count(*) FROM bulk GROUP BY 1 ORDER BY 1").fetchall()
        assert loads == [(k, BULK_ROWS) for k in range(1, written[1] + 1)]  # each load whole, once
        total = d.execute("SELECT sum(balance) FROM accounts").fetchone()[0]  # type: ignore[index]
        assert total == 1000 * ACCOUNTS  # a consistent cut: money is never half-moved
        batches = d.execute("SELECT batch_id, end_lsn, resolved_ts FROM changefeed.progress WHERE feed = %s "
                            "ORDER BY end_lsn", (dbs.name,)).fetchall()
    batch_ids = [b[0] for b in batches]
    assert len(batch_ids) == len(set(batch_ids)), "a batch was applied twice"
    assert batch_ids == sorted(batch_ids)
    resolved = [b[2] for b in batches]
    assert resolved == sorted(resolved), "resolved timestamps went backwards"
    assert len(batches) > len(kills)  # work really was spread over the killed runs
