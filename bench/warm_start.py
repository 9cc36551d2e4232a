#!/usr/bin/env python
"""Warm start: what a feed's run costs on Spark of its own, and on a Spark Connect server that
stays up (`changefeed spark-server`, `run --master sc://...`).

One pair of fresh local PostgreSQL servers; --runs rounds, each with two feeds of its own (own,
warm) over a table of --rows rows: a first `run --available-now` (snapshot), then --changes
updates, then a second one (the stream). The two kinds alternate within a round, so each
round's figures come from the same moment. Per run: wall time of the runner process and the CPU
time the machine spent meanwhile (all processes: runner, JVM, Python workers, the servers), from
/proc/stat. The server's own start is measured once, apart. Every replica is checked against
the source; a mismatch or a failed run makes the script exit 1.

    .venv/bin/python bench/warm_start.py                 # 5 rounds
    .venv/bin/python bench/warm_start.py --runs 3 --rows 100000
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from changefeed.local.postgres import LocalPostgres  # noqa: E402 - after the path above
from changefeed.spark.connect import start_server, stop_server  # noqa: E402 - after the path above


def busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (user, nice, system, irq, steal)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def measured(cmd: list[str], log: Path) -> tuple[float, float]:
    """(wall s, machine CPU s) of one command, which must succeed."""
    c0, t0 = busy_s(), time.monotonic()
    with open(log, "ab") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    wall, cpu = time.monotonic() - t0, busy_s() - c0
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed (exit {rc}); its log: {log}")
    return wall, cpu


def same(a: str, b: str) -> bool:
    q = "SELECT count(*), md5(string_agg(t::text, '|' ORDER BY id)) FROM t"
    with psycopg.connect(a) as x, psycopg.connect(b) as y:
        return x.execute(q).fetchone() == y.execute(q).fetchone()


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.2f} [{min(xs):.2f} - {max(xs):.2f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="rounds (default 5)")
    ap.add_argument("--rows", type=int, default=10_000, help="rows of the table (default 10,000)")
    ap.add_argument("--changes", type=int, default=1_000, help="updates between the two runs (default 1,000)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="warm-bench-"))
    source, sink = LocalPostgres.start(work / "source"), LocalPostgres.start(work / "sink")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c0, t0 = busy_s(), time.monotonic()
    server = start_server("127.0.0.1", port, "local[*]", out=open(work / "server.log", "ab"))
    server_start = (time.monotonic() - t0, busy_s() - c0)
    try:
        with psycopg.connect(source.uri(), autocommit=True) as c:
            c.execute("CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL, pad text)")
            c.execute("INSERT INTO t SELECT g, 0, repeat('x', 80) FROM generate_series(1, %s) g", (args.rows,))
        figures: dict[str, list[tuple[float, float]]] = {}
        for k in range(1, args.runs + 1):
            for kind in (("own", "warm") if k % 2 else ("warm", "own")):
                name = f"{kind}{k}"
                with psycopg.connect(sink.uri(), autocommit=True) as c:
                    c.execute(f"CREATE DATABASE {name}")
                master = f"sc://127.0.0.1:{port}" if kind == "warm" else "local[*]"
                cmd = [sys.executable, "-m", "changefeed", "run", "--name", name, "--state", str(work / "state"),
                       "--source", source.uri(), "--sink", sink.uri(name), "--tables", "public.t",
                       "--available-now", "--master", master]
                figures.setdefault(f"{kind} snapshot", []).append(measured(cmd, work / f"{name}.log"))
                with psycopg.connect(source.uri(), autocommit=True) as c:
                    c.execute("UPDATE t SET v = v + 1 WHERE id <= %s", (args.changes,))
                figures.setdefault(f"{kind} stream", []).append(measured(cmd, work / f"{name}.log"))
                if not same(source.uri(), sink.uri(name)):
                    raise SystemExit(f"feed {name}: the replica differs from the source")
                with psycopg.connect(source.uri(), autocommit=True) as c:  # each feed its own slot: drop it
                    c.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                              "WHERE slot_name = %s", (f"changefeed_{name}",))
                print(f"round {k} {kind}: " + ", ".join(f"{p} {figures[f'{kind} {p}'][-1][0]:.2f} s wall "
                                                         f"{figures[f'{kind} {p}'][-1][1]:.2f} CPU-s"
                                                         for p in ("snapshot", "stream")), flush=True)
    finally:
        stop_server(server)
        source.stop("immediate")
        sink.stop("immediate")
    print(f"\n{args.runs} rounds, {args.rows:,} rows, {args.changes:,} changes; {os.cpu_count()} cores")
    print(f"Spark Connect server start (once): {server_start[0]:.1f} s wall, {server_start[1]:.1f} CPU-s")
    print(f"{'':24}{'wall s, median [min - max]':>30}{'machine CPU-s, median [min - max]':>36}")
    for key, runs in figures.items():
        print(f"{key:<24}{spread([w for w, _ in runs]):>30}{spread([c for _, c in runs]):>36}")
    print("warm / own, per round:")
    for part in ("snapshot", "stream"):
        own, warm = figures[f"own {part}"], figures[f"warm {part}"]
        print(f"  {part:<10} wall {spread([w[0] / o[0] for w, o in zip(warm, own)])}"
              f"   CPU {spread([w[1] / o[1] for w, o in zip(warm, own)])}")
    print(f"(logs and servers under {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
