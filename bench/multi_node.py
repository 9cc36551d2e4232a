#!/usr/bin/env python
"""One feed over 1, 2 and 3 source nodes: the same total workload spread over more servers.

Starts three fresh source servers and a replica server. For each run and each node count k
(interleaved, so that every run's figures come from the same moment), it makes a table
`mn_t (id bigint primary key, a int, b text /*80 chars*/, c timestamptz)` in a fresh database
on each of the first k servers, creates a feed of those k named nodes (so every k takes the same
path: one Spark task per node, the merge, one replica transaction per batch), writes
--changes / k changes on each node at once (80% inserts, then 20% updates, in 1,000-row
transactions, node-disjoint keys), then times `changefeed run --available-now`. The replica is
checked against the union of the nodes (count + md5 in key order); a mismatch fails the bench.

Reported per k: changes/s of the whole process, of the query alone (its "running" line to its
"stopped cleanly" line) and from batch 2 (as in replica_throughput.py), median [min - max] over
the runs, and each run's ratio to the one-node feed of the same run.

    .venv/bin/python bench/multi_node.py                          # 600,000 changes, 3 runs
    .venv/bin/python bench/multi_node.py --changes 60000 --runs 1  # quick try
    .venv/bin/python bench/multi_node.py --two-phase               # with the scan for distributed transactions
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replica_throughput import (  # noqa: E402
    bench_args,
    bench_setup,
    fmt_ratio,
    log,
    machine_facts,
    run_stamped,
    spread,
    steady_batches,
    verdict,
)

TABLE = "mn_t"
TXN_ROWS = 1000
COUNTS = (1, 2, 3)


def write_node(uri: str, node: int, changes: int) -> None:
    """`changes` changes on one node: 80% inserts, then 20% updates, 1,000 rows per transaction."""
    inserts = changes * 4 // 5
    base = node * 1_000_000_000
    with psycopg.connect(uri, autocommit=True) as c:
        for lo in range(0, inserts, TXN_ROWS):
            n = min(TXN_ROWS, inserts - lo)
            c.execute(f"INSERT INTO {TABLE} SELECT %s + g, g %% 1000, md5(g::text) || md5((g + 1)::text) || "
                      "left(md5((g + 2)::text), 16), now() FROM generate_series(%s::bigint, %s::bigint) g",
                      (base, lo + 1, lo + n))
        for lo in range(0, changes - inserts, TXN_ROWS):
            n = min(TXN_ROWS, changes - inserts - lo)
            c.execute(f"UPDATE {TABLE} SET a = a + 1 WHERE id > %s AND id <= %s", (base + lo, base + lo + n))


def fingerprint(uris: list[str]) -> tuple[int, str]:
    rows: list[tuple[int, int, str]] = []
    for uri in uris:
        with psycopg.connect(uri) as c:
            rows += c.execute(f"SELECT id, a, b FROM {TABLE}").fetchall()
    rows.sort()
    return len(rows), hashlib.md5(repr(rows).encode()).hexdigest()


def one(run: int, k: int, sources: list, replica, state: Path, logdir: Path, changes: int, timeout: float,
        extra: list[str]) -> tuple[dict[str, float], str | None]:
    name = f"mn{run}k{k}"
    uris = []
    for i, server in enumerate(sources[:k]):
        with psycopg.connect(server.uri(), autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
        uri = server.uri(name)
        with psycopg.connect(uri, autocommit=True) as c:
            c.execute(f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, a int, b text, c timestamptz)")
        uris.append(uri)
    with psycopg.connect(replica.uri(), autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name}")
    sink = replica.uri(name)
    feed = [sys.executable, "-m", "changefeed"]
    nodes = [a for i, uri in enumerate(uris) for a in ("--source", f"{'abc'[i]}={uri}")]
    created = run_stamped([*feed, "create", "--name", name, "--state", str(state), *nodes, "--sink", sink,
                           "--tables", f"public.{TABLE}"], logdir / f"{name}-create.out", timeout)
    if created[0] != 0:
        return {}, f"create {name} failed: {created[3]}"
    errors: list[BaseException] = []

    def write(uri: str, node: int) -> None:
        try:
            write_node(uri, node, changes // k)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    writers = [threading.Thread(target=write, args=(uri, i + 1)) for i, uri in enumerate(uris)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    if errors:
        return {}, f"writing the workload of {name} failed: {errors[0]!r}"
    total = (changes // k) * k
    rows = fingerprint(uris)[0]
    if rows != (changes // k) * 4 // 5 * k:
        return {}, f"{name}: the nodes hold {rows} rows, not the workload's"
    rc, wall, stamped, tail = run_stamped([*feed, "run", "--name", name, "--state", str(state), "--available-now",
                                           *extra], logdir / f"{name}-run.out", timeout)
    if rc != 0:
        return {}, f"feed {name} exited {rc} after {wall:.1f}s: {tail}"
    t_run = next((t for t, _, ln in stamped if ": running (" in ln), None)
    t_end = next((t for t, _, ln in stamped if ": stopped cleanly" in ln), None)
    out = {"whole": total / wall}
    if t_run is not None and t_end is not None:
        out["query"] = total / (t_end - t_run)
    batches = steady_batches(sink, name)
    if len(batches) >= 3:
        later = sum(ch for ch, _, _ in batches[1:])
        out["batch2"] = later / (batches[-1][2] - batches[1][1])
    if fingerprint(uris) != fingerprint([sink]):
        return out, f"feed {name}: the replica differs from the union of its {k} nodes"
    run_stamped([*feed, "remove", "--name", name, "--state", str(state)], logdir / f"{name}-remove.out", timeout)
    return out, None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--changes", type=int, default=600_000, help="total changes, spread over the nodes")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--two-phase", action="store_true",
                    help="servers that can prepare transactions (max_prepared_transactions 64): the planner then "
                         "scans each window for distributed transactions (none in this workload)")
    bench_args(ap, "servers, feed state and logs", "--max-bytes-per-batch=16MB")
    args = ap.parse_args()
    t0 = time.monotonic()
    work, removed, servers = bench_setup(ap, args.workdir, args.keep, "changefeed-multinode-",
                                         ("s1", "s2", "s3", "replica"),
                                         {"max_prepared_transactions": "64"} if args.two_phase else None)
    sources, replica = servers[:3], servers[3]
    logdir, state = work / "logs", work / "state"
    facts = machine_facts(sources[0])
    results: dict[int, list[dict[str, float]]] = {k: [] for k in COUNTS}
    failures: list[str] = []
    for run in range(1, args.runs + 1):
        for k in COUNTS:
            log(f"run {run}: {args.changes:,} changes over {k} node(s) ...")
            out, failure = one(run, k, sources, replica, state, logdir, args.changes, args.feed_timeout,
                               args.feed_arg)
            if failure:
                failures.append(failure)
            results[k].append(out)
            log(f"run {run}, {k} node(s): " + ", ".join(f"{m} {v:,.0f}/s" for m, v in out.items()))
    print(f"\n{args.changes:,} changes spread over 1, 2, 3 nodes, {args.runs} run(s)"
          f"{', servers that can prepare transactions' if args.two_phase else ''}; changes/s median [min - max]"
          " and ratio to 1 node in the same run")
    for metric, what in (("whole", "whole process"), ("query", "query only"), ("batch2", "from batch 2")):
        print(f"\n{what}:")
        for k in COUNTS:
            rates = [r[metric] for r in results[k] if metric in r]
            ratios = [r[metric] / one_[metric] for r, one_ in zip(results[k], results[1])
                      if metric in r and metric in one_]
            s = spread(rates)
            shown = "n/a" if s is None else f"{s[0]:>10,.0f} [{s[1]:,.0f} - {s[2]:,.0f}]"
            print(f"  {k} node(s): {shown}   ratio {fmt_ratio(spread(ratios))}")
    print("\n" + "\n".join(facts))
    return verdict(time.monotonic() - t0, logdir, removed, failures, "every replica equals the union of its nodes")


if __name__ == "__main__":
    sys.exit(main())
