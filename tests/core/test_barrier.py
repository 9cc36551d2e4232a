"""core.barrier: windows stop at a verify's position and wait there; never move backwards."""
from __future__ import annotations

import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from changefeed.core import barrier as bar

NODES = ["n1", "n2", "n3"]
positions = st.dictionaries(st.sampled_from(NODES), st.integers(0, 1000), min_size=1)


@given(start=positions, grow=positions, at=positions)
def test_cap_never_passes_a_position_from_before_it_and_never_goes_back(start: dict, grow: dict, at: dict) -> None:
    ends = {n: start.get(n, 0) + grow.get(n, 0) for n in NODES}
    barrier = bar.Barrier(at, time.time() + 60)
    capped = barrier.cap(start, ends)
    for n in NODES:
        s = start.get(n, 0)
        assert s <= capped[n] <= ends[n]  # a window is never longer, nor reversed
        if n in at and s <= at[n]:
            assert capped[n] <= at[n]  # a node before (or at) its position stops there
            assert capped[n] == min(ends[n], at[n])
        else:
            assert capped[n] == ends[n]  # other nodes, or one planned past it, go on


def test_reached_only_when_every_node_is_exactly_at_its_position() -> None:
    b = bar.Barrier({"n1": 10, "n2": 20}, time.time() + 60)
    assert b.reached({"n1": 10, "n2": 20, "n3": 5})
    assert not b.reached({"n1": 10, "n2": 19})
    assert not b.reached({"n1": 11, "n2": 20})


def test_file_round_trip_expiry_and_damage(tmp_path: Path) -> None:
    path = tmp_path / "feed" / "barrier.json"
    assert bar.read(path) is None
    bar.write(path, bar.Barrier({"n1": 7}, time.time() + 60))
    assert bar.read(path) == bar.Barrier({"n1": 7}, bar.read(path).expires)  # type: ignore[union-attr]
    bar.write(path, bar.Barrier({"n1": 7}, time.time() - 1))
    assert bar.read(path) is None  # a verify that died leaves no feed waiting
    path.write_text("{not json")
    assert bar.read(path) is None
    bar.remove(path)
    bar.remove(path)
    assert not path.exists()
