"""The floor of the low-latency design of issue 42, outside Spark: one process follows the slot
over a replication connection that stays open and applies each sub-window (everything up to a
commit, at least --cut-ms after the last cut) in a replica transaction of its own, with its
ledger row, as a long-lived task would (see bench/README.md, latency_floor.py).

The pieces are the feed's own: postgres.follow.Follower (the slot followed in sub-windows) and
the replica's BatchApplier, one per sub-window. The writer and the watcher are
latency.py's, so the figures compare with that benchmark's: commit-to-visible at fixed rates,
median and spread over the runs. What it leaves out (the long-lived task's Spark side: its input
partition's transit from the reading to the writing Python worker, and the batch boundary) is
what is left to measure once this floor is known.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from changefeed.core import change as ch  # noqa: E402
from changefeed.core.lsn import format_lsn  # noqa: E402
from changefeed.postgres.follow import Follower  # noqa: E402
from changefeed.sinks.replica.apply import BatchApplier  # noqa: E402
from changefeed.sinks.replica.ledger import applied_upto, ensure_meta  # noqa: E402
from changefeed.spec.definition import SourceNode  # noqa: E402
from latency import ReplicaWatcher, measure, quiet  # noqa: E402  (bench/ is not a package)
from replica_throughput import bench_setup, fmt_ratio, log, spread  # noqa: E402

SLOT, PUBLICATION, FEED = "floor_slot", "floor_pub", "floor"
TAIL_S = 2.0  # a phase's follower runs this long after the writer stops: every transaction arrives


class Applier(threading.Thread):
    """Follows the slot (postgres.follow) until `until` and applies each sub-window in a replica
    transaction of its own; `applied` counts them, `apply_s` their apply times."""

    def __init__(self, source: str, replica: str, every: float, until: float) -> None:
        super().__init__(daemon=True)
        self.source, self.replica, self.every, self.until = source, replica, every, until
        self.applied = 0
        self.apply_s: list[float] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._follow()
        except BaseException as e:  # reported by main
            self.error = e

    def _follow(self) -> None:
        with psycopg.connect(self.source, autocommit=True) as catalog, \
                psycopg.connect(self.replica, autocommit=True) as sink:
            at = int(catalog.execute("SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots "
                                     "WHERE slot_name = %s", (SLOT,)).fetchone()[0])  # type: ignore[index]
            node = SourceNode("n1", self.source, SLOT, PUBLICATION)
            applier, began = None, 0.0
            for rb in Follower(catalog, node, "source", at, 0, every=self.every).windows(self.until):
                if applier is None:
                    began = time.monotonic()
                    applier = BatchApplier(sink, FEED, self.applied)
                    applier.begin()
                applier.add(rb)
                if rb.num_rows and rb.column("op")[rb.num_rows - 1].as_py() == ch.PROGRESS:
                    applier.commit()
                    applier = None
                    self.apply_s.append(time.monotonic() - began)
                    self.applied += 1
            if applier is not None:
                applier.rollback()  # rows past the last sub-window: the next follower reads them again
            with psycopg.connect(self.replica) as r:
                done = applied_upto(r, FEED)
            catalog.execute("SELECT pg_replication_slot_advance(%s, %s::pg_lsn)", (SLOT, format_lsn(done)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="1000,10000", help="changes/s, comma-separated")
    ap.add_argument("--cut-ms", default="0,20,50", help="sub-window lengths to measure, comma-separated")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--poll-ms", type=float, default=5.0)
    ap.add_argument("--synchronous-commit", choices=("on", "off"), default="on",
                    help="the servers' synchronous_commit: with off, a commit reaches a WAL reader only once the "
                         "WAL writer flushed it (wal_writer_delay, 200 ms)")
    ap.add_argument("--workdir")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    rates, cuts = [int(r) for r in args.rates.split(",")], [float(c) for c in args.cut_ms.split(",")]
    _, _, (source, replica) = bench_setup(ap, args.workdir, args.keep, "latency-floor-", ("source", "replica"),
                                          {"fsync": "off", "synchronous_commit": args.synchronous_commit})
    src_uri, rep_uri = source.uri(), replica.uri()
    with psycopg.connect(src_uri, autocommit=True) as c:
        c.execute("CREATE TABLE lat (id bigint PRIMARY KEY, v text)")
        c.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE lat")
        c.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))
    with psycopg.connect(rep_uri, autocommit=True) as c:
        c.execute("CREATE TABLE lat (id bigint PRIMARY KEY, v text)")
        ensure_meta(c)
    results: dict[tuple[float, int], list[dict[str, float]]] = {(c, r): [] for c in cuts for r in rates}
    next_id = 0
    for run in range(args.runs):
        for cut_ms in cuts if run % 2 == 0 else cuts[::-1]:  # (which goes first alternates)
            for rate in rates:
                quiet(src_uri, rep_uri)
                watcher = ReplicaWatcher(rep_uri, args.poll_ms / 1000)
                watcher.start()
                applier = Applier(src_uri, rep_uri, cut_ms / 1000,
                                  time.monotonic() + args.warmup + args.seconds + TAIL_S)
                applier.start()
                try:
                    got, next_id = measure(watcher, src_uri, next_id, rate, args)
                finally:
                    watcher.stop.set()
                applier.join()
                if applier.error:
                    raise applier.error
                got["windows/s"] = applier.applied / (args.warmup + args.seconds + TAIL_S)
                results[(cut_ms, rate)].append(got)
                log(f"run {run + 1} cut {cut_ms:.0f} ms {rate}/s  sustained {got['sustained']:,.0f}/s  "
                    f"p50 {got['p50']:.3f} p90 {got['p90']:.3f} p99 {got['p99']:.3f} max {got['max']:.3f}  "
                    f"{got['windows/s']:.0f} sub-windows/s, apply p50 "
                    f"{statistics.median(applier.apply_s or [0]) * 1000:.1f} ms")
    print(f"\n{'=' * 90}\ncommit-to-visible on the replica, one follower without Spark, seconds, median "
          f"[min - max] over {args.runs} run(s) of {args.seconds:.0f} s; replica polled every {args.poll_ms:.0f} ms")
    for (cut_ms, rate), runs in results.items():
        line = "  ".join(f"{k} {fmt_ratio(spread([r[k] for r in runs]))}" for k in ("p50", "p90", "p99", "max"))
        print(f"cut {cut_ms:.0f} ms  {rate}/s  {statistics.median(r['windows/s'] for r in runs):.0f} sub-windows/s  "
              f"{line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
