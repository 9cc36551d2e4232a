"""core.schema_change: what a replica table does with each new shape a Relation brings."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.core.change import TableShape
from changefeed.core.schema_change import Current, Step, plan, widens
from changefeed.errors import UnfollowableChange

NOW = Current(("id", "a", "b"), ("integer", "text", "character varying(10)"), ("id",))


def shape(columns: tuple[str, ...], types: tuple[str, ...], key: tuple[str, ...] = ("id",),
          missing: tuple = (), filled: tuple = ()) -> TableShape:
    return TableShape("public", "t", columns, types, key, "d", missing, filled)


def test_additions_drops_widening_and_key_moves_are_followed() -> None:
    assert plan("f", NOW, shape(NOW.columns, NOW.types)) == []
    added = plan("f", NOW, shape((*NOW.columns, "c", "d"), (*NOW.types, "integer", "text"),
                                 missing=(None,) * 3 + ("7", None)))
    assert added == [Step("add", "c", "integer", "7"), Step("add", "d", "text")]
    assert plan("f", NOW, shape(("id", "a"), ("integer", "text"))) == [Step("drop", "b")]
    assert plan("f", NOW, shape(NOW.columns, ("bigint", "text", "text"))) == [
        Step("type", "id", "bigint"), Step("type", "b", "text")]
    assert plan("f", NOW, shape(NOW.columns, NOW.types, key=("id", "a"))) == [Step("key", key=("id", "a"))]


@pytest.mark.parametrize("new, says", [
    (shape(("id", "a", "c"), ("integer", "text", "character varying(10)")), "b are gone and c are new"),
    (shape(("id", "a", "b"), ("integer", "text", "character varying(5)")), "changed type from character varying(10)"),
    (shape(("id", "a", "b"), ("smallint", "text", "character varying(10)")), "column id changed type"),
    (shape((*NOW.columns, "at"), (*NOW.types, "timestamp with time zone"), filled=(False,) * 3 + (True,)),
     "added with a default computed for each row"),
])
def test_what_the_wal_cannot_tell_stops_with_the_table_change_and_fix(new: TableShape, says: str) -> None:
    with pytest.raises(UnfollowableChange) as e:
        plan("orders", NOW, new)
    assert says in e.value.message and "public.t" in e.value.message
    assert "changefeed snapshot --name orders --tables public.t" in e.value.hint
    followed = plan("orders", NOW, new, resync=True)  # a re-read requested: follow, values start empty
    assert all(s.missing is None for s in followed if s.kind == "add")
    assert any(s.kind == "type" and s.reset for s in followed) == ("changed type" in says)


def test_a_feed_of_several_nodes_keeps_columns_one_node_has_not_got_yet() -> None:
    assert plan("f", NOW, shape(("id", "a"), ("integer", "text")), keep_dropped=True) == []
    assert plan("f", NOW, shape(("id", "a", "c"), ("integer", "text", "text")), keep_dropped=True) == [
        Step("add", "c", "text")]


TYPES = ["smallint", "integer", "bigint", "text", "character varying", "character varying(5)",
         "character varying(20)", "numeric", "numeric(10,2)", "numeric(12,2)", "numeric(12,3)", "real",
         "double precision", "boolean", "date"]


@given(a=st.sampled_from(TYPES), b=st.sampled_from(TYPES), c=st.sampled_from(TYPES))
def test_widening_is_reflexive_and_transitive(a: str, b: str, c: str) -> None:
    assert widens(a, a)
    if widens(a, b) and widens(b, c):
        assert widens(a, c)
    if a != b and widens(a, b):
        assert not widens(b, a) or {a, b} <= {"text", "character varying"}


def test_widening_table() -> None:
    assert widens("integer", "bigint") and not widens("bigint", "integer")
    assert widens("character varying(5)", "character varying(20)") and widens("character varying(5)", "text")
    assert not widens("character varying(20)", "character varying(5)") and not widens("text", "character varying(5)")
    assert widens("numeric(10,2)", "numeric(12,2)") and widens("numeric(10,2)", "numeric")
    assert not widens("numeric(10,2)", "numeric(12,3)") and not widens("numeric", "numeric(10,2)")
    assert not widens("real", "double precision")  # float4 values print differently as float8
    assert not widens("integer", "text")
