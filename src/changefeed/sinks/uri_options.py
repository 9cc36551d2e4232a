"""Simple `--sink` URI query options read from a table, so every sink parses, checks and reports them alike.

A sink declares its plain options (`name -> Option(field, parse, expected, check)`) and hands the
query pairs to `parse_query`; a refused value is a ConfigError `NAME must be EXPECTED, got 'TEXT'`
with the sink's hint. Options that are not one plain value (librdkafka settings, `storage.KEY`,
repeatable headers) go to the sink's own `other` handler, in query order. It imports only the
stdlib, changefeed.errors and spec.units: it runs in Spark writer tasks and in the CLI's checks.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from changefeed.errors import ConfigError
from changefeed.spec.units import parse_duration


def _anything(value: Any) -> bool:
    return True


@dataclass(frozen=True)
class Option:
    """One plain query option: the field it sets, how its text is parsed, and what is allowed.

    `parse` raises ValueError for text it refuses (the message then says `expected`), or a
    ConfigError of its own where it can say more. `check` is kept apart from `parse` so that values
    set in code can be held to it too. `hint` and `label` (the option as the message names it)
    override the sink's usual ones where an option deserves its own words."""

    field: str
    parse: Callable[[str], Any]
    expected: str
    check: Callable[[Any], bool] = _anything
    hint: str = ""
    label: str = ""

    def refuse(self, name: str, got: Any, hint: Callable[[str], str]) -> ConfigError:
        """The error for a value `got` (the text as written, or a value set in code) of option `name`."""
        return ConfigError(f"{self.label or name} must be {self.expected}, got {got!r}", self.hint or hint(name))

    def read(self, name: str, text: str, hint: Callable[[str], str]) -> Any:
        """The typed value of `text`, or the sink's ConfigError naming `name` and the text."""
        try:
            value = self.parse(text)
        except ValueError:
            raise self.refuse(name, text, hint) from None
        if not self.check(value):
            raise self.refuse(name, text, hint)
        return value


def parse_query(pairs: Iterable[tuple[str, str]], table: Mapping[str, Option], *, hint: Callable[[str], str],
                other: Callable[[str, str], None], once: bool = False) -> dict[str, Any]:
    """The typed values of `table`'s options among the (name, text) `pairs`, by field.

    Pairs of other names go to `other` in query order, so errors come in the order written; it
    handles the sink's own options and raises for unknown ones. `hint(name)` is the sink's hint for
    a refused value. `once`: an option given twice is refused (else the last one counts)."""
    values: dict[str, Any] = {}
    seen: set[str] = set()
    for name, text in pairs:
        option = table.get(name)
        if option is None:
            other(name, text)
            continue
        if once and name in seen:
            raise ConfigError(f"{name} is given twice in the --sink URI", "give each option once")
        seen.add(name)
        values[option.field] = option.read(name, text, hint)
    return values


# -- value parsers: each raises ValueError for text it refuses --------------------------------------------------

def boolean(text: str) -> bool:
    """`true` or `false`, in any case."""
    value = {"true": True, "false": False}.get(text.lower())
    if value is None:
        raise ValueError(text)
    return value


def whole(least: int = 0, most: int | None = None) -> Callable[[str], int]:
    """A whole number in [least, most], written in digits (a leading `-` only if least < 0): no
    `+`, spaces, `1e3` or `1.0`, which int() and float() would take."""
    digits = re.compile(r"-?[0-9]+" if least < 0 else r"[0-9]+")

    def parse(text: str) -> int:
        if not digits.fullmatch(text) or int(text) < least or (most is not None and int(text) > most):
            raise ValueError(text)
        return int(text)

    return parse


def whole_or_inf(least: int = 0, most: int | None = None) -> Callable[[str], int | None]:
    """`inf` in any case (None: no limit), or a whole number as `whole`."""
    number = whole(least, most)
    return lambda text: None if text.lower() == "inf" else number(text)


def duration(text: str) -> float:
    """Seconds of a duration as spec.units reads them (500ms, 30s, 2m, 1.5); bounds go in `check`."""
    try:
        return parse_duration(text)
    except ConfigError:
        raise ValueError(text) from None


def choice(*names: str) -> Callable[[str], str]:
    """One of `names`, exactly as written (case matters: the names are the sink's own words)."""

    def parse(text: str) -> str:
        if text not in names:
            raise ValueError(text)
        return text

    return parse


def any_text(value: str) -> str:
    """Any text, kept as written (empty too)."""
    return value
