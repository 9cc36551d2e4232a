"""The resolved timestamp of a batch of several nodes: never past any node's frontier, always growing."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from changefeed.core.hlc import ceiling_of_ms, from_millis, physical_ms
from changefeed.core.resolved import Frontier, resolved_ts

clocks = st.integers(1_600_000_000_000, 1_900_000_000_000)
frontiers = st.dictionaries(st.sampled_from(["n1", "n2", "n3", "a", "zz"]),
                            st.builds(Frontier, st.integers(0, 1 << 40), clocks), min_size=1)


@given(st.integers(0, 1 << 62), frontiers)
def test_resolved_grows_and_claims_no_more_than_the_slowest_node(start_ms_ts: int, fs: dict[str, Frontier]) -> None:
    start = from_millis(physical_ms(start_ms_ts) % 1_900_000_000_000)
    r = resolved_ts(start, fs)
    assert r > start
    slowest = min(f.clock_ms for f in fs.values())
    # the slowest node's clock bounds it, unless the previous batch already reached that far
    assert r == ceiling_of_ms(slowest) or physical_ms(r) == physical_ms(start) + 1


@given(frontiers, st.data(), clocks)
def test_a_node_whose_clock_moves_on_never_lowers_it(fs: dict[str, Frontier], data: st.DataObject,
                                                    later: int) -> None:
    """An idle node answers each heartbeat with a later clock: the resolved ts follows, never drops."""
    start = from_millis(1_500_000_000_000)
    node = data.draw(st.sampled_from(sorted(fs)))
    moved = {**fs, node: Frontier(fs[node].lsn, max(later, fs[node].clock_ms))}
    assert resolved_ts(start, moved) >= resolved_ts(start, fs)


def test_no_node_is_an_error() -> None:
    import pytest

    with pytest.raises(ValueError):
        resolved_ts(0, {})
