#!/usr/bin/env python
"""Replica throughput: how fast is the feed, next to what the servers alone can do?

Measures, on one pair of fresh local PostgreSQL servers (source, replica), the same
deterministic workload of --changes changes (70% inserts in 1,000-row transactions, then 20%
updates, then 10% deletes, ~100-byte rows) three ways, --runs times each, interleaved so that
every run's three figures come from the same moment:

  a  pg_recvlogical draining the changes with pgoutput (decode limit: WAL -> client);
  b  a plain COPY of the same changes into an unlogged staging table and one set-based merge per
     50,000 changes into a fresh table on the replica (apply limit); also "b tuned": the same
     into a temporary staging table with the replica sink's session memory settings;
  c  `changefeed run --available-now` end to end (a Spark process), on its own feed, slot and
     replica database per run. Its whole-process wall time includes JVM/Spark start-up, so it is
     also reported "query only" (from the feed's "running" log line to its "stopped cleanly"
     line), "steady state" (changes of the batches after the first / time from the end of the
     first batch's apply to the end of the last, from the replica's progress table) and "from
     batch 2" (the same changes / time from the start of the second batch's apply: without the one-off
     start of the driver's Python sink runners, about 2 s, that follows the first batch).
  cw with --warm: c on a Spark Connect server that the bench starts once, before the runs
     (`run --master sc://...`, the warm start), on feeds of its own; c and cw take turns at going first.

Every replica (b and c) is checked against the source (count + md5 of rows in key order); a
mismatch or a failed feed run makes the script exit 1.

    .venv/bin/python bench/replica_throughput.py                       # 1M changes, 3 runs
    .venv/bin/python bench/replica_throughput.py --changes 100000 --runs 1
"""
from __future__ import annotations

import argparse
import atexit
import itertools
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from changefeed.local.postgres import LocalPostgres, bin_dir  # noqa: E402
from changefeed.sinks.replica.apply import SESSION_MEMORY  # noqa: E402

TABLE = "bench_t"
SOURCE_DB = "bench"
PUBLICATION = "bench_pub"
TXN_ROWS = 1000
APPLY_BATCH = 50_000

_children: list[subprocess.Popen[bytes] | subprocess.Popen[str]] = []


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- workload -----------------------------------------------------------------------------------

@dataclass
class Workload:
    changes: int
    inserts: int
    updates: int
    deletes: int
    copy_file: Path  # seq, op, id, a, b, c in commit order (COPY text format)
    start_lsn: str = ""
    last_commit_lsn: str = ""  # end of the workload's last commit record
    end_lsn: str = ""
    wal_bytes: int = 0
    seconds: float = 0.0


def write_workload(conn: psycopg.Connection, n: int, copy_file: Path, seed: int = 42) -> Workload:
    """Write the workload to the source and the same changes, in commit order, to `copy_file`."""
    assert conn.autocommit, "transaction() blocks must be real transactions, not savepoints"
    n_ins, n_upd = n * 7 // 10, n * 2 // 10
    n_del = n - n_ins - n_upd
    wl = Workload(n, n_ins, n_upd, n_del, copy_file)
    rng = random.Random(seed)
    base = datetime(2025, 1, 1, tzinfo=timezone.utc)

    def values(i: int) -> tuple[int, str, str]:
        a = rng.randrange(-2**31, 2**31)
        b = rng.randbytes(40).hex()  # 80 chars
        c = (base + timedelta(microseconds=rng.randrange(10**14))).isoformat(sep=" ")
        return a, b, c

    seq = 0
    t0 = time.monotonic()
    conn.execute("SET synchronous_commit = on")
    wl.start_lsn = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]
    with open(copy_file, "w") as out:
        # inserts, 1,000 rows per transaction, by COPY
        for start in range(1, n_ins + 1, TXN_ROWS):
            lines = []
            for i in range(start, min(start + TXN_ROWS, n_ins + 1)):
                a, b, c = values(i)
                lines.append(f"{i}\t{a}\t{b}\t{c}\n")
                seq += 1
                out.write(f"{seq}\ti\t{i}\t{a}\t{b}\t{c}\n")
            with conn.transaction(), conn.cursor().copy(f"COPY {TABLE} (id, a, b, c) FROM STDIN") as cp:
                cp.write("".join(lines))
        # updates: 1,000 distinct keys per transaction (a key may be updated again later)
        done = 0
        while done < n_upd:
            k = min(TXN_ROWS, n_upd - done)
            ids = rng.sample(range(1, n_ins + 1), k)
            cols: tuple[list[int], list[int], list[str], list[str]] = ([], [], [], [])
            for i in ids:
                a, b, c = values(i)
                for col, v in zip(cols, (i, a, b, c)):
                    col.append(v)  # type: ignore[arg-type]
                seq += 1
                out.write(f"{seq}\tu\t{i}\t{a}\t{b}\t{c}\n")
            with conn.transaction():
                cur = conn.execute(
                    f"UPDATE {TABLE} t SET a = u.a, b = u.b, c = u.c::timestamptz "
                    "FROM unnest(%s::bigint[], %s::int[], %s::text[], %s::text[]) AS u(id, a, b, c) "
                    "WHERE t.id = u.id", cols)
                assert cur.rowcount == k, (cur.rowcount, k)
            done += k
        # deletes: distinct keys, 1,000 per transaction
        del_ids = rng.sample(range(1, n_ins + 1), n_del)
        for start in range(0, n_del, TXN_ROWS):
            ids = del_ids[start:start + TXN_ROWS]
            for i in ids:
                seq += 1
                out.write(f"{seq}\td\t{i}\t\\N\t\\N\t\\N\n")
            with conn.transaction():
                cur = conn.execute(f"DELETE FROM {TABLE} WHERE id = ANY(%s)", (ids,))
                assert cur.rowcount == len(ids)
    assert seq == n
    # logical decoding (and pg_recvlogical --endpos) only sees flushed WAL: the workload commits
    # synchronously (the servers default to synchronous_commit=off), so all of it is flushed now
    wl.end_lsn = wl.last_commit_lsn = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]
    deadline = time.monotonic() + 30
    while conn.execute("SELECT pg_current_wal_flush_lsn() < %s::pg_lsn", (wl.end_lsn,)).fetchone()[0]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"WAL not flushed up to {wl.end_lsn} after 30s")
        time.sleep(0.05)
    wl.wal_bytes = int(conn.execute("SELECT %s::pg_lsn - %s::pg_lsn", (wl.end_lsn, wl.start_lsn)).fetchone()[0])
    wl.seconds = time.monotonic() - t0
    return wl


def fingerprint(uri: str) -> tuple[int, str]:
    with psycopg.connect(uri) as c:
        row = c.execute(f"SELECT count(*), coalesce(md5(string_agg(x::text, '|' ORDER BY x.id)), '') "
                        f"FROM {TABLE} x").fetchone()
    return int(row[0]), str(row[1])


# -- a: pg_recvlogical ------------------------------------------------------------------------

def run_recvlogical(source: LocalPostgres, slot: str, end_lsn: str, last_commit_lsn: str, out: Path,
                    timeout: float) -> tuple[float, int]:
    cmd = [str(bin_dir() / "pg_recvlogical"),
           "-d", f"host=127.0.0.1 port={source.port} user=postgres dbname={SOURCE_DB}",
           "--slot", slot, "--start", "--no-loop",
           "-o", "proto_version=1", "-o", f"publication_names={PUBLICATION}",
           "--endpos", end_lsn, "-f", str(out), "-v"]
    env = {**os.environ, "PGPASSWORD": source.password}
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    secs = time.monotonic() - t0
    if p.returncode != 0 or "end position" not in p.stderr:
        raise RuntimeError(f"pg_recvlogical exited {p.returncode}: {p.stderr.strip()}")
    size = out.stat().st_size
    out.unlink()
    with psycopg.connect(source.uri(SOURCE_DB), autocommit=True) as c:
        for _ in range(50):  # the walsender may still be handling the last feedback message
            confirmed = c.execute("SELECT confirmed_flush_lsn::text, confirmed_flush_lsn >= %s::pg_lsn "
                                  "FROM pg_replication_slots WHERE slot_name = %s", (last_commit_lsn, slot)).fetchone()
            if confirmed[1]:
                break
            time.sleep(0.1)
    if not confirmed[1]:
        raise RuntimeError(f"pg_recvlogical stopped before the last commit ({last_commit_lsn}): slot {slot} "
                           f"confirmed only up to {confirmed[0]}; pg_recvlogical said: {p.stderr.strip()}")
    return secs, size


# -- b: COPY + set-based merge ----------------------------------------------------------------

MERGE_SQL = f"""
    WITH last AS (
        SELECT DISTINCT ON (id) op, id, a, b, c FROM stage ORDER BY id, seq DESC
    ), deleted AS (
        DELETE FROM {TABLE} t USING last l WHERE l.op = 'd' AND t.id = l.id
    )
    INSERT INTO {TABLE} (id, a, b, c) SELECT id, a, b, c FROM last WHERE op <> 'd'
    ON CONFLICT (id) DO UPDATE SET a = EXCLUDED.a, b = EXCLUDED.b, c = EXCLUDED.c
"""


def run_apply(uri: str, copy_file: Path, tuned: bool = False) -> float:
    """b: COPY + merge per 50k changes. `tuned`: in a temporary staging table, with the replica
    sink's session memory (temp_buffers, work_mem), so the sink's own tuning is not mistaken for
    a lower pipeline overhead."""
    with psycopg.connect(uri, autocommit=True) as c:
        c.execute(f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, a int, b text, c timestamptz)")
    with psycopg.connect(uri) as c, open(copy_file, "rb") as f:
        if tuned:
            c.execute(f"SET temp_buffers = '{SESSION_MEMORY}'")
            c.execute(f"SET work_mem = '{SESSION_MEMORY}'")
            c.commit()
        t0 = time.monotonic()
        while True:
            lines = list(itertools.islice(f, APPLY_BATCH))
            if not lines:
                break
            with c.transaction():
                c.execute(f"CREATE {'TEMPORARY' if tuned else 'UNLOGGED'} TABLE stage (seq bigint, op text, "
                          "id bigint, a int, b text, c timestamptz)")
                with c.cursor().copy("COPY stage FROM STDIN") as cp:
                    cp.write(b"".join(lines))
                c.execute(MERGE_SQL)
                c.execute("DROP TABLE stage")
        return time.monotonic() - t0


# -- c: the feed ------------------------------------------------------------------------------

@dataclass
class FeedRun:
    wall: float
    rc: int
    query_s: float | None  # "running" line -> "stopped cleanly" line
    lines: list[str] = field(default_factory=list)
    stderr_tail: str = ""
    log_file: Path | None = None


def run_stamped(cmd: list[str], out_path: Path,
                timeout: float) -> tuple[int, float, list[tuple[float, float, str]], str]:
    """Run `cmd` in its own process group (SIGKILLed after `timeout`), stamping each stdout line:
    (exit code, wall seconds, [(seconds since start, epoch seconds, line)], stderr tail). The
    stamped stdout goes to `out_path`, stderr next to it (.err)."""
    err_path = out_path.with_suffix(".err")
    stamped: list[tuple[float, float, str]] = []
    with open(err_path, "w") as err:
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=str(ROOT), start_new_session=True)
        _children.append(p)
        timer = threading.Timer(timeout, lambda: os.killpg(p.pid, signal.SIGKILL))
        timer.start()
        try:
            assert p.stdout is not None
            for line in p.stdout:
                stamped.append((time.monotonic() - t0, time.time(), line.rstrip("\n")))
            rc = p.wait()
        finally:
            timer.cancel()
            _children.remove(p)
        wall = time.monotonic() - t0
    out_path.write_text("".join(f"{t:8.2f}s  {ln}\n" for t, _, ln in stamped))
    return rc, wall, stamped, "\n".join(err_path.read_text(errors="replace").splitlines()[-40:])


def run_feed(name: str, source_uri: str, sink_uri: str, state: Path, logdir: Path, tag: str,
             timeout: float, extra: list[str]) -> FeedRun:
    cmd = [sys.executable, "-m", "changefeed", "run", "--name", name, "--source", source_uri,
           "--sink", sink_uri, "--tables", f"public.{TABLE}", "--available-now", "--state", str(state), *extra]
    out_path = logdir / f"{name}-{tag}.out"
    rc, wall, stamped, tail = run_stamped(cmd, out_path, timeout)
    t_run = next((t for t, _, ln in stamped if ": running (" in ln), None)
    t_end = next((t for t, _, ln in stamped if ": stopped cleanly" in ln), None)
    return FeedRun(wall, rc, (t_end - t_run) if t_run is not None and t_end is not None else None,
                   [ln for _, _, ln in stamped], tail, out_path)


def measure_feed(name: str, k: int, n: int, source_uri: str, sink_uri: str, src_fp: tuple[int, str], state: Path,
                 logdir: Path, timeout: float, extra: list[str],
                 failures: list[str]) -> tuple[float, float, float, float]:
    """The measured run of feed `name` over the workload of `n` changes, its replica checked against the source:
    changes/s whole process, steady state, from batch 2 and query only (NaN where not known)."""
    c_rate = c_steady = c_from2 = c_q = float("nan")
    r = run_feed(name, source_uri, sink_uri, state, logdir, "2-measured", timeout, extra)
    if r.rc != 0:
        failures.append(feed_failure(r, f"run {k} feed {name} (measured run)"))
        log(f"  feed {name} FAILED: exit {r.rc} after {r.wall:.1f}s (see report below)")
        return c_rate, c_steady, c_from2, c_q
    fp = fingerprint(sink_uri)
    ok = fp == src_fp
    if not ok:
        failures.append(f"run {k} feed {name}: its {TABLE} differs from the source: {fp} vs {src_fp}")
    c_rate = n / r.wall
    batches = steady_batches(sink_uri, name)
    if len(batches) >= 2:
        later = sum(b[0] for b in batches[1:])
        c_steady = later / (batches[-1][2] - batches[0][2])
        c_from2 = later / (batches[-1][2] - batches[1][1])
    if r.query_s:
        c_q = n / r.query_s
    log(f"  feed {name}: {r.wall:.2f}s whole process, {c_rate:,.0f} changes/s; steady "
        f"{c_steady:,.0f} changes/s, from batch 2's start {c_from2:,.0f} changes/s "
        f"(batches 2..{len(batches)}); query (log) {r.query_s or float('nan'):.2f}s, {c_q:,.0f} changes/s")
    log(f"    feed said: {(r.lines[-1] if r.lines else '').strip()}")
    log(f"    replica {'EQUALS' if ok else 'DIFFERS FROM'} source "
        f"({fp[0]:,} rows, md5 {fp[1][:12]} vs {src_fp[1][:12]})")
    return c_rate, c_steady, c_from2, c_q


def feed_failure(r: FeedRun, what: str) -> str:
    return (f"{what} exited {r.rc} after {r.wall:.1f}s (log {r.log_file})\n"
            f"--- stdout ---\n" + "\n".join(r.lines[-20:]) + f"\n--- stderr (tail) ---\n{r.stderr_tail}")


def steady_batches(uri: str, feed: str) -> list[tuple[int, float, float]]:
    """(changes, began-at, applied-at epoch seconds) of the feed's batches that carried changes, in order.

    The replica records each batch's progress row as its apply ends, with the time its
    transaction began. From the end of the first to the end of the last, the feed ran warm (its
    first batch also pays for starting Python workers); from the start of the second, it also
    skips the one-off start of the driver's Python sink runners that follows the first batch.
    """
    with psycopg.connect(uri) as c:
        rows = c.execute("SELECT changes, extract(epoch FROM began_at), extract(epoch FROM applied_at) "
                         "FROM changefeed.progress WHERE feed = %s AND changes > 0 ORDER BY end_lsn",
                         (feed,)).fetchall()
    return [(int(ch), float(began), float(at)) for ch, began, at in rows]


# -- report -----------------------------------------------------------------------------------

def spread(xs: list[float]) -> tuple[float, float, float] | None:
    xs = [x for x in xs if x == x]  # drop NaN
    return (statistics.median(xs), min(xs), max(xs)) if xs else None


def fmt_rate(s: tuple[float, float, float] | None) -> str:
    return "          n/a" if s is None else f"{s[0]:>13,.0f} {s[1]:>13,.0f} {s[2]:>13,.0f}"


def fmt_ratio(s: tuple[float, float, float] | None) -> str:
    return "n/a" if s is None else f"{s[0]:.3f}  [{s[1]:.3f} - {s[2]:.3f}]"


def machine_facts(source: LocalPostgres) -> list[str]:
    cpu = "?"
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip() or str(os.cpu_count())
    with psycopg.connect(source.uri()) as c:
        pgv = c.execute("SELECT version()").fetchone()[0]
    try:
        import pyspark
        spark_v = pyspark.__version__
    except ImportError:
        spark_v = "?"
    java = subprocess.run(["java", "-version"], capture_output=True, text=True).stderr.splitlines()
    mem = "?"
    try:
        mem = f"{int(Path('/proc/meminfo').read_text().split()[1]) / 1024**2:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "src"], capture_output=True,
                           text=True).stdout.splitlines()
    code = (f"{git.stdout.strip()}{f' + {len(dirty)} uncommitted file(s) under src/' if dirty else ''}"
            if git.returncode == 0 else "?")
    return [f"nproc: {nproc}   cpu: {cpu}   memory: {mem}",
            f"changefeed code: git {code}",
            f"python: {platform.python_version()} ({sys.executable})",
            f"postgres: {pgv}",
            f"pyspark: {spark_v}   java: {java[0] if java else '?'}",
            f"os: {platform.platform()}"]


# -- main -------------------------------------------------------------------------------------

def bench_args(ap: argparse.ArgumentParser, kept: str, feed_arg_example: str) -> None:
    """The options every bench has: where it works, what it keeps, and how feeds run."""
    ap.add_argument("--workdir", help="where servers, state and logs go (default: a temp dir, removed at exit)")
    ap.add_argument("--keep", action="store_true", help=f"keep {kept} (always kept with --workdir)")
    ap.add_argument("--feed-timeout", type=float, default=1200, help="seconds before a feed run is killed")
    ap.add_argument("--feed-arg", action="append", default=[],
                    help=f"extra argument for `changefeed run` (repeatable), e.g. --feed-arg={feed_arg_example}")


def bench_setup(ap: argparse.ArgumentParser, workdir: str | None, keep: bool, prefix: str,
                servers: tuple[str, ...],
                settings: dict[str, str] | None = None) -> tuple[Path, bool, list[LocalPostgres]]:
    """The work directory (--workdir, else a temp dir removed at exit unless --keep) with a logs
    folder, fresh PostgreSQL servers named `servers` in it, and the clean-up at exit (feed
    processes, servers, work directory). Returns (work, removed at exit, servers)."""
    if workdir:
        work = Path(workdir).absolute()
        if work.exists() and any(work.iterdir()):
            ap.error(f"--workdir {work} is not empty")
        work.mkdir(parents=True, exist_ok=True)
        remove_work = False
    else:
        work = Path(tempfile.mkdtemp(prefix=prefix))
        remove_work = not keep
    (work / "logs").mkdir()
    started: list[LocalPostgres] = []

    def cleanup() -> None:
        for p in list(_children):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for s in started:
            s.stop("immediate")
        started.clear()
        if remove_work:
            shutil.rmtree(work, ignore_errors=True)

    atexit.register(cleanup)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log(f"work directory {work}{' (removed at exit)' if remove_work else ''}")
    for name in servers:
        started.append(LocalPostgres.start(work / name, settings=settings))
    log(", ".join(f"{n} on port {s.port}" for n, s in zip(servers, started)))
    return work, remove_work, list(started)


def bench_paths(work: Path, source: LocalPostgres, source_db: str) -> tuple[Path, Path, list[str], str]:
    """Logs and state folders, machine facts, and the URI of a fresh source database `source_db`."""
    with psycopg.connect(source.uri(), autocommit=True) as c:
        c.execute(f"CREATE DATABASE {source_db}")
    return work / "logs", work / "state", machine_facts(source), source.uri(source_db)


def verdict(total_s: float, logdir: Path, removed: bool, failures: list[str], ok: str) -> int:
    """Print the bench's time, where its logs are, and its failures or `ok`; the exit code."""
    print(f"\ntotal benchmark time {total_s / 60:.1f} min; feed logs in {logdir}"
          f"{' (removed at exit; use --keep)' if removed else ''}")
    if failures:
        print("\nFAILED:")
        for f in failures:
            print(f"- {f}")
        return 1
    print(f"verdict: {ok}")
    return 0


def warm_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--warm", action="store_true",
                    help="also measure each feed run on a Spark Connect server that the bench starts first "
                         "(`run --master sc://...`, the warm start), beside its run on a Spark of its own")


def warm_server(out: Path) -> str:
    """Start a Spark Connect server on a free loopback port, stopped with the bench's other
    children at exit, and return its `--master` URI."""
    from changefeed.spark.connect import start_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log(f"starting a Spark Connect server on 127.0.0.1:{port} (its log: {out}) ...")
    t0 = time.monotonic()
    _children.append(start_server("127.0.0.1", port, "local[*]", out=open(out, "ab")))
    log(f"  up in {time.monotonic() - t0:.1f}s")
    return f"sc://127.0.0.1:{port}"


def workload_args(doc: str, feed_arg_example: str,
                  warm: bool = False) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The command line of a bench that runs this workload: --changes, --runs and bench_args
    (and --warm where the bench measures the warm start)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--changes", type=int, default=1_000_000, help="changes in the workload (default 1,000,000)")
    ap.add_argument("--runs", type=int, default=3, help="measured runs of each system (default 3)")
    bench_args(ap, "the work directory", feed_arg_example)
    if warm:
        warm_args(ap)
    args = ap.parse_args()
    if args.changes < 10 or args.runs < 1:
        ap.error("need --changes >= 10 and --runs >= 1")
    return ap, args


def main() -> int:
    ap, args = workload_args(__doc__, "--max-bytes-per-batch=256MB", warm=True)

    t_start = time.monotonic()
    work, remove_work, (source, replica) = bench_setup(ap, args.workdir, args.keep, "replica-bench-",
                                                       ("source", "replica"))
    logdir, state, facts, src_uri = bench_paths(work, source, SOURCE_DB)
    with psycopg.connect(src_uri, autocommit=True) as c:
        c.execute(f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, a int, b text, c timestamptz)")
        c.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {TABLE}")
    # c: system -> (feed name and replica database prefix, extra `run` arguments)
    feeds = {"c": ("bench", args.feed_arg)}
    if args.warm:
        feeds["cw"] = ("warm", [*args.feed_arg, f"--master={warm_server(work / 'spark-server.log')}"])
    with psycopg.connect(replica.uri(), autocommit=True) as c:
        for k in range(1, args.runs + 1):
            for name, _ in feeds.values():
                c.execute(f"CREATE DATABASE {name}_{k}")
            c.execute(f"CREATE DATABASE apply_{k}")
            c.execute(f"CREATE DATABASE tuned_{k}")

    failures: list[str] = []
    # c, step 1: a first (empty) run of each feed creates its publication, slot and target table
    set_up: set[str] = set()
    for k in range(1, args.runs + 1):
        for name, extra in feeds.values():
            log(f"feed {name}{k}: first --available-now run (creates slot changefeed_{name}{k}) ...")
            r = run_feed(f"{name}{k}", src_uri, replica.uri(f"{name}_{k}"), state, logdir, "1-setup",
                         args.feed_timeout, extra)
            log(f"  exit {r.rc} in {r.wall:.1f}s")
            if r.rc != 0:
                failures.append(feed_failure(r, f"feed {name}{k} first run"))
            else:
                set_up.add(f"{name}{k}")
    # a: one pgoutput slot per run, all created before the workload
    with psycopg.connect(src_uri, autocommit=True) as c:
        for k in range(1, args.runs + 1):
            c.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (f"bench_recv_{k}",))

    log(f"writing the workload: {args.changes:,} changes ...")
    with psycopg.connect(src_uri, autocommit=True) as c:  # autocommit: each transaction() is a real one
        wl = write_workload(c, args.changes, work / "changes.copy")
    src_fp = fingerprint(src_uri)
    log(f"  {wl.inserts:,} inserts, {wl.updates:,} updates, {wl.deletes:,} deletes in {wl.seconds:.1f}s; "
        f"WAL {wl.start_lsn} -> {wl.end_lsn} ({wl.wal_bytes / 2**20:,.0f} MiB); "
        f"COPY file {wl.copy_file.stat().st_size / 2**20:,.0f} MiB; source has {src_fp[0]:,} rows")

    n = args.changes
    res: dict[str, list[float]] = {k + t: [] for k in ("c", "cw") for t in ("", "_steady", "_from2", "_query")}
    res.update(a=[], b=[], b_tuned=[])
    per_run: list[str] = []
    for k in range(1, args.runs + 1):
        log(f"run {k}/{args.runs}")
        # a
        try:
            secs, size = run_recvlogical(source, f"bench_recv_{k}", wl.end_lsn, wl.last_commit_lsn, work / "recv.out",
                                         args.feed_timeout)
            res["a"].append(n / secs)
            log(f"  a pg_recvlogical: {secs:.2f}s, {n / secs:,.0f} changes/s ({size / 2**20:,.0f} MiB received)")
        except Exception as e:  # noqa: BLE001
            res["a"].append(float("nan"))
            failures.append(f"run {k} a pg_recvlogical: {e}")
            log(f"  a FAILED: {e}")
        # b
        secs = run_apply(replica.uri(f"apply_{k}"), wl.copy_file)
        res["b"].append(n / secs)
        fp = fingerprint(replica.uri(f"apply_{k}"))
        ok = fp == src_fp
        log(f"  b COPY + merge:   {secs:.2f}s, {n / secs:,.0f} changes/s; replica {'EQUALS' if ok else 'DIFFERS FROM'} "
            f"source ({fp[0]:,} rows, md5 {fp[1][:12]} vs {src_fp[1][:12]})")
        if not ok:
            failures.append(f"run {k} b: apply_{k}.{TABLE} differs from the source: {fp} vs {src_fp}")
        secs = run_apply(replica.uri(f"tuned_{k}"), wl.copy_file, tuned=True)
        res["b_tuned"].append(n / secs)
        fp = fingerprint(replica.uri(f"tuned_{k}"))
        log(f"  b tuned:          {secs:.2f}s, {n / secs:,.0f} changes/s; "
            f"replica {'EQUALS' if fp == src_fp else 'DIFFERS FROM'} source")
        if fp != src_fp:
            failures.append(f"run {k} b tuned: tuned_{k}.{TABLE} differs from the source: {fp} vs {src_fp}")
        # c, and c on the warm server (which of the two goes first alternates)
        for system in sorted(feeds, reverse=k % 2 == 0):
            name, extra = feeds[system]
            measured = (measure_feed(f"{name}{k}", k, n, src_uri, replica.uri(f"{name}_{k}"), src_fp, state,
                                               logdir, args.feed_timeout, extra, failures)
                        if f"{name}{k}" in set_up else (float("nan"),) * 4)
            for key, value in zip(("", "_steady", "_from2", "_query"), measured):
                res[system + key].append(value)
        per_run.append(f"  run {k}: a {res['a'][-1]:>11,.0f}  b {res['b'][-1]:>11,.0f}"
                       f"  b tuned {res['b_tuned'][-1]:>11,.0f}" + "".join(
                           f"  {system} {res[system][-1]:>11,.0f}"
                           f"  {system} steady {res[system + '_steady'][-1]:>11,.0f}"
                           f"  {system} from 2 {res[system + '_from2'][-1]:>11,.0f}"
                           f"  {system} query {res[system + '_query'][-1]:>11,.0f}" for system in feeds))

    def ratios(num: str, den: str) -> tuple[float, float, float] | None:
        return spread([x / y for x, y in zip(res[num], res[den])])

    total = time.monotonic() - t_start
    print()
    print("=" * 100)
    print(f"replica throughput: {n:,} changes ({wl.inserts:,} inserts in {TXN_ROWS:,}-row transactions, "
          f"{wl.updates:,} updates, {wl.deletes:,} deletes), ~100-byte rows, {args.runs} run(s)")
    print(f"WAL of the workload: {wl.wal_bytes / 2**20:,.0f} MiB; source table after: {src_fp[0]:,} rows")
    for f in facts:
        print(f)
    print()
    print(f"{'changes/s':<52}{'median':>13} {'min':>13} {'max':>13}")
    print(f"{'a  pg_recvlogical, pgoutput (decode limit)':<52}{fmt_rate(spread(res['a']))}")
    print(f"{'b  COPY + set-based merge, 50k/batch (apply limit)':<52}{fmt_rate(spread(res['b']))}")
    print(f"{'b  same, temp staging + sink session memory':<52}{fmt_rate(spread(res['b_tuned']))}")
    titles = {"c": "c  feed", "cw": "cw feed on a warm Spark Connect server"}
    for system in feeds:
        print(f"{titles[system] + ', whole process' + (' (incl. Spark start-up)' if system == 'c' else ''):<52}"
              f"{fmt_rate(spread(res[system]))}")
        print(f"{titles[system][:2] + '  ... query only (running -> stopped log lines)':<52}"
              f"{fmt_rate(spread(res[system + '_query']))}")
        print(f"{titles[system][:2] + '  ... steady state (batches after the first)':<52}"
              f"{fmt_rate(spread(res[system + '_steady']))}")
        print(f"{titles[system][:2] + '  ... from the start of the second batch':<52}"
              f"{fmt_rate(spread(res[system + '_from2']))}")
    print()
    print("ratios, computed per run, median [min - max]:")
    for system in feeds:
        print(f"  {system}/a{'':<{21 - len(system)}}{fmt_ratio(ratios(system, 'a'))}")
        print(f"  {system}/b{'':<{21 - len(system)}}{fmt_ratio(ratios(system, 'b'))}")
        print(f"  {system}(query only)/b{'':<{9 - len(system)}}{fmt_ratio(ratios(system + '_query', 'b'))}")
        print(f"  {system}(steady)/a{'':<{13 - len(system)}}{fmt_ratio(ratios(system + '_steady', 'a'))}")
        print(f"  {system}(steady)/b{'':<{13 - len(system)}}{fmt_ratio(ratios(system + '_steady', 'b'))}")
        print(f"  {system}(steady)/b tuned{'':<{7 - len(system)}}{fmt_ratio(ratios(system + '_steady', 'b_tuned'))}")
        print(f"  {system}(from batch 2)/b{'':<{7 - len(system)}}{fmt_ratio(ratios(system + '_from2', 'b'))}")
    if "cw" in feeds:
        print(f"  cw/c (whole process)   {fmt_ratio(ratios('cw', 'c'))}")
    print()
    print("per run (changes/s):")
    print("\n".join(per_run))
    return verdict(total, logdir, remove_work, failures, "every replica equals the source")


if __name__ == "__main__":
    sys.exit(main())
