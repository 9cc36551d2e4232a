"""Followed batches (core.followed): the end file keeps the furthest end a sink recorded, and what
reads from a followed batch's offset starts there, never behind the offset nor past a planned end."""
from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from changefeed.core import followed
from changefeed.core.offsets import Offset
from changefeed.core.snapshot import Cursor

ends = st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 2**50)), min_size=1, max_size=8)


@given(ends)
def test_the_end_file_keeps_the_furthest_end_noted_whatever_the_order(noted: list[tuple[int, int]]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "ck" / followed.END_FILE
        for lsn, ts in noted:
            followed.note_end(path, Offset({"n1": lsn}, ts, follow=3))
        kept = followed.recorded_end(path)
        assert kept is not None and kept.lsn == max(lsn for lsn, _ in noted)
        assert not list(path.parent.glob("*.tmp"))  # written whole: no half file left beside it


def test_a_followed_offset_starts_at_the_recorded_end_when_that_is_further(tmp_path: Path) -> None:
    path = tmp_path / followed.END_FILE
    cursor = Cursor(pending=("public.t",))
    offset = Offset({"n1": 100}, 7, cursor, follow=2)
    assert followed.started(offset, path) == offset  # nothing recorded yet
    followed.note_end(path, Offset({"n1": 250}, 9, follow=2))
    got = followed.started(offset, path)
    assert (got.lsn, got.ts, got.cursor, got.follow) == (250, 9, cursor, 2)  # the rest of the offset kept
    assert followed.started(Offset({"n1": 300}, 10, follow=3), path).lsn == 300  # an older end is ignored
    assert followed.started(Offset({"n1": 100}, 7), path).lsn == 100  # a batch's ordinary end: as it is
    assert followed.started(offset, None) == offset  # not in low-latency mode
    # a batch planned from the offset ends where it ends: a later end recorded since is not its start
    assert followed.started(offset, path, until=Offset({"n1": 200}, 8)).lsn == 100
    assert followed.started(offset, path, until=Offset({"n1": 400}, 8)).lsn == 250


def test_a_damaged_end_file_costs_only_a_read_again(tmp_path: Path) -> None:
    path = tmp_path / followed.END_FILE
    path.write_text('{"lsn": ')
    offset = Offset({"n1": 100}, 7, follow=2)
    assert followed.recorded_end(path) is None and followed.started(offset, path) == offset
    followed.note_end(path, Offset({"n1": 120}, 8))
    assert followed.started(offset, path).lsn == 120
