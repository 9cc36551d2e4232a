"""`--capture-ddl`: schema changes of captured tables as transactional logical messages, in order.

An event trigger (`ddl_command_end`, and `sql_drop` for dropped tables) runs in the DDL's own
transaction and writes, for each captured table the statement changed, a message with prefix
`changefeed.ddl` whose content is JSON (see `event` below) through `pg_logical_emit_message(true,
...)`: it reaches the slot exactly where the DDL committed, between the data changes around it.

The message also carries the table's columns (name, type, missing value) and key after the
statement, so the replica takes the new shape right there, not only with the table's next change.
What a Relation message cannot tell, the trigger can: it keeps each captured table's columns by
attribute number and its relfilenode (`changefeed.ddl_shapes`, per feed), so a column whose number
stays but whose name changed was renamed, a table whose name changed was renamed, and a new
relfilenode means the table was rewritten (a type change, a column added with a volatile default).
After a rewrite the trigger updates every row to itself in the same transaction, so the rewritten
values reach the slot as updates right after the message. Table renames are also kept in
`changefeed.ddl_renames`, from which the runner updates the feed's table list.

Creating an event trigger needs a superuser.
"""
from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from changefeed.errors import SourceNotReady
from changefeed.postgres.connect import one_row, shared_ddl

PREFIX = "changefeed.ddl"

_SETUP = """
CREATE SCHEMA IF NOT EXISTS changefeed;
CREATE TABLE IF NOT EXISTS changefeed.ddl_shapes (
    feed text NOT NULL, relid oid NOT NULL, nspname name NOT NULL, relname name NOT NULL,
    filenode oid NOT NULL, columns jsonb NOT NULL, PRIMARY KEY (feed, relid));
CREATE TABLE IF NOT EXISTS changefeed.ddl_renames (
    feed text NOT NULL, old text NOT NULL, new text NOT NULL, at timestamptz NOT NULL DEFAULT now());
CREATE OR REPLACE FUNCTION changefeed.ddl_columns(rel oid) RETURNS jsonb LANGUAGE sql STABLE AS $f$
    SELECT coalesce(jsonb_object_agg(attnum::text, attname), '{}') FROM pg_attribute
    WHERE attrelid = rel AND attnum > 0 AND NOT attisdropped $f$;
"""

# {feed} and {publication} are literals; the function reads changefeed.ddl_shapes as it was
# before the statement and writes the message, the rewrite's updates and the new shapes.
_FUNCTION = """
CREATE OR REPLACE FUNCTION changefeed.{function}() RETURNS event_trigger LANGUAGE plpgsql AS $f$
DECLARE
    r record;
    old record;
    now_cols jsonb;
    renamed jsonb;
    first_col name;
BEGIN
    FOR r IN SELECT DISTINCT c.oid, n.nspname, c.relname, c.relfilenode, d.command_tag
             FROM pg_event_trigger_ddl_commands() d JOIN pg_class c ON c.oid = d.objid
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE d.classid = 'pg_class'::regclass AND c.relkind IN ('r', 'p')
             AND EXISTS (SELECT 1 FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
                         WHERE p.pubname = {publication} AND pr.prrelid = c.oid)
    LOOP
        SELECT * INTO old FROM changefeed.ddl_shapes WHERE feed = {feed} AND relid = r.oid;
        now_cols := changefeed.ddl_columns(r.oid);
        SELECT coalesce(jsonb_agg(jsonb_build_array(o.value, n.value)), '[]') INTO renamed
            FROM jsonb_each_text(coalesce(old.columns, '{{}}')) o JOIN jsonb_each_text(now_cols) n USING (key)
            WHERE o.value <> n.value;
        PERFORM pg_logical_emit_message(true, 'changefeed.ddl', jsonb_build_object(
            'tag', r.command_tag, 'schema', r.nspname, 'table', r.relname,
            'from_schema', coalesce(old.nspname, r.nspname), 'from_table', coalesce(old.relname, r.relname),
            'renamed_columns', renamed, 'rewrite', old.filenode IS NOT NULL AND old.filenode <> r.relfilenode,
            'columns', (SELECT jsonb_agg(jsonb_build_array(attname, format_type(atttypid, atttypmod),
                            CASE WHEN atthasmissing THEN (attmissingval::text::text[])[1] END) ORDER BY attnum)
                        FROM pg_attribute WHERE attrelid = r.oid AND attnum > 0 AND NOT attisdropped),
            'key', (SELECT jsonb_agg(a.attname ORDER BY k.ord) FROM pg_index i
                    CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(attnum, ord)
                    JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                    WHERE i.indrelid = r.oid AND CASE WHEN (SELECT relreplident FROM pg_class WHERE oid = r.oid) = 'i'
                          THEN i.indisreplident ELSE i.indisprimary END),
            'statement', current_query())::text);
        IF old.relname IS NOT NULL AND (old.nspname, old.relname) <> (r.nspname, r.relname) THEN
            INSERT INTO changefeed.ddl_renames (feed, old, new)
                VALUES ({feed}, old.nspname || '.' || old.relname, r.nspname || '.' || r.relname);
        END IF;
        IF old.filenode IS NOT NULL AND old.filenode <> r.relfilenode THEN
            SELECT attname INTO first_col FROM pg_attribute
                WHERE attrelid = r.oid AND attnum > 0 AND NOT attisdropped ORDER BY attnum LIMIT 1;
            EXECUTE format('UPDATE %I.%I SET %I = %I', r.nspname, r.relname, first_col, first_col);
        END IF;
        INSERT INTO changefeed.ddl_shapes VALUES ({feed}, r.oid, r.nspname, r.relname,
            (SELECT relfilenode FROM pg_class WHERE oid = r.oid), now_cols)
            ON CONFLICT (feed, relid) DO UPDATE SET nspname = EXCLUDED.nspname, relname = EXCLUDED.relname,
            filenode = EXCLUDED.filenode, columns = EXCLUDED.columns;
    END LOOP;
END $f$;
CREATE OR REPLACE FUNCTION changefeed.{drop_function}() RETURNS event_trigger LANGUAGE plpgsql AS $f$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT s.nspname, s.relname FROM pg_event_trigger_dropped_objects() d
             JOIN changefeed.ddl_shapes s ON s.relid = d.objid AND s.feed = {feed}
             WHERE d.object_type = 'table'
    LOOP
        PERFORM pg_logical_emit_message(true, 'changefeed.ddl', jsonb_build_object(
            'tag', 'DROP TABLE', 'schema', r.nspname, 'table', r.relname, 'from_schema', r.nspname,
            'from_table', r.relname, 'renamed_columns', '[]'::jsonb, 'rewrite', false,
            'statement', current_query())::text);
        DELETE FROM changefeed.ddl_shapes WHERE feed = {feed} AND nspname = r.nspname AND relname = r.relname;
    END LOOP;
END $f$;
"""


def _names(feed: str) -> dict[str, str]:
    return {"function": f"ddl_{feed}", "drop_function": f"ddl_drop_{feed}", "trigger": f"changefeed_ddl_{feed}",
            "drop_trigger": f"changefeed_ddl_drop_{feed}"}


def install(conn: psycopg.Connection[Any], feed: str, publication: str) -> None:
    """Create (or renew) the feed's event triggers and record its tables' shapes (idempotent: run
    again after tables were added)."""
    names = _names(feed)
    try:
        with conn.transaction():
            shared_ddl(conn, _SETUP)
            conn.execute(_FUNCTION.format(feed=sql.Literal(feed).as_string(conn),
                                          publication=sql.Literal(publication).as_string(conn), **names))
            for trigger, event, function in ((names["trigger"], "ddl_command_end", names["function"]),
                                             (names["drop_trigger"], "sql_drop", names["drop_function"])):
                if not conn.execute("SELECT 1 FROM pg_event_trigger WHERE evtname = %s", (trigger,)).fetchone():
                    conn.execute(sql.SQL("CREATE EVENT TRIGGER {} ON {} EXECUTE FUNCTION changefeed.{}()").format(
                        sql.Identifier(trigger), sql.SQL(event), sql.Identifier(function)))
            conn.execute(
                "INSERT INTO changefeed.ddl_shapes SELECT %s, c.oid, n.nspname, c.relname, c.relfilenode, "
                "changefeed.ddl_columns(c.oid) FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid "
                "JOIN pg_class c ON c.oid = pr.prrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE p.pubname = %s ON CONFLICT (feed, relid) DO NOTHING", (feed, publication))
    except psycopg.errors.InsufficientPrivilege as e:
        raise SourceNotReady(f"--capture-ddl needs to create an event trigger, which takes a superuser: {e}".strip(),
                             "run the feed's first start with --capture-ddl as a superuser, or leave it out") from None


def uninstall(conn: psycopg.Connection[Any], feed: str) -> list[str]:
    """Drop the feed's event triggers, functions and recorded shapes; returns what went."""
    names = _names(feed)
    gone = []
    for trigger in (names["trigger"], names["drop_trigger"]):
        if conn.execute("SELECT 1 FROM pg_event_trigger WHERE evtname = %s", (trigger,)).fetchone():
            conn.execute(sql.SQL("DROP EVENT TRIGGER {}").format(sql.Identifier(trigger)))
            gone.append(f"event trigger {trigger}")
    for function in (names["function"], names["drop_function"]):
        conn.execute(sql.SQL("DROP FUNCTION IF EXISTS changefeed.{}()").format(sql.Identifier(function)))
    if one_row(conn.execute("SELECT to_regclass('changefeed.ddl_shapes')"))[0]:
        conn.execute("DELETE FROM changefeed.ddl_shapes WHERE feed = %s", (feed,))
        conn.execute("DELETE FROM changefeed.ddl_renames WHERE feed = %s", (feed,))
    return gone


def renames(conn: psycopg.Connection[Any], feed: str) -> list[tuple[str, str]]:
    """Tables the feed's trigger saw renamed, in order: (old, new) schema.table."""
    if not one_row(conn.execute("SELECT to_regclass('changefeed.ddl_renames')"))[0]:
        return []
    return [(r[0], r[1]) for r in conn.execute(
        "SELECT old, new FROM changefeed.ddl_renames WHERE feed = %s ORDER BY at, ctid", (feed,))]
