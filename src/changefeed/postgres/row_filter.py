"""Row filters on the source: what PostgreSQL accepts as a publication's row filter, checked
before anything is created, and the filter as a WHERE clause of the feed's own reads.

PostgreSQL (15+) evaluates a publication's row filter on each change it decodes: an UPDATE whose
old row passed and new row does not is published as a DELETE, the other way round as an INSERT.
A filter of a table whose updates and deletes are published may use only the columns of its
replica identity (else PostgreSQL refuses the UPDATE or DELETE itself, on the source): that is
checked here, with the filter's syntax and types, by creating the publication in a transaction
that is rolled back.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from changefeed.errors import ConfigError, SourceNotReady
from changefeed.postgres.connect import one_row, server_version
from changefeed.spec.row_filters import EXAMPLE

MIN_VERSION = 150000
_VAR = re.compile(r":varattno (\d+)")


def clause(predicate: str | None) -> sql.Composable:
    """`(predicate)`, to AND into a WHERE clause; TRUE without one. (The user's SQL, as given:
    check() had PostgreSQL take it as a row filter first. A query holding it takes no parameters,
    which would read a `%` in it, `id % 4 = 0`, as a placeholder.)"""
    return sql.SQL("({})").format(sql.SQL(predicate)) if predicate else sql.SQL("TRUE")


def check(conn: psycopg.Connection[Any], where: dict[str, str], feed: str) -> dict[str, str]:
    """ConfigError (SourceNotReady before PostgreSQL 15) for a filter PostgreSQL would refuse, or
    one on columns outside the table's replica identity; nothing is left behind. Returns each
    filter as the server prints it back (what `published` reads once it is the publication's)."""
    if not where:
        return {}
    printed: dict[str, str] = {}
    version = server_version(conn)
    if version < MIN_VERSION:
        raise SourceNotReady(f"--where needs PostgreSQL 15 or later (publication row filters); the source runs "
                             f"{version // 10000}", "leave --where out, or capture from a newer server")
    for table, predicate in where.items():
        schema, name = table.split(".", 1)
        try:
            with conn.transaction(force_rollback=True):
                conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {} WHERE ({}) "
                                     "WITH (publish_via_partition_root = true)").format(
                    sql.Identifier(f"changefeed_check_{feed}"), sql.Identifier(schema, name),
                    sql.SQL(predicate)))  # (the user's SQL: what is tried here)
                used = _columns_used(conn, f"changefeed_check_{feed}")
                identity = _replica_identity(conn, schema, name)
                printed[table] = str(published(conn, f"changefeed_check_{feed}", table)[1])
        except psycopg.Error as e:
            reason = (e.diag.message_primary or str(e)).strip()
            raise ConfigError(f"--where {table}: PostgreSQL refuses {predicate!r} as a row filter: {reason}",
                              EXAMPLE) from None
        outside = [c for c in used if identity is not None and c not in identity]
        if outside:
            raise ConfigError(
                f"--where {table}: the filter uses {', '.join(outside)}, outside the table's replica identity "
                f"({', '.join(identity or ())}): PostgreSQL would refuse every UPDATE and DELETE of the table",
                f"filter on those columns only, or ALTER TABLE {table} REPLICA IDENTITY FULL")
    return printed


def check_published(conn: psycopg.Connection[Any], publication: str, tables: list[str], where: dict[str, str],
                    printed: dict[str, str], feed: str) -> None:
    """ConfigError when the publication filters a table other than the feed's definition says
    (`where`, as check printed it back): an `alter --where` stopped half way, which running it
    again finishes."""
    if server_version(conn) < MIN_VERSION:
        return
    for table in tables:
        held, now = published(conn, publication, table)
        if held and now != printed.get(table):
            wanted = where.get(table, "")
            raise ConfigError(f"the publication {publication} filters {table} by {now or 'nothing'}, the feed {feed} "
                              f"by {wanted or 'nothing'}: a changefeed alter --where did not finish",
                              f"run it again with the filter you want, e.g. the feed's: changefeed alter --name {feed} "
                              f"--where \"{table}={wanted}\"")


def replace_filter(conn: psycopg.Connection[Any], publication: str, table: str, predicate: str | None,
                   columns: Sequence[str] | None = None) -> None:
    """Give `table` in `publication` the row filter `predicate` (None: none), keeping its column
    list `columns`: the table is dropped from the publication and added back in one transaction,
    so decoding switches filters exactly at that transaction's commit (each change is filtered by
    the publication as it stood where the change is in the WAL). The filter must have passed
    check() first."""
    schema, name = table.split(".", 1)
    entry: sql.Composable = sql.Identifier(schema, name)
    if columns:
        entry = sql.SQL("{} ({})").format(entry, sql.SQL(", ").join(map(sql.Identifier, columns)))
    if predicate:
        entry = sql.SQL("{} WHERE ({})").format(entry, sql.SQL(predicate))  # (the user's SQL, checked)
    with conn.transaction():
        conn.execute(sql.SQL("ALTER PUBLICATION {} DROP TABLE {}").format(
            sql.Identifier(publication), sql.Identifier(schema, name)))
        conn.execute(sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(sql.Identifier(publication), entry))


def published(conn: psycopg.Connection[Any], publication: str, table: str) -> tuple[bool, str | None]:
    """(whether `publication` holds `table`, its row filter as the server prints it or None): what
    the stream filters by, read in the caller's snapshot (before PostgreSQL 15: no filters)."""
    if server_version(conn) < MIN_VERSION:
        return False, None
    schema, name = table.split(".", 1)
    row = conn.execute("SELECT rowfilter FROM pg_publication_tables WHERE pubname = %s AND schemaname = %s "
                       "AND tablename = %s", (publication, schema, name)).fetchone()
    return (False, None) if row is None else (True, row[0])


def _columns_used(conn: psycopg.Connection[Any], publication: str) -> list[str]:
    """The columns the row filter of `publication`'s one table reads (from its stored expression)."""
    row = one_row(conn.execute(
        "SELECT r.prrelid, r.prqual::text FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid "
        "WHERE p.pubname = %s", (publication,)))
    numbers = sorted({int(n) for n in _VAR.findall(row[1] or "")})
    if not numbers:
        return []
    names = conn.execute("SELECT attname FROM pg_attribute WHERE attrelid = %s AND attnum = ANY(%s) ORDER BY attnum",
                         (row[0], numbers)).fetchall()
    return [str(n[0]) for n in names]


def _replica_identity(conn: psycopg.Connection[Any], schema: str, name: str) -> list[str] | None:
    """The columns of the table's replica identity; None for FULL (every column)."""
    oid, ident = one_row(conn.execute("SELECT c.oid, c.relreplident::text FROM pg_class c JOIN pg_namespace n "
                                      "ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s",
                                      (schema, name)))
    if ident == "f":
        return None
    kind = "indisreplident" if ident == "i" else "indisprimary"
    rows = conn.execute(f"SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND "
                        f"a.attnum = ANY(i.indkey) WHERE i.indrelid = %s AND i.{kind}", (oid,)).fetchall()
    return [str(r[0]) for r in rows]
