"""wal_layout.starts_before against a model of how PostgreSQL lays a record into pages."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from changefeed.postgres.wal_layout import PAGE_HEADER_LONG, PAGE_HEADER_SHORT, message_record_length, starts_before

PAGE, SEGMENT = 8192, 1 << 16  # small segments: long page headers show up often


def _header(page_start: int) -> int:
    return PAGE_HEADER_LONG if page_start % SEGMENT == 0 else PAGE_HEADER_SHORT


def _laid(start: int, length: int) -> int:
    """Where a record of `length` bytes that starts at `start` ends, page headers put in between."""
    pos, left = start, length
    while left:
        page_end = pos - pos % PAGE + PAGE
        here = min(left, page_end - pos)
        pos, left = pos + here, left - here
        if left:
            pos = page_end + _header(page_end)
    return pos


def _aligned_start(at: int) -> int:
    """A place a record may start: MAXALIGNed, not inside a page header."""
    at += (-at) % 8
    page_start = at - at % PAGE
    return max(at, page_start + _header(page_start))  # (headers are MAXALIGNed sizes)


@given(at=st.integers(0, 40 * PAGE), length=st.integers(40, 5 * PAGE), page_cut=st.integers(1, 45),
       slack=st.integers(0, 7))
def test_a_record_starts_before_a_page_cut_exactly_when_it_does(at: int, length: int, page_cut: int,
                                                               slack: int) -> None:
    start = _aligned_start(at)
    end = page_cut * PAGE
    record_end = _laid(start, length)
    # a length known a few bytes short (a replication origin's) must not change the answer
    assert starts_before(record_end, length - slack, end, PAGE, SEGMENT) == (start < end)


@given(at=st.integers(0, 40 * PAGE), length=st.integers(40, 3 * PAGE), slack=st.integers(0, 7))
def test_a_record_that_starts_at_a_record_boundary_is_not_before_it(at: int, length: int, slack: int) -> None:
    start = _aligned_start(at)
    assert not starts_before(_laid(start, length), length - slack, start, PAGE, SEGMENT)
    before = _aligned_start(start + 8)  # the record that starts next: `start` lies before it
    assert starts_before(_laid(before, length), length, before + 1, PAGE, SEGMENT)


def test_the_length_of_a_message_record() -> None:
    assert message_record_length(b"p", 10) == 24 + 2 + 24 + 2 + 10
    assert message_record_length(b"p", 300) == 24 + 5 + 24 + 2 + 300
