#!/usr/bin/env python
"""What judging window changes against snapshot reads (core.judge, issue 62) costs a snapshot
read while an application writes.

On one pair of fresh local servers, a table of --rows rows (~100-byte rows). Each of --runs runs
times, in turn, a feed's first run (`run --available-now`, default options, into a fresh replica
database) under a writer that, in each transaction, adds one to a column of three random rows
and appends a row (--tps transactions per second, from before the feed starts): once with this
checkout (`judged`), once with the code of --baseline (a git revision, checked out into a
worktree of its own and run from it: `unjudged`, where a change its read saw comes again).
Printed: each run's whole-process seconds, and judged / unjudged, median [min - max].

    .venv/bin/python bench/snapshot_under_writes.py                       # 500k rows, 3 runs
    .venv/bin/python bench/snapshot_under_writes.py --rows 200000 --runs 1
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replica_throughput import ROOT, bench_paths, bench_setup, fmt_ratio, log, spread  # noqa: E402

TABLE = "judged_t"
BASELINE = "1bdad6e~1"  # the commit before windows were judged against snapshot reads


def writer(uri: str, rows: int, tps: float, stop: threading.Event, done: list[int]) -> None:
    rng = random.Random(7)
    with psycopg.connect(uri, autocommit=True) as c:
        top = c.execute(f"SELECT max(id) FROM {TABLE}").fetchone()[0]  # type: ignore[index]
        while not stop.is_set():
            began = time.monotonic()
            top += 1
            with c.transaction():
                c.execute(f"UPDATE {TABLE} SET a = a + 1 WHERE id = ANY(%s)", (rng.sample(range(1, rows + 1), 3),))
                c.execute(f"INSERT INTO {TABLE} VALUES (%s, 0, md5(%s::text))", (top, top))
            done[0] += 1
            time.sleep(max(0.0, 1 / tps - (time.monotonic() - began)))


def timed_feed(name: str, source: str, sink: str, work: Path, rows: int, tps: float, src: Path) -> float:
    """Seconds of a feed's first run under the writer, run from the code at `src`."""
    stop, done = threading.Event(), [0]
    w = threading.Thread(target=writer, args=(source, rows, tps, stop, done))
    w.start()
    try:
        time.sleep(1.0)
        began = time.monotonic()
        with (work / "logs" / f"{name}.out").open("w") as out:
            subprocess.run([sys.executable, "-m", "changefeed", "run", "--name", name, "--state", str(work / "state"),
                            "--source", source, "--sink", sink, "--tables", f"public.{TABLE}", "--available-now"],
                           stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT), check=True,
                           env={**os.environ, "PYTHONPATH": str(src)})
        return time.monotonic() - began
    finally:
        stop.set()
        w.join()
        subprocess.run([sys.executable, "-m", "changefeed", "remove", "--name", name, "--state", str(work / "state")],
                       cwd=str(ROOT), capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--tps", type=float, default=200, help="the writer's transactions per second")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--baseline", default=BASELINE, help="the git revision timed as `unjudged`")
    ap.add_argument("--workdir")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    work, _, (src_pg, sink_pg) = bench_setup(ap, args.workdir, args.keep, "judged-", ("source", "sink"))
    _, _, facts, source = bench_paths(work, src_pg, "snap")
    tree = work / "baseline"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.baseline], cwd=str(ROOT), check=True,
                   capture_output=True)
    try:
        with psycopg.connect(source, autocommit=True) as c:
            c.execute(f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, a int, b text)")
            c.execute(f"INSERT INTO {TABLE} SELECT g, 0, md5(g::text) || md5((g + 1)::text) "
                      "FROM generate_series(1, %s) g", (args.rows,))
            c.execute(f"VACUUM (ANALYZE) {TABLE}")
        log("; ".join(facts))
        ratios = []
        for run in range(1, args.runs + 1):
            seconds = {}
            modes = [("judged", ROOT / "src"), ("unjudged", tree / "src")]
            for mode, src in modes if run % 2 else modes[::-1]:  # (alternating which goes first)
                name = f"{mode}_{run}"
                with psycopg.connect(sink_pg.uri(), autocommit=True) as c:
                    c.execute(f"CREATE DATABASE {name}")
                seconds[mode] = timed_feed(name, source, sink_pg.uri(name), work, args.rows, args.tps, src)
            ratios.append(seconds["judged"] / seconds["unjudged"])
            log(f"run {run}: judged {seconds['judged']:.1f} s, unjudged {seconds['unjudged']:.1f} s")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=str(ROOT), capture_output=True)
    print(f"\na first run's snapshot of {args.rows:,} rows under {args.tps:.0f} writes/s, {args.runs} runs, "
          "median [min - max]:")
    print(f"  seconds judged / unjudged:   {fmt_ratio(spread(ratios))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
