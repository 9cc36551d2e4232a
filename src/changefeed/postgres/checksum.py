"""Checksums of a table's rows, computed on the server that holds them (for `verify`).

Rows are compared by their text form: ROW(columns)::text in one fixed column order, under the
same output settings on both servers, so a value equal on both sides (also across int/bigint or
varchar/text) gives the same text. Each row goes into a chunk by a hash of its key's text, not by
a key range: a key range depends on each database's collation, a hash does not, and one scan
sums every chunk at once. A chunk's checksum is its row count and the sum of its rows' 64-bit
text hashes: sums add up, so a table read in several block ranges (parallel sessions), or spread
over several nodes, is summed part by part. (hashtext is the same function on every server of
one byte order.)
"""
from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from changefeed.postgres import row_filter
from changefeed.postgres.connect import connect, lost_connection
from changefeed.postgres.source import split_table

# Output settings both sides render values under (timestamps in UTC, ISO dates, exact floats).
SETTINGS = {"DateStyle": "ISO, YMD", "TimeZone": "UTC", "IntervalStyle": "postgres",
            "extra_float_digits": "1", "bytea_output": "hex"}


@dataclass(frozen=True)
class Columns:
    """A table's columns on one server: names in order and their types."""

    names: tuple[str, ...]
    types: tuple[str, ...]

    def type_of(self, name: str) -> str:
        return self.types[self.names.index(name)]


def session(conn: psycopg.Connection[Any]) -> None:
    """Fix the output settings of this session (autocommit, outside a transaction)."""
    for name, value in SETTINGS.items():
        conn.execute(sql.SQL("SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))


def adopt(conn: psycopg.Connection[Any], snapshot: str) -> None:
    """Start a read-only transaction that sees what the exported `snapshot` sees."""
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
    conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))


def columns(conn: psycopg.Connection[Any], qualified: str) -> Columns | None:
    """The table's live columns, None if it does not exist."""
    schema, name = split_table(qualified)
    rows = conn.execute(
        "SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a "
        "JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
        (schema, name)).fetchall()
    return Columns(tuple(r[0] for r in rows), tuple(r[1] for r in rows)) if rows else None


def blocks(conn: psycopg.Connection[Any], qualified: str) -> int:
    """The table's size in blocks now (rows a snapshot sees lie in blocks below it)."""
    row = conn.execute(sql.SQL("SELECT pg_relation_size({}::regclass) / current_setting('block_size')::int").format(
        sql.Literal(_quoted(qualified)))).fetchone()
    return int(row[0]) if row else 0


def _quoted(qualified: str) -> str:
    schema, name = split_table(qualified)
    return sql.Identifier(schema, name).as_string(None)


def _row(cols: Sequence[str]) -> sql.Composable:
    return sql.SQL("ROW({})::text").format(sql.SQL(", ").join(map(sql.Identifier, cols)))


def _bucket(key: Sequence[str], buckets: int) -> sql.Composable:
    return sql.SQL("mod(hashtext({})::bigint + 2147483648, {})").format(_row(key), sql.Literal(buckets))


def _blocks(lo: int, hi: int | None) -> sql.Composable:
    cond = sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({lo},0)"))
    if hi is not None:
        cond = sql.SQL("{} AND ctid < {}::tid").format(cond, sql.Literal(f"({hi},0)"))
    return cond


def chunk_sums(conn: psycopg.Connection[Any], qualified: str, key: Sequence[str], cols: Sequence[str],
               buckets: int, lo: int, hi: int | None, where: str | None = None) -> dict[int, tuple[int, int]]:
    """Per chunk of the rows in blocks [lo, hi) that the row filter `where` lets through: (rows,
    sum of row hashes)."""
    query = sql.SQL("SELECT {b}, count(*), sum(hashtextextended({row}, 0)::numeric) FROM {t} WHERE {where} "
                    "AND {rows} GROUP BY 1").format(b=_bucket(key, buckets), row=_row(cols),
                                                    t=sql.SQL(_quoted(qualified)), where=_blocks(lo, hi),
                                                    rows=row_filter.clause(where))
    return {int(b): (int(n), int(s)) for b, n, s in conn.execute(query)}


def chunk_rows(conn: psycopg.Connection[Any], qualified: str, key: Sequence[str], cols: Sequence[str],
               buckets: int, chosen: Sequence[int], where: str | None = None) -> dict[str, int]:
    """The rows of chunks `chosen` (that `where` lets through): key text -> row hash."""
    query = sql.SQL("SELECT {k}, hashtextextended({row}, 0) FROM {t} WHERE {b} = ANY({chosen}) AND {rows}").format(
        k=_row(key), row=_row(cols), t=sql.SQL(_quoted(qualified)), b=_bucket(key, buckets),
        chosen=sql.Literal(list(chosen)), rows=row_filter.clause(where))  # (no parameters: a filter may hold %)
    return {k: int(h) for k, h in conn.execute(query)}


def rows_of(conn: psycopg.Connection[Any], qualified: str, key: Sequence[str], cols: Sequence[str],
            keys: Sequence[str], where: str | None = None) -> dict[str, dict[str, str | None]]:
    """The rows with these key texts (that `where` lets through): key text -> {column: value text}."""
    if not keys:
        return {}
    query = sql.SQL("SELECT {k}, {c} FROM {t} WHERE {k} = ANY({keys}::text[]) AND {rows}").format(
        k=_row(key), c=sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(c)) for c in cols),
        t=sql.SQL(_quoted(qualified)), keys=sql.Literal(list(keys)), rows=row_filter.clause(where))
    return {r[0]: dict(zip(cols, r[1:])) for r in conn.execute(query)}  # (no parameters: a filter may hold %)


class Sessions:
    """Connections per thread and server, each in a transaction on the snapshot it is given."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._all: list[psycopg.Connection[Any]] = []
        self._lock = threading.Lock()

    @contextmanager
    def on(self, uri: str, role: str, snapshot: str) -> Iterator[psycopg.Connection[Any]]:
        conns = self._local.__dict__.setdefault("conns", {})
        conn = conns.get(uri)
        if conn is None:
            conn = conns[uri] = connect(uri, role)
            with self._lock:
                self._all.append(conn)
            session(conn)
        with lost_connection(role):
            adopt(conn, snapshot)
            try:
                yield conn
            finally:
                conn.execute("ROLLBACK")

    def close(self) -> None:
        for conn in self._all:
            conn.close()
