"""Column lists checked on the source: `--columns SCHEMA.TABLE=c1,c2,...` (spec.column_lists).

PostgreSQL takes a publication's column list at CREATE PUBLICATION but refuses, later and on the
source, every UPDATE and DELETE of a table whose list leaves out a replica identity column: the
user's application would fail, not the feed. So the list is checked here, before anything is
created: the names exist, and they hold the key (every column, under REPLICA IDENTITY FULL).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from changefeed.errors import ConfigError, SourceNotReady
from changefeed.postgres.connect import one_row, server_version


def keep(conn: psycopg.Connection[Any], table: str, oid: int, cols: list[Any], key: list[str],
            listed: Sequence[str]) -> list[Any]:
    """The table's columns a column list keeps, in the table's order, once PostgreSQL would take
    the list for a publication that also publishes UPDATE and DELETE."""
    version = server_version(conn)
    if version < 150000:
        raise SourceNotReady(f"--columns needs PostgreSQL 15 or later (publication column lists); the source runs "
                             f"{version // 10000}", "leave --columns out, or capture from a newer server")
    names = [c[0] for c in cols]
    unknown = [c for c in listed if c not in names]
    if unknown:
        raise ConfigError(f"--columns {table}: no column {', '.join(unknown)} on the source (generated columns "
                          "are not captured)", f"its columns: {', '.join(names)}")
    identity = one_row(conn.execute("SELECT relreplident::text FROM pg_class WHERE oid = %s", (oid,)))[0]
    needed = names if identity == "f" else key
    left_out = [c for c in needed if c not in listed]
    if left_out:
        why = "the table has REPLICA IDENTITY FULL, so" if identity == "f" else "the key"
        raise ConfigError(f"--columns {table} leaves out {', '.join(left_out)}: {why} every UPDATE and DELETE "
                          "publishes them, and PostgreSQL would refuse those on the source",
                          f"add {', '.join(left_out)} to the list" + (
                              f", or ALTER TABLE {table} REPLICA IDENTITY DEFAULT" if identity == "f" else ""))
    return [c for c in cols if c[0] in listed]
