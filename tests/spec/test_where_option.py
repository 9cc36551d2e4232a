"""--where as the definition holds it: split at the first `=`, one per table, captured tables only."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.errors import ConfigError
from changefeed.spec.definition import FeedSpec
from changefeed.spec.row_filters import parse_where


def test_split_at_the_first_equals_sign_and_the_table_qualified() -> None:
    assert parse_where(["public.orders=region = 'eu'", "items=qty >= 1 AND note <> 'a=b'"]) == (
        ("public.orders", "region = 'eu'"), ("public.items", "qty >= 1 AND note <> 'a=b'"))


@given(st.text(min_size=1).filter(lambda p: p.strip() != ""))
def test_any_predicate_comes_back_as_given_but_trimmed(predicate: str) -> None:
    assert parse_where([f"public.t={predicate}"]) == (("public.t", predicate.strip()),)


@pytest.mark.parametrize("given_, words", [
    (["public.orders"], "SCHEMA.TABLE=PREDICATE"),
    (["public.orders=  "], "SCHEMA.TABLE=PREDICATE"),
    (["=id > 1"], "SCHEMA.TABLE=PREDICATE"),
    (["public.a,public.b=id > 1"], "SCHEMA.TABLE=PREDICATE"),
    (["public.t=id > 1", "t=id < 9"], "names public.t twice"),
])
def test_malformed_where_says_how_to_write_it(given_: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_where(given_)


def test_a_filter_on_a_table_not_captured_is_refused_and_the_filters_are_stored() -> None:
    spec = FeedSpec("shop", "postgresql://u@src/db", "postgresql://u@dst/db", ("public.orders",),
                    where=(("public.orders", "region = 'eu'"),))
    assert FeedSpec.from_json(spec.to_json(), "test") == spec
    assert json.loads(spec.to_json())["where"] == [["public.orders", "region = 'eu'"]]
    assert spec.row_filters == {"public.orders": "region = 'eu'"}
    with pytest.raises(ConfigError, match="does not capture"):
        FeedSpec(**{**spec.__dict__, "where": (("public.items", "id > 1"),)}).validate()
