"""The retry policy of a running feed: capped exponential backoff with full jitter, a give-up
deadline, and the `retrying` note status reads."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.errors import ConnectionFailed
from changefeed.retry import Retry, read_note, write_note


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


@pytest.mark.parametrize("message, trace, component", [
    ("lost the connection to the sink: server closed the connection", "", "sink"),
    ("cannot reach source postgresql://h:1/db: refused", 'File "/x/changefeed/spark/sink.py"', "source"),
    ("webhook http://h/x did not take batch 1", 'File "/x/changefeed/spark/webhook_sink.py", line 40', "sink"),
    ("Kafka h:1, committing batch 3: _TRANSPORT", 'File "/x/changefeed/spark/kafka_sink.py"', "sink"),
    ("replication slot s is in use", 'File "/x/changefeed/spark/source.py", line 9', "source"),
    ("something", "", "query"),
])
def test_a_query_failure_names_the_part_it_came_from(message: str, trace: str, component: str) -> None:
    from changefeed.feed import _component

    assert _component(message, f"org.apache.spark.SparkException: ...\n{trace}\nchangefeed.errors.X: {message}") \
        == component
