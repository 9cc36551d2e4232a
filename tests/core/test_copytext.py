"""COPY text format: escaping round trips, and agreement with PostgreSQL's own COPY."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from changefeed.core.copytext import NULL, escape, join_line, split_line, unescape

# Bytes rich in the characters that matter: backslash, tab, newline, CR, and the N of \N.
TRICKY = st.lists(st.sampled_from([b"\\", b"\t", b"\n", b"\r", b"N", b"\\N", b"a", b"\x00", b"\xff", b"b",
                                   b"t", b"n", b"r", b"\b", b"\f", b"\v", b" "]), max_size=24).map(b"".join)
VALUE = st.one_of(TRICKY, st.binary(max_size=64))
FIELD = st.one_of(st.none(), VALUE)


@given(VALUE)
def test_unescape_inverts_escape(value: bytes) -> None:
    assert unescape(escape(value)) == value


@given(VALUE)
def test_escaped_value_has_no_raw_separators(value: bytes) -> None:
    out = escape(value)
    assert b"\t" not in out and b"\n" not in out and b"\r" not in out
    assert out != NULL  # a value can never be mistaken for NULL
    # Every backslash in the output starts an escape pair of a known kind.
    i = 0
    while i < len(out):
        if out[i:i + 1] == b"\\":
            assert out[i + 1:i + 2] in (b"\\", b"t", b"n", b"r"), out
            i += 2
        else:
            i += 1


@given(VALUE)
def test_escape_leaves_plain_values_alone(value: bytes) -> None:
    plain = not any(c in value for c in b"\\\t\n\r")
    assert (escape(value) == value) == plain


def test_escape_known_values() -> None:
    assert escape(b"a\tb\nc\rd\\e") == b"a\\tb\\nc\\rd\\\\e"
    assert escape(b"\\N") == b"\\\\N"
    assert escape(b"") == b""
    assert unescape(b"\\N") is None
    assert unescape(b"\\\\N") == b"\\N"
    assert unescape(b"") == b""
    # PostgreSQL's COPY TO also writes \b, \f and \v escapes.
    assert unescape(b"\\b\\f\\v") == b"\b\f\v"


@given(st.lists(FIELD, min_size=1, max_size=12))
def test_split_line_inverts_join_line(values: list[bytes | None]) -> None:
    line = join_line(values)
    assert b"\n" not in line and b"\r" not in line
    assert line.count(b"\t") == len(values) - 1
    assert split_line(line) == values


def test_join_line_distinguishes_null_empty_and_backslash_n() -> None:
    values = [None, b"", NULL, b"\\", b"\t"]
    line = join_line(values)
    assert line == b"\\N\t\t\\\\N\t\\\\\t\\t"
    assert split_line(line) == values


# -- against a real server ------------------------------------------------------------------
TEXT = (st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=30)
        | st.lists(st.sampled_from(["\\", "\t", "\n", "\r", "N", "\\N", "\b", "\f", "\v", "é", "x"]),
                   max_size=12).map("".join))


def test_postgresql_copy_agrees(dbs) -> None:  # type: ignore[no-untyped-def]
    """What join_line writes, COPY FROM reads back as the same values; what COPY TO writes, split_line reads."""
    with dbs.src() as conn:
        conn.execute("CREATE TABLE copytext (id int PRIMARY KEY, a text, b text, c text)")

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.lists(st.tuples(st.none() | TEXT, st.none() | TEXT, st.none() | TEXT), min_size=1, max_size=6))
        def check(rows: list[tuple[str | None, ...]]) -> None:
            conn.execute("TRUNCATE copytext")
            enc = [[None if v is None else v.encode() for v in r] for r in rows]
            with conn.cursor().copy("COPY copytext FROM STDIN") as copy:
                for i, r in enumerate(enc):
                    copy.write(join_line([str(i).encode(), *r]) + b"\n")
            got = conn.execute("SELECT a, b, c FROM copytext ORDER BY id").fetchall()
            assert [list(g) for g in got] == [list(r) for r in rows]
            out = bytearray()
            with conn.cursor().copy("COPY (SELECT a, b, c FROM copytext ORDER BY id) TO STDOUT") as copy:
                for chunk in copy:
                    out += chunk
            lines = bytes(out).split(b"\n")
            assert lines[-1] == b""
            assert [split_line(line) for line in lines[:-1]] == enc

        check()


@pytest.mark.parametrize("value", [b"\\", b"\\\\", b"\\N", b"x\\", b"\\\t\\", b"\r\n", b"N\\"])
def test_edge_values_round_trip(value: bytes) -> None:
    assert unescape(escape(value)) == value
    assert split_line(join_line([value, None, value])) == [value, None, value]
