"""One writer task's rows handed to several sinks side by side (sinks.fan_out), and their ledgers
asked as one (sinks.ledgers): pure, no Spark."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.core import change as ch
from changefeed.core.offsets import Offset
from changefeed.errors import ConnectionFailed
from changefeed.sinks.batch_input import BatchInput, Task
from changefeed.sinks.fan_out import QUEUED, Writing, write_all
from changefeed.sinks.ledger import FileLedger
from changefeed.sinks.ledgers import SinkLedgers

TASK = Task(3, "query", 0, 7)


def packed(n: int) -> list[Any]:
    """`n` packed chunks of one change each, then the batch's P row."""
    rows = [ch.pack(ch.record_batch({f: [v] for f, v in _change(i).items()})) for i in range(n)]
    return [*rows, ch.pack(ch.progress_batch(ch.Progress(100 + n, 5, None, n)))]


def _change(i: int) -> dict[str, Any]:
    row: dict[str, Any] = {name: None for name in ch.NAMES}
    row.update(op="c", lsn=100 + i, seq=i, xid=1, commit_ts=5, schema="public", table="t")
    return row


class Counting:
    """A writer that counts the changes it was given, and what it saw of the batch's progress."""

    def __init__(self, stop_after: int | None = None, fail_after: int | None = None) -> None:
        self.stop_after, self.fail_after, self.thread = stop_after, fail_after, ""

    def write(self, batch: BatchInput) -> Any:
        self.thread = threading.current_thread().name
        seen = 0
        for rb in batch.batches():
            seen += sum(1 for op in rb.column("op").to_pylist() if op == "c")
            if self.fail_after is not None and seen >= self.fail_after:
                raise ConnectionFailed("the broker went away", "it comes back", component="sink")
            if self.stop_after is not None and seen >= self.stop_after:
                return ("stopped", seen)
        return seen, batch.progress().end_lsn

    def commit(self, results: list[Any], batch_id: int) -> None: ...

    def abort(self, results: list[Any], batch_id: int) -> None: ...


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 3 * QUEUED + 5), st.integers(1, 4))
def test_every_sink_gets_every_row_in_its_own_thread(n: int, sinks: int) -> None:
    writers = [Counting() for _ in range(sinks)]
    got = write_all(iter(packed(n)), [Writing(f"s{i}", w) for i, w in enumerate(writers)], TASK, False)
    assert got == [(n, 100 + n)] * sinks
    assert sorted(w.thread for w in writers) == sorted(f"sink-s{i}" for i in range(sinks))


def test_a_sink_that_fails_leaves_the_others_whole_and_is_named() -> None:
    ok, broken, also = Counting(), Counting(fail_after=2), Counting()
    with pytest.raises(ConnectionFailed) as e:
        write_all(iter(packed(3 * QUEUED)), [Writing("dr", ok), Writing("events", broken), Writing("lake", also)],
                  TASK, False)
    assert e.value.message == "sink events: the broker went away" and e.value.component == "sink events"


def test_a_sink_that_ends_early_does_not_hold_the_others() -> None:
    early, whole = Counting(stop_after=1), Counting()
    got = write_all(iter(packed(4 * QUEUED)), [Writing("a", early), Writing("b", whole)], TASK, False)
    assert got == [("stopped", 1), (4 * QUEUED, 100 + 4 * QUEUED)]


def test_input_that_fails_fails_every_sink_and_is_raised() -> None:
    def broken_input() -> Any:
        yield from packed(2)[:2]
        raise OSError("the worker's socket closed")

    writers = [Counting(), Counting()]
    with pytest.raises(OSError, match="socket closed"):
        write_all(broken_input(), [Writing("a", writers[0]), Writing("b", writers[1])], TASK, False)


def test_a_shape_of_its_own_is_applied_for_its_sink_alone() -> None:
    def doubled(chunks: Any) -> Any:
        for c in chunks:
            yield c
            if c.column("rows")[0].as_py() and ch.PROGRESS not in [r for b in ch.unpack(c)
                                                                  for r in b.column("op").to_pylist()]:
                yield c

    got = write_all(iter(packed(3)), [Writing("plain", Counting()), Writing("twice", Counting(), doubled)],
                    TASK, False)
    assert got == [(3, 103), (6, 103)]


class Fixed:
    """A ledger at a fixed position, recording its offset with its batches."""

    def __init__(self, lsn: int | None, changes: int = 0) -> None:
        self.lsn, self.changes, self.closed = lsn, changes, False

    def checkpoint(self) -> dict[str, int] | None:
        return None if self.lsn is None else {"n1": self.lsn}

    def resume_offset(self) -> dict[str, Any] | None:
        return None if self.lsn is None else Offset({"n1": self.lsn}, self.lsn * 10).to_json()

    def totals(self) -> tuple[int, int]:
        return (self.changes // 10, self.changes)

    def close(self) -> None:
        self.closed = True


def test_several_ledgers_are_as_far_as_the_least_far_one() -> None:
    each: list[Any] = [("dr", Fixed(500, 70)), ("events", Fixed(400, 60)), ("new", Fixed(None))]
    ledgers = SinkLedgers(each)
    assert ledgers.checkpoint() == {"n1": 400}
    assert Offset.from_json(ledgers.resume_offset() or {}).lsn == 400
    assert [(name, o.lsn) for name, o in ledgers.offsets()] == [("events", 400), ("dr", 500)]
    assert ledgers.totals() == (0, 0)
    ledgers.close()
    assert all(ledger.closed for _, ledger in each)
    agree = SinkLedgers([("a", Fixed(400)), ("b", Fixed(400))])  # type: ignore[list-item]
    assert {o.lsn for _, o in agree.offsets()} == {400}


def test_a_ledger_error_names_its_sink(tmp_path: Path) -> None:
    class Down(FileLedger):
        def checkpoint(self) -> dict[str, int] | None:
            raise ConnectionFailed("could not connect", "start it", component="sink")

    ledgers = SinkLedgers([("dr", FileLedger(tmp_path / "a")), ("events", Down(tmp_path / "b"))])
    with pytest.raises(ConnectionFailed, match="^sink events: could not connect"):
        ledgers.checkpoint()
