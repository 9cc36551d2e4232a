#!/usr/bin/env python
"""Snapshot throughput: how fast does the feed copy a table's existing rows, next to a plain COPY?

Measures, on one pair of fresh local PostgreSQL servers (source, sink), the initial snapshot of
one table of --rows rows (~100-byte rows, written once, then VACUUM ANALYZE), --runs times each,
interleaved so that every run's figures come from the same moment:

  b      a plain `COPY (SELECT * FROM snap_t ORDER BY id) TO STDOUT` on the source, streamed
         into `COPY snap_copy_K FROM STDIN` (a fresh table with the same columns and key, in a
         fresh sink database): what the two servers alone can do for a bulk copy;
  c-par  `changefeed run --snapshot only --snapshot-reads parallel` (a Spark process) on a fresh
         feed, sink database and state folder: a batch's chunks are read as parallel Spark tasks
         and shuffled to the one writer task (`repartition(1)`);
  c-seq  the same with `--snapshot-reads sequential`: the writer task reads the batch's chunks
         itself, one after the other, as one input partition (no shuffle).
  c-sc   with --warm: c-seq on a Spark Connect server that the bench starts once, before the
         runs (`run --master sc://...`): the feed's run without the JVM's start.

A feed run is timed four ways: its whole-process wall time (JVM and Spark start-up included);
"snapshot only", from the start of the first batch that carried chunks (its progress row's
`began_at`, the writer's transaction start) to the last chunk applied (`snapshot_chunks.applied_at`);
"from query start", from the feed's `running` log line to the last chunk applied; and "warm", the
rows of the batches after the first over the time from the first batch's commit to the last one's.
"snapshot only" flatters the parallel mode: its writer task, and so `began_at`, starts only once
the batch's chunks are read (after the shuffle); "from query start" and "warm" time both modes
alike (see bench/README.md).

After each feed run the replica table is compared with the source (count + md5 of rows in key
order), every chunk must have been applied once (count = distinct chunk numbers, rows add up
to --rows) and the chunks' Spark read tasks must show the mode (parallel: one task per chunk,
sequential: one per batch). A mismatch or a failed feed run makes the script exit 1. Each run's
feed is removed afterwards (`changefeed remove`: slot, publication, bookkeeping, state).

    .venv/bin/python bench/snapshot_throughput.py                      # 1M rows, 3 runs
    .venv/bin/python bench/snapshot_throughput.py --rows 100000 --runs 1
"""
from __future__ import annotations

import argparse
import math
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from changefeed.spec.definition import DEFAULT_CHUNK_ROWS  # noqa: E402
from replica_throughput import (  # noqa: E402
    ROOT,
    bench_args,
    bench_paths,
    bench_setup,
    feed_failure,
    fmt_rate,
    fmt_ratio,
    log,
    run_stamped,
    spread,
    verdict,
    warm_args,
    warm_server,
)

TABLE = "snap_t"
SOURCE_DB = "snap"
COLUMNS = "id bigint PRIMARY KEY, a int, b text, c timestamptz"
COPY_ROWS = 100_000  # rows per COPY statement while writing the table

MODES = ("par", "seq")
MODE_TEXT = {"par": "--snapshot-reads parallel (repartition(1))", "seq": "--snapshot-reads sequential",
             "sc": "--snapshot-reads sequential, on a warm Spark Connect server (--warm)"}
# how a feed run is timed: (key, label); rows/s = rows / seconds
WAYS = (("whole", "whole process (incl. JVM/Spark start-up)"),
        ("snap", "snapshot only (1st chunk batch began -> last applied)"),
        ("query", "from query start (running line -> last applied)"),
        ("warm", "warm (batches after the 1st: its applied -> last)"))



# -- workload -----------------------------------------------------------------------------------

def write_table(conn: psycopg.Connection, n: int, seed: int = 42) -> float:
    """Create snap_t and fill it with `n` deterministic rows (ids 1..n), in one transaction."""
    rng = random.Random(seed)
    base = datetime(2025, 1, 1, tzinfo=timezone.utc)
    t0 = time.monotonic()
    with conn.transaction():
        conn.execute(f"CREATE TABLE {TABLE} ({COLUMNS})")
        for start in range(1, n + 1, COPY_ROWS):
            lines = []
            for i in range(start, min(start + COPY_ROWS, n + 1)):
                a = rng.randrange(-2**31, 2**31)
                b = rng.randbytes(40).hex()  # 80 chars
                c = (base + timedelta(microseconds=rng.randrange(10**14))).isoformat(sep=" ")
                lines.append(f"{i}\t{a}\t{b}\t{c}\n")
            with conn.cursor().copy(f"COPY {TABLE} (id, a, b, c) FROM STDIN") as cp:
                cp.write("".join(lines))
    # VACUUM too, not only ANALYZE: it sets the hint bits, so the first reader measured (b of
    # run 1) does not pay for writing them
    conn.execute(f"VACUUM (ANALYZE) {TABLE}")
    return time.monotonic() - t0


def fingerprint(uri: str, table: str) -> tuple[int, str]:
    with psycopg.connect(uri) as c:
        row = c.execute(f"SELECT count(*), coalesce(md5(string_agg(x::text, '|' ORDER BY x.id)), '') "
                        f"FROM {table} x").fetchone()
    return int(row[0]), str(row[1])


# -- b: COPY -> COPY --------------------------------------------------------------------------

def run_copy(src_uri: str, dst_uri: str, table: str) -> float:
    """Stream the source table, in key order, into a fresh table on the sink; seconds taken."""
    with psycopg.connect(dst_uri, autocommit=True) as d:
        d.execute(f"CREATE TABLE {table} ({COLUMNS})")
    with psycopg.connect(src_uri) as s, psycopg.connect(dst_uri) as d:
        t0 = time.monotonic()
        with s.cursor().copy(f"COPY (SELECT * FROM {TABLE} ORDER BY id) TO STDOUT") as out, \
                d.cursor().copy(f"COPY {table} FROM STDIN") as inp:
            for data in out:  # chunks of bytes as the server sends them
                inp.write(data)
        d.commit()
        return time.monotonic() - t0


# -- c: the feed ------------------------------------------------------------------------------

@dataclass
class FeedRun:
    wall: float
    rc: int
    running_at: float | None  # epoch seconds of the feed's "running (" line
    marks: dict[str, float] = field(default_factory=dict)  # seconds after start of its running/complete/stopped lines
    lines: list[str] = field(default_factory=list)
    restarts: list[str] = field(default_factory=list)  # the runner's "restarting the query ..." lines
    stderr_tail: str = ""
    log_file: Path | None = None


def run_feed(mode: str, name: str, src_uri: str, sink_uri: str, state: Path, logdir: Path, chunk_rows: int,
             timeout: float, extra: list[str]) -> FeedRun:
    reads = "parallel" if mode == "par" else "sequential"
    cmd = [sys.executable, "-m", "changefeed", "run", "--snapshot-reads", reads, "--name", name,
           "--source", src_uri, "--sink", sink_uri, "--tables", f"public.{TABLE}",
           "--snapshot", "only", "--snapshot-chunk-rows", str(chunk_rows), "--state", str(state), *extra]
    rc, wall, stamped, tail = run_stamped(cmd, logdir / f"{name}.out", timeout)
    running_at = next((at for _, at, ln in stamped if ": running (" in ln), None)
    marks = {what: next(t for t, _, ln in stamped if text in ln)
             for what, text in (("running", ": running ("), ("snapshot complete", ": snapshot complete"),
                                ("stopped", ": stopped cleanly")) if any(text in ln for _, _, ln in stamped)}
    restarts = [f"{t:.2f}s {ln.strip()}" for t, _, ln in stamped if "restarting the query" in ln]
    return FeedRun(wall, rc, running_at, marks, [ln for _, _, ln in stamped], restarts, tail, logdir / f"{name}.out")


@dataclass
class Batch:
    """A batch that carried snapshot chunks, as the sink recorded it."""

    batch_id: int
    chunks: int
    empty: int  # chunks with no rows
    tasks: int  # distinct Spark read tasks of its chunks
    rows: int
    began: float  # epoch seconds: its progress row's began_at (the writer's transaction start)
    applied: float  # epoch seconds: its chunks' applied_at (at its commit)


@dataclass
class Chunks:
    """What the sink recorded for a feed's snapshot."""

    count: int
    distinct: int
    rows: int
    with_task: int  # chunks with a read_task
    batches: list[Batch]  # in end_lsn order


def chunk_record(uri: str, feed: str) -> Chunks:
    with psycopg.connect(uri) as c:
        count, distinct, rows, with_task = c.execute(
            "SELECT count(*), count(DISTINCT chunk_no), coalesce(sum(rows), 0), count(read_task) "
            "FROM changefeed.snapshot_chunks WHERE feed = %s", (feed,)).fetchone()
        batches = c.execute(
            "SELECT s.batch_id, count(*), count(*) FILTER (WHERE s.rows = 0), count(DISTINCT s.read_task), "
            "sum(s.rows), extract(epoch FROM min(p.began_at)), extract(epoch FROM max(s.applied_at)) "
            "FROM changefeed.snapshot_chunks s "
            "JOIN changefeed.progress p ON p.feed = s.feed AND p.batch_id = s.batch_id "
            "WHERE s.feed = %s GROUP BY s.batch_id ORDER BY min(p.end_lsn)", (feed,)).fetchall()
    return Chunks(int(count), int(distinct), int(rows), int(with_task),
                  [Batch(int(b), int(n), int(e), int(t), int(r), float("nan") if x is None else float(x), float(y))
                   for b, n, e, t, r, x, y in batches])


def mode_shown(mode: str, ck: Chunks) -> str | None:
    """None if the chunks' read tasks show the mode, else what is wrong."""
    if ck.with_task < ck.count:
        return f"{ck.count - ck.with_task} of {ck.count} chunks have no read_task"
    shape = [(b.batch_id, b.chunks, b.tasks) for b in ck.batches]
    if mode == "par":
        if any(b.tasks != b.chunks for b in ck.batches) or not any(b.chunks > 1 for b in ck.batches):
            return (f"parallel mode, but (batch, chunks, read tasks) {shape}: expected one task per chunk, "
                    "and a batch with more than one chunk")
    elif any(b.tasks != 1 for b in ck.batches):
        return f"sequential mode, but (batch, chunks, read tasks) {shape}: expected one task per batch"
    return None


def fmt_one(x: float) -> str:
    return f"{'n/a':>7}" if math.isnan(x) else f"{x:>7,.0f}"


def remove_feed(name: str, state: Path) -> str | None:
    """`changefeed remove`: drops the feed's slot, publication, sink bookkeeping and state."""
    p = subprocess.run([sys.executable, "-m", "changefeed", "remove", "--name", name, "--state", str(state)],
                       capture_output=True, text=True, cwd=str(ROOT), timeout=120, check=False)
    return None if p.returncode == 0 else f"changefeed remove --name {name} exited {p.returncode}: {p.stderr.strip()}"


def warm_up_feed(source: Any, sink: Any, state: Path, logdir: Path, master: str, timeout: float) -> None:
    """One small snapshot feed on the Spark Connect server, not timed, so that every c-sc run is
    a feed on a server that ran one before (a warm start: its pool of Python workers is up), as
    replica_throughput's first empty runs do for its cw feeds."""
    for server in (source, sink):
        with psycopg.connect(server.uri(), autocommit=True) as c:
            c.execute("CREATE DATABASE warm_up")
    with psycopg.connect(source.uri("warm_up"), autocommit=True) as c:
        c.execute("CREATE TABLE warm_up_t (id int PRIMARY KEY, v text)")
        c.execute("INSERT INTO warm_up_t SELECT g, md5(g::text) FROM generate_series(1, 10000) g")
    cmd = [sys.executable, "-m", "changefeed", "run", "--name", "warmup", "--source", source.uri("warm_up"),
           "--sink", sink.uri("warm_up"), "--tables", "public.warm_up_t", "--snapshot", "only",
           "--state", str(state), f"--master={master}"]
    rc, wall, _, tail = run_stamped(cmd, logdir / "warmup.out", timeout)
    gone = remove_feed("warmup", state)
    if rc != 0 or gone:
        raise SystemExit(f"the warm-up feed on {master} failed (exit {rc}): {gone or tail}")
    log(f"  warm-up feed on the server (not timed): {wall:.2f}s")
    for server in (source, sink):
        with psycopg.connect(server.uri(), autocommit=True) as c:
            c.execute("DROP DATABASE warm_up WITH (FORCE)")


# -- main -------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows in the table (default 1,000,000)")
    ap.add_argument("--runs", type=int, default=3, help="measured runs of each system (default 3)")
    ap.add_argument("--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS,
                    help=f"--snapshot-chunk-rows of the feed (default {DEFAULT_CHUNK_ROWS:,})")
    bench_args(ap, "the work directory and the sink databases", "--master=local[2]")
    warm_args(ap)
    ap.add_argument("--modes", default=",".join(MODES),
                    help="the feed modes to run, of par, seq and sc (sc implies --warm; default: par,seq)")
    args = ap.parse_args()
    if args.rows < 1 or args.runs < 1 or args.chunk_rows < 1:
        ap.error("need --rows >= 1, --runs >= 1 and --chunk-rows >= 1")
    modes = tuple(m for m in args.modes.split(",") if m)
    if not modes or any(m not in MODE_TEXT for m in modes):
        ap.error(f"--modes takes a comma-separated list of {', '.join(MODE_TEXT)}")
    if args.warm and "sc" not in modes:
        modes = (*modes, "sc")
    args.warm = args.warm or "sc" in modes

    t_start = time.monotonic()
    work, remove_work, (source, sink) = bench_setup(ap, args.workdir, args.keep, "snapshot-bench-",
                                                    ("source", "sink"))
    logdir, state, facts, src_uri = bench_paths(work, source, SOURCE_DB)
    log(f"writing {TABLE}: {args.rows:,} rows ...")
    with psycopg.connect(src_uri, autocommit=True) as c:
        secs = write_table(c, args.rows)
        heap, total_size = c.execute(
            f"SELECT pg_relation_size('{TABLE}'), pg_total_relation_size('{TABLE}')").fetchone()
    src_fp = fingerprint(src_uri, TABLE)
    n_chunks = args.rows // args.chunk_rows + 1  # the last chunk runs to the table's end (it may be empty)
    log(f"  {src_fp[0]:,} rows in {secs:.1f}s; table {heap / 2**20:,.0f} MiB ({total_size / 2**20:,.0f} MiB with "
        f"its key); {n_chunks} chunk(s) of up to {args.chunk_rows:,} rows")
    if src_fp[0] != args.rows:
        print(f"FAILED: the source has {src_fp[0]:,} rows, not {args.rows:,}")
        return 1

    def drop_db(name: str) -> None:
        if not remove_work:
            return  # kept for a look (--workdir, --keep)
        with psycopg.connect(sink.uri(), autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    extra = {m: args.feed_arg for m in MODES}
    if args.warm:
        master = warm_server(work / "spark-server.log")
        extra["sc"] = [*args.feed_arg, f"--master={master}"]
        warm_up_feed(source, sink, state, logdir, master, args.feed_timeout)
    n = args.rows
    res: dict[str, list[float]] = {"b": [], **{f"{m}_{w}": [] for m in modes for w, _ in WAYS}}
    shapes: dict[str, list[str]] = {m: [] for m in modes}  # per run: chunks and read tasks per batch
    failures: list[str] = []
    per_run: list[str] = []
    # One COPY first, not timed: a fresh sink server's first bulk write makes its WAL segments
    # (later ones recycle them), which cost the first run's b a quarter of its rate.
    with psycopg.connect(sink.uri(), autocommit=True) as c:
        c.execute("CREATE DATABASE warm_up")
    log(f"  warm-up COPY -> COPY (not timed): {run_copy(src_uri, sink.uri('warm_up'), 'snap_copy_0'):.2f}s")
    with psycopg.connect(sink.uri(), autocommit=True) as c:
        c.execute("DROP DATABASE warm_up WITH (FORCE)")
    for k in range(1, args.runs + 1):
        log(f"run {k}/{args.runs}")
        with psycopg.connect(sink.uri(), autocommit=True) as c:
            for db in (f"copy_{k}", *(f"{m}_{k}" for m in modes)):
                c.execute(f"CREATE DATABASE {db}")
        # b
        table = f"snap_copy_{k}"
        secs = run_copy(src_uri, sink.uri(f"copy_{k}"), table)
        res["b"].append(n / secs)
        fp = fingerprint(sink.uri(f"copy_{k}"), table)
        ok = fp == src_fp
        log(f"  b     COPY -> COPY: {secs:.2f}s, {n / secs:,.0f} rows/s; copy {'EQUALS' if ok else 'DIFFERS FROM'} "
            f"source ({fp[0]:,} rows, md5 {fp[1][:12]} vs {src_fp[1][:12]})")
        if not ok:
            failures.append(f"run {k} b: copy_{k}.{table} differs from the source: {fp} vs {src_fp}")
        drop_db(f"copy_{k}")
        # c-par and c-seq, taking turns at going first, so that neither always runs right after b
        for mode in (modes if k % 2 else modes[::-1]):
            name, db = f"{mode}{k}", f"{mode}_{k}"
            rates = dict.fromkeys((w for w, _ in WAYS), float("nan"))
            r = run_feed(mode, name, src_uri, sink.uri(db), state, logdir, args.chunk_rows, args.feed_timeout,
                         extra[mode])
            if r.rc != 0:
                failures.append(feed_failure(r, f"run {k} c-{mode} feed {name}"))
                log(f"  c-{mode} FAILED: exit {r.rc} after {r.wall:.1f}s (see report below)")
                shapes[mode].append("failed")
            else:
                fp = fingerprint(sink.uri(db), TABLE)
                ok = fp == src_fp
                if not ok:
                    failures.append(f"run {k} c-{mode}: {db}.{TABLE} differs from the source: {fp} vs {src_fp}")
                ck = chunk_record(sink.uri(db), name)
                once = ck.count == ck.distinct and ck.rows == n
                if not once:
                    failures.append(f"run {k} c-{mode}: {ck.count} chunk records for {ck.distinct} chunks, "
                                    f"{ck.rows:,} rows for {n:,}")
                wrong = mode_shown(mode, ck)
                if wrong:
                    failures.append(f"run {k} c-{mode}: {wrong}" + "".join(
                        f"; the feed said at {x}" for x in r.restarts)
                        + ("; so its chunks were read again without the shuffle: the comparison is void "
                           "(see bench/README.md)" if r.restarts else ""))
                secs_of: dict[str, tuple[float, int]] = {"whole": (r.wall, n)}  # seconds, rows
                if ck.batches:
                    first, last = ck.batches[0], max(b.applied for b in ck.batches)
                    secs_of["snap"] = (last - first.began, n)
                    if r.running_at is not None:
                        secs_of["query"] = (last - r.running_at, n)
                    warm_rows = sum(b.rows for b in ck.batches[1:])
                    if warm_rows:
                        secs_of["warm"] = (last - first.applied, warm_rows)
                for w, (secs, rows) in secs_of.items():
                    if not math.isnan(secs):  # began_at may be missing
                        rates[w] = rows / max(secs, 1e-6)
                shape = (f"{len(ck.batches)} batch(es), chunks per batch {[b.chunks for b in ck.batches]} "
                         f"({sum(b.empty for b in ck.batches)} empty), read tasks per batch "
                         f"{[b.tasks for b in ck.batches]}")
                shapes[mode].append(shape)
                log(f"  c-{mode} feed: " + "; ".join(
                    f"{w} {secs:.2f}s{f' for {rows:,} rows' if rows != n else ''} ({rates[w]:,.0f} rows/s)"
                    for w, (secs, rows) in secs_of.items()))
                log(f"    every chunk applied once: {once}; {shape}")
                log("    process: " + ", ".join(f"{w} line {t:.2f}s" for w, t in r.marks.items())
                    + f", exit {r.wall:.2f}s")
                if r.running_at is not None:
                    log("    batches with chunks, seconds after the running line: " + ", ".join(
                        f"{b.batch_id} began {b.began - r.running_at:.2f} applied {b.applied - r.running_at:.2f}"
                        for b in ck.batches))
                for x in r.restarts:
                    log(f"    the runner restarted its query: {x}")
                log(f"    replica {'EQUALS' if ok else 'DIFFERS FROM'} source "
                    f"({fp[0]:,} rows, md5 {fp[1][:12]} vs {src_fp[1][:12]})")
            if (state / name / "feed.json").exists():  # also after a failed run: no slot left behind
                gone = remove_feed(name, state)
                if gone:
                    failures.append(f"run {k} c-{mode}: {gone}")
            drop_db(db)
            for w, _ in WAYS:
                res[f"{mode}_{w}"].append(rates[w])
        per_run.append(f"  run {k}: b {res['b'][-1]:>9,.0f}" + "".join(
            f"  c-{m} " + " /".join(fmt_one(res[f"{m}_{w}"][-1]) for w, _ in WAYS) for m in modes))

    def ratios(num: str, den: str) -> tuple[float, float, float] | None:
        return spread([x / y for x, y in zip(res[num], res[den])])

    with psycopg.connect(source.uri(SOURCE_DB)) as c:
        slots = c.execute("SELECT count(*) FROM pg_replication_slots").fetchone()[0]
    if slots:
        failures.append(f"{slots} replication slot(s) left on the source after removing the feeds")

    total = time.monotonic() - t_start
    print()
    print("=" * 100)
    print(f"snapshot throughput: {n:,} rows of ~100 bytes (table {heap / 2**20:,.0f} MiB, "
          f"{total_size / 2**20:,.0f} MiB with its key), {n_chunks} chunk(s) of up to {args.chunk_rows:,} rows, "
          f"{args.runs} run(s)")
    for f in facts:
        print(f)
    print()
    print(f"{'rows/s':<64}{'median':>13} {'min':>13} {'max':>13}")
    print(f"{'b      COPY TO STDOUT -> COPY FROM STDIN (baseline)':<64}{fmt_rate(spread(res['b']))}")
    for m in modes:
        print(f"c-{m}{' ' * (5 - len(m))}feed, {MODE_TEXT[m]}:")
        for w, text in WAYS:
            print(f"{'         ' + text:<64}{fmt_rate(spread(res[f'{m}_{w}']))}")
    print()
    print("ratios, computed per run, median [min - max]:")
    pairs = [(m, "b") for m in modes] + [(x, y) for x, y in (("par", "seq"), ("sc", "seq")) if {x, y} <= set(modes)]
    for w, text in WAYS:
        print(f"  {text}:")
        for x, y in pairs:
            label = f"c-{x}/{y if y == 'b' else 'c-' + y}"
            print(f"    {label:<15}{fmt_ratio(ratios(f'{x}_{w}', y if y == 'b' else f'{y}_{w}'))}")
    print()
    print("chunk reads per run (Spark read tasks, from snapshot_chunks.read_task):")
    for m in modes:
        for k, s in enumerate(shapes[m], 1):
            print(f"  c-{m} run {k}: {s}")
    print()
    print(f"per run (rows/s; c: {' / '.join(w for w, _ in WAYS)}):")
    print("\n".join(per_run))
    return verdict(total, logdir, remove_work, failures, "every copy and replica equals the source, every chunk "
                   "was applied once, the read tasks show the modes")


if __name__ == "__main__":
    sys.exit(main())
