"""A table's row filter changed on a feed, running or not (`changefeed alter --where`), on one node.

One transaction does it all, so the stream sees the change at one point of the WAL:

1. `LOCK TABLE ... IN SHARE MODE`: writers of the table wait until it commits (readers do not),
   so the rows read next are exactly the table at the switch;
2. the rows the old filter (the publication's, as it stands) lets through and the new one does
   not are written, by their replica identity, into `changefeed.leave` messages
   (postgres.decode.leaving): the decoder turns them into deletes right there. PostgreSQL itself
   publishes nothing for them, as they did not change;
3. the table is dropped from the publication and added back with the new filter
   (row_filter.replace_filter): decoding filters each change by the publication as it stood
   where the change is in the WAL, so every later transaction is filtered by the new one.

Rows the new filter lets in that the old one kept out come with a snapshot of the table, which
the caller requests for a window past the switch (`after` of a request, see core.requests); the
snapshot reads with the filter the publication has where it reads (postgres.snapshot), so it
agrees with the stream. Running it again is harmless: the rows it finds leaving are already gone.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import sql
from psycopg.abc import Buffer
from psycopg.adapt import Loader

from changefeed.core.copytext import join_line
from changefeed.errors import SourceNotReady, TransientError
from changefeed.postgres import row_filter
from changefeed.postgres.connect import insert_lsn, one_row
from changefeed.postgres.decode import pgoutput as po
from changefeed.postgres.decode.leaving import LINES_PER_MESSAGE, PREFIX, pieces
from changefeed.postgres.source import SourceTable, table_oid

LOCK_TIMEOUT = "60s"  # how long the switch waits for the table's writers before it gives up
TEXT_OID = 25


def switch(conn: psycopg.Connection[Any], publication: str, table: SourceTable, new: str | None,
           listed: bool) -> tuple[int, int]:
    """Give `table` the row filter `new` (None: none) in `publication`, its column list kept when
    `listed`; returns (rows that left, a WAL position past the switch's commit). `new` must have
    passed row_filter.check; `conn` is in autocommit mode."""
    oid = table_oid(conn, table.schema, table.name)
    if oid is None:
        raise SourceNotReady(f"table {table.qualified} does not exist on the source", "check the table's name")
    try:
        with conn.transaction():
            conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(LOCK_TIMEOUT)))
            conn.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(sql.Identifier(table.schema, table.name)))
            _, old = row_filter.published(conn, publication, table.qualified)
            relation = _relation(conn, oid, table)
            left = 0
            for lines in _leaving(conn, table, relation, old, new):
                for piece in pieces(publication, relation, lines):
                    conn.execute("SELECT pg_logical_emit_message(true, %s, %s::bytea)", (PREFIX, piece.encode()))
                left += len(lines)
            row_filter.replace_filter(conn, publication, table.qualified, new, table.columns if listed else None)
    except psycopg.errors.LockNotAvailable:
        raise TransientError(f"table {table.qualified} stayed locked by writers for {LOCK_TIMEOUT}: its row filter "
                             "was not changed", "run the same changefeed alter again (a long transaction may "
                             "hold it: see pg_stat_activity)") from None
    return left, insert_lsn(conn)


def _relation(conn: psycopg.Connection[Any], oid: int, table: SourceTable) -> po.Relation:
    """The table's Relation as pgoutput describes it to this publication: its published columns
    in order, the replica identity's flagged as key (every column under FULL)."""
    ident, identity = one_row(conn.execute(
        "SELECT c.relreplident::text, array(SELECT a.attname::text FROM pg_index i JOIN pg_attribute a "
        "ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) WHERE i.indrelid = c.oid AND "
        "CASE c.relreplident WHEN 'i' THEN i.indisreplident WHEN 'd' THEN i.indisprimary ELSE false END) "
        "FROM pg_class c WHERE c.oid = %s", (oid,)))
    types = {str(n): (int(t), int(m)) for n, t, m in conn.execute(
        "SELECT attname, atttypid::int, atttypmod FROM pg_attribute WHERE attrelid = %s AND attnum > 0 "
        "AND NOT attisdropped", (oid,))}
    return po.Relation(oid, table.schema, table.name, ident, tuple(
        po.Column(c, *types[c], ident == "f" or c in identity) for c in table.columns))


def _leaving(conn: psycopg.Connection[Any], table: SourceTable, relation: po.Relation, old: str | None,
             new: str | None) -> Iterator[list[bytes]]:
    """The old tuples (as a DELETE would carry them: COPY text lines) of the rows `old` lets through
    and `new` does not, a message's worth at a time, through a cursor (however many rows leave)."""
    values = [sql.Identifier(c.name) if c.is_key else sql.SQL("NULL::text") for c in relation.columns]
    query = sql.SQL("SELECT {} FROM {} WHERE ({}) IS TRUE AND ({}) IS NOT TRUE").format(
        sql.SQL(", ").join(values), sql.Identifier(table.schema, table.name),
        row_filter.clause(old), row_filter.clause(new))
    with conn.cursor(name="changefeed_leaving") as cur:
        for oid in {c.type_oid for c in relation.columns} | {TEXT_OID}:
            cur.adapters.register_loader(oid, _OutputText)  # each value as its type's output text
        cur.execute(query)
        while rows := cur.fetchmany(LINES_PER_MESSAGE):
            yield [join_line(row) for row in rows]


class _OutputText(Loader):
    """A value as the server sent it (its type's output function): what pgoutput sends too."""

    def load(self, data: Buffer) -> bytes:
        return bytes(data)
