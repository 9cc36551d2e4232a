"""One micro-batch delivered to Kafka, exactly once (one transaction) or at least once.

Exactly once, after Materialize's Kafka sink: every batch gets a fresh transactional producer
whose `init_transactions()` fences any earlier one of the feed (same transactional id) and ends
its open transaction. Only then is the progress topic read, by a read_committed consumer or from
the transaction markers (`progress_reader`, sinks.kafka.probe): if the last committed progress
record of this feed names this query and a batch id at or past this one, the batch is already in
Kafka and is skipped. Otherwise its
messages, then its progress record, go in one transaction. A crash anywhere before the commit
leaves an aborted (or fenced, then aborted) transaction; a crash after it leaves a committed
batch that the replay skips. A timed-out commit has an unknown outcome: the producer is dropped
and the batch fails, and the next attempt's fresh producer and progress read settle it.

Spark replays a batch with the same id and the same offsets (its offset log), so (query id,
batch id) names the batch's content; the query id changes only with a new checkpoint. As a
second guard, a batch whose end LSN is not past the committed one is aborted, not committed.

Runners of different lease terms (postgres.lease): each progress record carries its runner's term
(`epoch`), and a runner that takes the feed claims Kafka for its term before its first batch
(`claim`: a transaction of one progress record, the last one re-stated with the new term, after
an init_transactions that fences every earlier producer of the feed). A batch whose progress read
finds a later term is refused (LeaseLost): a runner that lost its lease delivers nothing more,
and one whose transaction was open at the claim is fenced by the claim's init_transactions.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from changefeed import faults
from changefeed.core.change import BatchProgress
from changefeed.core.envelope import Record
from changefeed.core.offsets import Offset
from changefeed.errors import ChangefeedError, LeaseLost, SinkError, TransientError
from changefeed.sinks.kafka.failures import ProducerFenced, kafka_error
from changefeed.sinks.kafka.options import KafkaOptions
from changefeed.sinks.messages import Message, Run

POLL_S = 0.05
CLAIM_TRIES = 8  # a claim fenced by a leftover task of the runner's stopped query is tried again this often
CLAIM = "(claim)"  # the query a claim opens its transaction as: no Spark query id looks like it


@dataclass(frozen=True)
class ProgressRecord:
    """The progress record a batch commits with its data: key = the feed's name."""

    feed: str
    query: str  # Spark's query id: the same across restarts of one checkpoint
    batch: int
    progress: BatchProgress
    messages: int
    epoch: int = 0  # the lease term of the runner that wrote it (0: written before terms)
    claimed: bool = False  # a claim's record (KafkaBatch.claim): the last batch's, re-stated with a new term

    def encode(self) -> bytes:
        return json.dumps({"feed": self.feed, "query": self.query, "batch": self.batch, "messages": self.messages,
                           "progress": self.progress.__dict__, "epoch": self.epoch,
                           **({"claimed": True} if self.claimed else {})}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, value: bytes) -> ProgressRecord:
        d = json.loads(value)
        return cls(d["feed"], d["query"], int(d["batch"]), BatchProgress.from_json(d["progress"]), int(d["messages"]),
                   int(d.get("epoch") or 0), bool(d.get("claimed")))


def committed_progress(opts: KafkaOptions, feed: str) -> ProgressRecord | None:
    """The feed's last committed progress record in the progress topic, None if it has none; read
    as `opts.progress_reader` says (auto, if the driver did not resolve it: probed here, once per process)."""
    from changefeed.sinks.kafka.probe import resolve
    from changefeed.sinks.kafka.progress import reader

    opts = resolve(opts, feed)
    key = feed.encode()
    found = reader(opts.progress_reader)(opts.client_config(), opts.progress_topic, 0, lambda r: r.key == key,
                                         timeout=opts.timeout_s)
    if found is None or found.value is None:
        return None
    try:
        return ProgressRecord.decode(found.value)
    except (ValueError, KeyError, TypeError) as e:
        raise SinkError(f"the progress record of feed {feed} at {opts.progress_topic}[0]@{found.offset} is "
                        f"not readable: {e}", "another program writes to the progress topic under this feed's "
                        "name; give the sink its own progress_topic") from None


class KafkaBatch:
    """open() -> skip or begin; send() each message in order; close(progress) commits."""

    def __init__(self, opts: KafkaOptions, feed: str, query: str, batch: int,
                 read_progress: Callable[[KafkaOptions, str], ProgressRecord | None] = committed_progress,
                 epoch: int | None = None) -> None:
        self.opts, self.feed, self.query, self.batch, self.read_progress = opts, feed, query, batch, read_progress
        self.epoch = epoch  # the runner's lease term; None: a run that holds none
        self.exactly_once = opts.delivery == "exactly_once"
        self.sent = 0
        self._marked = 0  # of `sent`, how many the sink_write fault point was reached for (send_part)
        self._committed = 0  # of `sent`, those in committed transactions (a followed batch commits several)
        self._producer: Any = None
        self._failed: list[Any] = []
        self._partitions: dict[str, int] = {}  # topic -> partition count, for messages to all partitions
        self._topics: set[str] = set()  # known to exist
        self._in_txn = False
        self._last: ProgressRecord | None = None

    # -- life of the batch ----------------------------------------------------------------------
    def open(self) -> ProgressRecord | None:
        """Start the batch; returns the committed progress record if this batch is already in Kafka."""
        if not self._start():
            return None
        if self._last is not None and self._last.query == self.query and self._last.batch >= self.batch:
            self._drop()
            return self._last
        self._begin()
        return None

    def open_in_parts(self) -> ProgressRecord | None:
        """Start a batch of a feed in low-latency mode, which commits whenever what was sent makes
        a whole batch or sub-window (kafka.followed), exactly once. Returns the committed progress
        record if all of the batch is in Kafka already: a later batch's is there, or this (not
        followed) batch's own. A followed batch's own record says only that some of it is."""
        assert self.exactly_once, "a batch in parts commits a transaction per part"
        self._start()
        last = self._last
        if last is not None and last.query == self.query and (
                last.batch > self.batch or (last.batch == self.batch and not _followed(last))):
            self._drop()
            return last
        self._begin()
        return None

    def restart(self) -> None:
        """Give up what was sent since the last commit (it was in Kafka before) and begin anew."""
        from confluent_kafka import KafkaException

        try:
            self._producer.abort_transaction(self.opts.timeout_s)
        except KafkaException as e:
            raise self._fail(kafka_error(e, f"aborting a transaction of batch {self.batch}", self.opts)) from None
        self._in_txn, self._committed = False, self.sent
        self._begin()

    def _begin(self) -> None:
        from confluent_kafka import KafkaException

        try:
            self._producer.begin_transaction()
        except KafkaException as e:
            raise self._fail(kafka_error(e, "beginning a transaction", self.opts)) from None
        self._in_txn = True

    def _start(self) -> bool:
        """A fresh producer; exactly once (returns True), its transactions initialised (which fences
        every earlier producer of the feed), then the feed's last committed progress read."""
        from confluent_kafka import KafkaException, Producer

        try:
            # Delivery reports for failures only: no Python call per message that arrived.
            self._producer = Producer(self.opts.producer_config(self.feed), error_cb=self._on_error,
                                      on_delivery=self._on_delivery, **{"delivery.report.only.error": True})
            if not self.exactly_once:
                return False
            self._producer.init_transactions(self.opts.timeout_s)
        except KafkaException as e:
            raise self._fail(kafka_error(e, "starting the producer", self.opts)) from None
        try:
            self._last = self.read_progress(self.opts, self.feed)
        except KafkaException as e:
            raise self._fail(kafka_error(e, "reading the progress topic", self.opts)) from None
        except ChangefeedError as e:
            raise self._fail(e) from None
        if self._last is not None and self.epoch is not None and self._last.epoch > self.epoch:
            raise self._fail(LeaseLost(
                f"feed {self.feed}: this runner's lease (term {self.epoch}) was taken over (term "
                f"{self._last.epoch} claimed Kafka); batch {self.batch} was not delivered",
                "nothing of the batch was delivered; the runner holding the lease goes on with the feed",
                component="sink"))
        return True

    def claim(self) -> None:
        """As a batch of no messages: fence every earlier producer of the feed, then commit its last
        progress record again with this term (one with no batch, if the feed has none yet). A
        later term's claim found there is left as it is: this runner's batches are then refused."""
        from confluent_kafka import KafkaException

        try:
            done = self.open()
        except LeaseLost:
            return
        assert done is None, "no progress record names the claim's query"
        last, epoch = self._last, self.epoch or 0
        nothing = BatchProgress(0, 0, None, 0, ())
        record = (ProgressRecord(self.feed, last.query, last.batch, last.progress, last.messages, epoch, True)
                  if last is not None else ProgressRecord(self.feed, "", -1, nothing, 0, epoch, True))
        try:
            self._producer.produce(self.opts.progress_topic, key=self.feed.encode(), value=record.encode(),
                                   partition=0)
            self._flush()
            self._producer.commit_transaction(self.opts.timeout_s)
            self._in_txn = False
        except KafkaException as e:
            raise self._fail(kafka_error(e, f"claiming the feed for lease term {epoch}", self.opts)) from None
        except ProducerFenced as e:
            raise self._fail(ProducerFenced(f"claiming the feed for lease term {epoch}: {e.message}", e.hint,
                                            component="sink")) from None
        except ChangefeedError as e:
            raise self._fail(e) from None
        finally:
            if not self._in_txn:
                self._producer = None

    def send_part(self, part: Message | Run) -> None:
        """Queue a message or a run of them (sinks.messages). The crash tests' `sink_write` fault
        point is reached once per thousand messages queued, however they came."""
        if isinstance(part, Run):
            self.send_run(*part)
        else:
            self.send(part.topic, part.record)
        while self.sent >= self._marked + 1000:
            self._marked += 1000
            faults.reach("sink_write")  # (in the middle of a transaction)

    def send(self, topic: str, record: Record, partition: int | None = None) -> None:
        """Queue one message; librdkafka sends in order per partition (idempotent producer)."""
        if record.key is None and partition is None and record.value is not None:
            for p in range(self.partitions(topic)):  # no key (a truncate): every partition's reader must see it
                self.send(topic, record, p)
            return
        self._known(topic)
        args: dict[str, Any] = {"key": record.key, "value": record.value}
        if record.headers:
            args["headers"] = list(record.headers)
        if partition is not None:
            args["partition"] = partition
        while True:
            try:
                self._producer.produce(topic, **args)
                break
            except BufferError:  # the local queue is full: let deliveries drain it
                self._producer.poll(POLL_S)
        self.sent += 1
        if self.sent % 10_000 == 0:
            self._producer.poll(0)

    def send_run(self, topic: str, keys: list[bytes], values: list[bytes], tombstones: bool = False) -> None:
        """Queue messages of one topic, each key with its value (then a tombstone of the key if
        `tombstones`): send() for many messages at once, without a call of ours per message."""
        self._known(topic)
        produce = self._producer.produce
        for key, value in zip(keys, values):
            for v in (value, None) if tombstones else (value,):
                while True:
                    try:
                        produce(topic, v, key)
                        break
                    except BufferError:  # the local queue is full: let deliveries drain it
                        self._producer.poll(POLL_S)
        self.sent += len(keys) * (2 if tombstones else 1)
        self._producer.poll(0)

    def _known(self, topic: str) -> None:
        """Fails with an earlier delivery's error; creates `topic` if new (with the sink's
        partitions, not as the broker might auto-create it)."""
        self._check()
        if topic not in self._topics:
            self.ensure_topics([topic])
            self._topics.add(topic)

    def partitions(self, topic: str) -> int:
        if topic not in self._partitions:
            from confluent_kafka import KafkaException

            self.ensure_topics([topic])
            try:
                meta = self._producer.list_topics(topic, timeout=self.opts.timeout_s)
            except KafkaException as e:
                raise self._fail(kafka_error(e, f"reading the partitions of {topic}", self.opts)) from None
            t = meta.topics.get(topic)
            if t is None or t.error is not None or not t.partitions:
                raise self._fail(SinkError(f"Kafka {self.opts.bootstrap}: topic {topic} has no partitions "
                                           f"({t.error if t is not None else 'missing'})",
                                           "create the topic, or let the sink create it (create_topics=true)"))
            self._partitions[topic] = len(t.partitions)
        return self._partitions[topic]

    def ensure_topics(self, topics: list[str]) -> None:
        if self.opts.create_topics:
            from changefeed.sinks.kafka.admin import create_topics

            create_topics(self.opts, topics)

    def resolved(self, topics: list[str], value: bytes) -> None:
        """A resolved message to every partition of `topics`, after the batch's messages."""
        for topic in topics:
            for p in range(self.partitions(topic)):
                self.send(topic, Record(None, value), p)

    def close(self, progress: BatchProgress) -> ProgressRecord:
        """Deliver what was sent: commit the transaction with the progress record, or (at least
        once) wait until every message was acknowledged."""
        if self.exactly_once and self._last is not None and self._last.progress.end_lsn >= progress.end_lsn > 0:
            self.abort()  # already in Kafka under another query id: never twice
            return self._last
        return self._commit(progress, then_begin=False)

    def commit_part(self, progress: BatchProgress) -> ProgressRecord:
        """A followed batch's sub-window(s), sent since the last commit: commit them with their
        progress record, then begin the next transaction on the same producer."""
        assert self._last is None or progress.end_lsn > self._last.progress.end_lsn, "committed before"
        return self._commit(progress, then_begin=True)

    def _commit(self, progress: BatchProgress, *, then_begin: bool) -> ProgressRecord:
        from confluent_kafka import KafkaException

        record = ProgressRecord(self.feed, self.query, self.batch, progress, self.sent - self._committed,
                                self.epoch or 0)
        try:
            if not self.exactly_once:
                self._flush()
                return record
            self._producer.produce(self.opts.progress_topic, key=self.feed.encode(), value=record.encode(),
                                   partition=0)
            self._flush()
            self._producer.commit_transaction(self.opts.timeout_s)
            self._in_txn = False
            self._last, self._committed = record, self.sent
            if then_begin:
                self._producer.begin_transaction()
                self._in_txn = True
            return record
        except KafkaException as e:
            raise self._fail(kafka_error(e, f"committing batch {self.batch}", self.opts)) from None
        except ChangefeedError as e:
            raise self._fail(e) from None
        finally:
            if not self._in_txn:
                self._producer = None  # done: a fresh one (a fresh epoch) for the next batch

    @property
    def recorded_end(self) -> int:
        """The end LSN of the feed's last committed progress record, once open (0: none)."""
        return self._last.progress.end_lsn if self._last is not None else 0

    @property
    def uncommitted(self) -> int:
        """Messages sent since the last commit (or the start)."""
        return self.sent - self._committed

    def _flush(self) -> None:
        """Wait until every message sent was acknowledged: each one is, or fails, within the delivery
        timeout (message.timeout.ms), so a flush that long plus one step ends with a verdict."""
        try:
            left = self._producer.flush(self.opts.timeouts.delivery_ms / 1000 + self.opts.timeout_s)
        except SystemError:  # the binding's answer to a fatal error (a fenced producer)
            if not self._failed:  # (else _check asks for the cause when the deliveries were purged)
                self._fatal()
            self._check()
            raise
        self._check()
        if left:
            raise TransientError(f"Kafka {self.opts.bootstrap}: {left} messages of batch {self.batch} not "
                                 "acknowledged in time", "the feed resumes from its checkpoint when run again")

    def abort(self) -> None:
        """Give the batch up: its transaction aborted (best effort: fencing ends it otherwise)."""
        if self._producer is not None and self._in_txn:
            try:
                self._producer.abort_transaction(self.opts.timeout_s)
            except Exception:  # noqa: BLE001 - the next producer's init_transactions aborts it anyway
                pass
            self._in_txn = False
        self._drop()

    # -- errors -----------------------------------------------------------------------------------
    def _on_delivery(self, err: Any, msg: Any) -> None:
        if err is not None and not self._failed:
            try:
                topic = msg.topic()
            except Exception:  # noqa: BLE001 - the binding may call back with an error of its own pending
                topic = ""
            self._failed.append((err, topic))

    def _on_error(self, err: Any) -> None:
        """librdkafka's global errors: only fatal ones end the batch (the others it retries itself).
        A fatal one is the cause of whatever deliveries failed with it (purged): it goes first."""
        if err.fatal() and not any(e.fatal() for e, _ in self._failed):
            self._failed.insert(0, (err, ""))

    def _fatal(self) -> None:
        """The producer's fatal error first among the failures: the deliveries it purged name only
        that; a transaction's abort fails at once with the cause itself."""
        from confluent_kafka import KafkaException

        if self.exactly_once and not any(e.fatal() for e, _ in self._failed):
            try:
                self._producer.abort_transaction(self.opts.timeout_s)
            except KafkaException as e:
                if e.args and e.args[0].fatal():
                    self._failed.insert(0, (e.args[0], ""))

    def _check(self) -> None:
        if self._failed:
            from confluent_kafka import KafkaError, KafkaException

            if self._failed[0][0].code() == KafkaError._PURGE_QUEUE:  # purged by a fatal error, maybe
                self._fatal()
            err, topic = self._failed[0]
            raise kafka_error(KafkaException(err), f"delivering batch {self.batch}" + (f" to {topic}" if topic else ""),
                              self.opts)

    def _fail(self, error: ChangefeedError) -> ChangefeedError:
        self._drop()
        return error

    def _drop(self) -> None:
        """Forget the producer without closing it (a fenced one may never answer a close); its
        transaction, if any, is aborted by the next init_transactions of the feed."""
        if self._producer is not None:
            try:
                self._producer.purge()
            except Exception:  # noqa: BLE001 - purging is best effort: the transaction is aborted anyway
                pass
        self._producer = None
        self._in_txn = False


def _followed(record: ProgressRecord) -> bool:
    """Whether `record` is a followed batch's sub-window's (core.followed): its offset says so."""
    offset = record.progress.offset
    return offset is not None and Offset.from_json(offset).follow > 0


def claim(opts: KafkaOptions, feed: str, epoch: int) -> None:
    """Claim the feed's Kafka sink for lease term `epoch` (see the module doc). A claim fenced in
    turn is tried again: a later term's runner would have claimed with its own term, which the next
    try reads and leaves be; otherwise the fencer is a task of this runner's query just stopped
    (a re-attach), still starting a batch's transaction, and the next try fences it."""
    for attempt in range(CLAIM_TRIES):
        try:
            KafkaBatch(opts, feed, CLAIM, -1, epoch=epoch).claim()
            return
        except ProducerFenced:
            if attempt == CLAIM_TRIES - 1:
                raise
            time.sleep(min(0.1 * 2 ** attempt, 2.0))
