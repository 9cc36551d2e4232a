"""The option table all sink URIs are read with: its value parsers, and how `parse_query` applies a
table, words its errors and hands the sink's own options back in query order."""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.errors import ConfigError
from changefeed.sinks.uri_options import Option, any_text, boolean, choice, duration, parse_query, whole, whole_or_inf
from changefeed.spec.units import parse_duration


def fix(name: str) -> str:
    return f"fix {name}= in the --sink URI"


def refuse_others(name: str, text: str) -> None:
    raise ConfigError(f"unknown option {name!r}", "see the docs")


TABLE = {
    "count": Option("count_n", whole(1), "a whole number >= 1"),
    "flag": Option("flag", boolean, "true or false"),
    "wait": Option("wait_s", duration, "a duration > 0", lambda v: v > 0),
    "kind": Option("kind", choice("a", "b"), "one of a, b", hint="a (the default) or b", label="the sink's kind"),
    "name": Option("name", any_text, "any text"),
}


def parsed(query: list[tuple[str, str]], **kw: Any) -> dict[str, Any]:
    return parse_query(query, TABLE, hint=fix, other=refuse_others, **kw)


def refusal(query: list[tuple[str, str]], **kw: Any) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        parsed(query, **kw)
    return e.value


# -- value parsers ---------------------------------------------------------------------------------

@given(st.sampled_from(["true", "false"]).flatmap(
    lambda word: st.tuples(st.just(word), st.lists(st.booleans(), min_size=len(word), max_size=len(word)))))
def test_boolean_takes_true_and_false_in_any_case(case: tuple[str, list[bool]]) -> None:
    word, upper = case
    written = "".join(c.upper() if u else c for c, u in zip(word, upper, strict=True))
    assert boolean(written) is (word == "true")


@given(st.text().filter(lambda t: t.lower() not in ("true", "false")))
def test_boolean_refuses_anything_else(text: str) -> None:
    with pytest.raises(ValueError):
        boolean(text)


@given(st.integers(-5, 5), st.integers(0, 20), st.integers(-30, 30))
def test_whole_takes_exactly_the_numbers_within_its_bounds(least: int, span: int, n: int) -> None:
    parse = whole(least, least + span)
    if least <= n <= least + span:
        assert parse(str(n)) == n
    else:
        with pytest.raises(ValueError):
            parse(str(n))


@given(st.integers(0, 10**6))
def test_whole_without_an_upper_bound(n: int) -> None:
    assert whole()(str(n)) == n


@pytest.mark.parametrize("text", ["", "+5", " 5", "5 ", "1e3", "1.0", "0x1", "\u0663", "5\n", "inf", "-"])
def test_whole_takes_digits_only(text: str) -> None:
    with pytest.raises(ValueError):
        whole(-1)(text)


def test_whole_takes_a_minus_sign_only_below_zero() -> None:
    assert whole(-1)("-1") == -1 and whole(-1)("-0") == 0
    with pytest.raises(ValueError):
        whole(0)("-0")


@pytest.mark.parametrize("text", ["inf", "INF", "Inf"])
def test_whole_or_inf_reads_inf_as_no_limit(text: str) -> None:
    assert whole_or_inf()(text) is None


def test_whole_or_inf_holds_numbers_to_the_bounds() -> None:
    assert whole_or_inf(1, 9)("9") == 9
    for text in ("0", "10", "infinity", ""):
        with pytest.raises(ValueError):
            whole_or_inf(1, 9)(text)


@given(st.integers(0, 10**6), st.sampled_from(["", "ms", "s", "m", "h"]))
def test_duration_reads_what_spec_units_reads(n: int, unit: str) -> None:
    assert duration(f"{n}{unit}") == parse_duration(f"{n}{unit}")


@pytest.mark.parametrize("text", ["", "soon", "-1s", "1d", "s"])
def test_duration_refuses_with_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        duration(text)


def test_choice_is_exact_and_any_text_is_kept_as_written() -> None:
    assert choice("a", "b")("b") == "b"
    for text in ("A", " a", "", "c"):
        with pytest.raises(ValueError):
            choice("a", "b")(text)
    assert any_text("") == "" and any_text(" x&y ") == " x&y "


# -- applying a table ------------------------------------------------------------------------------

def test_values_come_back_typed_by_field() -> None:
    assert parsed([("count", "3"), ("flag", "TRUE"), ("wait", "500ms"), ("kind", "b"), ("name", "")]) == {
        "count_n": 3, "flag": True, "wait_s": 0.5, "kind": "b", "name": ""}
    assert parsed([]) == {}


@pytest.mark.parametrize("query, message, hint", [
    ([("count", "x")], "count must be a whole number >= 1, got 'x'", fix("count")),
    ([("count", "0")], "count must be a whole number >= 1, got '0'", fix("count")),
    ([("flag", "yes")], "flag must be true or false, got 'yes'", fix("flag")),
    ([("wait", "0s")], "wait must be a duration > 0, got '0s'", fix("wait")),  # refused by the check
    ([("wait", "soon")], "wait must be a duration > 0, got 'soon'", fix("wait")),
    ([("kind", "c")], "the sink's kind must be one of a, b, got 'c'", "a (the default) or b"),
])
def test_a_refused_value_names_the_option_what_is_allowed_and_the_text(
        query: list[tuple[str, str]], message: str, hint: str) -> None:
    error = refusal(query)
    assert (error.message, error.hint, error.exit_code) == (message, hint, 64)


def test_a_parsers_own_config_error_passes_through() -> None:
    def template(text: str) -> str:
        raise ConfigError(f"template {text!r} is no good", "its own hint")

    with pytest.raises(ConfigError) as e:
        parse_query([("t", "{x}")], {"t": Option("t", template, "a template")}, hint=fix, other=refuse_others)
    assert (e.value.message, e.value.hint) == ("template '{x}' is no good", "its own hint")


def test_an_option_given_twice_counts_last_unless_once() -> None:
    assert parsed([("count", "1"), ("count", "2")]) == {"count_n": 2}
    error = refusal([("count", "1"), ("count", "2")], once=True)
    assert (error.message, error.hint) == ("count is given twice in the --sink URI", "give each option once")
    assert refusal([("count", "x"), ("count", "2")], once=True).message.startswith("count must be")


def test_other_names_go_to_the_sink_in_query_order() -> None:
    seen: list[tuple[str, str]] = []
    values = parse_query([("a.b", "1"), ("count", "2"), ("header", "X:1"), ("a.b", "3")], TABLE, hint=fix,
                         other=lambda name, text: seen.append((name, text)))
    assert values == {"count_n": 2} and seen == [("a.b", "1"), ("header", "X:1"), ("a.b", "3")]


def test_errors_come_in_the_order_written() -> None:
    assert refusal([("colour", "red"), ("count", "x")]).message == "unknown option 'colour'"
    assert refusal([("count", "x"), ("colour", "red")]).message.startswith("count must be")


def test_refuse_shows_a_value_set_in_code_as_its_repr() -> None:
    error = TABLE["wait"].refuse("wait", 0.0, fix)
    assert (error.message, error.hint) == ("wait must be a duration > 0, got 0.0", fix("wait"))


@given(st.lists(st.tuples(st.sampled_from(["count", "name"]), st.integers(1, 99).map(str))))
def test_the_last_of_each_option_is_the_value(query: list[tuple[str, str]]) -> None:
    last = {name: text for name, text in query}
    expected = {**({"count_n": int(last["count"])} if "count" in last else {}),
                **({"name": last["name"]} if "name" in last else {})}
    assert parsed(query) == expected
