"""A followed batch into Kafka (sinks.kafka.followed), against a real server and a real broker: each
sub-window commits as a transaction with its progress record; a batch read again (its task
retried after a kill, or read from an earlier position in one window under another query) leaves
out what Kafka has, so a read_committed consumer gets every change once, in order; a task cut
short keeps its earlier sub-windows and leaves its last open one aborted."""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.compute as pc
import pytest

from changefeed.core import change as ch
from changefeed.core import followed
from changefeed.core.envelope import formatter
from changefeed.core.offsets import Offset
from changefeed.errors import IncompleteBatch
from changefeed.local.kafka import LocalKafka, committed, read_partition
from changefeed.postgres import source as src
from changefeed.postgres.decode.builder import ChangeBuilder
from changefeed.postgres.follow import FOLLOWED
from changefeed.sinks.batch_input import BatchInput, Task
from changefeed.sinks.kafka.batch import committed_progress
from changefeed.sinks.kafka.options import KafkaOptions
from changefeed.sinks.kafka.writer import KafkaWriter
from changefeed.sinks.messages import MessageStream
from support.servers import Dbs
from support.windows import followed_batches, sub_window_ends

pytestmark = pytest.mark.timeout(300)


class Target:
    """One feed's Kafka sink: a topic of one partition for table t, its own progress topic."""

    def __init__(self, kafka: LocalKafka, dbs: Dbs, tmp: Path) -> None:
        tag = uuid.uuid4().hex[:8]
        self.kafka, self.feed, self.end_file = kafka, f"f{tag}", tmp / followed.END_FILE
        self.uri = (f"kafka://{kafka.bootstrap}?topic_prefix=k{tag}.&progress_topic=progress{tag}"
                    "&timeout=10s&topic_partitions=1")
        self.opts = KafkaOptions.parse(self.uri)
        self.topic = self.opts.topic("public", "t")

    def write(self, batches: list[Any], query: str, batch_id: int, *, follow: bool = True) -> Any:
        writer = KafkaWriter({"uri": self.uri, "feed": self.feed, "key": self.feed, "format": "json", "diff": "false",
                              "database": "src", "ledger": str(self.end_file.with_name("ledger.jsonl")),
                              "outbox": "", "topics": self.topic, "follow_end": str(self.end_file) if follow else ""})
        result = writer.write(BatchInput(iter([ch.pack(rb) for rb in batches]), Task(batch_id, query, 0, batch_id)))
        writer.commit([result], batch_id)
        return result

    def messages(self) -> list[tuple[bytes, bytes]]:
        """The committed data messages (key, value), in the partition's order."""
        return [(r.key, r.value) for r in committed(read_partition(self.kafka.bootstrap, self.topic, timeout=30))]

    def expected(self, batches: list[Any]) -> list[tuple[bytes, bytes]]:
        return _expected(batches, self.feed)

    def recorded(self) -> int:
        last = committed_progress(self.opts, self.feed)
        return last.progress.end_lsn if last is not None else 0


def test_each_sub_window_commits_to_kafka_and_a_batch_read_again_doubles_nothing(
        dbs: Dbs, tmp_path: Path, kafka: LocalKafka) -> None:
    target = Target(kafka, dbs, tmp_path)
    batches, start = followed_batches(dbs, every=0.0)
    ends = sub_window_ends(batches)
    assert len(ends) > 5
    half = next(i for i in range(len(batches)) if sub_window_ends(batches[:i + 1]) == ends[:len(ends) // 2])
    first = target.write(batches[:half + 1], "q", 7)  # a task that ended halfway (cut short by a kill)
    assert first.progress.end_lsn == target.recorded() == ends[len(ends) // 2 - 1]
    assert followed.recorded_end(target.end_file).lsn == ends[len(ends) // 2 - 1]  # type: ignore[union-attr]
    assert target.messages() == target.expected(batches[:half + 1])
    # read again from the start as one window in micro-batches under another query (a lost
    # checkpoint): what Kafka has is left out, the rest sent
    with dbs.src() as c, psycopg.connect(dbs.source) as r:
        whole = ChangeBuilder(start, ends[-1], 0, FOLLOWED, lambda rel: src.column_catalog(c, rel),
                              offset=Offset({"n1": ends[-1]}, 0).to_json())
        one = list(whole.batches(src.peek(r, "s", "p", ends[-1])))
    assert target.expected(one) == target.expected(batches)
    target.write(one, "lost", 1, follow=False)
    assert target.recorded() == ends[-1] and target.messages() == target.expected(batches)
    # then the followed task tried again, and the window once more in low-latency mode: all in Kafka
    target.write(batches, "q", 7)
    target.write(one, "lost", 2)
    assert target.messages() == target.expected(batches), "nothing sent twice"


def test_a_task_cut_short_keeps_its_sub_windows_and_sends_the_rest_once(dbs: Dbs, tmp_path: Path,
                                                                       kafka: LocalKafka) -> None:
    target = Target(kafka, dbs, tmp_path)
    batches, _ = followed_batches(dbs, every=0.0, seconds=2.0)
    ends = sub_window_ends(batches)
    last_p = max(i for i, rb in enumerate(batches) if sub_window_ends([rb]))
    tail = batches[:last_p] + [batches[last_p].filter(pc.not_equal(batches[last_p].column("op"), ch.PROGRESS))]
    assert tail[-1].num_rows and len(ends) > 1  # the last sub-window's rows, without its P row
    with pytest.raises(IncompleteBatch):
        target.write(tail, "q", 3)
    assert target.recorded() == ends[-2]  # up to the sub-window before the cut-short one
    assert target.messages() == target.expected(batches[:last_p])
    target.write(batches, "q", 3)  # the task tried again
    assert target.recorded() == ends[-1] and target.messages() == target.expected(batches)


def _expected(batches: list[Any], feed: str) -> list[tuple[bytes, bytes]]:
    """The messages a consumer should see: each data row's, in order, as the sink encodes them."""
    stream = MessageStream(formatter("json", feed, False, "src"))
    return [(m.record.key, m.record.value) for rb in batches for m in stream.messages(rb)]
