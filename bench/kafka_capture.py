#!/usr/bin/env python
"""Kafka capture: the feed into Kafka (exactly once) next to pg_recvlogical and a plain producer.

Measures, on one fresh local PostgreSQL server and one local Kafka-protocol broker, the same
deterministic workload as replica_throughput.py (--changes changes: 70% inserts in 1,000-row
transactions, then 20% updates, then 10% deletes, ~100-byte rows), --runs times each, interleaved:

  a  pg_recvlogical draining the changes with pgoutput from a slot of its own (decode limit);
  p  one confluent-kafka producer sending the feed's own messages (read back from run 1's topic:
     the same keys, values and partitions) into a fresh topic, with the sink's producer settings
     (idempotent, acks=all, transactional), one transaction per as many messages as the feed's
     average batch held: what this client and broker alone can take;
  c  `changefeed run --available-now --sink kafka://...?delivery=exactly_once` on its own feed,
     slot and topic per run. Timed as the whole process, and "from batch 2": the changes of the
     batches after the first / time from the second batch's start to the last one's end (from
     the sink's ledger, delivered.jsonl in the feed's state folder), which leaves out the feed's
     start-up.

Every feed topic must hold exactly --changes committed messages. Exit 1 on a mismatch or a failed run.

    .venv/bin/python bench/kafka_capture.py                          # 1M changes, 3 runs
    .venv/bin/python bench/kafka_capture.py --changes 100000 --runs 1
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from changefeed.local.kafka import LocalKafka, read_partition  # noqa: E402
from replica_throughput import (  # noqa: E402
    PUBLICATION,
    SOURCE_DB,
    TABLE,
    bench_paths,
    bench_setup,
    feed_failure,
    fmt_rate,
    fmt_ratio,
    log,
    run_feed,
    run_recvlogical,
    spread,
    verdict,
    workload_args,
    write_workload,
)

Message = tuple[bytes | None, bytes | None, int]  # key, value, partition


def topic_of(prefix: str) -> str:
    return f"{prefix}public.{TABLE}"


def committed_messages(bootstrap: str, topic: str) -> list[Message]:
    """The topic's committed data records (the broker's read_committed view cannot be trusted on
    every broker, see local_kafka), partition by partition."""
    from confluent_kafka.admin import AdminClient

    meta = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10)
    out: list[Message] = []
    for p in sorted(meta.topics[topic].partitions):
        out += [(r.key, r.value, p) for r in read_partition(bootstrap, topic, p, timeout=60)
                if r.outcome in ("committed", "none")]
    return out


def batches_from_ledger(state: Path, feed: str) -> list[tuple[int, float, float]]:
    """(changes, began, done) of the feed's batches that carried changes, in end-LSN order."""
    rows = []
    for line in (state / feed / "delivered.jsonl").read_text().splitlines():
        d = json.loads(line)
        if d["progress"]["changes"] > 0:
            rows.append((d["progress"]["end_lsn"], int(d["progress"]["changes"]), float(d["began"]), float(d["done"])))
    return [r[1:] for r in sorted(rows)]


def run_producer(bootstrap: str, topic: str, messages: list[Message], per_txn: int, tag: str) -> float:
    """Send `messages` into `topic` (created with as many partitions as they name) in transactions
    of `per_txn`; the seconds it took, from the first produce to the last commit."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    partitions = max(p for _, _, p in messages) + 1
    admin = AdminClient({"bootstrap.servers": bootstrap})  # (kept alive until the topic exists)
    admin.create_topics([NewTopic(topic, partitions)])[topic].result()
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
                         "queue.buffering.max.messages": 1_000_000, "transactional.id": f"bench-plain-{tag}",
                         "log_level": 0})
    producer.init_transactions(30)
    t0 = time.monotonic()
    for start in range(0, len(messages), per_txn):
        producer.begin_transaction()
        for key, value, p in messages[start:start + per_txn]:
            while True:
                try:
                    producer.produce(topic, key=key, value=value, partition=p)
                    break
                except BufferError:
                    producer.poll(0.05)
        producer.commit_transaction(60)
    return time.monotonic() - t0


def main() -> int:
    ap, args = workload_args(__doc__, "--max-bytes-per-batch=128MB")

    t_start = time.monotonic()
    work, remove_work, (source,) = bench_setup(ap, args.workdir, args.keep, "kafka-bench-", ("source",))
    kafka = LocalKafka.start(work / "kafka")
    try:
        return _bench(args, work, remove_work, source, kafka, t_start)
    finally:
        kafka.stop()


def _bench(args: argparse.Namespace, work: Path, remove_work: bool, source: object, kafka: LocalKafka,
           t_start: float) -> int:
    logdir, state, facts, src_uri = bench_paths(work, source, SOURCE_DB)  # type: ignore[arg-type]
    with psycopg.connect(src_uri, autocommit=True) as c:
        c.execute(f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, a int, b text, c timestamptz)")
        c.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {TABLE}")
    sink = {k: f"kafka://{kafka.bootstrap}?delivery=exactly_once&topic_prefix=run{k}." for k in range(1, args.runs + 1)}
    failures: list[str] = []
    ready: dict[int, bool] = {}
    for k in range(1, args.runs + 1):  # an empty first run creates each feed's slot before the workload
        r = run_feed(f"kcap{k}", src_uri, sink[k], state, logdir, "1-setup", args.feed_timeout, args.feed_arg)
        ready[k] = r.rc == 0
        if r.rc != 0:
            failures.append(feed_failure(r, f"feed kcap{k} first run"))
    with psycopg.connect(src_uri, autocommit=True) as c:
        for k in range(1, args.runs + 1):
            c.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (f"kcap_recv_{k}",))
    log(f"writing the workload: {args.changes:,} changes ...")
    with psycopg.connect(src_uri, autocommit=True) as c:
        wl = write_workload(c, args.changes, work / "changes.copy")
    n = args.changes
    res: dict[str, list[float]] = {k: [] for k in ("a", "p", "c", "c_from2")}
    messages: list[Message] = []
    per_txn = n
    for k in range(1, args.runs + 1):
        log(f"run {k}/{args.runs}")
        secs, _ = run_recvlogical(source, f"kcap_recv_{k}", wl.end_lsn, wl.last_commit_lsn, work / "recv.out",  # type: ignore[arg-type]
                                  args.feed_timeout)
        res["a"].append(n / secs)
        log(f"  a pg_recvlogical: {secs:.2f}s, {n / secs:,.0f} changes/s")
        c_rate = c_from2 = float("nan")
        if ready[k]:
            r = run_feed(f"kcap{k}", src_uri, sink[k], state, logdir, "2-measured", args.feed_timeout, args.feed_arg)
            if r.rc != 0:
                failures.append(feed_failure(r, f"run {k} feed kcap{k}"))
            else:
                c_rate = n / r.wall
                batches = batches_from_ledger(state, f"kcap{k}")
                if len(batches) >= 2:
                    c_from2 = sum(b[0] for b in batches[1:]) / (batches[-1][2] - batches[1][1])
                got = committed_messages(kafka.bootstrap, topic_of(f"run{k}."))
                if len(got) != n:
                    failures.append(f"run {k}: topic {topic_of(f'run{k}.')} holds {len(got):,} committed messages, "
                                    f"not {n:,}")
                if not messages:
                    messages, per_txn = got, max(1, n // max(1, len(batches)))
                log(f"  c feed: {r.wall:.2f}s whole process, {c_rate:,.0f} changes/s; from batch 2 {c_from2:,.0f} "
                    f"changes/s ({len(batches)} batches); topic holds {len(got):,} committed messages")
        res["c"].append(c_rate)
        res["c_from2"].append(c_from2)
        p_rate = float("nan")
        if messages:
            secs = run_producer(kafka.bootstrap, topic_of(f"plain{k}."), messages, per_txn, str(k))
            p_rate = n / secs
            log(f"  p producer: {secs:.2f}s, {p_rate:,.0f} messages/s ({per_txn:,} per transaction)")
        res["p"].append(p_rate)

    def ratios(num: str, den: str) -> tuple[float, float, float] | None:
        return spread([x / y for x, y in zip(res[num], res[den])])

    print()
    print("=" * 100)
    print(f"Kafka capture: {n:,} changes ({wl.inserts:,} inserts, {wl.updates:,} updates, {wl.deletes:,} deletes), "
          f"{args.runs} run(s), WAL {wl.wal_bytes / 2**20:,.0f} MiB")
    for f in facts:
        print(f)
    print()
    print(f"{'changes/s':<52}{'median':>13} {'min':>13} {'max':>13}")
    print(f"{'a  pg_recvlogical, pgoutput (decode limit)':<52}{fmt_rate(spread(res['a']))}")
    print(f"{'p  one producer, the same messages, transactional':<52}{fmt_rate(spread(res['p']))}")
    print(f"{'c  feed, whole process (incl. Spark start-up)':<52}{fmt_rate(spread(res['c']))}")
    print(f"{'c  feed, from the start of the second batch':<52}{fmt_rate(spread(res['c_from2']))}")
    print()
    print("ratios, computed per run, median [min - max]:")
    print(f"  c(from batch 2)/a      {fmt_ratio(ratios('c_from2', 'a'))}")
    print(f"  c(from batch 2)/p      {fmt_ratio(ratios('c_from2', 'p'))}")
    print(f"  c(whole)/a             {fmt_ratio(ratios('c', 'a'))}")
    print(f"  p/a                    {fmt_ratio(ratios('p', 'a'))}")
    return verdict(time.monotonic() - t_start, logdir, remove_work, failures,
                   f"every feed topic holds exactly {n:,} committed messages")


if __name__ == "__main__":
    sys.exit(main())
