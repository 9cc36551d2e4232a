"""`changefeed demo --sink delta`: the bank workload into a Delta lake, queried with DuckDB.

One embedded PostgreSQL server; two feeds of its tables into `WORKDIR/lake`: `demo` keeps a
mirror, live, while transfers run; `demo_log` (created at the start, so its slot holds every
change) writes the change log once the workload is done. DuckDB then reads both (`delta_scan`):
the mirror's account total must equal the source's, every table's row count and content sum
must match, and the change log must hold every transfer once. Exit 0 only if all do.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import psycopg

from changefeed.demo.workload import SCHEMA, TABLES, FeedThread, transfers_while_feeding, wait_until
from changefeed.errors import DefiniteError
from changefeed.local.postgres import LocalPostgres
from changefeed.postgres.connect import one_row
from changefeed.sinks.delta.duck import connect as duckdb
from changefeed.sinks.delta.ledger import DeltaLedger
from changefeed.sinks.delta.options import DeltaOptions
from changefeed.spec.definition import FeedSpec
from changefeed.spec.state import FeedState

# per table: a sum over its rows that both PostgreSQL and DuckDB compute the same way
CHECKS = {"public.accounts": "count(*), sum(balance), sum(id)", "public.transfers": "count(*), sum(amount), sum(id)",
          "public.outbox": "count(*), count(DISTINCT id), sum(length(event_type))"}


def demo_delta(workdir: Path, *, seconds: float = 45, master: str = "local[*]", writers: int = 2) -> int:
    from changefeed.control.lifecycle import create

    workdir = workdir.absolute()
    for sub in ("source", "lake", "state"):
        shutil.rmtree(workdir / sub, ignore_errors=True)
    lake = workdir / "lake"
    print(f"demo: starting PostgreSQL under {workdir}; the Delta lake is {lake}")
    source = LocalPostgres.start(workdir / "source")
    feed: FeedThread | None = None
    try:
        with psycopg.connect(source.uri(), autocommit=True) as c:
            c.execute(SCHEMA)
        mirror = FeedSpec("demo", source.uri(), f"delta://{lake}?mode=mirror", TABLES,
                          trigger_interval_s=1.0).validate()
        # its slot predates every row: the change log needs no snapshot
        log = FeedSpec("demo_log", source.uri(), f"delta://{lake}/log?mode=changelog", TABLES,
                       snapshot="never").validate()
        create(log, FeedState(workdir / "state", log.name))
        feed = FeedThread(mirror, FeedState(workdir / "state", mirror.name), master)
        target = transfers_while_feeding(source.uri(), feed, writers, seconds, "mirror feed started")
        ledger = DeltaLedger(DeltaOptions.parse(mirror.sink), mirror.name)
        wait_until(lambda: min((ledger.checkpoint() or {"": 0}).values()) >= target, feed)
        feed.end()
        print("demo: writing the change log (feed demo_log, its own process: one Spark session per process)")
        done = subprocess.run([sys.executable, "-m", "changefeed", "run", "--name", log.name, "--state",
                               str(workdir / "state"), "--available-now", "--master", master])
        if done.returncode:
            raise DefiniteError(f"the change log's feed failed (exit {done.returncode})",
                                f"see {workdir / 'state' / log.name / 'spark.log'}")
        return _compare(source.uri(), lake)
    finally:
        if feed is not None:
            feed.stop.set()
        source.stop("fast")


def _compare(uri: str, lake: Path) -> int:
    con = duckdb()
    ok = True
    print("demo: comparing the mirror (DuckDB over Delta) with the source")
    with psycopg.connect(uri) as c:
        for table, sums in CHECKS.items():
            a = tuple(one_row(c.execute(f"SELECT {sums} FROM {table}")))
            b = tuple(con.sql(f"SELECT {sums} FROM delta_scan('{lake}/{table}')").fetchone())
            same = tuple(map(float, a)) == tuple(map(float, b))
            ok &= same
            shown = [", ".join(str(v) for v in x) for x in (a, b)]
            print(f"  {table:18} source ({shown[0]})  mirror ({shown[1]})  {'equal' if same else 'DIFFERENT'}")
        transfers = one_row(c.execute("SELECT count(*) FROM transfers"))[0]
    accounts_log = f"delta_scan('{lake}/log/public.accounts')"
    ops = con.sql(f"SELECT _op, count(*) FROM {accounts_log} GROUP BY 1 ORDER BY 1").fetchall()
    print(f"demo: change log of public.accounts by operation: {dict(ops)}")
    logged = con.sql(f"SELECT count(*), count(DISTINCT id) FROM delta_scan('{lake}/log/public.transfers') "
                     "WHERE _op = 'c'").fetchone()
    print("demo: the last changes of account 1:")
    for row in con.sql(f"SELECT _commit_time::varchar, _op, balance FROM {accounts_log} WHERE id = 1 "
                       "ORDER BY _commit_ts DESC, _seq DESC LIMIT 3").fetchall():
        print(f"  {row[0]}  {row[1]}  balance {row[2]}")
    same = logged == (transfers, transfers)
    ok &= same
    print(f"  change log: {logged[0]} transfer inserts, source {transfers} transfers  "
          f"{'equal' if same else 'DIFFERENT'}")
    print(f"demo: verdict: {'lake == source' if ok else 'lake DIFFERS from source'}")
    return 0 if ok else 1
