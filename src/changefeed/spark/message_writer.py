"""What the message sinks' stream writers (webhook, Kafka) share.

The batch's one writer task delivers it and returns `Delivered`; the driver's `commit` then
appends the batch to the feed's ledger file (sinks.ledger.FileLedger) for status and metrics,
and only after that does Spark record the batch as done and the source release its WAL.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage

from ..core import change as ch
from ..core.envelope import Formatter, formatter
from ..errors import carried
from ..sinks.ledger import FileLedger


class Delivered(WriterCommitMessage):
    def __init__(self, progress: ch.BatchProgress, began: float, done: float) -> None:
        self.progress, self.began, self.done = progress, began, done


class MessageWriter(DataSourceStreamArrowWriter):
    """Options shared by the message sinks: uri, feed, format, diff ("true"/"false"), database (for
    Debezium's source.db), ledger (path), outbox (core.outbox.OutboxSpec as JSON, or "")."""

    def __init__(self, options: dict[str, str]) -> None:
        self.options = options

    def batches(self, iterator: Iterator[Any]) -> Iterator[Any]:
        """The batch's record batches in the feed's order: as they come on a one-node feed; on a
        feed of several nodes all read first and put in one order (core.merge: a distributed
        transaction's parts in this one batch, with one commit timestamp), their `P` rows last."""
        unpacked = (rb for packed in iterator for rb in ch.unpack(packed))
        if self.options.get("multi_node") != "true":
            yield from unpacked
            return
        from ..core import merge

        parts = merge.split(unpacked)
        merge.refuse_truncate(parts)
        yield from merge.ordered(parts, renumber=False).to_batches(max_chunksize=65536)
        for p in parts:
            yield ch.progress_batch(p.progress)

    def formatter(self) -> Formatter:
        o = self.options
        return formatter(o["format"], o["feed"], o["diff"] == "true", o.get("database", ""))

    @carried("sink")
    def commit(self, messages: list[Delivered | None], batchId: int) -> None:
        """The batch was delivered: record it in the ledger."""
        for m in messages:  # one writer task: one message
            if m is not None:
                FileLedger(self.options["ledger"]).record(batchId, m.progress, m.began, m.done)
