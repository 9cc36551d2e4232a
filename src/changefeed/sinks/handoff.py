"""A writer task's input handed to a worker thread through a short queue.

The task's thread keeps taking Spark's input while the worker applies or delivers what came
before (a database merge, a Kafka transaction's commit), so neither waits on the other. In
low-latency mode the worker also asks whether a sub-window's `P` row waits in the queue already:
then it folds that sub-window into the transaction it has open (group commit) rather than
commit now and again at once, so a sink behind its reader catches up in fewer, larger commits.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from changefeed.core import change as ch

DEPTH = 4  # record batches (up to ~64k changes each) taken ahead of the worker
T = TypeVar("T")


class Handoff:
    """The worker's side: iterate over the record batches; `progress_waits()` for group commit."""

    def __init__(self, depth: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(depth)
        self._ended = False  # the end (or the input's failure) was taken

    def __iter__(self) -> Iterator[Any]:
        while not self._ended:
            item = self._queue.get()
            self._ended = item is _END or isinstance(item, _Failed)
            if isinstance(item, _Failed):
                raise item.error  # the input failed: what is open must not be committed
            if not self._ended:
                yield item

    def progress_waits(self) -> bool:
        """Whether a record batch ending with a `P` row waits in the queue already."""
        with self._queue.mutex:
            return any(ends_with_progress(rb) for rb in self._queue.queue
                       if rb is not _END and not isinstance(rb, _Failed))

    def _drain(self) -> None:
        """After the worker failed: let the task's thread finish (its rows are not needed)."""
        while not self._ended:
            item = self._queue.get()
            self._ended = item is _END or isinstance(item, _Failed)


def run(batches: Iterator[Any], work: Callable[[Handoff], T], depth: int = DEPTH) -> T:
    """`work(handoff)` on a worker thread while this one puts `batches` in the handoff. Either
    side's error is raised here (the input's reaches the worker first, as its iteration's error)."""
    handoff = Handoff(depth)
    result: list[T] = []
    failed: list[BaseException] = []

    def worker() -> None:
        try:
            result.append(work(handoff))
        except BaseException as e:  # noqa: BLE001 - handed to the task's thread
            failed.append(e)
            handoff._drain()

    thread = threading.Thread(target=worker, name="changefeed-sink-worker", daemon=True)
    thread.start()
    end: Any = _END
    try:
        for rb in batches:
            if failed:
                break
            handoff._queue.put(rb)
    except BaseException as e:
        end = _Failed(e)
        raise
    finally:
        handoff._queue.put(end)
        thread.join()
    if failed:
        raise failed[0]
    return result[0]


def ends_with_progress(rb: Any) -> bool:
    """Whether the record batch `rb` ends with a `P` row."""
    return bool(rb.num_rows) and rb.column("op")[rb.num_rows - 1].as_py() == ch.PROGRESS


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()
