"""The Kafka sink's writer work per change, without Spark or a server, and against another checkout.

A synthetic batch of change rows of the workload's table (`id bigint` key, `a int`, `b text` of 80
characters, `c timestamptz`) goes through what the writer task does with it: the messages
(sinks.messages), the producer, and the commit of one Kafka transaction with its progress record,
into a local Tansu broker this script starts. Scenarios:
  inserts  N inserts (json)
  mixed    70% inserts, 20% updates, 10% deletes in runs of 1,000, json with tombstones
  debezium the inserts in the debezium format
  text     the inserts in the text format
Each run is a fresh process per source tree (`--against DIR`: another checkout's `src`), the trees
taking turns at going first. Prints wall and CPU microseconds per change, medians and spreads per
tree, and the per-run ratios other / this tree (above 1: this tree is faster).

    .venv/bin/python bench/kafka_writer.py --against /tmp/base/src
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"
SCENARIOS = {"inserts": ("json", 200_000), "mixed": ("json", 200_000), "debezium": ("debezium", 50_000),
             "text": ("text", 50_000)}


def batch(scenario: str, n: int) -> Any:
    from changefeed.core import change as ch
    from changefeed.core.copytext import join_line

    shape = ch.TableShape("public", "bench_t", ("id", "a", "b", "c"),
                          ("bigint", "integer", "text", "timestamp with time zone"), ("id",), "d")
    rng = random.Random(1)
    rows: list[dict[str, Any]] = [{"op": ch.RELATION, "schema": "public", "table": "bench_t", "meta": shape.to_meta()}]
    for i in range(n):
        op = "c" if scenario != "mixed" or i % 10_000 < 7_000 else "u" if i % 10_000 < 9_000 else "d"
        line = join_line(v.encode() for v in (str(i % 7_000 if op != "c" else i), str(rng.randrange(10**6)),
                                              rng.randbytes(40).hex(), "2024-01-02 03:04:05.123456+00"))
        rows.append({"op": op, "schema": "public", "table": "bench_t", "lsn": 100 + i, "seq": i, "xid": 7 + i // 1000,
                     "commit_time": 1_700_000_000_000_000, "commit_ts": (5 << 16) + i,
                     "after": line if op != "d" else None, "before": line if op == "d" else None})
    rows.append({"op": ch.PROGRESS, "lsn": 10**9, "meta": ch.Progress(10**9, 6 << 16, None, len(rows)).to_meta()})
    return ch.record_batch({name: [r.get(name) for r in rows] for name in ch.NAMES})


def child(bootstrap: str, scenario: str) -> dict[str, float]:
    """One scenario's batch written once, timed from its first message to the commit."""
    from changefeed.core.change import BatchProgress
    from changefeed.core.envelope import Record, formatter
    from changefeed.sinks import messages
    from changefeed.sinks.kafka.batch import KafkaBatch
    from changefeed.sinks.kafka.options import KafkaOptions

    fmt, n = SCENARIOS[scenario]
    rb = batch(scenario, n)
    tag = f"{scenario}{random.randrange(10**9)}"
    opts = KafkaOptions.parse(f"kafka://{bootstrap}?topic_prefix=p{tag}&progress_topic=pr{tag}&timeout=30s"
                              "&topic_partitions=1")
    stream = messages.MessageStream(formatter(fmt, "f", False), opts.topic, scenario == "mixed")
    out = KafkaBatch(opts, f"f{tag}", "q", 0)
    out.open()
    out.send(opts.topic("public", "bench_t"), Record(b"[-1]", b"{}"))  # the topic made before the clock starts
    t0, c0 = time.perf_counter(), time.process_time()
    if hasattr(stream, "parts"):  # (an older tree sends message by message)
        for part in stream.parts(rb):
            if isinstance(part, messages.Run):
                out.send_run(*part)
            else:
                out.send(part.topic, part.record)
    else:
        for m in stream.messages(rb):
            out.send(m.topic, m.record)
    out.close(BatchProgress(10**9, 1, None, n, ()))
    t1, c1 = time.perf_counter(), time.process_time()
    return {"wall_us": (t1 - t0) / n * 1e6, "cpu_us": (c1 - c0) / n * 1e6}


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f} - {max(values):.2f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--against", type=Path, help="another checkout's src to compare with")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--child", nargs=2, metavar=("BOOTSTRAP", "SCENARIO"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    from changefeed.local.kafka import LocalKafka

    trees = {"this": SRC, **({"other": args.against.resolve()} if args.against else {})}
    got: dict[tuple[str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as workdir:
        broker = LocalKafka.start(workdir)
        try:
            for run in range(args.runs):
                for scenario in args.scenarios.split(","):
                    for name in (list(trees) if run % 2 == 0 else list(reversed(trees))):
                        env = {**os.environ, "PYTHONPATH": str(trees[name])}
                        done = subprocess.run([sys.executable, __file__, "--child", broker.bootstrap, scenario],
                                              env=env, capture_output=True, text=True, check=False)
                        if done.returncode:
                            print(done.stderr[-3000:], file=sys.stderr)
                            return 1
                        got.setdefault((name, scenario), []).append(json.loads(done.stdout.strip().splitlines()[-1]))
        finally:
            broker.stop()
    for scenario in args.scenarios.split(","):
        for name in trees:
            rows = got[(name, scenario)]
            print(f"{scenario:9} {name:5} wall us/change {summary([r['wall_us'] for r in rows])}   "
                  f"cpu us/change {summary([r['cpu_us'] for r in rows])}")
        if "other" in trees:
            for m in ("wall_us", "cpu_us"):
                ratios = [o[m] / t[m] for o, t in zip(got[("other", scenario)], got[("this", scenario)])]
                print(f"{scenario:9} other/this {m}: {summary(ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
