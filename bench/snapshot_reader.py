#!/usr/bin/env python
"""The snapshot reader alone: what reading a chunk (postgres.snapshot.read_chunk) costs per row,
next to a bare COPY read by psycopg a row at a time.

One fresh local PostgreSQL server, one table `snap_t` like snapshot_throughput.py's (--rows rows of
~100 bytes, VACUUM ANALYZEd), read whole, --runs rounds, the two readers taking turns at going
first:

  copy   `COPY (SELECT ... ORDER BY id) TO STDOUT` iterated by psycopg a row at a time, each row
         dropped: the wire and the server, with psycopg's cost per row;
  chunk  `read_chunk` over the whole table as one chunk (50,000-row, 2 MB pieces, as a feed's
         tasks read them): the Arrow record batches of `r` rows the feed's reading task yields.

Prints, per reader, this process's CPU time and the wall time per row (median [min - max]), and
the per-round ratio chunk / copy of each. Run it with PYTHONPATH=OTHER_CHECKOUT/src to measure
another version of the reader against the same baseline.

    .venv/bin/python bench/snapshot_reader.py                 # 1,000,000 rows, 5 rounds
    .venv/bin/python bench/snapshot_reader.py --rows 200000 --runs 3
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from changefeed.local.postgres import LocalPostgres
from changefeed.postgres import snapshot
from changefeed.postgres.connect import connect

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replica_throughput import fmt_ratio, spread  # noqa: E402  (bench/ is not a package)

QUERY = "COPY (SELECT id, a, b, c FROM snap_t ORDER BY id) TO STDOUT"


def _copy(uri: str) -> tuple[float, float, int]:
    with psycopg.connect(uri, autocommit=True) as conn:
        wall, cpu, n = time.perf_counter(), time.process_time(), 0
        with conn.cursor().copy(QUERY) as copy:
            for _ in copy:
                n += 1
        return time.process_time() - cpu, time.perf_counter() - wall, n


def _chunk(uri: str) -> tuple[float, float, int]:
    with connect(uri, "source") as conn:  # the feed's own connection (its stall watchdog included)
        wall, cpu = time.perf_counter(), time.process_time()
        found = snapshot.ChunkRead()
        for _ in snapshot.read_chunk(conn, "public.snap_t", None, None, 0, 1, found, 50_000, 2 << 20):
            pass
        return time.process_time() - cpu, time.perf_counter() - wall, found.rows


def _spread(values: list[float]) -> str:
    return fmt_ratio(spread(values))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="snapshot-reader-") as work:
        pg = LocalPostgres.start(Path(work) / "pg")
        try:
            uri = pg.uri()
            with psycopg.connect(uri, autocommit=True) as c:
                c.execute("CREATE TABLE snap_t (id bigint PRIMARY KEY, a int, b text, c timestamptz)")
                c.execute("INSERT INTO snap_t SELECT g, g %% 1000, md5(g::text) || md5((g + 1)::text) || "
                          "left(md5((g + 2)::text), 16), '2026-01-01'::timestamptz + g * interval '1 s' "
                          "FROM generate_series(1, %s) g", (args.rows,))
                c.execute("VACUUM ANALYZE snap_t")
            readers = {"copy": _copy, "chunk": _chunk}
            got: dict[str, list[tuple[float, float]]] = {name: [] for name in readers}
            for run in range(args.runs):
                for name in (["copy", "chunk"] if run % 2 == 0 else ["chunk", "copy"]):
                    cpu, wall, n = readers[name](uri)
                    if n != args.rows:
                        print(f"FAILED: {name} read {n:,} rows of {args.rows:,}")
                        return 1
                    got[name].append((cpu / n * 1e6, wall / n * 1e6))
        finally:
            pg.stop()
    print(f"{args.rows:,} rows, {args.runs} rounds; per row, median [min - max]:")
    for name, values in got.items():
        print(f"  {name:5}  CPU {_spread([v[0] for v in values])} us   wall {_spread([v[1] for v in values])} us")
    for i, what in enumerate(("CPU", "wall")):
        ratios = [c[i] / b[i] for c, b in zip(got["chunk"], got["copy"])]
        print(f"  chunk / copy, {what}: {_spread(ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
