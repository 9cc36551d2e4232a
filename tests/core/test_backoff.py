"""The one backoff formula: full jitter under a doubling step that never passes its cap, never
overflows however long a fault lasts, and is exactly `first * 2**(n-1)` below the cap."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.core.backoff import backoff_step, full_jitter

ATTEMPTS = st.integers(min_value=1, max_value=5000)  # past 1024: 2**(n-1) alone overflows a float
FIRST = st.floats(min_value=1e-3, max_value=60)
CAP = st.floats(min_value=1e-3, max_value=3600)
DRAW = st.floats(min_value=0, max_value=1)


@given(ATTEMPTS, FIRST, CAP, DRAW)
def test_a_wait_is_between_zero_and_the_cap(attempt: int, first: float, cap: float, draw: float) -> None:
    wait = full_jitter(attempt, first, cap, lambda: draw)
    assert 0 <= wait <= backoff_step(attempt, first, cap) <= cap
    assert wait == draw * backoff_step(attempt, first, cap)


@given(ATTEMPTS, FIRST, CAP)
def test_the_step_doubles_until_the_cap(attempt: int, first: float, cap: float) -> None:
    step, after = backoff_step(attempt, first, cap), backoff_step(attempt + 1, first, cap)
    assert step <= after == min(cap, 2 * step)
    assert backoff_step(1, first, cap) == min(first, cap)


@given(st.integers(min_value=1, max_value=60), FIRST, CAP)
def test_below_overflow_it_is_the_textbook_formula(attempt: int, first: float, cap: float) -> None:
    assert backoff_step(attempt, first, cap) == min(cap, first * 2 ** (attempt - 1))


@given(DRAW, DRAW)
def test_full_jitter_spans_zero_to_the_step(low: float, high: float) -> None:
    assert full_jitter(3, 1.0, 30.0, lambda: 0.0) == 0.0
    assert full_jitter(3, 1.0, 30.0, lambda: 1.0) == 4.0
    if low <= high:
        assert full_jitter(3, 1.0, 30.0, lambda: low) <= full_jitter(3, 1.0, 30.0, lambda: high)


@pytest.mark.parametrize("attempt", [0, -1])
def test_attempts_count_from_one(attempt: int) -> None:
    with pytest.raises(ValueError, match="from 1"):
        backoff_step(attempt, 0.5, 30.0)
