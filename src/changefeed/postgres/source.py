"""The source database: checks, publication, replication slot, and reading decoded changes.

`peek` reads with the SQL interface of logical decoding (`pg_logical_slot_peek_binary_changes`):
it decodes inside the server, faster than the walsender (see postgres/wal_reader.py, which also
has the streaming reader), over an ordinary connection, and it never consumes the slot. The slot
moves only through postgres/slots.py, once the sink has committed.
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from changefeed.core.lsn import Lsn, format_lsn, parse_lsn
from changefeed.errors import FeedBusy, SourceNotReady
from changefeed.postgres import column_list
from changefeed.postgres.connect import ADVISORY_HELD, one_row, server_version
from changefeed.postgres.decode.pgoutput import RelationInfo
from changefeed.postgres.slots import slot_errors

PGOUTPUT_OPTIONS = ("proto_version", "1", "messages", "true")


# Key columns of a table: its replica identity index if it has one (that is what the source sends
# old values for), else its primary key.
_KEY_SQL = (
    "SELECT a.attname FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid "
    "CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(attnum, ord) "
    "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
    "WHERE i.indrelid = %s AND CASE WHEN c.relreplident = 'i' THEN i.indisreplident ELSE i.indisprimary END "
    "ORDER BY k.ord")


@dataclass(frozen=True)
class SourceTable:
    schema: str
    name: str
    columns: tuple[str, ...]
    types: tuple[str, ...]
    key: tuple[str, ...]
    generated: tuple[tuple[str, str], ...] = ()  # (column, expression) of its stored generated columns

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"


GENERATED_VERSION = 180000  # PostgreSQL publishes stored generated columns from 18 on (publish_generated_columns)


def keyless(tables: Sequence[SourceTable]) -> list[str]:
    """The tables without a key among `tables` (REPLICA IDENTITY FULL: for sinks that append)."""
    return [t.qualified for t in tables if not t.key]


def split_table(qualified: str) -> tuple[str, str]:
    schema, _, name = qualified.rpartition(".")
    return (schema or "public"), name


def check_wal_level(conn: psycopg.Connection[Any]) -> None:
    level = one_row(conn.execute("SHOW wal_level"))[0]
    if level != "logical":
        raise SourceNotReady(
            f"the source has wal_level={level}; logical decoding needs wal_level=logical",
            "run ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL")


def table_oid(conn: psycopg.Connection[Any], schema: str, name: str) -> int | None:
    """The oid of a plain or partitioned table, None if there is none by that name."""
    row = conn.execute(
        "SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')", (schema, name)).fetchone()
    return None if row is None else int(row[0])


def partitioned(conn: psycopg.Connection[Any], tables: list[str]) -> list[str]:
    """Those of `tables` that are partitioned tables (captured by their root)."""
    return [t for t in tables if conn.execute(
        "SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = %s AND c.relkind = 'p'", split_table(t)).fetchone()]


def describe_tables(conn: psycopg.Connection[Any], tables: list[str],
                    columns: Mapping[str, Sequence[str]] | None = None) -> list[SourceTable]:
    """Columns, SQL types and key of each table, only the listed ones of a table in `columns`
    (a feed's column lists); typed errors for missing tables, bad column lists and tables without
    a key, but for one under REPLICA IDENTITY FULL: its key is () (sinks.registry.check_keys)."""
    out = []
    for qualified in tables:
        schema, name = split_table(qualified)
        oid = table_oid(conn, schema, name)
        if oid is None:
            raise SourceNotReady(f"table {schema}.{name} does not exist on the source",
                                 "create it, or fix --tables (names are schema.table, case-sensitive); if "
                                 "a captured table was renamed: changefeed alter --rename-table OLD=NEW")
        # Stored generated columns where the server can publish them: sinks get their values
        cols = conn.execute(
            "SELECT attname, format_type(atttypid, atttypmod), pg_get_expr(d.adbin, d.adrelid) FROM pg_attribute a "
            "LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum AND a.attgenerated = 's' "
            "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped AND (attgenerated = '' OR attgenerated = 's' "
            "AND %s) ORDER BY attnum", (oid, server_version(conn) >= GENERATED_VERSION)).fetchall()
        key = [r[0] for r in conn.execute(_KEY_SQL, (oid,)).fetchall()]
        full = one_row(conn.execute("SELECT relreplident::text FROM pg_class WHERE oid = %s", (oid,)))[0] == "f"
        if not key and not full:  # (keyless under REPLICA IDENTITY FULL: for sinks that append, check_keys)
            raise SourceNotReady(
                f"table {schema}.{name} has no primary key (nor a replica identity index)",
                f"add one (ALTER TABLE {schema}.{name} ADD PRIMARY KEY (...)); for sinks that only append (Kafka, "
                f"webhooks, a Delta change log) ALTER TABLE {schema}.{name} REPLICA IDENTITY FULL also does; "
                "or leave the table out of --tables")
        listed = (columns or {}).get(f"{schema}.{name}")
        if listed is not None:
            cols = column_list.keep(conn, f"{schema}.{name}", oid, cols, key, listed)
        out.append(SourceTable(schema, name, tuple(c[0] for c in cols), tuple(c[1] for c in cols),
                               tuple(dict.fromkeys(key)), tuple((c[0], c[2]) for c in cols if c[2] is not None)))
    return out



def missing_values(conn: psycopg.Connection[Any], oid: int) -> dict[str, str]:
    """Per column added with a default: the value rows older than the column read as."""
    return dict(conn.execute(
        "SELECT attname, (attmissingval::text::text[])[1] FROM pg_attribute "
        "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped AND atthasmissing", (oid,)).fetchall())


def filled_columns(conn: psycopg.Connection[Any], oid: int) -> set[str]:
    """Columns with a default but no missing value: added with one, their existing rows got values
    by a table rewrite, which the WAL does not carry (see core.schema_change)."""
    return {r[0] for r in conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped "
        "AND atthasdef AND NOT atthasmissing AND attgenerated = ''", (oid,))}


def column_catalog(conn: psycopg.Connection[Any], rel: Any) -> RelationInfo:
    """Type names, primary key, missing values and filled columns of a pgoutput Relation, from the catalog."""
    missing = missing_values(conn, rel.oid)
    filled = filled_columns(conn, rel.oid)
    types = conn.execute(
        "SELECT format_type(t, m) FROM unnest(%s::oid[], %s::int[]) WITH ORDINALITY u(t, m, i) ORDER BY i",
        ([c.type_oid for c in rel.columns], [c.typmod for c in rel.columns])).fetchall()
    names = [c.name for c in rel.columns]
    key = [r[0] for r in conn.execute(_KEY_SQL, (rel.oid,)).fetchall()]
    key_idx = tuple(names.index(k) for k in dict.fromkeys(key) if k in names)
    if not key_idx and rel.replica_identity != "f":  # (FULL, no key: the table has none, as describe_tables says)
        key_idx = rel.key_indexes
    return RelationInfo(tuple(t[0] for t in types), key_idx, tuple(missing.get(n) for n in names),
                        tuple(n in filled for n in names))


def check_rights(conn: psycopg.Connection[Any], publication: str, tables: list[SourceTable]) -> None:
    """What creating the feed's slot and publication needs of the connecting user, checked before
    anything is created: REPLICATION (or superuser), and to publish a table not yet published, the
    right to create in the database and ownership of the table."""
    row = conn.execute("SELECT current_user, rolsuper, rolreplication FROM pg_roles WHERE rolname = current_user"
                       ).fetchone()
    assert row is not None
    user, superuser, replication = row
    if superuser:
        return
    if not replication:
        raise SourceNotReady(f"user {user} may not read replication slots (it has no REPLICATION attribute)",
                             f"ALTER ROLE {user} REPLICATION; or connect as a user that has it")
    have = {(r[0], r[1]) for r in conn.execute(
        "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s", (publication,))}
    todo = [t for t in tables if (t.schema, t.name) not in have]
    if todo and not have and not one_row(conn.execute("SELECT has_database_privilege(current_database(), 'CREATE')"
                                                      ))[0]:
        raise SourceNotReady(f"user {user} may not create the publication {publication} (no CREATE on the database)",
                             f"GRANT CREATE ON DATABASE ... TO {user}")
    for t in todo:
        owner = conn.execute("SELECT pg_has_role(c.relowner, 'USAGE') FROM pg_class c WHERE c.oid = %s::regclass",
                             (f'"{t.schema}"."{t.name}"',)).fetchone()
        if owner and not owner[0]:
            raise SourceNotReady(f"user {user} may not publish table {t.qualified}: it must be owner of the table",
                                 f"ALTER TABLE {t.qualified} OWNER TO {user}; or connect as the tables' owner")


def ensure_publication(conn: psycopg.Connection[Any], publication: str, tables: list[SourceTable],
                       where: dict[str, str] | None = None, columns: Mapping[str, Sequence[str]] | None = None
                       ) -> bool:
    """Create the publication, or add tables it lacks, each with its row filter in `where` (checked
    by postgres.row_filter) and its column list in `columns` (checked by describe_tables); True if
    it was created.

    A partitioned table is published by its root (publish_via_partition_root): its changes arrive
    as the root's, whichever partition they touch, and partitions created later are in it at once.
    On PostgreSQL 18+ stored generated columns are published too (publish_generated_columns), so
    sinks get their values. A publication an older changefeed created without these gets them
    (from that point of the WAL on).
    """
    generated = server_version(conn) >= GENERATED_VERSION
    row = conn.execute(f"SELECT pubviaroot, {'pubgencols' if generated else 'NULL'} FROM pg_publication "
                       "WHERE pubname = %s", (publication,)).fetchone()
    options = sql.SQL("publish_via_partition_root = true" + (", publish_generated_columns = stored" if generated
                                                              else ""))

    def entry(t: SourceTable) -> sql.Composable:
        predicate = (where or {}).get(t.qualified)
        ident: sql.Composable = sql.Identifier(t.schema, t.name)
        if t.qualified in (columns or {}):
            ident = sql.SQL("{} ({})").format(ident, sql.SQL(", ").join(map(sql.Identifier, t.columns)))
        return sql.SQL("{} WHERE ({})").format(ident, sql.SQL(predicate)) if predicate else ident

    if row is None:
        conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {} WITH ({})").format(
            sql.Identifier(publication), sql.SQL(", ").join(map(entry, tables)), options))
        return True
    if not row[0] and partitioned(conn, [t.qualified for t in tables]) or \
            generated and row[1] != "s" and any(t.generated for t in tables):
        conn.execute(sql.SQL("ALTER PUBLICATION {} SET ({})").format(sql.Identifier(publication), options))
    have = {(r[0], r[1]) for r in conn.execute(
        "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s", (publication,))}
    missing = [entry(t) for t in tables if (t.schema, t.name) not in have]
    if missing:
        conn.execute(sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(
            sql.Identifier(publication), sql.SQL(", ").join(missing)))
    return False


def flush_lsn(conn: psycopg.Connection[Any]) -> tuple[Lsn, int]:
    """(WAL flush position, server clock in Unix ms): everything at or before it is decodable."""
    row = one_row(conn.execute("SELECT pg_current_wal_flush_lsn()::text, "
                               "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"))
    return parse_lsn(row[0]), int(row[1])


def flush_point(conn: psycopg.Connection[Any]) -> tuple[Lsn, int]:
    """(WAL flush position, then the server clock in Unix µs): every commit before the position
    took its commit time before that clock reading."""
    row = one_row(conn.execute("SELECT pg_current_wal_flush_lsn()::text, "
                               "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint"))
    return parse_lsn(row[0]), int(row[1])


_BEGIN, _COMMIT, _ROW_MESSAGES = ord("B"), ord("C"), {ord(k) for k in "IUDT"}  # pgoutput message types


def lsn_after_changes(conn: psycopg.Connection[Any], slot: str, publication: str, start: Lsn, upto: Lsn,
                      changes: int, rows_only: bool = False) -> tuple[Lsn, int]:
    """End LSN of the first commit after `start` by which `changes` messages were decoded (with
    `rows_only`, only inserts, updates, deletes and truncates count: --max-rate), or `upto`; and
    how many were decoded before it (more than `changes` when a transaction ends past them).

    A commit's end is a record boundary: a window ending there holds that commit.

    Decodes inside the server; only (LSN, is-commit) pairs come back, never change data. The peek
    widens until it has seen `changes` messages past `start` (the slot may lag `start`).
    """
    want = changes
    while True:
        rows = conn.execute(
            "SELECT lsn - '0/0'::pg_lsn, get_byte(data, 0) FROM pg_logical_slot_peek_binary_changes("
            "%s, %s::pg_lsn, %s, 'proto_version', '1', 'publication_names', %s)",
            (slot, format_lsn(upto), want, publication)).fetchall()
        seen, txn = 0, None  # txn: what the open transaction counts so far
        for lsn, kind in rows:
            counts = int(not rows_only or kind in _ROW_MESSAGES)
            if kind == _BEGIN:
                txn = counts
            elif txn is None:  # a message outside a transaction
                seen += counts if int(lsn) > start else 0
            else:
                txn += counts
                if kind == _COMMIT:
                    # (a commit's LSN here is its record's end: past `start` iff it is in the window,
                    # whatever the LSNs of its changes, which may lie before `start`)
                    seen, txn = seen + (txn if int(lsn) > start else 0), None
                    if seen >= changes:
                        return Lsn(min(int(lsn), upto)), seen
        if len(rows) < want:
            return upto, seen  # decoded all there is up to `upto`
        want *= 2


def captured_change_after(conn: psycopg.Connection[Any], slot: str, publication: str, after: int,
                          rows: int = 256, timeout_ms: int = 3000) -> bool | None:
    """Whether the slot holds a transaction that changed a captured table and committed past
    `after` (a checkpoint's end LSN). Decodes in the server from the slot's position, stopping
    after about `rows` messages; None when that does not settle it, when it takes longer than
    `timeout_ms`, or when the slot is in use (never call it while the feed runs: it would take
    the slot from the feed's reader)."""
    try:
        with conn.transaction():
            conn.execute("SELECT set_config('statement_timeout', %s, true)", (str(timeout_ms),))
            found = conn.execute(
                "SELECT lsn - '0/0'::pg_lsn, get_byte(data, 0) FROM pg_logical_slot_peek_binary_changes("
                "%s, NULL, %s, 'proto_version', '1', 'publication_names', %s)", (slot, rows, publication)).fetchall()
    except (psycopg.errors.ObjectInUse, psycopg.errors.QueryCanceled, psycopg.errors.UndefinedObject,
            psycopg.errors.ObjectNotInPrerequisiteState):
        return None
    data = False
    for lsn, kind in found:  # a commit's row carries the end of its commit record
        if kind == ord("B"):
            data = False
        elif chr(kind) in "IUDT":
            data = True
        elif kind == ord("C") and data and int(lsn) > after:
            return True
    return False if len(found) < rows else None


def wal_layout(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """The server's WAL page and segment size, in bytes."""
    page, segment = one_row(conn.execute(
        "SELECT current_setting('wal_block_size')::int, "
        "(SELECT setting::bigint FROM pg_settings WHERE name = 'wal_segment_size')"))
    return int(page), int(segment)


def page_cut(start: int, max_bytes: int, block: int) -> int:
    """The last WAL page boundary at most `max_bytes` past `start` (the first one past it if
    `max_bytes` is less than a page): where a window limited by bytes ends.

    Like a record boundary, and unlike a position inside a record, a page boundary splits no WAL
    record, so the records a peek up to it decodes are exactly those that start before it, which
    are exactly those a slot advanced to it skips. Computed without decoding anything.
    """
    cut = (start + max_bytes) // block * block
    return cut if cut > start else (start // block + 1) * block


def peek(conn: psycopg.Connection[Any], slot: str, publication: str, upto: int,
         fetch: int = 20000) -> Iterator[list[bytes]]:
    """pgoutput messages of the records that start before `upto` (a record or page boundary), in
    commit order, from the slot's position on; in blocks of up to `fetch`, as fetched (the
    builder works on a block at once)."""
    with slot_errors(slot), conn.transaction(), conn.cursor(name="changefeed_peek", binary=True) as cur:
        cur.itersize = fetch
        cur.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, %s::pg_lsn, NULL, "
            "'proto_version', '1', 'publication_names', %s, 'messages', 'true')",
            (slot, format_lsn(upto), publication))
        while rows := cur.fetchmany(fetch):
            yield [data for (data,) in rows]


def lock_feed(conn: psycopg.Connection[Any], feed: str, *, by: str = "changefeed", patience_s: float = 3.0) -> None:
    """Hold a session advisory lock for `feed` on the source: one runner per feed, anywhere. A lock
    still held is tried again for `patience_s`: a verify that held the stopped feed, or a runner
    just stopped, may have closed its session before the server ended it."""
    key = _feed_key(feed)
    conn.execute("SELECT set_config('application_name', %s, false)",
                 (f"{by}:{feed}@{socket.gethostname()}:{os.getpid()}"[:63],))
    deadline = time.monotonic() + patience_s
    while not one_row(conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (key,)))[0]:
        if time.monotonic() >= deadline:
            raise FeedBusy(f"feed {feed} is already running: held by {_lock_holder(conn, key)}",
                           "stop the other runner first, or use another --name")
        time.sleep(0.2)


def _lock_holder(conn: psycopg.Connection[Any], key: str) -> str:
    holder = conn.execute(
        "SELECT a.pid, a.application_name, a.client_addr::text, a.backend_start::text FROM pg_locks l "
        f"JOIN pg_stat_activity a ON a.pid = l.pid WHERE {ADVISORY_HELD}", (key,)).fetchone()
    return f"{holder[1] or 'unknown'} (backend pid {holder[0]}, from {holder[2] or 'local socket'}, since " \
        f"{holder[3]})" if holder else "another session"


def _feed_key(feed: str) -> str:
    return f"changefeed:{feed}"


def feed_lock_free(conn: psycopg.Connection[Any], feed: str) -> bool:
    """Whether no session holds `feed`'s lock (lock_feed): its runner is gone. Let go again at once."""
    key = _feed_key(feed)
    if not one_row(conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (key,)))[0]:
        return False
    conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (key,))
    return True


def end_feed_sessions(conn: psycopg.Connection[Any], feed: str, slot_names: list[str]) -> None:
    """End the sessions of `feed`'s runner on this server: the one holding its lock, and those
    reading its slots `slot_names` (a runner whose lease ended, frozen or cut off)."""
    conn.execute(
        f"SELECT pg_terminate_backend(pid) FROM (SELECT l.pid FROM pg_locks l WHERE {ADVISORY_HELD} "
        "UNION SELECT active_pid FROM pg_replication_slots WHERE slot_name = ANY(%s) AND active_pid IS NOT NULL) s "
        "WHERE pid <> pg_backend_pid()", (_feed_key(feed), slot_names))


def heartbeat(conn: psycopg.Connection[Any], prefix: str, pad: int = 0) -> tuple[Lsn, int]:
    """Write a non-transactional logical decoding message (`pad` bytes long) and wait until it is
    flushed.

    Returns (the LSN just past it, server clock in Unix ms): a flushed WAL record boundary, so a
    window may end there (see page_cut), and a server clock reading taken once it was flushed.
    The message also keeps an idle slot moving.
    """
    if conn.info.server_version >= 170000:
        row = one_row(conn.execute("SELECT pg_logical_emit_message(false, %s, repeat(' ', %s), true)::text",
                                   (prefix, pad)))
        lsn = parse_lsn(row[0])
    else:
        row = one_row(conn.execute("SELECT pg_logical_emit_message(false, %s, repeat(' ', %s))::text",
                                   (prefix, pad)))
        lsn = parse_lsn(row[0])
        while flush_lsn(conn)[0] < lsn:
            time.sleep(0.02)
    return lsn, flush_lsn(conn)[1]


MAX_PAD = 16 << 20  # bytes of one padding message


def reach(conn: psycopg.Connection[Any], upto: int, prefix: str) -> None:
    """Make sure the server's WAL reaches `upto` before a window that ends there is read.

    A window's end was a flushed position of the server that planned it. After a failover the new
    primary may lack the end of that WAL (its standby lagged): a peek would return what there is,
    the window would be recorded whole, and what the new primary then writes below `upto` would
    never be read. Heartbeat messages as long as the gap move its WAL past `upto` first, so the
    window holds exactly what the new primary's WAL has below it."""
    while (gap := upto - flush_lsn(conn)[0]) > 0:
        heartbeat(conn, prefix, min(gap, MAX_PAD))
