"""Rows leaving a changed row filter (decode.leaving): the message survives its trip through the
WAL whatever the lines hold, and the builder turns it into deletes of its table in its
transaction, for the feed's own publication only."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.postgres.decode import leaving
from changefeed.postgres.decode import pgoutput as po
from changefeed.postgres.decode.builder import ChangeBuilder

REL = po.Relation(16400, "public", "orders", "d", (po.Column("id", 20, -1, True), po.Column("part", 25, -1, True),
                                                   po.Column("note", 25, -1, False)))
LINE = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40).map(
    lambda t: t.replace("\n", "\\n").replace("\t", "\\t").encode("utf-8"))


@given(st.lists(LINE, max_size=30), st.text(min_size=1, max_size=20))
def test_a_message_decodes_to_what_was_encoded(lines: list[bytes], publication: str) -> None:
    sent = leaving.Leaving(publication, REL, tuple(lines))
    assert leaving.Leaving.decode(sent.encode()) == sent


def test_many_rows_go_in_several_messages_none_lost() -> None:
    lines = [f"{i}\tp\t\\N".encode() for i in range(leaving.LINES_PER_MESSAGE * 2 + 3)]
    parts = leaving.pieces("pub", REL, lines)
    assert [len(p.lines) for p in parts] == [leaving.LINES_PER_MESSAGE, leaving.LINES_PER_MESSAGE, 3]
    assert [line for p in parts for line in p.lines] == lines


def _message(content: bytes, lsn: int, transactional: bool = True) -> bytes:
    return (b"M" + bytes([int(transactional)]) + struct.pack(">Q", lsn) + leaving.PREFIX.encode() + b"\0"
            + struct.pack(">i", len(content)) + content)


def _txn(xid: int, at: int, *inner: bytes) -> list[bytes]:
    begin = b"B" + struct.pack(">QqI", at, 1_000_000, xid)
    commit = b"C" + b"\0" + struct.pack(">QQq", at, at + 8, 1_000_000)
    return [begin, *inner, commit]


def _rows(publication: str | None, stream: list[bytes]) -> list[dict[str, object]]:
    builder = ChangeBuilder(100, 10_000, 0, 1 << 62, publication=publication)
    return [r for rb in builder.batches([stream]) for r in rb.to_pylist() if r["op"] not in "P"]


def test_the_builder_makes_deletes_of_the_feeds_own_messages_only() -> None:
    lines = (b"7\tp1\t\\N", b"9\tp0\t\\N")
    stream = _txn(501, 200, _message(leaving.Leaving("mine", REL, lines).encode(), 200),
                  _message(leaving.Leaving("theirs", REL, (b"8\tp1\t\\N",)).encode(), 200))
    rows = _rows("mine", stream)
    assert [r["op"] for r in rows] == ["R", "d", "d"], "the table described, then its deletes"
    assert [r["before"] for r in rows[1:]] == list(lines)
    assert {r["table"] for r in rows[1:]} == {"orders"} and {r["xid"] for r in rows[1:]} == {501}
    assert _rows("another", stream) == [], "neither message is another feed's"
    assert _rows(None, stream) == []


def test_a_message_that_does_not_parse_is_a_decode_error() -> None:
    with pytest.raises(po.DecodeError, match="changefeed.leave"):
        _rows("mine", _txn(502, 200, _message(b'{"publication": "mine"}', 200)))
