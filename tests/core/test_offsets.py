"""Offsets in Spark's offset log: one-node offsets keep the JSON every older checkpoint holds, and
every offset reads back as itself (Spark compares them as JSON to tell new data from none)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.core.distributed import Part
from changefeed.core.offsets import DEFAULT_NODE, Offset, OffsetError
from changefeed.core.snapshot import Chunk, Cursor

lsn = st.integers(0, 2**64 - 1)
key = st.none() | st.lists(st.integers() | st.text(max_size=8), min_size=1, max_size=3)
cursors = st.builds(Cursor, st.lists(st.text(min_size=1, max_size=12), max_size=3).map(tuple), key,
                    st.integers(0, 10**6), st.integers(0, 10**6))
chunks = st.lists(st.builds(Chunk, st.integers(0, 10**6), st.text(min_size=1, max_size=12), key, key), max_size=4)
names = st.from_regex(r"[a-z][a-z0-9_-]{0,8}", fullmatch=True)
nodes = st.dictionaries(names, lsn, min_size=1, max_size=5)
gids = st.text(min_size=1, max_size=10)
parts = st.dictionaries(names, st.lists(st.tuples(gids, lsn, lsn), min_size=1, max_size=3).map(tuple), max_size=3)
opened = st.dictionaries(names, st.lists(st.builds(Part, gids, lsn, lsn, st.integers(0, 99)), min_size=1,
                                         max_size=3).map(tuple), max_size=3)


@given(nodes, st.integers(0, 2**63 - 1), cursors, chunks, st.integers(0, 2**62), parts, opened, st.integers(0, 10**9))
def test_every_offset_reads_back_as_itself_through_json_text(lsns: dict[str, int], ts: int, cursor: Cursor,
                                                             found: list[Chunk], theta: int,
                                                             delivered: dict[str, tuple[tuple[str, int, int], ...]],
                                                             still: dict[str, tuple[Part, ...]], follow: int) -> None:
    if set(lsns) == {DEFAULT_NODE}:
        theta, delivered, still = 0, {}, {}  # (a one-node feed has none of these)
    offset = Offset(lsns, ts, cursor, tuple(found), theta, delivered, still, follow)
    text = json.dumps(offset.to_json())
    again = Offset.from_json(text)
    assert again == offset
    assert json.dumps(again.to_json()) == text  # the same JSON: Spark sees no new data


@given(lsn, st.integers(0, 2**63 - 1), cursors, chunks)
def test_a_one_node_offset_keeps_the_old_shape(at: int, ts: int, cursor: Cursor, found: list[Chunk]) -> None:
    old = {"lsn": at, "ts": ts, "snap": cursor.to_json()}  # as spark/source.py wrote it before nodes
    if found:
        old["chunks"] = [c.to_json() for c in found]
    offset = Offset.from_json(old)
    assert offset.lsn == at and offset.lsns == {DEFAULT_NODE: at} and offset.cursor == cursor
    assert offset.to_json() == old
    assert offset.at(at + 1).to_json()["lsn"] == at + 1


def test_an_offset_of_several_nodes_names_them_and_has_no_single_lsn() -> None:
    offset = Offset({"b": 20, "a": 10}, 5)
    assert offset.to_json()["v"] == 3 and list(offset.to_json()["nodes"]) == ["a", "b"]
    with pytest.raises(OffsetError):
        offset.lsn


@pytest.mark.parametrize("bad", ['{"v": 4, "nodes": {}}', '{"ts": 1}', '{"lsn": "x"}', '[1, 2]',
                                 '{"v": 3, "nodes": [1]}', '{"v": 3, "nodes": {"a": 1}, "open": {"a": [[1]]}}'])
def test_an_unreadable_offset_is_a_definite_error(bad: str) -> None:
    with pytest.raises(OffsetError) as e:
        Offset.from_json(bad)
    assert e.value.exit_code == 2 and e.value.hint


def test_an_offset_of_two_phase_holds_asks_for_the_feed_to_be_created_again() -> None:
    with pytest.raises(OffsetError, match="older changefeed") as e:
        Offset.from_json({"v": 2, "nodes": {"a": 1}, "ts": 1, "snap": {}, "holds": {"a": 1}})
    assert "create it again" in e.value.hint
