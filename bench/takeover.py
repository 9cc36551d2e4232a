"""Takeover time: from the active runner's end to the first change a standby applies (see bench/README.md).

Two runners of one feed (source -> replica; with `--sink kafka` -> Kafka exactly once, read by a
read_committed consumer; `--sink delta` -> a Delta change log, read by the deltalake library;
`--sink webhook` -> a local HTTP endpoint), each with its own state folder, one active and one `run --standby`; a
writer commits a row every few milliseconds. Each round ends the active runner in one of two
ways, then waits for the sink to show a row committed after that moment:
* `kill`: SIGKILL of its whole process group (a crashed host whose connections the source's
  server sees close): the standby sees the feed's session lock free;
* `freeze`: SIGSTOP of its process group (a host cut off, a long pause; the source keeps its
  sessions): the standby waits for the lease to end (`--lease`), then ends those sessions.
The ended runner comes back as a standby before the next round. Prints each round's seconds,
then per kind the median, min and max.

    .venv/bin/python bench/takeover.py --rounds 5 --lease 5s
"""
from __future__ import annotations

import argparse
import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replica_throughput import bench_setup, log, spread  # noqa: E402


class Writer(threading.Thread):
    """Inserts row n every ~5 ms; `commits[n]` is the monotonic time its COMMIT returned."""

    def __init__(self, uri: str) -> None:
        super().__init__(daemon=True)
        self.uri, self.stop, self.last = uri, threading.Event(), 0
        self.commits: dict[int, float] = {}

    def run(self) -> None:
        with psycopg.connect(self.uri, autocommit=True) as c:
            n = 0
            while not self.stop.is_set():
                n += 1
                c.execute("INSERT INTO t VALUES (%s, now())", (n,))
                self.commits[n] = time.monotonic()
                self.last = n
                time.sleep(0.005)


def applied(uri: str) -> int:
    with psycopg.connect(uri) as c:
        if c.execute("SELECT to_regclass('public.t') IS NULL").fetchone()[0]:  # type: ignore[index]
            return 0
        return int(c.execute("SELECT coalesce(max(id), 0) FROM t").fetchone()[0])  # type: ignore[index]


class KafkaWatcher(threading.Thread):
    """A read_committed consumer of the feed's topic (one partition): `last` is the highest id seen."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.topic, self.last, self.stop = bootstrap, topic, 0, threading.Event()

    def run(self) -> None:
        import json

        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "takeover-bench",
                             "isolation.level": "read_committed", "enable.auto.commit": False,
                             "fetch.wait.max.ms": 10, "log_level": 0})
        while not self.stop.is_set():
            try:
                consumer.assign([TopicPartition(self.topic, 0, 0)])
                break
            except Exception:  # noqa: BLE001 - the topic is made with the feed's first batch
                time.sleep(0.2)
        while not self.stop.is_set():
            msg = consumer.poll(0.05)
            if msg is not None and msg.error() is None and msg.key() and msg.value():
                self.last = max(self.last, int(json.loads(msg.key())[0]))
        consumer.close()


class DeltaWatcher(threading.Thread):
    """Follows the Delta table every 20 ms, reading only the files added since the last look (a
    whole read of a growing change log would lag, and take the CPU the runners need): `last` is
    the highest id in it."""

    def __init__(self, table: Path) -> None:
        super().__init__(daemon=True)
        self.table, self.last, self.stop = table, 0, threading.Event()

    def run(self) -> None:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
        from deltalake import DeltaTable

        dt, seen = None, set()
        while not self.stop.wait(0.02):
            try:
                if dt is None:
                    dt = DeltaTable(str(self.table))
                else:
                    dt.update_incremental()
                for path in dt.get_add_actions(flatten=True).column("path").to_pylist():
                    if path not in seen:
                        seen.add(path)
                        ids = pq.read_table(self.table / path, columns=["id"]).column("id")
                        self.last = max(self.last, int(pc.max(ids).as_py() or 0))
            except Exception:  # noqa: BLE001 - no table yet, or a commit being written
                continue


class WebhookWatcher:
    """A local HTTP endpoint that acknowledges every request: `last` is the highest id received."""

    def __init__(self) -> None:
        import json
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        watcher = self
        self.last = 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                ids = [m["key"][0] for m in body.get("payload", []) if m.get("key")]
                watcher.last = max([watcher.last, *ids])
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.uri = f"webhook-http://127.0.0.1:{self.server.server_address[1]}/changes?flush_messages=200"


def start(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "changefeed", *args], stdout=open(log_path, "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait(what: str, check: object, timeout: float, poll: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(poll)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="takeovers of each kind (default 5)")
    ap.add_argument("--kinds", default="kill,freeze", help="kill, freeze or both (default)")
    ap.add_argument("--lease", default="5s", help="the feed's --lease (default 5s)")
    ap.add_argument("--sink", choices=("replica", "kafka", "delta", "webhook"), default="replica",
                    help="a replica (default), Kafka exactly once (a local broker, read by a read_committed "
                         "consumer), a Delta change log, or a local webhook endpoint")
    ap.add_argument("--workdir")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    work, _, (source, sink) = bench_setup(ap, args.workdir, args.keep, "changefeed-takeover-", ("source", "sink"))
    src_uri, dst_uri = source.uri(), sink.uri()
    with psycopg.connect(src_uri, autocommit=True) as c:
        c.execute("CREATE TABLE t (id bigint PRIMARY KEY, at timestamptz)")
    newest: Callable[[], int] = lambda: applied(dst_uri)  # noqa: E731 - swapped for Kafka below
    if args.sink == "kafka":
        from changefeed.local.kafka import LocalKafka

        broker = LocalKafka.start(work / "kafka")
        atexit.register(broker.stop)
        dst_uri = f"kafka://{broker.bootstrap}?topic_partitions=1"
        watcher = KafkaWatcher(broker.bootstrap, "public.t")
        watcher.start()
        newest = lambda: watcher.last  # noqa: E731
    elif args.sink == "delta":
        dst_uri = f"delta://{work / 'lake'}?mode=changelog"
        lake = DeltaWatcher(work / "lake" / "public.t")
        lake.start()
        newest = lambda: lake.last  # noqa: E731
    elif args.sink == "webhook":
        hook = WebhookWatcher()
        dst_uri = hook.uri
        newest = lambda: hook.last  # noqa: E731
    writer = Writer(src_uri)
    writer.start()
    states, logs = [work / "host-a", work / "host-b"], [work / "logs" / "a.log", work / "logs" / "b.log"]
    runners = [start(["run", "--name", "tk", "--state", str(states[0]), "--source", src_uri, "--sink", dst_uri,
                      "--tables", "public.t", "--lease", args.lease], logs[0]), None]
    wait("the first rows", lambda: newest() > 100, 120)
    runners[1] = start(["run", "--standby", "--name", "tk", "--state", str(states[1]), "--source", src_uri], logs[1])
    results: dict[str, list[float]] = {}
    active, seen = 0, [0, 0]  # per log: "standing by" lines before its runner's latest start

    def standing(i: int) -> int:
        return logs[i].read_text().count("standing by; active")

    kinds = [k for k in args.kinds.split(",") for _ in range(args.rounds)]
    for i, kind in enumerate(kinds):
        standby = 1 - active
        wait("the standby to stand by", lambda: standing(standby) > seen[standby], 120, 0.2)
        time.sleep(2)  # the active runner in its stride
        ended = time.monotonic()
        os.killpg(runners[active].pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)  # type: ignore[union-attr]
        mark = writer.last
        wait("a row committed after the end in the sink", lambda: newest() > mark, 120)
        took = time.monotonic() - ended
        results.setdefault(kind, []).append(took)
        log(f"round {i + 1} {kind}: {took:.2f}s from the end of the active runner to a new row in the {args.sink}")
        old = runners[active]
        assert old is not None
        if kind == "freeze":
            os.killpg(old.pid, signal.SIGCONT)
            code = old.wait(timeout=120)
            if code != 2:
                raise SystemExit(f"the woken runner exited {code}, not 2 (LeaseLost): see {logs[active]}")
        else:
            old.wait()
        seen[active] = standing(active)
        runners[active] = start(["run", "--standby", "--name", "tk", "--state", str(states[active])], logs[active])
        active = standby
    writer.stop.set()
    for kind, xs in results.items():
        s = spread(xs)
        assert s is not None
        print(f"{args.sink} {kind:6} lease {args.lease}: median {s[0]:.2f}s  [{s[1]:.2f} - {s[2]:.2f}] "
              f"over {len(xs)} takeovers")
    for p in runners:
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
