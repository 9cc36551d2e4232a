"""insert_runs: how the replica applier cuts a table's change rows into insert runs (COPYed
straight into the target: inserts and snapshot reads) and the rows between them (merged),
checked against a plain loop."""
from __future__ import annotations

import itertools

import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st

from changefeed.sinks.replica.insert_run import insert_runs


def _reference(ops: list[str], min_rows: int) -> list[tuple[int, int, bool]]:
    runs: list[tuple[int, int, bool]] = []
    at = 0
    for is_insert, group in itertools.groupby(ops, key=lambda op: op in "cr"):
        n = len(list(group))
        if is_insert and n >= min_rows:
            runs.append((at, at + n, True))
        elif runs and not runs[-1][2]:
            runs[-1] = (runs[-1][0], at + n, False)
        else:
            runs.append((at, at + n, False))
        at += n
    return runs


@given(st.lists(st.sampled_from("ccccudtr"), max_size=300), st.integers(1, 12))
def test_runs_match_a_plain_loop(ops: list[str], min_rows: int) -> None:
    assert insert_runs(pa.array(ops, pa.string()), min_rows) == _reference(ops, min_rows)


def test_examples() -> None:
    ops = pa.array(list("cccudcccccdc"), pa.string())
    assert insert_runs(ops, 3) == [(0, 3, True), (3, 5, False), (5, 10, True), (10, 12, False)]
    assert insert_runs(ops, 6) == [(0, 12, False)]
    assert insert_runs(pa.array(["c"] * 4, pa.string()), 4) == [(0, 4, True)]
    assert insert_runs(pa.array([], pa.string()), 1) == []
    assert insert_runs(pa.array(list("rrcrru"), pa.string()), 5) == [(0, 5, True), (5, 6, False)]
