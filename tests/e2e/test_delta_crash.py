"""Crash safety of the Delta sink: SIGKILL the whole feed at each commit step and at random.

A writer keeps moving money between accounts and appending ledger rows while the feed, writing
Delta in several tasks, is killed: after the data files were written (before any commit), right
before the driver commits, right after the commit (before Spark's own checkpoint), and at a
random moment. One clean run afterwards must leave every change exactly once, in either mode:
read back with the Delta library and with DuckDB.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from changefeed.sinks.delta.duck import connect as duckdb
from support.feeds import changefeed_cli, kill_runs
from support.servers import Dbs
from support.writers import WRITE_PAUSE, writing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ACCOUNTS = 40


def writer(uri: str, stop: threading.Event, written: list[int]) -> None:
    """Transaction n appends ledger row n and moves 1 between two accounts; `written` = [n]."""
    with psycopg.connect(uri, autocommit=True) as c:
        n = 0
        while not stop.is_set():
            n += 1
            with c.transaction():
                c.execute("INSERT INTO ledger (id, v) VALUES (%s, %s)", (n, f"entry {n}"))
                c.execute("UPDATE accounts SET balance = balance - 1 WHERE id = %s", (n % ACCOUNTS,))
                c.execute("UPDATE accounts SET balance = balance + 1 WHERE id = %s", ((n * 7) % ACCOUNTS,))
            written[:] = [n]
            time.sleep(WRITE_PAUSE)


def rows(lake: Path, table: str) -> list[dict[str, Any]]:
    from deltalake import DeltaTable

    return pa.table(DeltaTable(str(lake / table)).to_pyarrow_table()).to_pylist()


@pytest.mark.parametrize("mode", ["mirror", "changelog", "history"])
def test_sigkill_at_each_commit_step_keeps_delta_exactly_once(dbs: Dbs, tmp_path: Path, mode: str,
                                                             spark_server: str) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE ledger (id bigint PRIMARY KEY, v text NOT NULL)")
        c.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        c.execute("INSERT INTO accounts SELECT g, 1000 FROM generate_series(0, %s) g", (ACCOUNTS - 1,))
    lake = tmp_path / "lake"
    base = ["run", "--name", dbs.name, "--state", str(tmp_path / "state")]
    first = changefeed_cli(*base, "--source", dbs.source, "--sink", f"delta://{lake}?mode={mode}&buckets=4",
                           "--tables", "public.ledger,public.accounts", "--available-now",
                           "--max-changes-per-batch", "300", "--master", spark_server)
    assert first.returncode == 0, first.stderr[-3000:]

    written = [0]
    kills = ["delta_files_written:2", "before_sink_commit:2", "after_sink_commit:2", "random"]
    with writing(writer, dbs.source, written):
        kill_runs(base, kills, tmp_path, random_after=(10, 16))
    final = changefeed_cli(*base, "--available-now", "--master", spark_server, "--max-changes-per-batch", "0")
    assert final.returncode == 0, final.stderr[-3000:]
    n = written[0]
    assert n > 50

    ledger, accounts = rows(lake, "public.ledger"), rows(lake, "public.accounts")
    with psycopg.connect(dbs.source) as c:
        source_accounts = sorted(c.execute("SELECT id, balance FROM accounts").fetchall())
    if mode == "mirror":
        assert sorted(r["id"] for r in ledger) == list(range(1, n + 1))  # every committed row, once
        assert sorted((r["id"], r["balance"]) for r in accounts) == source_accounts
    elif mode == "history":
        assert sorted(r["id"] for r in ledger if r["_current"]) == list(range(1, n + 1))
        assert sorted((r["id"], r["balance"]) for r in accounts if r["_current"]) == source_accounts
        # a version per account a transaction touched (one where it moved money to itself), plus the snapshot's
        assert len(accounts) == ACCOUNTS + sum(1 if k % 20 == 0 else 2 for k in range(1, n + 1))
        for a in range(ACCOUNTS):
            vs = sorted((r for r in accounts if r["id"] == a), key=lambda r: r["_commit_ts"])
            assert all(x["_valid_to"] == y["_valid_from"] for x, y in zip(vs, vs[1:])), vs  # no gap, no overlap
    else:
        inserts = sorted(r["id"] for r in ledger if r["_op"] == "c")
        assert inserts == list(range(1, n + 1)), "a change log insert is missing or doubled"
        positions = [(r["_lsn"], r["_seq"]) for r in accounts]
        assert len(positions) == len(set(positions)), "a change appears twice"
        assert sum(r["_op"] == "u" for r in accounts) == 2 * n  # two updates per transaction
        assert sorted(r["id"] for r in accounts if r["_op"] == "r") == list(range(ACCOUNTS))  # the snapshot, once
        last = {}
        for r in sorted(accounts, key=lambda r: (r["_op"] != "r", r["_commit_ts"], r["_lsn"], r["_seq"])):
            last[r["id"]] = r["balance"]
        assert sorted(last.items()) == source_accounts
    con = duckdb()  # an independent reader of the same tables
    if mode != "changelog":
        current = "" if mode == "mirror" else " WHERE _current"
        total = con.sql(f"SELECT sum(balance), count(*) FROM delta_scan('{lake}/public.accounts'){current}").fetchall()
        assert total == [(1000 * ACCOUNTS, ACCOUNTS)]  # a consistent cut: money is never half-moved
    count = con.sql(f"SELECT count(DISTINCT id), count(*) FROM delta_scan('{lake}/public.ledger')").fetchall()
    assert count == [(n, n)]
    status = changefeed_cli("status", "--name", dbs.name, "--state", str(tmp_path / "state"), "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)  # read back from the ledger table in the lake
    assert report["batches"] > len(kills) and report["lag_bytes"] == 0, report
    assert report["snapshot"]["public.accounts"] == {"chunks": 1, "rows": ACCOUNTS}, report  # once
