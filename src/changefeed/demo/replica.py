"""`changefeed demo`: source and replica servers, a bank-like workload, a live feed, a verdict.

Starts two embedded PostgreSQL servers, creates accounts / transfers / outbox tables, starts the
feed (Spark local[*]), runs concurrent transfers while it streams, waits until the replica has
caught up, and compares every table by row fingerprint. Exit 0 only if replica == source.
"""
from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import psycopg

from changefeed.demo.workload import ACCOUNTS, SCHEMA, TABLES, failed, writer
from changefeed.local.postgres import LocalPostgres
from changefeed.postgres.connect import one_row
from changefeed.sinks.replica.apply import applied_upto
from changefeed.spec.definition import FeedSpec
from changefeed.spec.state import FeedState


def _fingerprint(uri: str, table: str) -> tuple[int, str]:
    with psycopg.connect(uri) as c:
        row = one_row(c.execute(f"SELECT count(*), coalesce(md5(string_agg(x::text, '|' ORDER BY x::text)), '') "
                                f"FROM {table} x"))
    return int(row[0]), str(row[1])


def _caught_up(sink: str, feed: str, target_lsn: int) -> bool:
    with psycopg.connect(sink) as c:
        return applied_upto(c, feed) >= target_lsn


def demo(workdir: Path, *, seconds: float = 45, master: str = "local[*]", writers: int = 2) -> int:
    from changefeed.control.runner import run

    workdir = workdir.absolute()
    for sub in ("source", "replica", "state"):
        shutil.rmtree(workdir / sub, ignore_errors=True)
    print(f"demo: starting PostgreSQL source and replica under {workdir}")
    source, replica = LocalPostgres.start(workdir / "source"), LocalPostgres.start(workdir / "replica")
    stop_feed = threading.Event()
    try:
        with psycopg.connect(source.uri(), autocommit=True) as c:
            c.execute(SCHEMA)
        # parallel snapshot reads whatever the cores: the demo shows the chunks read by Spark tasks
        # of their own, then the query restarted without the shuffle for streaming
        spec = FeedSpec("demo", source.uri(), replica.uri(), TABLES, trigger_interval_s=1.0,
                        snapshot_reads="parallel").validate()
        state = FeedState(workdir / "state", spec.name)
        failure: list[BaseException] = []

        def feed() -> None:
            try:
                run(spec, state, master=master, stop_event=stop_feed, report=lambda s: print(s, flush=True))
            except BaseException as e:  # noqa: BLE001 - reported below
                failure.append(e)

        feed_thread = threading.Thread(target=feed, name="feed")
        feed_thread.start()
        with psycopg.connect(source.uri(), autocommit=True) as c:
            while not c.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (spec.slot,)).fetchone():
                if failure or not feed_thread.is_alive():
                    raise failed("start", failure)
                time.sleep(0.2)
            c.execute("INSERT INTO accounts (id, owner, balance, tags) SELECT g, 'owner ' || g, 1000, "
                      "ARRAY['demo', 'n' || g %% 7] FROM generate_series(1, %s) g", (ACCOUNTS,))
        print(f"demo: feed started; {writers} writers run transfers for {seconds:.0f} s")
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
        print(f"demo: workload done ({sum(counts)} transfers); waiting for the replica to catch up")
        deadline = time.monotonic() + 300
        while not _caught_up(replica.uri(), spec.name, target):
            if failure or not feed_thread.is_alive() or time.monotonic() > deadline:
                raise failed("catch up within 300 s", failure)
            time.sleep(0.5)
        stop_feed.set()
        feed_thread.join()
        if failure:
            raise failure[0]
        print("demo: comparing replica with source")
        ok = True
        for table in TABLES:
            a, b = _fingerprint(source.uri(), table), _fingerprint(replica.uri(), table)
            same = a == b
            ok &= same
            print(f"  {table:20} source {a[0]:>7} rows {a[1][:12]}  replica {b[0]:>7} rows {b[1][:12]}  "
                  f"{'equal' if same else 'DIFFERENT'}")
        print(f"demo: verdict: {'replica == source' if ok else 'replica DIFFERS from source'}")
        return 0 if ok else 1
    finally:
        stop_feed.set()
        source.stop("fast")
        replica.stop("fast")
