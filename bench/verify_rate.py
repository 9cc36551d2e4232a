#!/usr/bin/env python
"""Verify rate: how fast does `changefeed verify` compare a table, next to reading it with COPY?

One pair of fresh local PostgreSQL servers (source, sink); one table of --rows rows (~100-byte
rows: bigint key, int, text, timestamptz, numeric) on the source, copied to the sink by a running
feed (`changefeed run`, initial snapshot). Then, --runs times, interleaved so that each run's
figures come from the same moment, while the feed keeps running idle:

  copy     `COPY t TO STDOUT` on the source and on the sink at the same time (two sessions,
           output discarded): what the two servers need to read the table once each;
  copy1    the same on the source alone;
  verify-W `verify()` of the feed with W sessions per server (--workers, default 1 and 2): meet a
           consistent point, checksum every chunk on both servers, compare.

Printed: seconds and rows compared per second of each, and the ratio verify-W / copy (same run;
median [min - max]). Every verify must say "equal"; then one row is changed on the sink and the
next verify must name its key (exit 1 otherwise).

    .venv/bin/python bench/verify_rate.py                      # 1M rows, 3 runs
    .venv/bin/python bench/verify_rate.py --rows 100000 --runs 1
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from changefeed.control.verify import verify  # noqa: E402
from changefeed.spec.definition import FeedState  # noqa: E402
from replica_throughput import (  # noqa: E402
    bench_args,
    bench_paths,
    bench_setup,
    fmt_ratio,
    log,
    spread,
    verdict,
)

TABLE = "public.vt"


def copy_out(uri: str) -> float:
    """Seconds to stream the whole table out of the server (discarded)."""
    with psycopg.connect(uri) as c:
        t0 = time.perf_counter()
        with c.cursor().copy(f"COPY {TABLE} TO STDOUT") as cp:
            for _ in cp:
                pass
        return time.perf_counter() - t0


def copy_both(source: str, sink: str) -> float:
    """Seconds until both servers have streamed the table out, at the same time."""
    took: list[float] = []
    threads = [threading.Thread(target=lambda u=u: took.append(copy_out(u))) for u in (source, sink)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", default="1,2", help="sessions per server to time, comma-separated (default 1,2)")
    bench_args(ap, "the servers and logs", "--max-bytes-per-batch=16MB")
    args = ap.parse_args()
    workers = [int(w) for w in args.workers.split(",")]
    began = time.monotonic()
    work, removed, (source, sink) = bench_setup(ap, args.workdir, args.keep, "cf-verify-", ("source", "sink"))
    logdir, state_dir, facts, source_uri = bench_paths(work, source, "vsrc")
    with psycopg.connect(sink.uri(), autocommit=True) as c:
        c.execute("CREATE DATABASE vsink")
    sink_uri = sink.uri("vsink")
    print("\n".join(facts))
    with psycopg.connect(source_uri, autocommit=True) as c:
        c.execute(f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, a int, b text, c timestamptz, d numeric)")
        c.execute(f"INSERT INTO {TABLE} SELECT g, g %% 1000, md5(g::text) || md5((g * 7)::text), "
                  "now() - g * interval '1 second', g / 7.0 FROM generate_series(1, %s) g", (args.rows,))
        c.execute(f"VACUUM ANALYZE {TABLE}")
    log(f"{args.rows:,} rows written; starting the feed")
    feed = ["--name", "vbench", "--state", str(state_dir)]
    out = open(logdir / "feed.log", "ab")
    p = subprocess.Popen([sys.executable, "-m", "changefeed", "run", *feed, "--source", source_uri, "--sink", sink_uri,
                          "--tables", TABLE, *args.feed_arg], stdout=out, stderr=subprocess.STDOUT,
                         start_new_session=True)
    failures: list[str] = []
    try:
        state = FeedState(state_dir, "vbench")
        deadline = time.monotonic() + args.feed_timeout
        while True:
            with psycopg.connect(sink_uri) as c:
                there = c.execute("SELECT to_regclass(%s) IS NOT NULL", (TABLE,)).fetchone()[0]  # type: ignore[index]
                have = c.execute(f"SELECT count(*) FROM {TABLE}").fetchone()[0] if there else -1  # type: ignore[index]
            if have == args.rows or time.monotonic() > deadline or p.poll() is not None:
                break
            time.sleep(1)
        if have != args.rows:
            print(f"the feed did not copy the table ({have} rows); see {logdir / 'feed.log'}")
            return 1
        log("table copied; timing")
        spec = state.load()
        assert spec is not None
        times: dict[str, list[float]] = {"copy": [], "copy1": [], **{f"verify-{w}": [] for w in workers}}
        for run in range(args.runs):
            times["copy"].append(copy_both(source_uri, sink_uri))
            times["copy1"].append(copy_out(source_uri))
            for w in workers:
                t0 = time.perf_counter()
                found = verify(spec, state, workers=w, report=log)
                times[f"verify-{w}"].append(time.perf_counter() - t0)
                if not found.equal:
                    failures.append(f"run {run}: verify-{w} found differences: {found.lines()}")
            log(f"run {run + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()))
        with psycopg.connect(sink_uri, autocommit=True) as c:
            c.execute(f"UPDATE {TABLE} SET a = -1 WHERE id = 4242")
        found = verify(spec, state, report=log)
        if [d.key for t in found.tables for d in t.differences] != ["(4242)"]:
            failures.append(f"a changed row was not named: {found.lines()}")
    finally:
        p.terminate()
        p.wait(timeout=120)
    print(f"\n{args.rows:,} rows, {args.runs} runs; seconds and rows/s: median [min - max]")
    for k, v in times.items():
        s = spread(v)
        assert s is not None
        print(f"  {k:<10} {s[0]:7.2f}s [{s[1]:.2f} - {s[2]:.2f}]   {args.rows / s[0]:>12,.0f} rows/s")
    for w in workers:
        ratio = spread([v / c for v, c in zip(times[f"verify-{w}"], times["copy"])])
        print(f"  verify-{w} / copy (both servers reading at once): {fmt_ratio(ratio)}")
    return verdict(time.monotonic() - began, logdir, removed, failures, "every verify was equal on the copied "
                   "table and named the one changed row")


if __name__ == "__main__":
    sys.exit(main())
