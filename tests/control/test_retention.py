"""Retention budget arithmetic: warn from 80%, stop past 100%, 0 means no budget."""
from __future__ import annotations

import pytest

from changefeed.control.retention import Holding, RetentionExceeded, check


def held(bytes_: int, age: float | None) -> Holding:
    return Holding("changefeed_f", 0x1000, bytes_, age)


def test_inside_near_and_past_the_budget() -> None:
    assert check(held(700, 10), "f", 100, 1000) is None
    assert "80% of --max-retained-wal" in (check(held(800, 10), "f", 100, 1000) or "")
    assert "90% of --retention" in (check(held(10, 90), "f", 100, 1000) or "")
    with pytest.raises(RetentionExceeded, match="changefeed_f at 0/1000 holds 1,001 bytes"):
        check(held(1001, 10), "f", 100, 1000)
    with pytest.raises(RetentionExceeded, match="101s old"):
        check(held(10, 101), "f", 100, 1000)


def test_zero_is_no_budget_and_no_checkpoint_has_no_age() -> None:
    assert check(held(10**12, 10**9), "f", 0, 0) is None
    assert check(held(10, None), "f", 100, 1000) is None
