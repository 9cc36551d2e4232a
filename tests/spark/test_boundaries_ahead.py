"""The next batch's chunk boundaries found ahead (spark.boundaries_ahead): the planner asks the
same questions with or without them and gets the same plan; the thread answers only questions it
may (never where a table's read ends), and a failure in it costs nothing but its scans."""
from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.core import snapshot
from changefeed.spark.boundaries_ahead import BoundariesAhead

Key = list[str]


def _conn(node: str) -> Any:
    return SimpleNamespace(closed=False, close=lambda: None)


class Table:
    """Keys 1..n of each table, a boundary found by counting (as an index scan would)."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes
        self.asked: list[tuple[str, Any, int, Any]] = []
        self.lock = threading.Lock()

    def boundary(self, entry: str, after: Key | None, rows: int, upto: Key | None) -> Key | None:
        with self.lock:
            self.asked.append((entry, after, rows, upto))
        lo = int(after[0]) if after else 0
        hi = int(upto[0]) if upto else self.sizes[entry]
        return [str(lo + rows)] if lo + rows < hi else None

    def last(self, entry: str) -> Key | None:
        return [str(self.sizes[entry])] if self.sizes[entry] else None


def _plans(sizes: dict[str, int], rows: int, per_batch: int, ahead: bool) -> tuple[list[list[snapshot.Chunk]], Table]:
    """Every batch's chunks of a snapshot of `sizes`, planned as the source plans them."""
    table = Table(sizes)
    found = BoundariesAhead(lambda conn, *q: table.boundary(*q), _conn, lambda e: "n")

    def boundary(entry: str, after: Key | None, n: int, upto: Key | None) -> Key | None:
        ok, key = found.take(entry, after, n, upto)
        return key if ok else table.boundary(entry, after, n, upto)

    cursor, out = snapshot.Cursor(pending=tuple(sizes)), []
    while cursor.pending:
        chunks, cursor = cursor.plan(boundary, per_batch, rows, last=table.last)
        out.append(chunks)
        if ahead:
            found.start(cursor, lambda e: per_batch, rows, lambda e: False)
    found.close()
    return out, table


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(["public.a", "public.b", "public.c"]), st.integers(0, 400), min_size=1),
       st.integers(1, 60), st.integers(1, 5))
def test_a_snapshot_planned_with_boundaries_found_ahead_is_the_same_plan(sizes: dict[str, int], rows: int,
                                                                          per_batch: int) -> None:
    plain, asked_plain = _plans(sizes, rows, per_batch, ahead=False)
    ahead, asked_ahead = _plans(sizes, rows, per_batch, ahead=True)
    assert ahead == plain
    # each boundary is scanned once either way: the thread's answers are taken, not scanned again
    assert sorted(map(repr, asked_ahead.asked)) == sorted(map(repr, asked_plain.asked))


def test_the_thread_answers_the_next_batch_and_stops_where_a_table_s_end_must_be_seen() -> None:
    table = Table({"public.a": 100, "public.b": 100})
    found = BoundariesAhead(lambda conn, *q: table.boundary(*q), _conn, lambda e: "n")
    chunks, cursor = snapshot.Cursor(pending=("public.a", "public.b")).plan(table.boundary, 3, 20, last=table.last)
    assert [c.hi for c in chunks] == [["20"], ["40"], ["60"]]
    table.asked.clear()
    found.start(cursor, lambda e: 3, 20, lambda e: False)
    assert found.take("public.a", ["60"], 20, ["100"]) == (True, ["80"])
    # the next batch: 80, then the table's end (None), then public.b, whose end it must not look up
    assert [q[:2] for q in table.asked] == [("public.a", ["60"]), ("public.a", ["80"])]
    assert found.take("public.a", ["80"], 20, ["100"]) == (True, None)
    assert found.take("public.b", None, 20, ["100"]) == (False, None)
    assert found.take("public.a", ["60"], 30, ["100"]) == (False, None)  # another question: not its answer
    found.close()


def test_a_batch_planned_again_from_the_same_cursor_scans_nothing_again() -> None:
    """(A batch not started, --max-rate held it back, is planned again at the next poll.)"""
    table = Table({"public.a": 1000})
    found = BoundariesAhead(lambda conn, *q: table.boundary(*q), _conn, lambda e: "n")

    def boundary(entry: str, after: Key | None, n: int, upto: Key | None) -> Key | None:
        ok, key = found.take(entry, after, n, upto)
        if not ok:
            key = table.boundary(entry, after, n, upto)
            found.keep(entry, after, n, upto, key)
        return key

    cursor = snapshot.Cursor(pending=("public.a",), after=["100"], upto=["1000"])
    first = cursor.plan(boundary, 3, 50, last=table.last)
    assert len(table.asked) == 3
    assert cursor.plan(boundary, 3, 50, last=table.last) == first and len(table.asked) == 3
    found.close()


def test_what_the_planner_does_not_know_yet_stops_the_thread() -> None:
    table = Table({"public.a": 100})
    found = BoundariesAhead(lambda conn, *q: table.boundary(*q), _conn, lambda e: "n")
    cursor = snapshot.Cursor(pending=("public.a",), after=["20"], upto=["100"])
    found.start(cursor, lambda e: None, 20, lambda e: False)  # (how many chunks a batch takes: not known)
    assert found.take("public.a", ["20"], 20, ["100"]) == (False, None)
    assert table.asked == []
    found.start(cursor, lambda e: 2, 20, lambda e: None)  # (whether the table has a key: not known)
    assert found.take("public.a", ["20"], 20, ["100"]) == (True, ["40"])  # (asked before it, as the planner does)
    assert found.take("public.a", ["40"], 20, ["100"]) == (False, None)
    assert len(table.asked) == 1
    found.close()


def test_its_connections_close_once_the_snapshot_is_planned_to_its_end() -> None:
    table = Table({"public.a": 100})
    conns: list[Any] = []

    def connect(node: str) -> Any:
        conns.append(SimpleNamespace(closed=False))
        conns[-1].close = lambda c=conns[-1]: setattr(c, "closed", True)
        return conns[-1]

    found = BoundariesAhead(lambda conn, *q: table.boundary(*q), connect, lambda e: "n")
    found.start(snapshot.Cursor(pending=("public.a",), after=["20"], upto=["100"]), lambda e: 2, 20, lambda e: False)
    assert found.take("public.a", ["20"], 20, ["100"]) == (True, ["40"])
    assert len(conns) == 1 and not conns[0].closed  # (kept for the next batch)
    found.start(snapshot.Cursor(), lambda e: 2, 20, lambda e: False)  # nothing left to plan
    assert conns[0].closed


def test_a_failing_scan_leaves_the_planner_to_scan() -> None:
    def fails(conn: Any, *q: Any) -> Key | None:
        raise OSError("the server went away")

    found = BoundariesAhead(fails, _conn, lambda e: "n")
    found.start(snapshot.Cursor(pending=("public.a",), after=["20"], upto=["100"]), lambda e: 2, 20, lambda e: False)
    assert found.take("public.a", ["20"], 20, ["100"]) == (False, None)
    found.close()
