"""copy_tuple, the per-message COPY line of TupleData, against the synthesised columns and `decode_tuple`."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_pgoutput import _encode_tuple  # TupleData bytes from (kind, value) pairs

from changefeed.core.copytext import join_line, split_line
from changefeed.postgres.decode import tuple_lines as tl
from changefeed.postgres.decode.pgoutput import UNCHANGED, DecodeError, decode_tuple

# -- copy_tuple: the capture hot path -----------------------------------------------------------------

SPECIAL_VALUE = st.binary(max_size=40) | st.lists(st.sampled_from([b"\t", b"\n", b"\r", b"\\", b"\\N", b"a", b"\x00"]),
                                                    max_size=6).map(b"".join)
COPY_COLUMN = st.one_of(st.tuples(st.sampled_from("tb"), SPECIAL_VALUE),
                        st.tuples(st.just("n"), st.none()), st.tuples(st.just("u"), st.none()))


@settings(max_examples=500, deadline=None)
@given(st.lists(COPY_COLUMN, min_size=1, max_size=20), st.binary(max_size=10), st.binary(max_size=10))
def test_copy_tuple_is_the_escaped_copy_line_of_the_tuple(
        cols: list[tuple[str, bytes | None]], before: bytes, after: bytes) -> None:
    body = _encode_tuple(cols)
    line, unchanged, end = tl.copy_tuple(before + body + after, len(before))
    assert end == len(before) + len(body)
    assert split_line(line) == [value if kind in "tb" else None for kind, value in cols]
    assert unchanged == ([i for i, (kind, _) in enumerate(cols) if kind == "u"] or None)
    assert line == join_line(None if v is UNCHANGED else v for v in decode_tuple(before + body, len(before))[0])


@settings(max_examples=300, deadline=None)
@given(st.lists(COPY_COLUMN, min_size=1, max_size=12), st.data())
def test_copy_tuple_of_a_truncated_tuple_raises_decode_error(
        cols: list[tuple[str, bytes | None]], data: st.DataObject) -> None:
    body = _encode_tuple(cols)
    cut = data.draw(st.integers(min_value=0, max_value=len(body) - 1), label="cut")
    with pytest.raises(DecodeError):
        tl.copy_tuple(body[:cut], 0)


def test_copy_tuple_rejects_negative_lengths_and_unknown_kinds() -> None:
    with pytest.raises(DecodeError, match="negative"):
        tl.copy_tuple(struct.pack(">h", 1) + b"t" + struct.pack(">i", -1), 0)
    with pytest.raises(DecodeError, match="kind"):
        tl.copy_tuple(struct.pack(">h", 1) + b"?", 0)

