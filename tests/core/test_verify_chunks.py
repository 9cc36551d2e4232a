"""core.verify: chunk checksums add up over parts, and narrowing finds exactly the differing keys."""
from __future__ import annotations

import hashlib
import random

from hypothesis import example, given
from hypothesis import strategies as st

from changefeed.core import verify as cv

rows = st.dictionaries(st.integers(0, 200).map(lambda k: f"({k})"), st.integers(-2**63, 2**63 - 1), max_size=60)


def _row_hash(key: str, value: int) -> int:
    """A row's 64-bit checksum, of its key and its values, as the server's hashtextextended of the
    row text: two rows that trade values hash differently (summing the bare values would not tell)."""
    return int.from_bytes(hashlib.blake2b(f"{key}={value}".encode(), digest_size=8).digest(), "big", signed=True)


def _sums(table: dict[str, int], chunks: int) -> cv.Sums:
    out: cv.Sums = {}
    for k, v in table.items():
        cv.add(out, {hash(k) % chunks: (1, _row_hash(k, v))})
    return out


@given(source=rows, sink=rows, chunks=st.integers(1, 16), seed=st.integers(0, 1000))
@example(source={"(1)": 1, "(2)": 2}, sink={"(1)": 2, "(2)": 1}, chunks=1, seed=0)  # two rows trade values
def test_mismatched_chunks_hold_every_differing_key_and_sums_add_over_parts(source: dict, sink: dict, chunks: int,
                                                                           seed: int) -> None:
    # a side read in random parts (block ranges, nodes) sums to the same checksums
    keys = list(source)
    random.Random(seed).shuffle(keys)
    cut = len(keys) // 2
    parts = [{k: source[k] for k in keys[:cut]}, {k: source[k] for k in keys[cut:]}]
    summed: cv.Sums = {}
    for part in parts:
        cv.add(summed, _sums(part, chunks))
    assert summed == _sums(source, chunks)

    bad = set(cv.mismatched(summed, _sums(sink, chunks)))
    differing = cv.keys_differing({k: h for k, h in source.items() if hash(k) % chunks in bad},
                                  {k: h for k, h in sink.items() if hash(k) % chunks in bad})
    expected = {k for k in source.keys() | sink.keys() if source.get(k) != sink.get(k)}
    assert {k for k, _ in differing} == expected
    for k, kind in differing:
        assert kind == (cv.MISSING if k not in sink else cv.EXTRA if k not in source else cv.CHANGED)
    assert (not bad) == (source == sink)


@given(blocks=st.integers(0, 100_000), parts=st.integers(1, 16), min_blocks=st.integers(1, 4096))
def test_block_ranges_cover_the_table_once(blocks: int, parts: int, min_blocks: int) -> None:
    ranges = cv.block_ranges(blocks, parts, min_blocks)
    assert 1 <= len(ranges) <= parts
    assert ranges[0][0] == 0 and ranges[-1][1] is None  # open end: blocks added meanwhile are read too
    for (_, hi), (lo, _) in zip(ranges, ranges[1:]):
        assert hi == lo
    if len(ranges) > 1:
        assert all(hi - lo >= min_blocks for lo, hi in ranges[:-1] if hi is not None)


def test_chunk_count_and_reports() -> None:
    assert cv.chunk_count(0, 1000) == 1 and cv.chunk_count(1001, 1000) == 2
    assert cv.chunk_count(10**12, 1) == cv.MAX_CHUNKS
    assert cv.shown(None) == "NULL" and cv.shown("ab") == "'ab'"
    long = cv.shown("x" * 5000)
    assert "5000 chars, md5" in long and len(long) < 100
    assert cv.schema_differences([("id", "integer"), ("a", "text")], [("id", "bigint"), ("b", "text")]) == [
        "a (text) missing on the sink", "b (text) extra on the sink", "id: integer on the source, bigint on the sink"]
    t = cv.TableResult("public.t", 3, 3, 1, 1, {cv.CHANGED: 1},
                       [cv.Difference("(1)", cv.CHANGED, {"v": ("a", "b")})])
    assert not t.equal and t.lines()[1] == "  key (1): differs: v: source 'a', sink 'b'"
