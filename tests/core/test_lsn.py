"""LSN text form: parse/format round trips and rejection of anything that is not `X/Y` hex."""
from __future__ import annotations

import json
import pickle
import re
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.core.lsn import Lsn, format_lsn, parse_lsn

U64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
HEX = st.text(alphabet="0123456789abcdefABCDEF", min_size=1, max_size=8)


@pytest.mark.parametrize("text, value", [
    ("0/0", 0),
    ("0/1", 1),
    ("1/0", 1 << 32),
    ("16/B374D848", 0x16_B374_D848),  # the example in PostgreSQL's pg_lsn docs
    ("0/16B3748", 0x16B3748),
    ("FFFFFFFF/FFFFFFFF", (1 << 64) - 1),
    ("ffffffff/0", 0xFFFFFFFF << 32),
    ("00000000/0000000A", 10),
    ("  2/3\n", (2 << 32) | 3),
])
def test_parse_known_values(text: str, value: int) -> None:
    assert parse_lsn(text) == value


@pytest.mark.parametrize("value, text", [
    (0, "0/0"), (1, "0/1"), (1 << 32, "1/0"), (0x16_B374_D848, "16/B374D848"),
    ((1 << 64) - 1, "FFFFFFFF/FFFFFFFF"), (0xABCDEF, "0/ABCDEF"),
])
def test_format_known_values(value: int, text: str) -> None:
    assert format_lsn(value) == text


@given(U64)
def test_format_then_parse_round_trips(value: int) -> None:
    text = format_lsn(value)
    # The form PostgreSQL prints: upper-case hex, no leading zeros, each half at most 8 digits.
    assert re.fullmatch(r"(0|[1-9A-F][0-9A-F]{0,7})/(0|[1-9A-F][0-9A-F]{0,7})", text), text
    assert parse_lsn(text) == value


@given(HEX, HEX)
def test_parse_then_format_canonicalises(hi: str, lo: str) -> None:
    value = parse_lsn(f"{hi}/{lo}")
    assert value == (int(hi, 16) << 32) | int(lo, 16)
    assert format_lsn(value) == f"{int(hi, 16):X}/{int(lo, 16):X}"
    assert parse_lsn(format_lsn(value)) == value


@given(U64, U64)
def test_parse_preserves_order(a: int, b: int) -> None:
    assert (parse_lsn(format_lsn(a)) < parse_lsn(format_lsn(b))) == (a < b)


@pytest.mark.parametrize("text", [
    "", " ", "/", "0/", "/0", "0", "00", "1/2/3", "G/0", "0/G", "0x1/0", "-1/0", "+1/0", "1/+0",
    "123456789/0", "0/123456789", "1 /0", "1/ 0", "1//0", "1.0/0", "0/0/", "０/０", "٣/٣", "0/0 0/0",
    "0/0\n1/1",
])
def test_invalid_text_raises_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        parse_lsn(text)


def _valid(text: str) -> bool:
    parts = text.strip().split("/")
    return (len(parts) == 2 and all(1 <= len(p) <= 8 and all(ch in string.hexdigits for ch in p)
                                    for p in parts))


@given(st.text(alphabet=st.sampled_from("0123456789abcdefABCDEFgx/ \t\n-+.") | st.characters(), max_size=20))
def test_arbitrary_text_parses_only_when_valid(text: str) -> None:
    if _valid(text):
        hi, lo = text.strip().split("/")
        assert parse_lsn(text) == (int(hi, 16) << 32) | int(lo, 16)
    else:
        with pytest.raises(ValueError):
            parse_lsn(text)


@pytest.mark.parametrize("value", [-1, 1 << 64, (1 << 64) + 5, -(1 << 63)])
def test_format_out_of_range_raises_value_error(value: int) -> None:
    with pytest.raises(ValueError):
        format_lsn(value)


@given(U64)
def test_an_lsn_is_the_number_everywhere_but_its_text(value: int) -> None:
    """SQL parameters, JSON (Spark's offset log) and pickles (Spark's partitions) see the number;
    only `.text` is PostgreSQL's `X/Y`."""
    lsn = Lsn(value)
    assert lsn == value and str(lsn) == str(value) and json.dumps(lsn) == str(value)
    assert pickle.loads(pickle.dumps(lsn)) == lsn and type(pickle.loads(pickle.dumps(lsn))) is Lsn
    assert lsn.text == format_lsn(value) and Lsn.parse(lsn.text) == lsn
    assert repr(lsn) == f"Lsn({lsn.text})"
    assert type(lsn + 1) is int  # a position plus a size is wrapped again on purpose


@pytest.mark.parametrize("value", [-1, 1 << 64])
def test_an_lsn_out_of_range_is_refused(value: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        Lsn(value)
