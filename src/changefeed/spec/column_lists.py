"""Column lists as a feed's definition holds them: `--columns SCHEMA.TABLE=c1,c2,...`, per table.

Only the listed columns are captured: the publication carries them as its column list
(PostgreSQL 15+), the snapshot and `verify` read only them, a replica's target table has only
them and message sinks send only them. The list must hold the table's key (the replica
identity, which PostgreSQL needs of every UPDATE and DELETE a column list publishes); whether the
names exist and hold the key is checked on the source (postgres.source.describe_tables).
"""
from __future__ import annotations

from changefeed.errors import ConfigError
from changefeed.spec.units import parse_tables

EXAMPLE = "e.g. --columns public.customers=id,name,country"


def parse_columns(given: list[str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`--columns` values (split at the first `=`) as (schema.table, columns) pairs, each table once."""
    out: list[tuple[str, tuple[str, ...]]] = []
    for text in given:
        table, sep, listed = text.partition("=")
        names = parse_tables(table)
        columns = tuple(c.strip() for c in listed.split(","))
        if not sep or len(names) != 1 or not all(columns):
            raise ConfigError(f"--columns takes SCHEMA.TABLE=COLUMN,COLUMN,..., got {text!r}", EXAMPLE)
        if len(set(columns)) != len(columns):
            raise ConfigError(f"--columns {names[0]} names a column twice", EXAMPLE)
        if names[0] in (t for t, _ in out):
            raise ConfigError(f"--columns names {names[0]} twice", "list all its columns in one --columns")
        out.append((names[0], columns))
    return tuple(out)


def check_columns(columns: tuple[tuple[str, tuple[str, ...]], ...], tables: tuple[str, ...]) -> None:
    """Every table with a column list is captured."""
    stray = [t for t, _ in columns if t not in tables]
    if stray:
        raise ConfigError(f"--columns names {', '.join(stray)}, which the feed does not capture",
                          "add it to --tables, or leave its --columns out")
