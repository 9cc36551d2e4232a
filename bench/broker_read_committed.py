"""The local broker alone under a stream of small transactions: when do its read_committed consumers see them?

Tells the broker's own behaviour apart from the feed's (bench/README.md, "The boundary into Kafka"):
one transactional producer, no feed, sends `--rate` messages/s to a topic of `--partitions`
partitions in transactions of `--txn-ms` (as low-latency mode's sub-windows do), and two
consumers, `read_committed` and `read_uncommitted`, stamp each message's arrival. Every
`--seconds` a phase ends and prints produce-to-visible per consumer (p50 / p99 / max, and how
many messages had not arrived 30 s after the phase). Run it long enough to hold as many
messages as the feed's third phase did (~1.7 million).

    .venv/bin/python bench/broker_read_committed.py --phases 4 --seconds 60   # ~2.4 M messages, ~6 min
"""
from __future__ import annotations

import argparse
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from changefeed.local.kafka import LocalKafka  # noqa: E402 - after the path above


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


class Stamper(threading.Thread):
    """A consumer at `isolation`: `arrived` maps a message number to the time it was consumed."""

    def __init__(self, bootstrap: str, topic: str, partitions: int, isolation: str) -> None:
        super().__init__(daemon=True)
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"stamp-{isolation}",
                                  "isolation.level": isolation, "enable.auto.commit": False,
                                  "fetch.wait.max.ms": 5, "enable.sparse.connections": False})
        # Assigned, not subscribed: no group join to wait for before the first fetch.
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        self.stop = threading.Event()
        self.arrived: dict[int, float] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            for m in self.consumer.consume(10000, 0.01):
                if m.error() is None:
                    self.arrived[struct.unpack(">q", m.key())[0]] = time.time()
        self.consumer.close()


class Producer(threading.Thread):
    """Sends `rate` messages/s in transactions of `txn_ms`; `sent` maps a message number to its
    send time."""

    def __init__(self, bootstrap: str, topic: str, rate: int, txn_ms: float) -> None:
        super().__init__(daemon=True)
        from confluent_kafka import Producer as KProducer

        self.p = KProducer({"bootstrap.servers": bootstrap, "transactional.id": "broker-bench", "linger.ms": 5,
                            "enable.sparse.connections": False})
        self.p.init_transactions(30)
        self.topic, self.rate, self.txn_s = topic, rate, txn_ms / 1000
        self.sent: dict[int, float] = {}
        self.stop, self.n = threading.Event(), 0

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.is_set():
            self.p.begin_transaction()
            end = time.monotonic() + self.txn_s
            while (now := time.monotonic()) < end:
                due = int((now - t0) * self.rate)
                while self.n < due:
                    self.sent[self.n] = time.time()
                    self.p.produce(self.topic, key=struct.pack(">q", self.n), value=b"x" * 100)
                    self.n += 1
                self.p.poll(0)
                time.sleep(0.002)
            self.p.commit_transaction(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=int, default=10000, help="messages/s")
    ap.add_argument("--txn-ms", type=float, default=30.0, help="how long each transaction stays open")
    ap.add_argument("--partitions", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=60.0, help="seconds per phase")
    ap.add_argument("--phases", type=int, default=4)
    args = ap.parse_args()
    from confluent_kafka.admin import AdminClient, NewTopic

    with tempfile.TemporaryDirectory() as work, LocalKafka.start(Path(work) / "kafka") as kafka:
        topic = "bench"
        admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
        admin.create_topics([NewTopic(topic, args.partitions, 1)])[topic].result()
        consumers = {iso: Stamper(kafka.bootstrap, topic, args.partitions, iso)
                     for iso in ("read_committed", "read_uncommitted")}
        producer = Producer(kafka.bootstrap, topic, args.rate, args.txn_ms)
        for t in (*consumers.values(), producer):
            t.start()
        first = 0
        print(f"{args.rate}/s in {args.txn_ms:g}-ms transactions, {args.partitions} partition(s), "
              f"{args.seconds:g}-s phases; produce-to-visible in seconds")
        for phase in range(1, args.phases + 1):
            time.sleep(args.seconds)
            last = producer.n
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(last - 1 not in c.arrived for c in consumers.values()):
                time.sleep(0.2)
            for iso, c in consumers.items():
                lat = [c.arrived[i] - producer.sent[i] for i in range(first, last) if i in c.arrived]
                missing = last - first - len(lat)
                print(f"phase {phase} ({last:,} messages so far) {iso:16s} p50 {quantile(lat, .5):.3f} "
                      f"p99 {quantile(lat, .99):.3f} max {max(lat):.3f} not seen {missing}", flush=True)
            first = last
        producer.stop.set()
        producer.join()
        for c in consumers.values():
            c.stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
