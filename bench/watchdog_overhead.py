"""What the stall watchdog (postgres.watchdog) costs per awaited answer: the round trip of a
trivial query on a WatchedConnection against a plain psycopg connection to the same local server,
interleaved rounds, median and spread of the ratio. Run: .venv/bin/python bench/watchdog_overhead.py"""
from __future__ import annotations

import statistics
import tempfile
import time

import psycopg

from changefeed.local.postgres import LocalPostgres
from changefeed.postgres.watchdog import WatchedConnection

ROUNDS, QUERIES = 9, 5000


def timed(conn: psycopg.Connection, n: int = QUERIES) -> float:
    began = time.perf_counter()
    for _ in range(n):
        conn.execute("SELECT 1").fetchone()
    return time.perf_counter() - began


def main() -> None:
    server = LocalPostgres.start(tempfile.mkdtemp(prefix="changefeed-bench-") + "/pg")
    try:
        uri = server.uri()
        with psycopg.connect(uri, autocommit=True) as plain, WatchedConnection.connect(uri, autocommit=True) as watched:
            watched.probe_uri = uri
            timed(plain, 500), timed(watched, 500)  # warm up
            pairs = [(timed(plain), timed(watched)) for _ in range(ROUNDS)]
        ratios = [w / p for p, w in pairs]
        per_query_us = statistics.median(p for p, _ in pairs) / QUERIES * 1e6
        print(f"plain SELECT 1 round trip: {per_query_us:.0f} us (median of {ROUNDS} rounds of {QUERIES})")
        print(f"watched / plain: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}")
    finally:
        server.stop("immediate")


if __name__ == "__main__":
    main()
