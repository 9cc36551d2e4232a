"""A followed batch delivered to Kafka (low-latency mode, core.followed): a transaction per sub-window.

The batch's task follows the slot for a while (spark.follow); its writer keeps one transactional
producer for all of it. That producer's init_transactions fences every earlier one of the feed,
then the progress topic says how far the feed is in Kafka: the end LSN of its last committed
record. Changes committed before it are left out (a batch read again from its start after a
crash or a retried task), and the rest go out sub-window by sub-window, each in a transaction
with its progress record, whose offset is where the next batch starts (the driver keeps it in
the end file, sinks.message_writer). So a read_committed consumer sees a sub-window as soon as
its transaction commits, every change once.

Group commit, as the replica's: a whole sub-window already waiting in the task's input joins
the open transaction, for up to FOLD_S, so a writer behind its reader commits less often.
Resolved messages (emit_resolved) go out at most once every followed.RESOLVED_S, in a sub-window's
transaction, rather than with each.
"""
from __future__ import annotations

import time

from changefeed import faults
from changefeed.core import change as ch
from changefeed.core import followed
from changefeed.core.envelope import resolved
from changefeed.errors import IncompleteBatch
from changefeed.sinks import handoff
from changefeed.sinks.batch_input import BatchInput, unsent
from changefeed.sinks.kafka.batch import KafkaBatch, committed_progress
from changefeed.sinks.kafka.options import KafkaOptions
from changefeed.sinks.messages import MessageStream

FOLD_S = 0.05  # the longest a transaction takes in sub-windows that wait (group commit)


def deliver_followed(batch: BatchInput, stream: MessageStream, out: KafkaBatch,
                     resolved_topics: list[str] | None) -> ch.BatchProgress | None:
    """Deliver a batch of a feed in low-latency mode, committed with its progress record whenever
    what was sent makes a whole batch or sub-window (a followed batch: at each sub-window; any
    other, such as a snapshot's: once, at its end). Returns the progress of all it committed
    (None: nothing new). `resolved_topics`: where resolved messages go (None: none)."""
    skipped = out.open_in_parts()
    if skipped is not None:  # all of it committed before a crash: Spark replays it, Kafka has it
        return skipped.progress
    done = out.recorded_end
    committed: list[ch.BatchProgress] = []

    def deliver(chunks: handoff.Handoff) -> None:
        began, resolved_at = 0.0, 0.0
        for rb in chunks:
            if not out.uncommitted:
                began = time.monotonic()
            for part in stream.parts(unsent(rb, done)):
                out.send_part(part)
            if not (handoff.ends_with_progress(rb) and stream.whole()):
                continue
            if time.monotonic() - began < FOLD_S and chunks.progress_waits():
                continue  # group commit: the next sub-window joins this transaction
            progress = stream.take_progress()
            if progress.end_lsn <= done:  # all of it in Kafka before (a batch read again under another query)
                if out.uncommitted:
                    out.restart()
                continue
            if resolved_topics is not None and time.monotonic() - resolved_at >= followed.RESOLVED_S:
                out.resolved(resolved_topics, resolved(progress.resolved_ts))
                resolved_at = time.monotonic()
            faults.reach("before_sink_commit")
            out.commit_part(progress)
            faults.reach("after_sink_commit")
            committed.append(progress)
        if out.uncommitted:
            raise IncompleteBatch(f"the followed batch's input ended with {out.uncommitted} messages no sub-window "
                                  "closed: its task was cut short, and they are not committed",
                                  "none: they are read again when the query runs next")

    try:
        handoff.run(batch.batches(), deliver)
    finally:
        out.abort()  # the transaction begun after the last commit (or one cut short)
    return followed.together(committed)


class CommittedEnd:
    """The end LSN of the feed's last committed progress record, as a followed batch's read asks
    it (sinks.base.Recorded): each ask reads the progress topic afresh."""

    def __init__(self, opts: KafkaOptions, feed: str) -> None:
        self.opts, self.feed = opts, feed

    def __call__(self) -> int:
        last = committed_progress(self.opts, self.feed)
        return last.progress.end_lsn if last is not None else 0

    def close(self) -> None:
        """Nothing held between asks."""
