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
import threading
import time
from pathlib import Path

import psycopg

from changefeed.demo.workload import ACCOUNTS, SCHEMA, TABLES, failed, writer
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
    from changefeed.control.runner import run

    workdir = workdir.absolute()
    for sub in ("source", "lake", "state"):
        shutil.rmtree(workdir / sub, ignore_errors=True)
    lake = workdir / "lake"
    print(f"demo: starting PostgreSQL under {workdir}; the Delta lake is {lake}")
    source = LocalPostgres.start(workdir / "source")
    stop_feed = threading.Event()
    try:
        with psycopg.connect(source.uri(), autocommit=True) as c:
            c.execute(SCHEMA)
        mirror = FeedSpec("demo", source.uri(), f"delta://{lake}?mode=mirror", TABLES,
                          trigger_interval_s=1.0).validate()
        # its slot predates every row: the change log needs no snapshot
        log = FeedSpec("demo_log", source.uri(), f"delta://{lake}/log?mode=changelog", TABLES,
                       snapshot="never").validate()
        create(log, FeedState(workdir / "state", log.name))
        state = FeedState(workdir / "state", mirror.name)
        failure: list[BaseException] = []

        def feed() -> None:
            try:
                run(mirror, state, master=master, stop_event=stop_feed, report=lambda s: print(s, flush=True))
            except BaseException as e:  # noqa: BLE001 - reported below
                failure.append(e)

        feed_thread = threading.Thread(target=feed, name="feed")
        feed_thread.start()
        with psycopg.connect(source.uri(), autocommit=True) as c:
            while not c.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (mirror.slot,)).fetchone():
                if failure or not feed_thread.is_alive():
                    raise failed("start", failure)
                time.sleep(0.2)
            c.execute("INSERT INTO accounts (id, owner, balance, tags) SELECT g, 'owner ' || g, 1000, "
                      "ARRAY['demo', 'n' || g %% 7] FROM generate_series(1, %s) g", (ACCOUNTS,))
        print(f"demo: mirror feed started; {writers} writers run transfers for {seconds:.0f} s")
        stop, counts = threading.Event(), [0] * writers
        threads = [threading.Thread(target=writer, args=(source.uri(), i, stop, counts)) for i in range(writers)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        with psycopg.connect(source.uri(), autocommit=True) as c:
            target = int(one_row(c.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn"))[0])
        print(f"demo: workload done ({sum(counts)} transfers); waiting for the mirror to catch up")
        ledger, deadline = DeltaLedger(DeltaOptions.parse(mirror.sink), mirror.name), time.monotonic() + 300
        while min((ledger.checkpoint() or {"": 0}).values()) < target:
            if failure or not feed_thread.is_alive() or time.monotonic() > deadline:
                raise failed("catch up within 300 s", failure)
            time.sleep(0.5)
        stop_feed.set()
        feed_thread.join()
        if failure:
            raise failure[0]
        print("demo: writing the change log (feed demo_log, its own process: one Spark session per process)")
        done = subprocess.run([sys.executable, "-m", "changefeed", "run", "--name", log.name, "--state",
                               str(workdir / "state"), "--available-now", "--master", master])
        if done.returncode:
            raise DefiniteError(f"the change log's feed failed (exit {done.returncode})",
                                f"see {workdir / 'state' / log.name / 'spark.log'}")
        return _compare(source.uri(), lake)
    finally:
        stop_feed.set()
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
