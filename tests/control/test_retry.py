"""The retry policy of a running feed: capped exponential backoff with full jitter, a give-up
deadline, and the `retrying` note status reads."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.control.retry import Retry, read_note, write_note
from changefeed.errors import ConnectionFailed, QueryFailed


@given(st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=30), st.floats(0.5, 120))
def test_waits_are_full_jitter_under_a_doubling_cap(draws: list[float], cap: float) -> None:
    it = iter(draws)
    retry = Retry(cap, rng=lambda: next(it), clock=lambda: 0.0)
    for n, draw in enumerate(draws, start=1):
        wait = retry.failed(ConnectionFailed("down", component="source"))
        assert wait == pytest.approx(draw * min(cap, 0.5 * 2 ** (n - 1)))
        assert 0 <= wait <= cap
    assert retry.current is not None and retry.current.attempts == len(draws)


def test_the_fault_is_remembered_from_its_start_until_success() -> None:
    now = [100.0]
    retry = Retry(30, rng=lambda: 1.0, clock=lambda: now[0])
    retry.failed(ConnectionFailed("lost the connection to the source: terminating", component="source"))
    now[0] = 107.0
    assert retry.failed(ConnectionFailed("cannot reach source x", component="source")) == 1.0  # 0.5 * 2
    assert retry.current is not None
    assert (retry.current.since, retry.current.attempts, retry.current.reason) == (100.0, 2, "cannot reach source x")
    assert "retrying for 7s after 2 failure(s) of the source: cannot reach source x" == retry.current.describe(107.0)
    retry.succeeded()
    assert retry.current is None
    assert retry.failed(ConnectionFailed("again")) == 0.5  # the backoff starts over
    assert retry.current is not None and retry.current.component == "feed"


def test_a_fault_longer_than_give_up_after_is_raised() -> None:
    now = [0.0]
    retry = Retry(30, give_up_after_s=60, rng=lambda: 0.0, clock=lambda: now[0])
    retry.failed(ConnectionFailed("sink down", component="sink"))
    now[0] = 59.0
    retry.failed(ConnectionFailed("sink down", component="sink"))
    now[0] = 60.0
    with pytest.raises(ConnectionFailed) as e:
        retry.failed(ConnectionFailed("sink down", component="sink"))
    assert e.value.exit_code == 75 and "gave up after 60s and 3 attempt(s)" in e.value.message


def test_the_note_is_written_read_and_removed(tmp_path: Path) -> None:
    retry = Retry(rng=lambda: 0.0, clock=lambda: 5.0)
    retry.failed(ConnectionFailed("down", component="sink"))
    path = tmp_path / "retrying"
    write_note(path, retry.current)
    assert read_note(path) == retry.current
    write_note(path, None)
    assert not path.exists() and read_note(path) is None
    path.write_text("{torn")
    assert read_note(path) is None


def test_an_unknown_error_is_retried_only_a_few_times_in_a_row() -> None:
    retry = Retry(30, rng=lambda: 0.0, clock=lambda: 0.0)
    for _ in range(5):  # a known transient fault is retried for as long as it lasts
        retry.failed(ConnectionFailed("source down", component="source"))
    retry.failed(QueryFailed("the streaming query failed: worker crashed"))  # counted by its type
    retry.failed(QueryFailed("the streaming query failed: worker crashed"))
    with pytest.raises(QueryFailed) as e:
        retry.failed(QueryFailed("the streaming query failed: worker crashed"))
    assert "gave up" in e.value.message and "8 attempt(s)" in e.value.message
    retry.succeeded()
    retry.failed(QueryFailed("once"))  # a success in between starts the count again
    retry.failed(QueryFailed("twice"))


def test_a_query_that_does_not_stop_is_a_query_failure(tmp_path: Path) -> None:
    from changefeed.control.runner import _stop
    from changefeed.spec.state import FeedState

    class Stuck:
        def stop(self) -> None:
            raise RuntimeError("java.util.concurrent.TimeoutException: Stream Execution thread for stream x "
                               "failed to stop within 60000 milliseconds\n\tat org.apache.spark...")

    with pytest.raises(QueryFailed) as e:
        _stop(Stuck(), FeedState(tmp_path, "f"))
    assert "did not stop: java.util.concurrent.TimeoutException" in e.value.message and e.value.component == "query"
