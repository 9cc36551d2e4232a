"""tuple_block against the per-message reference (`tuple_lines.copy_tuple`, as ChangeBuilder uses it).

A message tuple_block marks `fast` must get exactly the reference's COPY line; a message it leaves
out goes to the reference path, so leaving out is always safe, but it must be rare: only what
needs escaping, unchanged TOAST columns, old tuples, and what is not a well-formed plain change.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence
from unittest import mock

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pgoutput import _encode_tuple as encode_tuple  # TupleData bytes from (kind, value) pairs

from changefeed.postgres.decode import pgoutput as po
from changefeed.postgres.decode import tuple_block as tb
from changefeed.postgres.decode import tuple_lines as tl

OID = 16384
SPECIAL = b"\t\n\r\\"

Column = tuple[str, bytes | None]
Columns = Sequence[Column]


def change(kind: bytes, cols: Columns, oid: int = OID, old: Columns | None = None) -> bytes:
    """An Insert ('N'), Update ('N', or 'K' + old tuple + 'N') or Delete ('K') message."""
    if old is not None:
        return kind + struct.pack(">I", oid) + b"K" + encode_tuple(old) + b"N" + encode_tuple(cols)
    return kind + struct.pack(">I", oid) + (b"K" if kind == b"D" else b"N") + encode_tuple(cols)


def reference(data: bytes) -> bytes | None:
    """The line the per-message path gives a plain change, or None where it gives anything else
    (an error, unchanged columns, or a change that is not plain)."""
    plain = data[:1] in (b"I", b"U") and data[5:6] == b"N" or data[:1] == b"D" and data[5:6] in (b"K", b"O")
    if not plain:
        return None
    try:
        line, unchanged, end = tl.copy_tuple(data, 6)
    except po.DecodeError:
        return None
    return line if end == len(data) and not unchanged else None


def check(messages: list[bytes]) -> tb.Block:
    """Parse `messages`; every fast message must have the reference's line, relation and kind."""
    block = tb.parse(messages)
    assert block.messages is messages
    fast = block.fast.tolist()
    for i in range(len(messages) - 1):  # a run of fast messages has a run of lines (ChangeBuilder slices them)
        if fast[i] and fast[i + 1]:
            assert block.line_of[i + 1] == block.line_of[i] + 1
    for i, data in enumerate(messages):
        assert block.kinds[i] == (data[0] if data else 0)
        if block.fast[i]:
            assert block.lines[int(block.line_of[i])].as_py() == reference(data), (i, data)
            assert block.oids[i] == int.from_bytes(data[1:5], "big")
    return block


def test_plain_changes_become_their_copy_lines() -> None:
    messages = [
        change(b"I", [("t", b"1"), ("t", b"hello"), ("n", None)]),
        change(b"U", [("t", b"1"), ("t", b""), ("b", b"x" * 40)], oid=7),
        change(b"D", [("t", b"1"), ("n", None), ("n", None)]),
        change(b"I", []),
        change(b"I", [("n", None)]),
        change(b"I", [("t", "añ€😀".encode())]),
    ]
    block = check(messages)
    assert block.fast.all()
    assert block.lines.to_pylist() == [b"1\thello\t\\N", b"1\t\t" + b"x" * 40, b"1\t\\N\t\\N", b"", b"\\N",
                                       "añ€😀".encode()]
    assert block.oids.tolist() == [OID, 7, OID, OID, OID, OID]


@pytest.mark.parametrize("first", [0, 1, 10, 11, 12, 13, 100])
def test_values_around_the_inline_size_of_a_view(first: int) -> None:
    """A piece of up to 12 bytes is copied from its view, a longer one from the buffer."""
    messages = [change(b"I", [("t", bytes([65 + k % 26]) * first)] + [("t", b"v" * n) for n in range(k, k + 3)])
                for k in range(16)]
    block = check(messages)
    assert block.fast.all()


@pytest.mark.parametrize("data", [
    change(b"I", [("t", b"a\tb")]),  # needs escaping
    change(b"I", [("t", b"a"), ("t", b"back\\slash")]),
    change(b"U", [("t", b"line\nbreak"), ("n", None)]),
    change(b"D", [("t", b"cr\r")]),
    change(b"U", [("t", b"1"), ("u", None)]),  # unchanged TOAST
    change(b"U", [("t", b"2")], old=[("t", b"1")]),  # an old tuple
    change(b"I", [("t", b"1")]) + b"x",  # bytes after the tuple
    change(b"I", [("t", b"1"), ("t", b"2")])[:-1],  # truncated
    change(b"I", [("t", b"1")])[:-2] + b"\x7f\xff",  # a value past the end
    b"I" + struct.pack(">I", OID) + b"N" + struct.pack(">h", -1),  # negative column count
    b"I" + struct.pack(">I", OID) + b"N" + struct.pack(">h", 1) + b"t" + struct.pack(">i", -1),
    b"I" + struct.pack(">I", OID) + b"N" + struct.pack(">h", 1) + b"?",  # unknown column kind
    b"I" + struct.pack(">I", OID) + b"K" + encode_tuple([("t", b"1")]),  # inserts carry 'N'
    b"D" + struct.pack(">I", OID) + b"N" + encode_tuple([("t", b"1")]),  # deletes carry 'K' or 'O'
    b"I" + struct.pack(">I", OID) + b"N",  # no column count
    b"B" + bytes(20),
    b"",
])
def test_what_is_left_to_the_per_message_path(data: bytes) -> None:
    plain = change(b"I", [("t", b"ok")])
    block = check([plain, data, plain])
    assert block.fast.tolist() == [True, False, True]
    assert block.lines[int(block.line_of[2])].as_py() == b"ok"


def test_a_block_of_no_messages() -> None:
    (block,) = tb.blocks([])
    assert len(block.fast) == len(block.lines) == 0


def test_big_blocks_are_parsed_in_parts() -> None:
    messages = [change(b"I", [("t", str(i).encode() * 5)]) for i in range(50)]
    parts = list(tb.blocks(messages, 100))
    assert len(parts) > 5
    assert all(sum(map(len, p.messages)) <= 100 for p in parts)
    assert [m for p in parts for m in p.messages] == messages
    assert [line for p in parts for line in p.lines.to_pylist()] == [reference(m) for m in messages]


def test_big_messages_are_left_to_the_per_message_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tb, "MAX_MESSAGE_BYTES", 30)
    block = check([change(b"I", [("t", b"x" * 10)]), change(b"I", [("t", b"x" * 30)])])
    assert block.fast.tolist() == [True, False]


def test_the_input_is_not_changed() -> None:
    messages = [change(b"I", [("t", b"a"), ("t", b"b")])]
    copy = [bytes(m) for m in messages]
    tb.parse(messages)
    assert messages == copy


# -- properties -----------------------------------------------------------------------------------

VALUE = (st.binary(max_size=30) | st.text(max_size=15).map(str.encode)
         | st.lists(st.sampled_from([b"\t", b"\n", b"\r", b"\\", b"\\N", b"a", b"\x00", b"\x0b", "é".encode()]),
                    max_size=6).map(b"".join))
COLUMN = st.one_of(st.tuples(st.sampled_from("tb"), VALUE), st.tuples(st.just("n"), st.none()),
                   st.tuples(st.just("u"), st.none()))
PLAIN = st.builds(lambda kind, sub, oid, cols: kind + struct.pack(">I", oid) + sub + encode_tuple(cols),
                  st.sampled_from([b"I", b"U", b"D"]), st.sampled_from([b"N", b"K", b"O"]),
                  st.integers(0, 2**32 - 1), st.lists(COLUMN, max_size=12))
OTHER = st.one_of(
    st.builds(lambda old, new: change(b"U", new, old=old), st.lists(COLUMN, max_size=4), st.lists(COLUMN, max_size=4)),
    st.sampled_from([b"B" + bytes(20), b"C" + bytes(25), b"R" + bytes(12), b"", b"I", b"D\0\0\0\0K"]),
    st.binary(max_size=30),
)


def expected_fast(data: bytes) -> bool:
    """A plain change whose reference line is its values as they are: nothing to escape."""
    if reference(data) is None:
        return False
    values = po.decode_tuple(data, 6)[0]
    return all(not isinstance(v, bytes) or not any(c in SPECIAL for c in v) for v in values)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(PLAIN | OTHER, max_size=25))
def test_fast_exactly_where_the_reference_line_needs_nothing_more(messages: list[bytes]) -> None:
    block = check(messages)
    assert block.fast.tolist() == [expected_fast(d) for d in messages]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(PLAIN, min_size=1, max_size=12), st.data())
def test_damaged_tuples_are_never_fast_unless_the_reference_agrees(
        messages: list[bytes], data: st.DataObject) -> None:
    raw = [bytearray(d) for d in messages]
    for _ in range(data.draw(st.integers(1, 4), label="damages")):
        m = raw[data.draw(st.integers(0, len(raw) - 1), label="message")]
        if len(m) <= 1:
            continue
        if data.draw(st.booleans(), label="truncate"):
            del m[data.draw(st.integers(1, len(m) - 1), label="cut"):]
        else:
            m[data.draw(st.integers(1, len(m) - 1), label="at")] = data.draw(st.integers(0, 255), label="byte")
    check([bytes(m) for m in raw])  # fast ones equal the reference; the rest: the reference decides


@settings(max_examples=200, deadline=None)
@given(st.lists(PLAIN | OTHER, max_size=25), st.integers(1, 200))
def test_a_block_parsed_in_parts_is_parsed_the_same(raw: list[bytes], max_bytes: int) -> None:
    parts = list(tb.blocks(raw, max_bytes))
    assert [m for p in parts for m in p.messages] == raw
    assert all(len(p.messages) == 1 or sum(map(len, p.messages)) <= max_bytes for p in parts)
    whole = tb.parse(raw)
    assert [f for p in parts for f in p.fast.tolist()] == whole.fast.tolist()
    assert [p.lines[int(i)].as_py() for p in parts for i in p.line_of[p.fast]] == \
        [whole.lines[int(i)].as_py() for i in whole.line_of[whole.fast]]


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=4, max_size=200), st.data())
def test_views_follow_the_arrow_format(data_: bytes, data: st.DataObject) -> None:
    """A view of up to 12 bytes holds them zero-padded; a longer one its prefix, buffer 0, offset."""
    buf = bytearray(data_ + bytes(16))
    pieces = data.draw(st.lists(st.integers(4, len(data_)).flatmap(
        lambda at: st.tuples(st.just(at), st.integers(0, len(data_) - at))), max_size=20), label="pieces")
    at = np.array([p[0] for p in pieces], np.int64)
    size = np.array([p[1] for p in pieces], np.int64)
    views = tb._views(buf, at, size)
    for (a, n), view in zip(pieces, views.view(np.uint8).reshape(-1, 16)):
        assert int.from_bytes(bytes(view[:4]), "little") == n
        if n <= 12:
            assert bytes(view[4:]) == data_[a:a + n] + bytes(12 - n)
        else:
            assert bytes(view[4:]) == data_[a:a + 4] + bytes(4) + a.to_bytes(4, "little")
    arr = pa.Array.from_buffers(pa.binary_view(), len(pieces), [None, pa.py_buffer(views), pa.py_buffer(buf)])
    arr.validate(full=True)
    assert arr.to_pylist() == [data_[a:a + n] for a, n in pieces]


@settings(max_examples=100, deadline=None)
@given(st.lists(PLAIN | OTHER, max_size=25), st.integers(1, 30))
def test_columns_parsed_in_groups_give_the_same_block(raw: list[bytes], max_columns: int) -> None:
    whole = tb.parse(raw)
    with mock.patch.object(tb, "MAX_COLUMNS", max_columns):
        grouped = check(raw)
    assert grouped.fast.tolist() == whole.fast.tolist()
    assert grouped.line_of.tolist() == whole.line_of.tolist()
    assert grouped.lines.equals(whole.lines)
