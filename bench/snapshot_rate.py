#!/usr/bin/env python
"""What --snapshot-rate protects: pgbench TPC-B on the source while a large snapshot is read.

On one pair of fresh local servers (source, sink), a table of --rows rows (~150-byte rows) and a
pgbench database (scale --scale) on the source. Each of --runs runs measures, in this order:

  alone      pgbench TPC-B (-c 2 -j 1 -T --seconds), nothing else running;
  unlimited  the same, started once a feed's snapshot of the table is under way (`run --snapshot
             only`, no limit); the feed is killed after pgbench ends;
  limited    the same with `--snapshot-rate --limit` (rows per second); the snapshot's rate over
             pgbench's window is taken from the replica's record of the chunks it applied: the
             rows of the batches that landed in the window after the first, over the time from
             the first to the last. pgbench starts 3 s after the snapshot's first progress line,
             past the first batches' burst (what the limit saved up while the feed started).

Printed: each mode's TPS as a ratio to `alone` of the same run, and the limited read's rate as a
ratio to the limit, median [min - max] over the runs. Each run's feeds are removed afterwards.

    .venv/bin/python bench/snapshot_rate.py                  # 1M rows, limit 5000 rows/s, 3 runs
    .venv/bin/python bench/snapshot_rate.py --rows 500000 --runs 1
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from changefeed.local.postgres import bin_dir  # noqa: E402
from replica_throughput import ROOT, bench_paths, bench_setup, fmt_ratio, log, spread  # noqa: E402

TABLE = "snap_t"


def pgbench(uri: str, seconds: int) -> float:
    """TPC-B for `seconds` with 2 clients; transactions per second."""
    done = subprocess.run([str(bin_dir() / "pgbench"), "-n", "-c", "2", "-j", "1", "-T", str(seconds), uri],
                          capture_output=True, text=True, check=True)
    m = re.search(r"tps = ([0-9.]+)", done.stdout)
    assert m, done.stdout + done.stderr
    return float(m.group(1))


def during_snapshot(name: str, source: str, sink: str, bench: str, work: Path, seconds: int, extra: list[str]
                    ) -> tuple[float, float, float]:
    """(TPS, rows applied per second in pgbench's window, window seconds) with a feed's snapshot under way."""
    out = (work / "logs" / f"{name}.out").open("w")
    feed = subprocess.Popen([sys.executable, "-m", "changefeed", "run", "--name", name, "--state", str(work / "state"),
                             "--source", source, "--sink", sink, "--tables", f"public.{TABLE}", "--snapshot", "only",
                             "--snapshot-chunk-rows", "5000", *extra], stdout=out, stderr=subprocess.STDOUT,
                            cwd=str(ROOT), start_new_session=True)
    try:
        log_path = work / "logs" / f"{name}.out"
        deadline = time.monotonic() + 120
        while f"snapshot public.{TABLE}:" not in log_path.read_text():
            assert feed.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.2)
        time.sleep(3)  # (past the reads' first burst: what a limit saved up while the feed started)
        began = time.time()
        tps = pgbench(bench, seconds)
        ended = time.time()
    finally:
        feed.kill()
        feed.wait()
        out.close()
    with psycopg.connect(sink) as c:  # batches that landed in the window: rows after the first over their time
        landed = c.execute("SELECT extract(epoch FROM max(applied_at)), sum(rows) FROM changefeed.snapshot_chunks "
                           "WHERE feed = %s AND applied_at BETWEEN to_timestamp(%s) AND to_timestamp(%s) "
                           "GROUP BY batch_id ORDER BY 1", (name, began, ended)).fetchall()
    subprocess.run([sys.executable, "-m", "changefeed", "remove", "--name", name, "--state", str(work / "state")],
                   cwd=str(ROOT), capture_output=True, check=False)
    rate = sum(int(n) for _, n in landed[1:]) / (float(landed[-1][0]) - float(landed[0][0])) if len(landed) > 1 \
        else float("nan")
    return tps, rate, ended - began


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--scale", type=int, default=10, help="pgbench scale")
    ap.add_argument("--limit", type=int, default=5_000, help="--snapshot-rate of the limited mode (rows/s)")
    ap.add_argument("--seconds", type=int, default=20, help="pgbench's window")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    work, _, (src_pg, sink_pg) = bench_setup(ap, args.workdir, args.keep, "snaprate-", ("source", "sink"))
    _, _, facts, source = bench_paths(work, src_pg, "snap")
    with psycopg.connect(src_pg.uri(), autocommit=True) as c:
        c.execute("CREATE DATABASE bench")
    subprocess.run([str(bin_dir() / "pgbench"), "-i", "-q", "-s", str(args.scale), src_pg.uri("bench")],
                   capture_output=True, check=True)
    with psycopg.connect(source, autocommit=True) as c:
        c.execute(f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, a int, b text, c timestamptz)")
        c.execute(f"INSERT INTO {TABLE} SELECT g, g %% 1000, md5(g::text) || md5((g + 1)::text), now() "
                  "FROM generate_series(1, %s) g", (args.rows,))
        c.execute(f"VACUUM (ANALYZE) {TABLE}")
    log("; ".join(facts))
    ratios: dict[str, list[float]] = {"unlimited": [], "limited": [], "held": []}
    for run in range(1, args.runs + 1):
        alone = pgbench(src_pg.uri("bench"), args.seconds)
        figures = {}
        for mode, extra in (("unlimited", []), ("limited", ["--snapshot-rate", str(args.limit)])):
            with psycopg.connect(sink_pg.uri(), autocommit=True) as c:
                c.execute(f"CREATE DATABASE {mode}_{run}")
            figures[mode] = during_snapshot(f"{mode}_{run}", source, sink_pg.uri(f"{mode}_{run}"),
                                            src_pg.uri("bench"), work, args.seconds, extra)
            ratios[mode].append(figures[mode][0] / alone)
        ratios["held"].append(figures["limited"][1] / args.limit)
        log(f"run {run}: pgbench alone {alone:,.0f} tps; during an unlimited snapshot {figures['unlimited'][0]:,.0f} "
            f"tps (read {figures['unlimited'][1]:,.0f} rows/s); limited to {args.limit:,} rows/s "
            f"{figures['limited'][0]:,.0f} tps (read {figures['limited'][1]:,.0f} rows/s)")
    print(f"\npgbench TPC-B during a snapshot of {args.rows:,} rows, {args.runs} runs, median [min - max]:")
    print(f"  TPS / alone, snapshot unlimited:            {fmt_ratio(spread(ratios['unlimited']))}")
    print(f"  TPS / alone, --snapshot-rate {args.limit:<10,}    {fmt_ratio(spread(ratios['limited']))}")
    print(f"  snapshot read / --snapshot-rate:            {fmt_ratio(spread(ratios['held']))}")
    return 0


if __name__ == "__main__":
    threading.excepthook = lambda a: None  # (a killed feed's reader threads)
    sys.exit(main())
