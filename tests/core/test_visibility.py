"""The visibility rule a snapshot read is judged by (core.visibility), as a property: 64-bit ids
near the snapshot are recovered from pgoutput's 32-bit xids, across an epoch too, and seen
exactly when PostgreSQL's rule says so."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.core.visibility import Snap, SnapshotTextError

EPOCHS = st.integers(0, 5).map(lambda e: e << 32)


@st.composite
def snaps(draw: st.DrawFn) -> Snap:
    xmax = draw(EPOCHS) + draw(st.integers(3, (1 << 32) - 1))
    xmin = xmax - draw(st.integers(0, min(xmax - 3, 1 << 20)))
    xip = draw(st.frozensets(st.integers(xmin, xmax - 1), max_size=8)) if xmin < xmax else frozenset()
    return Snap(xmin, xmax, xip)


@given(snaps(), st.integers(-(1 << 31) + 1, (1 << 31) - 1))
def test_the_full_id_is_found_from_its_low_32_bits(snap: Snap, offset: int) -> None:
    full = snap.xmax + offset
    if full <= 0:
        return
    assert snap.full(full & 0xFFFFFFFF) == full


@given(snaps(), st.integers(-(1 << 20), 1 << 20))
def test_seen_exactly_below_xmin_or_below_xmax_and_not_in_progress(snap: Snap, offset: int) -> None:
    full = snap.xmax + offset
    if full <= 0:
        return
    expected = full < snap.xmin or (full < snap.xmax and full not in snap.xip)
    assert snap.sees(full & 0xFFFFFFFF) is expected


@given(snaps())
def test_text_round_trips(snap: Snap) -> None:
    assert Snap.parse(snap.to_text()) == snap


def test_text_as_postgresql_writes_it() -> None:
    snap = Snap.parse("4294967290:4294967301:4294967295,4294967297")
    assert snap.sees(4294967289 & 0xFFFFFFFF) and not snap.sees(4294967295 & 0xFFFFFFFF)
    assert snap.sees(4294967296 & 0xFFFFFFFF)  # xid 0 of epoch 1: committed before the snapshot
    assert not snap.sees(4294967297 & 0xFFFFFFFF) and not snap.sees(4294967301 & 0xFFFFFFFF)
    assert Snap.parse("10:10:") == Snap(10, 10)


@pytest.mark.parametrize("text", ["", "1:2", "a:b:", "5:3:", "3:9:10", "0:0:"])
def test_a_text_that_is_no_snapshot_is_refused(text: str) -> None:
    with pytest.raises(SnapshotTextError):
        Snap.parse(text)
