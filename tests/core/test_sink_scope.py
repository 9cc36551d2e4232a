"""Snapshot rows read for some sinks alone: marked, kept for those sinks, left out for the others."""
from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.core import change as ch
from changefeed.core import sink_scope

SINKS = ["dr", "events", "lake", "lake2"]


def rows(ops: list[str]) -> Any:
    n = len(ops)
    cols: dict[str, list[Any]] = {name: [None] * n for name in ch.NAMES}
    cols.update(op=ops, lsn=list(range(n)), seq=list(range(n)), xid=[0] * n, commit_ts=[1] * n,
                schema=["public"] * n, table=["t"] * n, after=[f"{i}".encode() for i in range(n)],
                meta=['{"shape": 1}' if op == "R" else None for op in ops])
    return ch.record_batch(cols)


@settings(deadline=None)  # (the first example imports pyarrow's compute kernels)
@given(st.lists(st.sampled_from(["R", "r", "c", "u"]), max_size=30),
       st.lists(st.sampled_from(SINKS), min_size=1, max_size=3, unique=True), st.sampled_from(SINKS))
def test_marked_rows_reach_only_their_sinks_unmarked(ops: list[str], only: list[str], sink: str) -> None:
    marked = sink_scope.mark(rows(ops), tuple(only))
    got = sink_scope.for_sink(marked, sink)
    want = [(op, i) for i, op in enumerate(ops) if op != "r" or sink in only]
    assert list(zip(got.column("op").to_pylist(), got.column("seq").to_pylist())) == want
    assert [m for op, m in zip(got.column("op").to_pylist(), got.column("meta").to_pylist()) if op == "r"] == \
        [None] * sum(1 for op, _ in want if op == "r")
    assert [m for op, m in zip(got.column("op").to_pylist(), got.column("meta").to_pylist()) if op == "R"] == \
        ['{"shape": 1}'] * ops.count("R")


def test_unmarked_rows_pass_as_they_are() -> None:
    plain = rows(["R", "r", "r", "c"])
    assert sink_scope.for_sink(plain, "lake") is plain
    assert sink_scope.mark(plain, ()) is plain


def test_a_chunk_read_for_others_is_not_recorded_by_a_sink() -> None:
    read = ch.Progress(10, 5, None, 7, {"no": 3, "table": "public.t", "rows": 7, "read_lsn": 9, "only": ["lake"]})
    assert sink_scope.progress_for(read, "lake") == read
    other = sink_scope.progress_for(read, "lake2")  # (a name that only starts like it)
    assert other.chunk is None and other.changes == 0 and other.end_lsn == 10
    everyone = ch.Progress(10, 5, None, 7, {"no": 3, "table": "public.t", "rows": 7, "read_lsn": 9})
    assert sink_scope.progress_for(everyone, "dr") == everyone


def test_a_p_row_of_a_chunk_read_for_others_reaches_a_sink_without_it() -> None:
    """Sinks that record progress from the rows themselves (the replica) see it so too."""
    read = ch.Progress(10, 5, None, 7, {"no": 3, "table": "public.t", "rows": 7, "read_lsn": 9, "only": ["lake"]})
    rows = ch.progress_batch(read)
    mine = ch.Progress.from_meta(sink_scope.for_sink(rows, "lake").column("meta")[0].as_py())
    theirs = ch.Progress.from_meta(sink_scope.for_sink(rows, "dr").column("meta")[0].as_py())
    assert mine == read and theirs.chunk is None and theirs.changes == 0
