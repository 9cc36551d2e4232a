"""Hybrid logical clock commit timestamps: strictly increasing whatever the commit clock does."""
from __future__ import annotations

from datetime import datetime, timezone

from hypothesis import given
from hypothesis import strategies as st

from changefeed.core import hlc

# Commit times in Unix µs: from 1970 to about year 2970 (beyond that ms << 18 leaves int64).
COMMIT_US = st.integers(min_value=0, max_value=31_500_000_000_000_000)
TS = st.integers(min_value=0, max_value=1 << 62)
INT64_MAX = (1 << 63) - 1


def test_pg_epoch_is_2000_01_01_utc() -> None:
    assert hlc.PG_EPOCH_US == int(datetime(2000, 1, 1, tzinfo=timezone.utc).timestamp()) * 1_000_000


@given(st.integers(min_value=0, max_value=1 << 44), st.integers(min_value=0, max_value=hlc.LOGICAL_MASK))
def test_from_millis_splits_back(ms: int, logical: int) -> None:
    ts = hlc.from_millis(ms, logical)
    assert hlc.physical_ms(ts) == ms
    assert hlc.logical(ts) == logical
    assert hlc.from_millis(ms) <= ts <= hlc.ceiling_of_ms(ms) < hlc.from_millis(ms + 1)


@given(TS, st.lists(COMMIT_US, min_size=1, max_size=60))
def test_strictly_increasing_for_any_commit_times(start: int, commit_times: list[int]) -> None:
    prev = start
    for t in commit_times:
        ts = hlc.next_commit_ts(prev, t)
        assert ts > prev
        prev = ts


@given(TS, st.lists(st.sampled_from([0, 1, -1, -1000, 1000, -999, 999, -5_000_000]), min_size=1, max_size=80),
       COMMIT_US)
def test_strictly_increasing_with_equal_and_decreasing_times(start: int, steps: list[int], first: int) -> None:
    t, prev = first, start
    for step in steps:
        t = max(0, t + step)
        ts = hlc.next_commit_ts(prev, t)
        assert ts > prev
        prev = ts


@given(TS, COMMIT_US)
def test_never_earlier_than_the_commit_millisecond(prev: int, t: int) -> None:
    ts = hlc.next_commit_ts(prev, t)
    assert hlc.physical_ms(ts) >= t // 1000
    # ... and the smallest timestamp that is both after `prev` and not before the commit's ms.
    smaller = ts - 1
    assert smaller <= prev or hlc.physical_ms(smaller) < t // 1000


@given(TS, COMMIT_US)
def test_physical_clock_ahead_resets_logical_counter(prev: int, t: int) -> None:
    ts = hlc.next_commit_ts(prev, t)
    if t // 1000 > hlc.physical_ms(prev):
        assert ts == hlc.from_millis(t // 1000)
        assert hlc.logical(ts) == 0
    else:  # the clock did not move past prev: the counter just ticks
        assert ts == prev + 1


@given(TS, st.lists(COMMIT_US, max_size=40))
def test_replaying_the_same_commits_gives_the_same_timestamps(start: int, times: list[int]) -> None:
    def run() -> list[int]:
        out, prev = [], start
        for t in times:
            prev = hlc.next_commit_ts(prev, t)
            out.append(prev)
        return out

    assert run() == run()


@given(st.integers(min_value=0, max_value=1 << 44), st.lists(COMMIT_US, min_size=1, max_size=30))
def test_nothing_after_a_resolved_ceiling_is_at_or_below_it(ms: int, times: list[int]) -> None:
    resolved = hlc.ceiling_of_ms(ms)
    assert hlc.physical_ms(resolved) == ms and hlc.logical(resolved) == hlc.LOGICAL_MASK
    prev = resolved
    for t in times:
        prev = hlc.next_commit_ts(prev, t)
        assert prev > resolved


@given(st.integers(min_value=0, max_value=int(datetime(2900, 1, 1, tzinfo=timezone.utc).timestamp()) * 10**6))
def test_timestamps_fit_int64_for_centuries(t: int) -> None:
    assert 0 <= hlc.next_commit_ts(0, t) <= INT64_MAX
    assert hlc.ceiling_of_ms(t // 1000) <= INT64_MAX


def test_many_commits_in_one_millisecond_stay_within_it() -> None:
    t = 1_700_000_000_123_456
    prev = 0
    seen = []
    for _ in range(1000):
        prev = hlc.next_commit_ts(prev, t)
        seen.append(prev)
    assert len(set(seen)) == 1000
    assert {hlc.physical_ms(ts) for ts in seen} == {t // 1000}
    assert [hlc.logical(ts) for ts in seen] == list(range(1000))
