#!/usr/bin/env python
"""Several sinks from one slot: one feed with three sinks against three feeds of one sink each.

On one fresh local source server, a replica server, a local Kafka-protocol broker and a lake
folder, the deterministic workload of replica_throughput.py (--changes changes) is captured, per
run, by:

  dr, events, lake  three feeds of one sink each (a replica; Kafka exactly once; a Delta change
                    log), one after the other, each `run --available-now` over a slot of its own;
  all               one feed with the three sinks (`--sink dr=... --sink events=... --sink lake=...`).

Every feed's slot is made before the workload. For each feed run: the source server's CPU time
(its postmaster and every backend, the decoding ones included: /proc, utime + stime, children
that ended counted by the postmaster) and the whole process's wall time. Prints per run and as
median [min - max]: the source's CPU of `all` against the sum of the three (goal <= 0.4: the
source decodes its WAL once, not three times) and `all`'s throughput against the slowest single
sink's (goal >= 0.8). Each sink must hold the workload: the replica equal to the source, Kafka
and the lake --changes records each. Exit 1 on a mismatch or a failed run.

    .venv/bin/python bench/multi_sink.py                       # 200k changes, 3 runs
    .venv/bin/python bench/multi_sink.py --changes 50000 --runs 1
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from changefeed.local.kafka import LocalKafka  # noqa: E402
from kafka_capture import committed_messages, topic_of  # noqa: E402
from replica_throughput import (  # noqa: E402
    SOURCE_DB,
    TABLE,
    bench_paths,
    bench_setup,
    feed_failure,
    fingerprint,
    fmt_rate,
    fmt_ratio,
    log,
    run_feed,
    spread,
    verdict,
    workload_args,
    write_workload,
)

SINGLES = ("dr", "events", "lake")
TICKS = os.sysconf("SC_CLK_TCK")


def server_cpu_s(pid: int) -> float:
    """CPU seconds of the server whose postmaster is `pid`: its own and its children's, live ones
    and those it reaped (each backend that decoded a window, the walsenders)."""
    def times(p: int, reaped: bool) -> float:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        own = int(fields[11]) + int(fields[12])  # utime, stime
        return (own + (int(fields[13]) + int(fields[14]) if reaped else 0)) / TICKS  # cutime, cstime

    total = times(pid, True)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    total += times(int(entry.name), False)
            except (OSError, ValueError, IndexError):
                continue  # ended meanwhile: the postmaster counts it now
    return total


def postmaster_pid(data_dir: Path) -> int:
    return int((data_dir / "postmaster.pid").read_text().split()[0])


def lake_rows(lake: Path) -> int:
    from deltalake import DeltaTable

    return int(DeltaTable(str(lake / f"public.{TABLE}")).to_pyarrow_table().num_rows)


def main() -> int:
    ap, args = workload_args(__doc__, "--max-bytes-per-batch=256MB")
    t_start = time.monotonic()
    work, remove_work, (source, replica) = bench_setup(ap, args.workdir, args.keep, "multi-sink-bench-",
                                                       ("source", "replica"))
    logdir, state, facts, src_uri = bench_paths(work, source, SOURCE_DB)
    kafka = LocalKafka.start(work / "kafka")
    try:
        return _bench(args, work, remove_work, logdir, state, facts, src_uri, source, replica, kafka, t_start)
    finally:
        kafka.stop()


def _bench(args: object, work: Path, remove_work: bool, logdir: Path, state: Path, facts: list[str], src_uri: str,
           source: object, replica: object, kafka: LocalKafka, t_start: float) -> int:
    n, runs = int(args.changes), int(args.runs)  # type: ignore[attr-defined]  # (argparse's namespace)
    timeout, extra = float(args.feed_timeout), list(args.feed_arg)  # type: ignore[attr-defined]
    with psycopg.connect(src_uri, autocommit=True) as c:
        c.execute(f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, a int, b text, c timestamptz)")
    with psycopg.connect(replica.uri(), autocommit=True) as c:  # type: ignore[attr-defined]
        for k in range(1, runs + 1):
            c.execute(f"CREATE DATABASE dr_{k}")
            c.execute(f"CREATE DATABASE all_{k}")

    def sinks(k: int, feed: str) -> dict[str, str]:
        db = f"dr_{k}" if feed != "all" else f"all_{k}"
        return {"dr": replica.uri(db),  # type: ignore[attr-defined]
                "events": f"kafka://{kafka.bootstrap}?topic_prefix={feed}{k}.&progress_topic=progress-{feed}{k}"
                          "&topic_partitions=1",
                "lake": f"delta://{work / 'lakes' / f'{feed}{k}'}?mode=changelog"}

    def feed_args(k: int, feed: str) -> tuple[str, list[str]]:
        """The feed's first --sink (run_feed's) and the rest of its options."""
        if feed == "all":
            named = [f"{name}={uri}" for name, uri in sinks(k, feed).items()]
            return named[0], [*(a for s in named[1:] for a in ("--sink", s)), *extra]
        return sinks(k, feed)[feed], extra

    failures: list[str] = []
    for k in range(1, runs + 1):  # every feed's slot, before the workload
        for feed in (*SINGLES, "all"):
            first, rest = feed_args(k, feed)
            r = run_feed(f"{feed}{k}", src_uri, first, state, logdir, "1-setup", timeout, rest)
            if r.rc != 0:
                failures.append(feed_failure(r, f"feed {feed}{k} first run"))
    if failures:
        return verdict(time.monotonic() - t_start, logdir, remove_work, failures, "")
    log(f"writing the workload: {n:,} changes ...")
    with psycopg.connect(src_uri, autocommit=True) as c:
        wl = write_workload(c, n, work / "changes.copy")
    src_fp = fingerprint(src_uri)
    log(f"  WAL {wl.wal_bytes / 2**20:,.0f} MiB in {wl.seconds:.1f}s")

    pid = postmaster_pid(Path(source.datadir))  # type: ignore[attr-defined]
    cpu: dict[str, list[float]] = {f: [] for f in (*SINGLES, "all")}
    rate: dict[str, list[float]] = {f: [] for f in (*SINGLES, "all")}
    for k in range(1, runs + 1):
        log(f"run {k}/{runs}")
        for feed in (*SINGLES, "all"):
            first, rest = feed_args(k, feed)
            before = server_cpu_s(pid)
            r = run_feed(f"{feed}{k}", src_uri, first, state, logdir, "2-measured", timeout, rest)
            used = server_cpu_s(pid) - before
            if r.rc != 0:
                failures.append(feed_failure(r, f"run {k} feed {feed}{k}"))
                cpu[feed].append(float("nan"))
                rate[feed].append(float("nan"))
                continue
            cpu[feed].append(used)
            rate[feed].append(n / r.wall)
            log(f"  {feed:<6} {r.wall:6.1f}s whole process, {n / r.wall:>9,.0f} changes/s; source CPU {used:6.2f}s "
                f"({used / n * 1e6:.1f} µs/change)")
            failures += _check(k, feed, sinks(k, feed), n, src_fp, kafka)

    def ratio(i: int) -> tuple[float, float]:
        singles = [cpu[f][i] for f in SINGLES]
        return cpu["all"][i] / sum(singles), rate["all"][i] / min(rate[f][i] for f in SINGLES)

    pairs = [ratio(i) for i in range(runs)]
    print()
    print("=" * 100)
    print(f"several sinks: {n:,} changes, WAL {wl.wal_bytes / 2**20:,.0f} MiB, {runs} run(s); "
          "three feeds of one sink against one feed of the three")
    for f in facts:
        print(f)
    print()
    print(f"{'changes/s (whole process)':<40}{'median':>13} {'min':>13} {'max':>13}")
    for feed in (*SINGLES, "all"):
        print(f"{feed:<40}{fmt_rate(spread(rate[feed]))}")
    print(f"{'source CPU s':<40}" + "".join(f"{feed} {fmt_ratio(spread(cpu[feed]))}  " for feed in (*SINGLES, "all")))
    print()
    print(f"source CPU, all / (dr + events + lake):   {fmt_ratio(spread([p[0] for p in pairs]))}   goal <= 0.4")
    print(f"throughput, all / slowest single sink:   {fmt_ratio(spread([p[1] for p in pairs]))}   goal >= 0.8")
    return verdict(time.monotonic() - t_start, logdir, remove_work, failures, "every sink holds the workload")


def _check(k: int, feed: str, uris: dict[str, str], n: int, src_fp: tuple[int, str], kafka: LocalKafka) -> list[str]:
    """What the run's sinks hold, against the workload."""
    out = []
    names = SINGLES if feed == "all" else (feed,)
    if "dr" in names and fingerprint(uris["dr"]) != src_fp:
        out.append(f"run {k} {feed}: the replica differs from the source")
    if "events" in names:
        got = len(committed_messages(kafka.bootstrap, topic_of(f"{feed}{k}.")))
        if got != n:
            out.append(f"run {k} {feed}: Kafka holds {got:,} records for {n:,} changes")
    if "lake" in names:
        got = lake_rows(Path(uris["lake"].split("://", 1)[1].split("?")[0]))
        if got != n:
            out.append(f"run {k} {feed}: the lake holds {got:,} rows for {n:,} changes")
    return out


if __name__ == "__main__":
    sys.exit(main())
