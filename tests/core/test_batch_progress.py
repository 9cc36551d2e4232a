"""BatchProgress.of: a batch's progress needs one `P` row from each of its input partitions."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.core.change import BatchProgress, Progress
from changefeed.errors import IncompleteBatch


def _parts(n: int) -> list[Progress]:
    """A window (partition 0) and n - 1 snapshot chunks."""
    window = Progress(500, 50, 7, 10, part=0, parts=n)
    chunks = [Progress(500, 50, None, 100 + i, {"no": i, "table": "public.t", "rows": 100 + i, "read_lsn": 1},
                       part=i, parts=n) for i in range(1, n)]
    return [window, *chunks]


@given(st.integers(1, 12), st.randoms())
def test_all_partitions_in_any_order_make_the_batch(n: int, rnd: object) -> None:
    parts = _parts(n)
    rnd.shuffle(parts)  # type: ignore[attr-defined]
    got = BatchProgress.of(parts)
    assert got.changes == 10 + sum(100 + i for i in range(1, n))
    assert sorted(c["no"] for c in got.chunks) == list(range(1, n))


def test_merge_takes_the_latest_bound_and_times_and_adds_the_changes() -> None:
    window = Progress(300, 30, 7, 10, part=1, parts=2)
    chunk = Progress(300, 30, None, 50, {"no": 3, "table": "public.t", "rows": 50, "read_lsn": 1}, part=0, parts=2)
    merged = BatchProgress.of([chunk, window])
    assert (merged.end_lsn, merged.resolved_ts, merged.last_commit_time, merged.changes) == (300, 30, 7, 60)
    assert merged.chunks == (chunk.chunk,)


@given(st.integers(2, 12), st.data())
def test_a_missing_partition_is_an_incomplete_batch(n: int, data: st.DataObject) -> None:
    parts = _parts(n)
    kept = data.draw(st.lists(st.sampled_from(range(n)), min_size=1, max_size=n - 1, unique=True))
    with pytest.raises(IncompleteBatch, match=f"of its {n}: it was cut short"):
        BatchProgress.of([parts[i] for i in kept])


def test_a_repeated_or_disagreeing_partition_is_an_incomplete_batch() -> None:
    window, chunk = _parts(2)
    with pytest.raises(IncompleteBatch):
        BatchProgress.of([window, window])
    with pytest.raises(IncompleteBatch):
        BatchProgress.of([window, chunk, Progress(500, 50, None, 1, part=2, parts=3)])


def test_no_progress_row_is_an_incomplete_batch() -> None:
    with pytest.raises(IncompleteBatch, match="no progress row"):
        BatchProgress.of([])
