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

import json
from collections.abc import Iterator
from contextlib import nullcontext
from functools import partial
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
    """One writer task's result: per sink of the feed, what its `write` returned."""

    def __init__(self, results: list[Any]) -> None:
        self.results = results


class SinkSource(DataSource):
    """Options: targets (a JSON list, per sink of the feed: name, sink (the package name,
    sinks.registry), uri, feed, key (its ledger's), multi_node, and the sink's own options,
    sinks.base.Sink.writer_options)."""

    @classmethod
    def name(cls) -> str:
        return "changefeed-sink"

    def streamWriter(self, schema: Any, overwrite: bool) -> "SinkStreamWriter":
        return SinkStreamWriter(json.loads(self.options["targets"]))


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
    """One sink writes as its own shape asks (sinks.base.Sink.plan); several write side by side
    in the batch's one task (sinks.fan_out), and commit one after the other on the driver."""

    def __init__(self, targets: list[dict[str, str]]) -> None:
        self.targets = targets

    def _named(self, target: dict[str, str]) -> Any:
        from changefeed.sinks.fan_out import named

        return named(target["name"]) if len(self.targets) > 1 else nullcontext()

    def write(self, iterator: Iterator[Any]) -> Written:
        from changefeed.sinks.batch_input import BatchInput
        from changefeed.sinks.fan_out import Writing, write_all
        from changefeed.sinks.registry import sink_named
        from changefeed.spark.reads import resolve

        with carried("sink"):
            iterator = resolve(iterator)  # (the chunks this task reads itself)
            multi_node = self.targets[0].get("multi_node") == "true"
            if len(self.targets) == 1:
                rows = BatchInput(iterator, task(), multi_node=multi_node, sink=self.targets[0]["name"])
                return Written([_writer(self.targets[0]).write(rows)])
            sinks = [Writing(t["name"], _writer(t), partial(sink_named(t["sink"]).beside, options=t))
                     for t in self.targets]
            return Written(write_all(iterator, sinks, task(), multi_node))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        with carried("sink"):
            for i, target in enumerate(self.targets):
                with self._named(target):
                    _writer(target).commit(_results(messages, i), batchId)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        with carried("sink"):
            for i, target in enumerate(self.targets):
                with self._named(target):
                    _writer(target).abort(_results(messages, i), batchId)


def _writer(target: dict[str, str]) -> "BatchWriter":
    from changefeed.sinks.registry import sink_named

    return sink_named(target["sink"]).writer(target)


def _results(messages: list[WriterCommitMessage | None], sink: int) -> list[Any]:
    """The writer tasks' results for the feed's `sink`-th sink (a task that returned no message is
    left out)."""
    out = []
    for m in messages:
        if m is not None:
            assert isinstance(m, Written), f"a writer task returned a {type(m).__name__}"  # write returns Written
            out.append(m.results[sink])
    return out
