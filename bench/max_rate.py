#!/usr/bin/env python
"""How closely --max-rate holds: a writer far faster than the limit, the changes delivered per second.

On one pair of fresh local servers (source, sink), a writer inserts rows in transactions of
--txn-rows as fast as it can, for the whole of each measurement. Each of --runs runs measures
a feed into a fresh replica database, in this order:

  unlimited  no --max-rate: what the feed delivers behind this writer (the limit must be below it);
  limited    --max-rate --limit.

A measurement lasts --seconds once the feed's first batch has landed; the delivered rate is
taken from the replica's ledger (changefeed.progress): the changes of the batches that landed
after the first in the window, over the time from the first to the last. Printed: the limited
rate as a ratio to the limit, and the unlimited rate as a ratio to the limit (how far the limit
binds), median [min - max] over the runs.

    .venv/bin/python bench/max_rate.py                  # limit 2000 changes/s, 3 runs
    .venv/bin/python bench/max_rate.py --limit 5000 --runs 1
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

from replica_throughput import ROOT, bench_paths, bench_setup, fmt_ratio, log, spread  # noqa: E402

TABLE = "rate_t"


def _write(uri: str, rows: int, stop: threading.Event) -> None:
    with psycopg.connect(uri, autocommit=True) as c:
        n = c.execute(f"SELECT coalesce(max(id), 0) FROM {TABLE}").fetchone()[0]  # type: ignore[index]
        while not stop.is_set():
            c.execute(f"INSERT INTO {TABLE} SELECT g, g %% 1000 FROM generate_series(%s::bigint, %s::bigint) g",
                      (n + 1, n + rows))
            n += rows


def delivered(name: str, source: str, sink: str, work: Path, seconds: int, rows: int, extra: list[str]) -> float:
    """Changes per second the feed applied to the replica over `seconds`, with the writer going."""
    stop = threading.Event()
    writer = threading.Thread(target=_write, args=(source, rows, stop))
    writer.start()
    out = (work / "logs" / f"{name}.out").open("w")
    feed = subprocess.Popen([sys.executable, "-m", "changefeed", "run", "--name", name, "--state", str(work / "state"),
                             "--source", source, "--sink", sink, "--tables", f"public.{TABLE}", "--snapshot", "never",
                             *extra], stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        with psycopg.connect(sink, autocommit=True) as c:
            while not c.execute("SELECT 1 FROM pg_tables WHERE schemaname = 'changefeed' AND tablename = 'progress'"
                                ).fetchone() or not c.execute("SELECT 1 FROM changefeed.progress WHERE feed = %s",
                                                              (name,)).fetchone():
                assert feed.poll() is None and time.monotonic() < deadline, \
                    (work / "logs" / f"{name}.out").read_text()[-2000:]
                time.sleep(0.5)
        time.sleep(2)  # (past the first batches: the backlog of the feed's start)
        began = time.time()
        time.sleep(seconds)
        ended = time.time()
    finally:
        feed.kill()
        feed.wait()
        out.close()
        stop.set()
        writer.join()
    with psycopg.connect(sink) as c:
        landed = c.execute("SELECT extract(epoch FROM applied_at), changes FROM changefeed.progress WHERE feed = %s "
                           "AND applied_at BETWEEN to_timestamp(%s) AND to_timestamp(%s) ORDER BY applied_at",
                           (name, began, ended)).fetchall()
    subprocess.run([sys.executable, "-m", "changefeed", "remove", "--name", name, "--state", str(work / "state")],
                   cwd=str(ROOT), capture_output=True, check=False)
    if len(landed) < 2:
        return float("nan")
    return sum(int(n) for _, n in landed[1:]) / (float(landed[-1][0]) - float(landed[0][0]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=2_000, help="--max-rate of the limited mode (changes/s)")
    ap.add_argument("--seconds", type=int, default=20, help="each measurement's window")
    ap.add_argument("--txn-rows", type=int, default=200, help="rows per writer transaction")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    work, _, (src_pg, sink_pg) = bench_setup(ap, args.workdir, args.keep, "maxrate-", ("source", "sink"))
    _, _, facts, source = bench_paths(work, src_pg, "rate")
    with psycopg.connect(source, autocommit=True) as c:
        c.execute(f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, v int)")
    log("; ".join(facts))
    held: list[float] = []
    binds: list[float] = []
    for run in range(1, args.runs + 1):
        rates = {}
        for mode, extra in (("unlimited", []), ("limited", ["--max-rate", str(args.limit)])):
            with psycopg.connect(sink_pg.uri(), autocommit=True) as c:
                c.execute(f"CREATE DATABASE {mode}_{run}")
            rates[mode] = delivered(f"{mode}_{run}", source, sink_pg.uri(f"{mode}_{run}"), work, args.seconds,
                                    args.txn_rows, extra)
        held.append(rates["limited"] / args.limit)
        binds.append(rates["unlimited"] / args.limit)
        log(f"run {run}: unlimited {rates['unlimited']:,.0f} changes/s; --max-rate {args.limit:,}: "
            f"{rates['limited']:,.0f} changes/s")
    print(f"\nchanges delivered per second behind a writer of {args.txn_rows}-row transactions, {args.runs} runs, "
          "median [min - max]:")
    print(f"  --max-rate {args.limit:,}: delivered / limit     {fmt_ratio(spread(held))}")
    print(f"  unlimited: delivered / limit          {fmt_ratio(spread(binds))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
