"""Row filters as a feed's definition holds them: `--where SCHEMA.TABLE=PREDICATE`, per table.

A predicate is SQL the source evaluates: PostgreSQL (15+) as the publication's row filter for the
stream, and changefeed in the WHERE clause of every snapshot read and of `verify`'s source side,
so the sink holds exactly the rows the predicate lets through. What PostgreSQL accepts as a row
filter is checked on the source before anything is created (postgres.row_filter).
"""
from __future__ import annotations

from changefeed.errors import ConfigError
from changefeed.spec.units import parse_tables

EXAMPLE = "e.g. --where \"public.orders=region = 'eu'\""


def parse_where(given: list[str], *, removal: bool = False) -> tuple[tuple[str, str], ...]:
    """`--where` values (split at the first `=`) as (schema.table, predicate) pairs, each table once;
    with `removal` (alter), an empty predicate stands for no filter."""
    out: list[tuple[str, str]] = []
    for text in given:
        table, sep, predicate = text.partition("=")
        names = parse_tables(table)
        if not sep or len(names) != 1 or not (removal or predicate.strip()):
            raise ConfigError(f"--where takes SCHEMA.TABLE=PREDICATE, got {text!r}", EXAMPLE)
        if names[0] in (t for t, _ in out):
            raise ConfigError(f"--where names {names[0]} twice", "join the predicates with AND in one --where")
        out.append((names[0], predicate.strip()))
    return tuple(out)


def check_where(where: tuple[tuple[str, str], ...], tables: tuple[str, ...]) -> None:
    """Every filtered table is captured."""
    stray = [t for t, _ in where if t not in tables]
    if stray:
        raise ConfigError(f"--where names {', '.join(stray)}, which the feed does not capture",
                          "add it to --tables, or leave its --where out")
