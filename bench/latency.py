"""Commit-to-visible latency of a running feed at fixed change rates (see bench/README.md).

A feed runs (`changefeed run`, a subprocess) from a source table `lat (id bigint primary key, v
text)` to a replica, or to Kafka (`--sink kafka`: a local broker, exactly-once delivery, read by a
`read_committed` consumer), or to a webhook (`--sink webhook`: a local HTTP endpoint in this
process). A writer commits transactions of consecutive ids at a fixed pace and stamps each at its
commit (the wall time COMMIT returned); a watcher sees them arrive: on the replica it polls
`max(id)` every --poll-ms (the replica applies in commit order, whole batches at once, so max(id)
>= n means transaction n is visible); on Kafka it stamps each message as the consumer gets it, at
the webhook as its request comes in. Per rate: VACUUM, ANALYZE and CHECKPOINT on both servers
(the previous phase's rows would keep autovacuum busy on the 2 cores), a warm-up, then --seconds
measured, then the tail is waited for.
Prints one line per rate and run (`10000/s ... p50 0.21 p99 0.44`, seconds), then medians over
the runs with their spread.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replica_throughput import bench_setup, fmt_ratio, log, spread  # noqa: E402

TXNS_PER_S = 1000  # the writer's pace: rates above it put more rows in each transaction


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Writer(threading.Thread):
    """Commits `rate` rows/s in transactions of consecutive ids; `commits` is (last id, wall time
    its COMMIT returned) per transaction, measured ones only."""

    def __init__(self, uri: str, first: int, rate: int, warmup: float, seconds: float) -> None:
        super().__init__(daemon=True)
        self.uri, self.next_id, self.rate, self.warmup, self.seconds = uri, first, rate, warmup, seconds
        self.commits: list[tuple[int, float]] = []
        self.sustained = 0.0

    def run(self) -> None:
        txns = min(TXNS_PER_S, self.rate)
        rows = max(1, self.rate // txns)
        with psycopg.connect(self.uri, autocommit=True) as c:
            began = time.monotonic()
            i = 0
            measured_rows, measured_from = 0, began + self.warmup
            while (now := time.monotonic()) < measured_from + self.seconds:
                due = began + i / txns
                if due > now:
                    time.sleep(due - now)
                last = self.next_id + rows - 1
                c.execute("INSERT INTO lat SELECT g, 'x' FROM generate_series(%s::bigint, %s::bigint) g",
                          (self.next_id, last))
                stamp = time.time()
                if time.monotonic() >= measured_from:
                    self.commits.append((last, stamp))
                    measured_rows += rows
                self.next_id, i = last + 1, i + 1
            self.sustained = measured_rows / (time.monotonic() - measured_from)


class ReplicaWatcher(threading.Thread):
    """Polls the replica's max(id): `seen` is (wall time, max id) at each change."""

    def __init__(self, uri: str, poll_s: float) -> None:
        super().__init__(daemon=True)
        self.uri, self.poll_s, self.stop = uri, poll_s, threading.Event()
        self.seen: list[tuple[float, int]] = []

    def run(self) -> None:
        with psycopg.connect(self.uri, autocommit=True) as c:
            last = -1
            while not self.stop.wait(self.poll_s):
                top = c.execute("SELECT coalesce(max(id), -1) FROM lat").fetchone()[0]  # type: ignore[index]
                if top != last:
                    self.seen.append((time.time(), top))
                    last = top

    def visible_at(self, commits: list[tuple[int, float]]) -> list[float | None]:
        out, j = [], 0
        for last, _ in commits:
            while j < len(self.seen) and self.seen[j][1] < last:
                j += 1
            out.append(self.seen[j][0] if j < len(self.seen) else None)
        return out


class KafkaWatcher(threading.Thread):
    """A read_committed consumer of the table's topic: `arrived` maps an id to the wall time its
    message was consumed."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(daemon=True)
        from confluent_kafka import Consumer

        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "latency",
                                  "auto.offset.reset": "earliest", "isolation.level": "read_committed",
                                  "enable.auto.commit": False, "fetch.wait.max.ms": 5})
        self.consumer.subscribe([topic])
        self.stop, self.arrived = threading.Event(), {}  # type: ignore[var-annotated]

    def run(self) -> None:
        while not self.stop.is_set():
            for m in self.consumer.consume(10000, 0.01):
                if m.error() is None and m.key():
                    self.arrived[int(json.loads(m.key())[0])] = time.time()
        self.consumer.close()

    def visible_at(self, commits: list[tuple[int, float]]) -> list[float | None]:
        return [self.arrived.get(last) for last, _ in commits]


class WebhookWatcher(threading.Thread):
    """A local HTTP endpoint for the webhook sink: `arrived` maps an id to the wall time the
    request holding its message came in (the first time, a request sent again is not counted)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        arrived: dict[int, float] = {}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                now = time.time()
                for m in body.get("payload", []):
                    if m.get("key"):
                        arrived.setdefault(int(m["key"][0]), now)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.arrived = arrived
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"webhook-http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.stop = threading.Event()
        # answering from now on: the feed checks the endpoint is reachable before it creates anything
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def run(self) -> None:
        self.stop.wait()
        self.server.shutdown()

    def visible_at(self, commits: list[tuple[int, float]]) -> list[float | None]:
        return [self.arrived.get(last) for last, _ in commits]


Watcher = ReplicaWatcher | KafkaWatcher | WebhookWatcher


def quiet(*uris: str) -> None:
    """Vacuum, analyze and checkpoint now, so that a phase does not pay for the previous one's
    rows in autovacuum and checkpoints running meanwhile (2 cores)."""
    for uri in uris:
        with psycopg.connect(uri, autocommit=True) as c:
            if c.execute("SELECT to_regclass('public.lat')").fetchone()[0]:  # type: ignore[index]
                c.execute("VACUUM (ANALYZE) lat")
            c.execute("CHECKPOINT")


def measure(watcher: Watcher, source: str, first: int, rate: int, args: argparse.Namespace
            ) -> tuple[dict[str, float], int]:
    writer = Writer(source, first, rate, args.warmup, args.seconds)
    writer.start()
    writer.join()
    deadline = time.monotonic() + 120  # every transaction (Kafka partitions are consumed at their own pace)
    while None in watcher.visible_at(writer.commits) and time.monotonic() < deadline:
        time.sleep(0.2)
    seen = watcher.visible_at(writer.commits)
    lat = [v - c for (_, c), v in zip(writer.commits, seen) if v is not None]
    missing = sum(v is None for v in seen)
    if not lat:
        raise SystemExit(f"nothing arrived at {rate}/s: see the feed's log")
    return ({"sustained": writer.sustained, "p50": quantile(lat, 0.5), "p90": quantile(lat, 0.9),
             "p99": quantile(lat, 0.99), "max": max(lat), "missing": missing}, writer.next_id)


def run_session(args: argparse.Namespace, work: Path, session: int, src_uri: str, replica_uri: str, rates: list[int],
                runs: int, next_id: int, results: dict[int, list[dict[str, float]]]) -> int:
    """One feed (and, into Kafka, one broker) through `runs` runs of every rate; returns the next id.
    A later session's feed starts on an emptied table, so its snapshot adds nothing to measure."""
    kafka = None
    name = f"lat{session}" if session else "lat"
    if session:
        with psycopg.connect(src_uri, autocommit=True) as c:
            c.execute("TRUNCATE lat")
    hook = WebhookWatcher() if args.sink == "webhook" else None
    if args.sink == "kafka":
        from changefeed.local.kafka import LocalKafka

        kafka = LocalKafka.start(work / f"kafka{session}")
        sink = "&".join([f"kafka://{kafka.bootstrap}?delivery=exactly_once", *args.sink_setting])
    elif hook is not None:
        sink = "&".join([f"{hook.url}?retry_backoff=50ms", *args.sink_setting])
    else:
        sink = replica_uri
    feed_log = work / "logs" / f"{name}.log"
    feed = subprocess.Popen([sys.executable, "-m", "changefeed", "run", "--name", name, "--source", src_uri,
                             "--sink", sink, "--tables", "public.lat", "--state", str(work / "state"), *args.feed_arg],
                            stdout=open(feed_log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    watcher: Watcher = (KafkaWatcher(kafka.bootstrap, "public.lat") if kafka else hook if hook is not None
               else ReplicaWatcher(replica_uri, args.poll_ms / 1000))
    try:
        deadline = time.monotonic() + 120
        while ": running (" not in feed_log.read_text():
            if feed.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the feed did not start:\n{feed_log.read_text()[-3000:]}")
            time.sleep(0.2)
        time.sleep(2)
        watcher.start()
        # a first trickle, not measured, until it arrives: the consumer has joined, the feed is warm
        _, next_id = measure(watcher, src_uri, next_id, 100, argparse.Namespace(warmup=0.0, seconds=2.0))
        for run in range(runs):
            for rate in rates:
                quiet(src_uri, *([replica_uri] if args.sink == "replica" else []))
                got, next_id = measure(watcher, src_uri, next_id, rate, args)
                results[rate].append(got)
                log(f"run {session * runs + run + 1} {rate}/s  sustained {got['sustained']:,.0f}/s  "
                    f"p50 {got['p50']:.3f} p90 {got['p90']:.3f} p99 {got['p99']:.3f} max {got['max']:.3f}"
                    + (f"  ({got['missing']:.0f} transactions never seen)" if got["missing"] else ""))
    finally:
        watcher.stop.set()
        feed.terminate()
        try:
            feed.wait(60)
        except subprocess.TimeoutExpired:
            feed.kill()
        if kafka:
            kafka.stop()
    return next_id


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="1000,10000,50000", help="changes/s, comma-separated")
    ap.add_argument("--seconds", type=float, default=15.0, help="measured seconds per rate")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds at each rate before measuring")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sink", choices=("replica", "kafka", "webhook"), default="replica")
    ap.add_argument("--poll-ms", type=float, default=5.0, help="replica: how often max(id) is polled")
    ap.add_argument("--synchronous-commit", choices=("on", "off"), default="off",
                    help="the servers' synchronous_commit: with off, a commit reaches a WAL reader only once the "
                         "WAL writer flushed it (wal_writer_delay, 200 ms)")
    ap.add_argument("--workdir")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--feed-arg", action="append", default=[], help="extra argument for `changefeed run` (repeatable)")
    ap.add_argument("--broker-per-run", action=argparse.BooleanOptionalAction, default=True,
                    help="kafka: a fresh broker and feed for each run (the local broker slows as it fills)")
    ap.add_argument("--sink-setting", action="append", default=[], metavar="NAME=VALUE",
                    help="kafka, webhook: one more setting of the sink URI, e.g. enable.sparse.connections=true "
                         "(repeatable)")
    args = ap.parse_args()
    rates = [int(r) for r in args.rates.split(",")]
    began = time.monotonic()
    work, _, (source, replica) = bench_setup(ap, args.workdir, args.keep, "latency-bench-", ("source", "replica"),
                                             {"fsync": "off", "synchronous_commit": args.synchronous_commit})
    src_uri = source.uri()
    with psycopg.connect(src_uri, autocommit=True) as c:
        c.execute("CREATE TABLE lat (id bigint PRIMARY KEY, v text)")
    results: dict[int, list[dict[str, float]]] = {r: [] for r in rates}
    # Into Kafka each run gets a broker and a feed of its own (--broker-per-run): the local broker
    # keeps every message in memory and slows as it fills (bench/broker_read_committed.py).
    sessions = args.runs if args.sink == "kafka" and args.broker_per_run else 1
    runs_each = args.runs // sessions
    next_id = 0
    for session in range(sessions):
        next_id = run_session(args, work, session, src_uri, replica.uri(), rates, runs_each, next_id, results)
    print(f"\n{'=' * 90}\ncommit-to-visible on the {args.sink}, seconds, median [min - max] over {args.runs} "
          f"run(s) of {args.seconds:.0f} s; feed args {' '.join(args.feed_arg) or '(defaults)'}"
          + (f"; replica polled every {args.poll_ms:.0f} ms" if args.sink == "replica" else "")
          + ("; a broker and a feed per run" if sessions > 1 else ""))
    for rate, runs in results.items():
        line = "  ".join(f"{k} {fmt_ratio(spread([r[k] for r in runs]))}" for k in ("p50", "p90", "p99", "max"))
        print(f"{rate}/s  sustained {statistics.median(r['sustained'] for r in runs):,.0f}/s  {line}")
    print(f"total benchmark time {(time.monotonic() - began) / 60:.1f} min; feed logs {work / 'logs'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
