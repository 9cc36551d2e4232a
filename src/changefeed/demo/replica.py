"""`changefeed demo`: source and replica servers, a bank-like workload, a live feed, a verdict.

Starts two embedded PostgreSQL servers, creates accounts / transfers / outbox tables, starts the
feed (Spark local[*]), runs concurrent transfers while it streams, waits until the replica has
caught up, and compares every table by row fingerprint. Exit 0 only if replica == source.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import psycopg

from changefeed.demo.workload import SCHEMA, TABLES, FeedThread, transfers_while_feeding, wait_until
from changefeed.local.postgres import LocalPostgres
from changefeed.postgres.connect import one_row
from changefeed.sinks.replica.ledger import applied_upto
from changefeed.spec.definition import FeedSpec
from changefeed.spec.state import FeedState


def _fingerprint(uri: str, table: str) -> tuple[int, str]:
    with psycopg.connect(uri) as c:
        row = one_row(c.execute(f"SELECT count(*), coalesce(md5(string_agg(x::text, '|' ORDER BY x::text)), '') "
                                f"FROM {table} x"))
    return int(row[0]), str(row[1])


def _caught_up(sink: str, feed: str, target_lsn: int) -> bool:
    with psycopg.connect(sink) as c:
        try:
            return applied_upto(c, feed) >= target_lsn
        except psycopg.errors.UndefinedTable:  # the feed has not prepared the replica yet
            return False


def demo(workdir: Path, *, seconds: float = 45, master: str = "local[*]", writers: int = 2) -> int:
    workdir = workdir.absolute()
    for sub in ("source", "replica", "state"):
        shutil.rmtree(workdir / sub, ignore_errors=True)
    print(f"demo: starting PostgreSQL source and replica under {workdir}")
    source, replica = LocalPostgres.start(workdir / "source"), LocalPostgres.start(workdir / "replica")
    feed: FeedThread | None = None
    try:
        with psycopg.connect(source.uri(), autocommit=True) as c:
            c.execute(SCHEMA)
        # parallel snapshot reads whatever the cores: the demo shows the chunks read by Spark tasks
        # of their own, then the query restarted without the shuffle for streaming
        spec = FeedSpec("demo", source.uri(), replica.uri(), TABLES, trigger_interval_s=1.0,
                        snapshot_reads="parallel").validate()
        feed = FeedThread(spec, FeedState(workdir / "state", spec.name), master)
        # the workload's time counts from the feed's first batch (the snapshot, read in parallel
        # tasks): streaming batches follow it, after the restart without the shuffle
        target = transfers_while_feeding(source.uri(), feed, writers, seconds, "feed running",
                                         first_batch=lambda: _caught_up(replica.uri(), spec.name, 1))
        wait_until(lambda: _caught_up(replica.uri(), spec.name, target), feed)
        feed.end()
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
        if feed is not None:
            feed.stop.set()
        source.stop("fast")
        replica.stop("fast")
