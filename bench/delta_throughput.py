#!/usr/bin/env python
"""Delta sink throughput: the feed into Delta tables, next to the Delta library writing alone.

One fresh source server; --changes changes to one table (id bigint key, an int, ~60 bytes of
text, a numeric, a timestamptz): 70% inserts, then 30% updates of random rows, in 1,000-row
transactions. Per run, four feeds read the same changes (each its own slot, created before the
workload, no snapshot): changelog and mirror mode, each with 1 and 2 writer tasks. A feed's rate
is "from batch 2": the changes of its batches after the first / time from the first batch's
commit to the last one's (from the feed's ledger in the lake; the first batch pays for the
Python workers' start). In the same run, the limit each is set against: the Delta library
(delta-rs, its own multi-threaded writer) writing the same rows as ONE Arrow table:

  changelog limit: `write_deltalake(..., mode="append")` of the change log the feed wrote;
  mirror limit:    the inserts' rows appended, then ONE merge of the updated keys' final rows.

Each feed's table is checked against the source (row count and sums); a mismatch exits 1.

    .venv/bin/python bench/delta_throughput.py                          # 300k changes, 3 runs
    .venv/bin/python bench/delta_throughput.py --changes 50000 --runs 1
"""
from __future__ import annotations

import argparse
import random
import shutil
import time
from pathlib import Path

import psycopg
import pyarrow as pa

from changefeed.sinks.delta.ledger import DeltaLedger
from changefeed.sinks.delta.options import DeltaOptions
from replica_throughput import ROOT, bench_args, bench_paths, bench_setup, fmt_ratio, log, run_stamped, spread, verdict

CONFIGS = (("changelog", 1), ("changelog", 2), ("mirror", 1), ("mirror", 2))
TXN_ROWS = 1000


def workload(uri: str, n: int, run: int) -> tuple[int, int]:
    inserts = int(n * 0.7)
    rng = random.Random(run)
    with psycopg.connect(uri, autocommit=True) as c:
        for lo in range(0, inserts, TXN_ROWS):
            c.execute("INSERT INTO bench_d SELECT g, g %% 1000, repeat(md5(g::text), 2), g / 7.0, now() "
                      "FROM generate_series(%s::bigint, %s::bigint) g", (lo + 1, min(lo + TXN_ROWS, inserts)))
        for lo in range(inserts, n, TXN_ROWS):
            ids = [rng.randint(1, inserts) for _ in range(min(TXN_ROWS, n - lo))]
            c.execute("UPDATE bench_d SET k = k + 1, v = md5(v), ts = now() WHERE id = ANY(%s)", (ids,))
    return inserts, n - inserts


def feed_rate(lake: Path, feed: str) -> tuple[float, int]:
    """(changes/s from the second batch on, batches) from the feed's ledger in the lake: the changes
    of the batches after the first / time from the first's commit to the last's (whole cycles:
    reading, splitting, writing, committing)."""
    entries = [e for e in DeltaLedger(DeltaOptions.parse(f"delta://{lake}"), feed)._entries() if e.progress.changes]
    if len(entries) < 2:
        return float("nan"), len(entries)
    return sum(e.progress.changes for e in entries[1:]) / (entries[-1].done - entries[0].done), len(entries)


def check(uri: str, lake: Path, mode: str) -> str | None:
    from deltalake import DeltaTable

    t = pa.table(DeltaTable(str(lake / "public.bench_d")).to_pyarrow_table())
    with psycopg.connect(uri) as c:
        rows, ksum = c.execute("SELECT count(*), sum(k) FROM bench_d").fetchone()  # type: ignore[misc]
    if mode == "mirror":
        got = (len(t), sum(t.column("k").to_pylist()))
        return None if got == (rows, ksum) else f"{lake}: mirror has {got}, source {(rows, ksum)}"
    return None if len(t) >= rows else f"{lake}: change log has {len(t)} rows, fewer than the source's {rows}"


def limit_changelog(lake: Path, out: Path) -> float:
    """Seconds for delta-rs to append the feed's whole change log as one Arrow table."""
    from deltalake import DeltaTable, write_deltalake

    data = pa.table(DeltaTable(str(lake / "public.bench_d")).to_pyarrow_table())
    began = time.perf_counter()
    write_deltalake(str(out), data, mode="append")
    return time.perf_counter() - began


def limit_mirror(lake: Path, out: Path, updated: int) -> float:
    """Seconds for delta-rs to append the inserted rows, then merge the updated keys' final rows once."""
    from deltalake import DeltaTable, write_deltalake

    final = pa.table(DeltaTable(str(lake / "public.bench_d")).to_pyarrow_table()).drop_columns(["_bucket"])
    changed = final.filter(pa.compute.greater(final.column("k"), pa.compute.modulo(final.column("id"), 1000)))
    began = time.perf_counter()
    write_deltalake(str(out), final, mode="append")
    (DeltaTable(str(out)).merge(changed, "t.id = s.id", source_alias="s", target_alias="t")
     .when_matched_update_all().when_not_matched_insert_all().execute())
    return time.perf_counter() - began


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--changes", type=int, default=300_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batch-changes", type=int, default=50_000, help="the feeds' --max-changes-per-batch")
    bench_args(ap, "the servers, lakes and logs", "--max-bytes-per-batch=0")
    args = ap.parse_args()
    began = time.monotonic()
    work, removed, (server,) = bench_setup(ap, args.workdir, args.keep, "changefeed-delta-bench-", ("source",))
    logdir, state, facts, _ = bench_paths(work, server, "bench_setup_db")
    print("\n".join(facts))
    failures: list[str] = []
    res: dict[str, list[float]] = {}
    cli = [str(ROOT / ".venv" / "bin" / "python"), "-m", "changefeed"]
    for run in range(args.runs):
        db = f"bench{run}"
        with psycopg.connect(server.uri(), autocommit=True) as c:
            c.execute(f"CREATE DATABASE {db}")
        uri = server.uri(db)
        with psycopg.connect(uri, autocommit=True) as c:
            c.execute("CREATE TABLE bench_d (id bigint PRIMARY KEY, k int, v text, n numeric(12,2), ts timestamptz)")
        feeds = []
        for mode, tasks in CONFIGS:
            name, lake = f"d{run}_{mode}_{tasks}", work / f"lake{run}_{mode}_{tasks}"
            feeds.append((mode, tasks, name, lake))
            done = run_stamped([*cli, "create", "--name", name, "--state", str(state), "--source", uri, "--sink",
                                f"delta://{lake}?mode={mode}&tasks={tasks}&buckets=8", "--tables", "public.bench_d",
                                "--snapshot", "never"], logdir / f"{name}.create.log", 120)
            if done[0]:
                failures.append(f"create {name} failed: {done[3][-500:]}")
        inserts, updates = workload(uri, args.changes, run)
        log(f"run {run + 1}: {inserts} inserts, {updates} updates written")
        for mode, tasks, name, lake in feeds:
            rc, wall, _, tail = run_stamped([*cli, "run", "--name", name, "--state", str(state), "--available-now",
                                             "--max-changes-per-batch", str(args.batch_changes), "--master", "local[2]",
                                             *args.feed_arg], logdir / f"{name}.log", args.feed_timeout)
            if rc:
                failures.append(f"feed {name} failed (exit {rc}): {tail[-500:]}")
                continue
            if (bad := check(uri, lake, mode)) is not None:
                failures.append(bad)
            rate, batches = feed_rate(lake, name)
            limit_s = (limit_changelog(lake, work / f"limit{run}_{mode}_{tasks}") if mode == "changelog"
                       else limit_mirror(lake, work / f"limit{run}_{mode}_{tasks}", updates))
            res.setdefault(f"{mode}{tasks}", []).append(rate)
            res.setdefault(f"{mode}{tasks}_limit", []).append(args.changes / limit_s)
            log(f"  {mode:9} tasks={tasks}: {rate:,.0f} changes/s from batch 2 ({batches} batches), "
                f"limit {args.changes / limit_s:,.0f}/s, whole process {wall:.1f} s")
            shutil.rmtree(work / f"limit{run}_{mode}_{tasks}", ignore_errors=True)
    print(f"\n{args.changes:,} changes, {args.runs} runs; ratios median [min-max]")
    for mode in ("changelog", "mirror"):
        for tasks in (1, 2):
            key = f"{mode}{tasks}"
            if key in res:
                ratio = spread([a / b for a, b in zip(res[key], res[f"{key}_limit"])])
                print(f"  {mode:9} {tasks} task(s): feed {statistics_line(res[key])}  / delta-rs alone "
                      f"{statistics_line(res[key + '_limit'])}  = x{fmt_ratio(ratio).strip()}")
        if f"{mode}1" in res and f"{mode}2" in res:
            ratio = spread([b / a for a, b in zip(res[mode + '1'], res[mode + '2'])])
            print(f"  {mode:9} 2 tasks / 1 task: x{fmt_ratio(ratio).strip()}")
    return verdict(time.monotonic() - began, logdir, removed, failures, "every Delta table matched the source")


def statistics_line(xs: list[float]) -> str:
    s = spread(xs)
    return f"{s[0]:,.0f}/s [{s[1]:,.0f}-{s[2]:,.0f}]" if s else "-"


if __name__ == "__main__":
    raise SystemExit(main())
