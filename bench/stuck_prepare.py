#!/usr/bin/env python
"""What a prepared transaction left undecided, and one left in doubt, cost a running feed of two nodes.

Starts two source servers (`max_prepared_transactions` on) and a replica. A feed of the two nodes
runs (`changefeed run`, a subprocess) while a writer commits --rate changes/s, half on each node,
in 20-row transactions. Each run has three phases of --seconds each:

  baseline   nothing prepared;
  prepared   one transaction PREPAREd on node b (it updates a captured row) and left undecided;
  in doubt   that transaction committed on node a, still prepared on node b (the feed must wait).

Then the transaction is committed on b and the feed catches up (timed; the replica is checked
against the nodes). Per phase it reports the batches per second (rows of the replica's
`changefeed.progress`), the CPU seconds per second the source servers spent (all their processes,
from /proc: the writer's transactions, the feed's decoding and scans) and, for the first and last
fifth of the phase, the same CPU rate: with a prepared transaction, every decoding session starts
at the transaction's first record, so the servers' decoding grows with the WAL written since.
Reported as medians [min - max] over the runs, and as ratios to the same run's baseline.

    .venv/bin/python bench/stuck_prepare.py                   # 3 runs of 3 x 60 s
    .venv/bin/python bench/stuck_prepare.py --seconds 20 --runs 1
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

from replica_throughput import _children, bench_setup, log, spread, verdict  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ACCOUNTS = 1000
BASE = 1_000_000  # node k's ids are k * BASE + 1 ..
TXN_ROWS = 20


def server_cpu_s(datadir: Path) -> float:
    """CPU seconds (user + system) of the PostgreSQL server of `datadir` so far: its running
    processes, and through the postmaster's children's times the backends that have ended (each
    batch's readers connect and leave)."""
    tick = os.sysconf("SC_CLK_TCK")
    master = (datadir / "postmaster.pid").read_text().split()[0]
    total = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if pid == master:
                total += sum(int(f) for f in fields[11:15]) / tick  # its own and its ended children's
            elif fields[1] == master:
                total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return total


class Writer(threading.Thread):
    """Commits `rate` changes/s, alternating between the nodes, in TXN_ROWS-row updates."""

    def __init__(self, uris: dict[str, str], rate: int) -> None:
        super().__init__(daemon=True)
        self.uris, self.rate, self.stop = uris, rate, threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        conns = [psycopg.connect(uri, autocommit=True) for uri in self.uris.values()]
        txns, i, began = max(1, self.rate // TXN_ROWS), 0, time.monotonic()
        try:
            while not self.stop.is_set():
                due = began + i / txns
                if due > time.monotonic():
                    time.sleep(due - time.monotonic())
                node = i % len(conns)
                lo = node * BASE + (i * TXN_ROWS) % (ACCOUNTS - TXN_ROWS) + 2
                conns[node].execute("UPDATE accounts SET balance = balance + 1 WHERE id BETWEEN %s AND %s",
                                    (lo, lo + TXN_ROWS - 1))
                i += 1
        except psycopg.Error as e:
            self.errors.append(str(e))
        finally:
            for c in conns:
                c.close()


def batches(replica: str, feed: str) -> int:
    with psycopg.connect(replica) as c:
        return int(c.execute("SELECT count(*) FROM changefeed.progress WHERE feed = %s", (feed,)).fetchone()[0])


def phase(seconds: float, datadirs: list[Path], replica: str, feed: str) -> dict[str, float]:
    """Batches/s and the servers' CPU s/s over the phase, and in its first and last fifth."""
    marks = []
    step = seconds / 5
    for k in range(6):
        if k:
            time.sleep(step)
        marks.append((time.monotonic(), sum(server_cpu_s(d) for d in datadirs), batches(replica, feed)))

    def rate(a: int, b: int, what: int) -> float:
        return (marks[b][what] - marks[a][what]) / (marks[b][0] - marks[a][0])

    return {"batches_per_s": rate(0, 5, 2), "cpu": rate(0, 5, 1), "cpu_first": rate(0, 1, 1),
            "cpu_last": rate(4, 5, 1)}


def balances(uri: str) -> list[tuple[int, int]]:
    with psycopg.connect(uri) as c:
        return sorted(c.execute("SELECT id, balance FROM accounts").fetchall())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60, help="length of each phase (default 60)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rate", type=int, default=2000, help="changes/s the writer commits (default 2000)")
    ap.add_argument("--workdir")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    t0 = time.monotonic()
    work, removed, (a, b, replica) = bench_setup(ap, args.workdir, args.keep, "cf-stuck-", ("a", "b", "replica"),
                                                 {"max_prepared_transactions": "8"})
    uris = {}
    for k, (name, server) in enumerate((("a", a), ("b", b))):
        with psycopg.connect(server.uri(), autocommit=True) as c:
            c.execute("CREATE DATABASE bench")
        uris[name] = server.uri("bench")
        with psycopg.connect(uris[name], autocommit=True) as c:
            c.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
            c.execute("INSERT INTO accounts SELECT %s + g, 0 FROM generate_series(1, %s) g", (k * BASE, ACCOUNTS))
    sink = replica.uri()
    logs, failures = work / "logs", []
    cmd = [sys.executable, "-m", "changefeed", "run", "--name", "stuck", "--state", str(work / "state"),
           "--source", f"a={uris['a']}", "--source", f"b={uris['b']}", "--sink", sink, "--tables", "public.accounts",
           "--master", "local[2]"]
    feed = subprocess.Popen(cmd, stdout=open(logs / "feed.log", "w"), stderr=subprocess.STDOUT, cwd=str(ROOT),
                            start_new_session=True)
    _children.append(feed)
    datadirs = [a.datadir, b.datadir]
    results: dict[str, list[dict[str, float]]] = {"baseline": [], "prepared": [], "in doubt": []}
    catchup: list[float] = []
    while batches_or_none(sink) is None:
        time.sleep(0.5)
    for run in range(args.runs):
        writer = Writer(uris, args.rate)
        writer.start()
        time.sleep(3)
        results["baseline"].append(phase(args.seconds, datadirs, sink, "stuck"))
        gid = f"stuck{run}"
        with psycopg.connect(uris["a"], autocommit=True) as ca, psycopg.connect(uris["b"], autocommit=True) as cb:
            for k, c in enumerate((ca, cb)):
                c.execute("BEGIN")
                c.execute("UPDATE accounts SET balance = balance + 1000 WHERE id = %s", (k * BASE + 1,))
                c.execute(f"PREPARE TRANSACTION '{gid}'")
            results["prepared"].append(phase(args.seconds, datadirs, sink, "stuck"))
            ca.execute(f"COMMIT PREPARED '{gid}'")
            time.sleep(2)  # the batch under way when it was decided
            results["in doubt"].append(phase(args.seconds, datadirs, sink, "stuck"))
            writer.stop.set()
            writer.join()
            began = time.monotonic()
            cb.execute(f"COMMIT PREPARED '{gid}'")
        want = sorted(balances(uris["a"]) + balances(uris["b"]))
        while balances(sink) != want:
            if time.monotonic() - began > 300:
                failures.append(f"run {run}: the replica did not catch up within 300 s")
                break
            time.sleep(0.2)
        catchup.append(time.monotonic() - began)
        failures += writer.errors
        for name in results:
            r = results[name][-1]
            log(f"run {run} {name:>9}: {r['batches_per_s']:6.2f} batches/s, servers {r['cpu']:.3f} CPU s/s "
                f"(first fifth {r['cpu_first']:.3f}, last fifth {r['cpu_last']:.3f})")
        log(f"run {run}: caught up {catchup[-1]:.1f}s after the decision")
    feed.terminate()
    feed.wait(timeout=120)
    print(f"\n{args.runs} run(s), phases of {args.seconds:.0f} s, writer {args.rate:,} changes/s; median [min - max]")
    base = results["baseline"]
    for name, rs in results.items():
        line = [f"{name:>9}:"]
        for key, label in (("batches_per_s", "batches/s"), ("cpu", "CPU s/s"), ("cpu_last", "last fifth CPU s/s")):
            s = spread([r[key] for r in rs])
            ratio = spread([r[key] / b_[key] if b_[key] else float("nan") for r, b_ in zip(rs, base)])
            versus = f" (x{ratio[0]:.2f} [{ratio[1]:.2f} - {ratio[2]:.2f}] of baseline)" if ratio else ""
            line.append(f"{label} {s[0]:.3f} [{s[1]:.3f} - {s[2]:.3f}]" + (versus if name != "baseline" else ""))
        growth = spread([r["cpu_last"] / r["cpu_first"] for r in rs if r["cpu_first"]])
        if growth:
            line.append(f"last/first fifth CPU x{growth[0]:.2f} [{growth[1]:.2f} - {growth[2]:.2f}]")
        print("  ".join(line))
    print(f"caught up after the decision: {statistics.median(catchup):.1f} s [{min(catchup):.1f} - {max(catchup):.1f}]")
    return verdict(time.monotonic() - t0, logs, removed, failures, "the replica equals the nodes after every run")


def batches_or_none(replica: str) -> int | None:
    try:
        return batches(replica, "stuck")
    except psycopg.Error:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
