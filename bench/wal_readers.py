"""The two WAL readers side by side: a big window, and many small ones (see bench/README.md).

Per run, on the same slot position and the same WAL, one after the other:
  big window   N changes read into change rows (reader + postgres/decode/builder.py's builder, as a task
               does), by `peek` and by `stream`; `pg_recvlogical` of the same window (from a slot
               of its own: it confirms what it receives) as reference; the server CPU of the
               backend or walsender that decoded it.
  small windows  --small windows of ~2,000 changes each: time per window, by each reader.
Prints medians and spreads, and the per-run ratios stream / peek.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from changefeed.core.change import HEARTBEAT_PREFIX  # noqa: E402
from changefeed.core.lsn import format_lsn  # noqa: E402
from changefeed.local.postgres import bin_dir  # noqa: E402
from changefeed.postgres import slots  # noqa: E402
from changefeed.postgres import source as src  # noqa: E402
from changefeed.postgres.connect import connect  # noqa: E402
from changefeed.postgres.decode.builder import ChangeBuilder  # noqa: E402
from changefeed.postgres.wal_reader import wal_reader  # noqa: E402
from changefeed.spec.definition import SourceNode  # noqa: E402
from replica_throughput import bench_setup, fmt_ratio, log, spread  # noqa: E402

READERS = ("peek", "stream")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_window(uri: str, node: SourceNode, reader: str, start: int, end: int) -> tuple[float, float, int]:
    """(seconds, server CPU seconds of the process that decoded, change rows) for one window. The
    walsender's CPU is sampled while it lives (it exits when the stream ends)."""
    conn = connect(uri, "source", autocommit=False)
    stop, sampled = threading.Event(), [0, 0.0]  # walsender pid, its CPU seconds

    def sample() -> None:
        with psycopg.connect(uri, autocommit=True) as look:
            while not stop.wait(0.02):
                pid = look.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                                   (node.slot,)).fetchone()[0]  # type: ignore[index]
                if pid and pid != conn.info.backend_pid:
                    try:
                        sampled[:] = [pid, cpu_s(pid)]
                    except OSError:
                        pass

    try:
        backend = conn.info.backend_pid
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        cpu0, began = cpu_s(backend), time.perf_counter()
        builder = ChangeBuilder(start, end, 0, 1 << 62, lambda rel: src.column_catalog(conn, rel))
        rows = sum(rb.num_rows for rb in builder.batches(wal_reader(reader).window(conn, node, "source", start, end)))
        took = time.perf_counter() - began
        stop.set()
        sampler.join()
        server = sampled[1] if reader == "stream" else cpu_s(backend) - cpu0
        conn.rollback()
        return took, server, rows
    finally:
        conn.close()


def small_windows(uri: str, run: int, windows: int) -> dict[str, list[float]]:
    """Seconds per window of 2,000 fresh changes, each read by both readers from a slot of its own
    that then moves past it (as a feed's slot does after each batch)."""
    times: dict[str, list[float]] = {r: [] for r in READERS}
    node = SourceNode("n1", uri, f"small{run}", "p")
    with psycopg.connect(uri, autocommit=True) as c:
        at = slots.create_slot(c, node.slot)
        for i in range(windows):
            first = 100_000_000 + (run * windows + i) * 2000
            c.execute("INSERT INTO t SELECT g, g, repeat('y', 80) FROM generate_series(%s::bigint, %s::bigint) g",
                      (first, first + 1999))
            end, _ = src.heartbeat(c, HEARTBEAT_PREFIX)
            for reader in READERS if i % 2 == 0 else READERS[::-1]:
                times[reader].append(read_window(uri, node, reader, at, end)[0])
            slots.advance(c, node.slot, end)
            at = end
        c.execute("SELECT pg_drop_replication_slot(%s)", (node.slot,))
    return times


def recvlogical(uri: str, slot: str, start: int, end: int) -> float:
    began = time.perf_counter()
    subprocess.run([str(bin_dir() / "pg_recvlogical"), "-d", uri, "-S", slot, "--start", "-I", format_lsn(start),
                    "-E", format_lsn(end), "-f", "/dev/null", "-o", "proto_version=1", "-o", "publication_names=p",
                    "--no-loop"], check=True, capture_output=True)
    return time.perf_counter() - began


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--changes", type=int, default=1_000_000, help="changes in the big window")
    ap.add_argument("--small", type=int, default=30, help="small windows of ~2,000 changes")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    began = time.monotonic()
    _, _, (server,) = bench_setup(ap, args.workdir, args.keep, "wal-readers-", ("source",),
                                  {"fsync": "off", "synchronous_commit": "off"})
    uri = server.uri()
    with psycopg.connect(uri, autocommit=True) as c:
        c.execute("CREATE TABLE t (id bigint PRIMARY KEY, a int, b text)")
        c.execute("CREATE PUBLICATION p FOR TABLE t")
        start = slots.create_slot(c, "w")
        for run in range(args.runs):  # pg_recvlogical confirms what it received: a slot per run
            slots.create_slot(c, f"recv{run}")
        log(f"writing {args.changes:,} changes (inserts of 80-char rows, 1,000 per transaction) ...")
        for k in range(0, args.changes, 1000):
            c.execute("INSERT INTO t SELECT g, g, repeat('x', 80) FROM generate_series(%s::bigint, %s::bigint) g",
                      (k, k + 999))
        big_end, _ = src.heartbeat(c, HEARTBEAT_PREFIX)
    node = SourceNode("n1", uri, "w", "p")
    big: dict[str, list[float]] = {r: [] for r in (*READERS, "pg_recvlogical")}
    cpu: dict[str, list[float]] = {r: [] for r in READERS}
    per_small: dict[str, list[float]] = {r: [] for r in READERS}
    ratios: dict[str, list[float]] = {"big": [], "small": []}
    for run in range(args.runs):
        log(f"run {run + 1}/{args.runs}")
        for reader in READERS if run % 2 == 0 else READERS[::-1]:
            took, server_cpu, rows = read_window(uri, node, reader, start, big_end)
            big[reader].append(took)
            cpu[reader].append(server_cpu)
            log(f"  {reader:6} big window: {took:.2f}s ({rows:,} rows), server CPU {server_cpu:.2f}s")
        for reader, times in small_windows(uri, run, args.small).items():
            per_small[reader].append(statistics.median(times))
            log(f"  {reader:6} small windows: median {statistics.median(times) * 1000:.1f} ms, "
                f"max {max(times) * 1000:.1f} ms")
        big["pg_recvlogical"].append(recvlogical(uri, f"recv{run}", start, big_end))
        log(f"  pg_recvlogical big window: {big['pg_recvlogical'][-1]:.2f}s")
        ratios["big"].append(big["stream"][-1] / big["peek"][-1])
        ratios["small"].append(per_small["stream"][-1] / per_small["peek"][-1])
    print(f"\n{'=' * 90}\nWAL readers: a window of {args.changes:,} changes, {args.small} windows of 2,000, "
          f"{args.runs} run(s); seconds, median [min - max]")
    for name, xs in big.items():
        s = spread(xs)
        assert s is not None
        extra = f"; server CPU {fmt_ratio(spread(cpu[name]))}" if name in cpu else ""
        print(f"  big window   {name:15} {s[0]:.2f} [{s[1]:.2f} - {s[2]:.2f}]  "
              f"{args.changes / s[0]:,.0f} changes/s{extra}")
    for name, xs in per_small.items():
        s = spread(xs)
        assert s is not None
        print(f"  small window {name:15} {s[0] * 1000:.1f} ms [{s[1] * 1000:.1f} - {s[2] * 1000:.1f}]")
    print(f"ratios stream / peek (time; > 1 = the stream is slower): big {fmt_ratio(spread(ratios['big']))}, "
          f"small {fmt_ratio(spread(ratios['small']))}")
    print(f"total benchmark time {(time.monotonic() - began) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
