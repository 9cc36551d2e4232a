"""The writer task's input handed to a worker thread (sinks.handoff): in order, either side's
failure raised in the task, an input that fails never looks like one that ended, and the worker
can see a `P` row waiting."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from changefeed.sinks import handoff


def rows(*ops: str) -> Any:
    return pa.record_batch({"op": pa.array(ops, pa.string())})


def test_the_worker_gets_every_batch_in_order_and_its_result_comes_back() -> None:
    batches = [rows("c", str(i)) for i in range(50)]
    assert handoff.run(iter(batches), lambda h: [rb.column("op")[1].as_py() for rb in h], depth=2) == \
        [str(i) for i in range(50)]


def test_an_input_that_fails_fails_the_workers_iteration_not_ends_it() -> None:
    ended: list[str] = []

    def failing() -> Iterator[Any]:
        yield rows("c")
        raise ConnectionError("the task's input broke")

    def work(h: handoff.Handoff) -> None:
        try:
            for _ in h:
                pass
            ended.append("cleanly")  # (would commit what it holds)
        except ConnectionError:
            ended.append("failed")
            raise

    with pytest.raises(ConnectionError, match="input broke"):
        handoff.run(failing(), work)
    assert ended == ["failed"]


def test_a_worker_that_fails_stops_the_input_being_taken() -> None:
    taken = [0]

    def many() -> Iterator[Any]:
        for _ in range(10_000):
            taken[0] += 1
            yield rows("c")

    def work(h: handoff.Handoff) -> None:
        next(iter(h))
        raise ValueError("the sink refused")

    with pytest.raises(ValueError, match="refused"):
        handoff.run(many(), work, depth=2)
    assert taken[0] < 100


def test_the_worker_sees_a_progress_row_waiting() -> None:
    go, seen = threading.Event(), []

    def slow_input() -> Iterator[Any]:
        yield rows("c")
        yield rows("c", "P")
        go.set()

    def work(h: handoff.Handoff) -> None:
        it = iter(h)
        next(it)
        go.wait(10)
        seen.append(h.progress_waits())
        for _ in it:
            seen.append(h.progress_waits())

    handoff.run(slow_input(), work, depth=4)
    assert seen == [True, False]
    assert handoff.ends_with_progress(rows("c", "P")) and not handoff.ends_with_progress(rows("P", "c"))
    assert not handoff.ends_with_progress(rows())
