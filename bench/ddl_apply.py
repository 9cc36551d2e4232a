#!/usr/bin/env python
"""DDL in the stream: the replica's apply rate of batches that carry schema changes, next to batches
that carry none.

One pair of fresh local PostgreSQL servers. Per run and variant (interleaved), a fresh source
database gets a table of --rows rows written in 1,000-row insert transactions and updates after
them (so that every batch holds inserts and updates), and a fresh feed copies them with
`changefeed run --available-now --snapshot never`:

  plain    no schema change;
  ddl      an `ALTER TABLE ... ADD COLUMN cK int DEFAULT K` after every --every transactions (a
           constant default: no rewrite), the feed run without --capture-ddl (the replica follows
           from the Relation messages);
  captured the same changes with --capture-ddl (each DDL also a logical message, applied in order).

Apply rate = changes / the sum over the feed's batches of (applied_at - began_at) from the
replica's `changefeed.progress`: the time the replica spent in batch transactions, so the feed's
start-up and Spark's scheduling are left out. Printed: median [min - max] over --runs, and the
ratio of each variant to `plain` in the same run. Each replica must equal its source (columns and
rows), or the script exits 1.

    .venv/bin/python bench/ddl_apply.py                    # 200,000 changes, 3 runs (~4 min)
    .venv/bin/python bench/ddl_apply.py --rows 50000 --runs 1
"""
from __future__ import annotations

import argparse
import sys
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
    verdict,
)

VARIANTS = ("plain", "ddl", "captured")


def write(uri: str, rows: int, every: int, ddl: bool) -> None:
    with psycopg.connect(uri, autocommit=True) as c:
        for i, lo in enumerate(range(0, rows, 1000)):
            with c.transaction():
                c.execute("INSERT INTO t SELECT g, g, md5(g::text) FROM generate_series(%s::int, %s::int) g",
                          (lo + 1, min(lo + 1000, rows)))
                c.execute("UPDATE t SET v = v + 1 WHERE id BETWEEN %s AND %s", (lo + 1, lo + 200))
            if ddl and i % every == every - 1:
                c.execute(f"ALTER TABLE t ADD COLUMN c{i} int DEFAULT {i}")
        c.execute("UPDATE t SET v = v WHERE id = 1")  # without --capture-ddl a new shape comes with a change


def fingerprint(uri: str) -> tuple:
    with psycopg.connect(uri) as c:
        cols = [r[0] for r in c.execute("SELECT attname FROM pg_attribute WHERE attrelid = 't'::regclass "
                                        "AND attnum > 0 AND NOT attisdropped ORDER BY attname")]
        row = c.execute("SELECT count(*), md5(string_agg(x::text, '|' ORDER BY id)) FROM (SELECT "
                        + ", ".join(cols) + " FROM t) x").fetchone()
    return tuple(cols), row


def apply_seconds(uri: str, feed: str) -> tuple[int, float]:
    with psycopg.connect(uri) as c:
        row = c.execute("SELECT sum(changes), sum(extract(epoch FROM applied_at - began_at)) FROM changefeed.progress "
                        "WHERE feed = %s AND changes > 0", (feed,)).fetchone()
    assert row is not None
    return int(row[0] or 0), float(row[1] or 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--rows", type=int, default=200_000, help="rows inserted (each run also updates a fifth)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--every", type=int, default=20, help="a schema change after every this many transactions")
    bench_args(ap, "the servers and logs", "--max-bytes-per-batch=4MB")
    args = ap.parse_args()
    began = time.monotonic()
    work, removed, (source, sink) = bench_setup(ap, args.workdir, args.keep, "cf-ddl-", ("source", "sink"))
    logdir, state = work / "logs", work / "state"
    print("\n".join(machine_facts(source)))
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    failures: list[str] = []
    for run in range(args.runs):
        for variant in VARIANTS:
            name = f"{variant}_{run}"
            for server in (source, sink):
                with psycopg.connect(server.uri(), autocommit=True) as c:
                    c.execute(f"CREATE DATABASE {name}")
            src_uri, dst_uri = source.uri(name), sink.uri(name)
            with psycopg.connect(src_uri, autocommit=True) as c:
                c.execute("CREATE TABLE t (id int PRIMARY KEY, v int, s text)")
            # the feed's slot (and triggers) first, then the workload, then the feed reads it all
            feed = ["--name", name, "--state", str(state)]
            created = run_stamped([sys.executable, "-m", "changefeed", "create", *feed, "--source", src_uri,
                                   "--sink", dst_uri, "--tables", "public.t", "--snapshot", "never",
                                   *(["--capture-ddl"] if variant == "captured" else [])],
                                  logdir / f"{name}-create.out", args.feed_timeout)
            if created[0] != 0:
                failures.append(f"{name}: create exited {created[0]}: {created[3]}")
                continue
            write(src_uri, args.rows, args.every, variant != "plain")
            rc, wall, _, tail = run_stamped([sys.executable, "-m", "changefeed", "run", *feed, "--available-now",
                                             *args.feed_arg], logdir / f"{name}.out", args.feed_timeout)
            if rc != 0:
                failures.append(f"{name}: feed exited {rc}: {tail}")
                continue
            if fingerprint(src_uri) != fingerprint(dst_uri):
                failures.append(f"{name}: the replica differs from the source")
            changes, seconds = apply_seconds(dst_uri, name)
            rates[variant].append(changes / seconds)
            log(f"run {run + 1} {variant}: {changes:,} changes applied in {seconds:.2f}s ({changes / seconds:,.0f}/s), "
                f"whole run {wall:.1f}s")
    print(f"\n{args.rows:,} rows (+{args.rows // 5:,} updates), a schema change every {args.every} transactions; "
          "apply rate (changes/s of replica transaction time), median [min - max]:")
    for v in VARIANTS:
        s = spread(rates[v])
        if s is None:
            continue
        ratio = spread([r / p for r, p in zip(rates[v], rates["plain"])])
        print(f"  {v:<9} {s[0]:>10,.0f} [{s[1]:,.0f} - {s[2]:,.0f}]   / plain {fmt_ratio(ratio)}")
    return verdict(time.monotonic() - began, logdir, removed, failures, "every replica equals its source")


if __name__ == "__main__":
    sys.exit(main())
