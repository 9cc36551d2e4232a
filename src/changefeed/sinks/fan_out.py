"""One writer task's rows handed to several sinks at once: one read of the slot, every sink fed.

A feed with several sinks (spec.sinks) has one writer task per batch, which reads the batch once
and gives each packed chunk to every sink's writer, each running in a thread of its own over a
short queue: the sinks write side by side, at the pace of the slowest, and the task holds only a
few chunks in memory whatever the batch's size. Each sink commits the batch on its own terms
(its ledger): one that failed leaves the others' commits standing, and the replay of the batch
(Spark plans it again, with the same rows) reaches only the sinks whose ledgers lack it.

A writer may return before it has read all its input (a Kafka batch found committed before):
what it did not read is dropped for it, and the others go on.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from changefeed.errors import ChangefeedError, QueryFailed
from changefeed.sinks.base import BatchWriter
from changefeed.sinks.batch_input import BatchInput, Task

QUEUED = 4  # packed chunks waiting per sink
PUT_WAIT_S = 0.2  # how often a full queue's reader is looked at while a chunk waits for room
_END = object()


@dataclass
class Writing:
    """One sink of the batch: its name, its writer, and what it takes the packed rows through
    (sinks.base.Sink.beside: the shape its writer tasks get when the sink writes alone)."""

    name: str
    writer: BatchWriter
    shaped: Callable[[Iterator[Any]], Iterator[Any]] = iter


@contextmanager
def named(sink: str) -> Iterator[None]:
    """A sink's error names the sink (its message, and the component retry and status show)."""
    try:
        yield
    except ChangefeedError as e:
        e.message = f"sink {sink}: {e.message}"
        e.component = f"sink {sink}"
        raise


def write_all(packed: Iterator[Any], sinks: list[Writing], task: Task, multi_node: bool) -> list[Any]:
    """Each sink's `write` result, in the order of `sinks`, once all returned; the first failure
    (in that order) is raised, named, after every sink ended."""
    lanes = [_Lane(s, task, multi_node) for s in sinks]
    try:
        for chunk in packed:
            for lane in lanes:
                lane.put(chunk)
    except BaseException as e:
        for lane in lanes:
            lane.put(_Failed(e))
        raise
    finally:
        for lane in lanes:
            lane.put(_END)
            lane.thread.join()
    for lane in lanes:
        if lane.error is not None:
            raise lane.error
    return [lane.result for lane in lanes]


@dataclass(frozen=True)
class _Failed:
    """The task's input failed: each sink's writer sees it as its own input failing."""

    error: BaseException


class _Lane:
    """One sink's thread and queue."""

    def __init__(self, sink: Writing, task: Task, multi_node: bool) -> None:
        self.sink = sink
        self.result: Any = None
        self.error: BaseException | None = None
        self.queue: queue.Queue[Any] = queue.Queue(QUEUED)
        self.thread = threading.Thread(target=self._run, args=(task, multi_node), name=f"sink-{sink.name}",
                                       daemon=True)
        self.thread.start()

    def put(self, item: Any) -> None:
        """Queue `item` for the sink, unless its writer ended (then it takes nothing more)."""
        while self.thread.is_alive():
            try:
                self.queue.put(item, timeout=PUT_WAIT_S)
                return
            except queue.Full:
                continue

    def _input(self) -> Iterator[Any]:
        while (item := self.queue.get()) is not _END:
            if isinstance(item, _Failed):
                raise QueryFailed(f"the batch's input failed: {type(item.error).__name__}: {item.error}",
                                  "the batch is replayed", component="query")
            yield item

    def _run(self, task: Task, multi_node: bool) -> None:
        try:
            with named(self.sink.name):
                self.result = self.sink.writer.write(BatchInput(self.sink.shaped(self._input()), task,
                                                                multi_node=multi_node, sink=self.sink.name))
        except BaseException as e:  # noqa: BLE001 - raised by write_all on the task's thread
            self.error = e
