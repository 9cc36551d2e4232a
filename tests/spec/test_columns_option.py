"""--columns as the definition holds it: split at the first `=`, columns by commas, one list per
table, captured tables only, stored with the feed."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.errors import ConfigError
from changefeed.spec.column_lists import parse_columns
from changefeed.spec.definition import FeedSpec

names = st.text(st.characters(blacklist_characters=",=", blacklist_categories=("Cs", "Zs", "Cc")), min_size=1)


@given(st.lists(names, min_size=1, max_size=6, unique=True))
def test_any_list_of_distinct_names_comes_back_in_its_order(columns: list[str]) -> None:
    assert parse_columns([f"shop.t={', '.join(columns)}"]) == (("shop.t", tuple(columns)),)


@pytest.mark.parametrize("given_, words", [
    (["public.t"], "SCHEMA.TABLE=COLUMN"),
    (["public.t="], "SCHEMA.TABLE=COLUMN"),
    (["public.t=id,,name"], "SCHEMA.TABLE=COLUMN"),
    (["public.t=id, "], "SCHEMA.TABLE=COLUMN"),
    (["public.t=id,name,id"], "names a column twice"),
    (["public.t=id", "t=id,name"], "names public.t twice"),
])
def test_malformed_columns_say_how_to_write_them(given_: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_columns(given_)


def test_a_list_for_a_table_not_captured_is_refused_and_the_lists_are_stored() -> None:
    spec = FeedSpec("shop", "postgresql://u@src/db", "postgresql://u@dst/db", ("public.orders",),
                    columns=(("public.orders", ("id", "total")),))
    assert FeedSpec.from_json(spec.to_json(), "test") == spec
    assert spec.column_lists == {"public.orders": ("id", "total")}
    with pytest.raises(ConfigError, match="does not capture"):
        FeedSpec("shop", "postgresql://u@src/db", "postgresql://u@dst/db", ("public.orders",),
                 columns=(("public.items", ("id",)),)).validate()
