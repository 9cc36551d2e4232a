"""`changefeed-sink`: the one PySpark streaming sink that drives every sink's batch writer.

Each writer task builds the feed's `BatchWriter` (sinks.base) from the query's options, hands it
the task's rows decoded (sinks.batch_input) and returns its result to the driver; the driver's
`commit` gives the writer every task's result. Whatever a sink raises leaves Spark as one
structured marker line (errors.carried) that the runner turns back into the same typed error, so
a sink never reports through Spark's own text.

The sink's package (with numpy, Arrow, its client library) is imported by `write` and `commit`
alone: Spark imports this module in each of the Python processes it starts one after another to
plan a query, where imports would only delay a feed's start.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSource,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)

from changefeed.errors import SinkError, carried

if TYPE_CHECKING:
    from changefeed.sinks.base import BatchWriter
    from changefeed.sinks.batch_input import Task


class Written(WriterCommitMessage):
    """One writer task's result, as its sink's `write` returned it."""

    def __init__(self, result: Any) -> None:
        self.result = result


class SinkSource(DataSource):
    """Options: sink (the package name, sinks.registry), uri, feed, multi_node, and the sink's own
    (sinks.base.Sink.writer_options)."""

    @classmethod
    def name(cls) -> str:
        return "changefeed-sink"

    def streamWriter(self, schema: Any, overwrite: bool) -> "SinkStreamWriter":
        return SinkStreamWriter(dict(self.options))


def task() -> "Task":
    """Which writer task this is; Spark passes the batch and query as task properties."""
    from changefeed.sinks.batch_input import Task

    ctx = TaskContext.get()
    batch = ctx.getLocalProperty("streaming.sql.batchId") if ctx is not None else None
    if ctx is None or batch is None:
        raise SinkError("changefeed sinks run only inside a streaming query's micro-batch",
                        "start it with writeStream (changefeed run does)")
    return Task(int(batch), str(ctx.getLocalProperty("sql.streaming.queryId") or ""), ctx.partitionId(),
                ctx.taskAttemptId())


class SinkStreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, options: dict[str, str]) -> None:
        self.options = options

    def _writer(self) -> "BatchWriter":
        from changefeed.sinks.registry import sink_named

        return sink_named(self.options["sink"]).writer(self.options)

    def write(self, iterator: Iterator[Any]) -> Written:
        from changefeed.sinks.batch_input import BatchInput

        with carried("sink"):
            rows = BatchInput(iterator, task(), multi_node=self.options.get("multi_node") == "true")
            return Written(self._writer().write(rows))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        with carried("sink"):
            self._writer().commit(_results(messages), batchId)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        with carried("sink"):
            self._writer().abort(_results(messages), batchId)


def _results(messages: list[WriterCommitMessage | None]) -> list[Any]:
    """The writer tasks' results (a task that returned no message is left out)."""
    out = []
    for m in messages:
        if m is not None:
            assert isinstance(m, Written), f"a writer task returned a {type(m).__name__}"  # write returns Written
            out.append(m.result)
    return out
