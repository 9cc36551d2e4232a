"""Staging and merging one table's rows on the replica: COPY a chunk of change rows into a
temporary staging table, then merge it into the target set-based (TRUNCATE first where one
occurred, unchanged TOAST values resolved from the target, per key only the last change, an
update that moved a key deletes the old one); and the target tables a replica lacks.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql

from changefeed.core import change as ch
from changefeed.core.copytext import NULL
from changefeed.errors import SinkError
from changefeed.sinks.replica.insert_run import terminated, write_lines

MERGE_VERSION = 150000  # PostgreSQL's MERGE; an older replica gets a DELETE and an upsert


def ident(*names: str) -> sql.Identifier:
    return sql.Identifier(*names)


def ensure_tables(conn: psycopg.Connection[Any], tables: Iterable[Any]) -> None:
    """Create missing target tables with the source's columns, types and key; a stored generated
    column stays generated (the replica computes it from the same expression)."""
    for t in tables:
        generated = dict(t.generated)
        cols = [sql.SQL("{} {}").format(ident(c), sql.SQL(ty)) if c not in generated else
                sql.SQL("{} {} GENERATED ALWAYS AS ({}) STORED").format(ident(c), sql.SQL(ty), sql.SQL(generated[c]))
                for c, ty in zip(t.columns, t.types)]
        cols.append(sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(map(ident, t.key))))
        try:
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident(t.schema)))
            conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
                ident(t.schema, t.name), sql.SQL(", ").join(cols)))
        except psycopg.Error as e:
            raise SinkError(f"cannot create target table {t.schema}.{t.name}: {e}".strip(),
                            "create the types it uses on the sink, or create the table yourself") from None


def generated_columns(conn: psycopg.Connection[Any], schema: str, table: str) -> set[str]:
    """The target's generated columns: never written, the replica computes them."""
    return {r[0] for r in conn.execute(
        "SELECT a.attname FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n "
        "ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped "
        "AND a.attgenerated <> ''", (schema, table))}


@dataclass
class Part:
    """A temporary staging table for one table shape; it holds one chunk of rows at a time."""

    shape: ch.TableShape
    staging: sql.Identifier
    copy_sql: sql.Composed
    insert_sql: sql.Composed
    nulls: Any
    key_nulls: Any
    columns: tuple[str, ...]  # of the shape's, those the target has (all but for a snapshot's shape ahead)


def copy_rows(conn: psycopg.Connection[Any], part: Part, rows: Any) -> None:
    """COPY rows into the part's staging table, as lines built column-wise by Arrow kernels:
    `lsn seq op unchanged values old_key`, where values are the new row (the old one for
    deletes) and NULLs fill what a row does not have."""
    lines = pc.binary_join_element_wise(
        _text(rows.column("lsn")), _text(rows.column("seq")), _text(rows.column("op")),
        _text(pc.fill_null(rows.column("unchanged"), NULL.decode())),
        pc.coalesce(_large(rows.column("after")), _large(rows.column("before")), part.nulls),
        terminated(pc.coalesce(_large(rows.column("old_key")), part.key_nulls)),
        _TAB)
    _copy_lines(conn, part.copy_sql, lines)


def _copy_lines(conn: psycopg.Connection[Any], copy_sql: sql.Composed, lines: Any) -> None:
    """COPY a large_binary array of complete lines."""
    with conn.cursor().copy(copy_sql) as copy:
        write_lines(copy, lines)


_TAB = pa.scalar(b"\t", pa.large_binary())


def _large(col: Any) -> Any:
    return col.cast(pa.large_binary())


def _text(col: Any) -> Any:
    """Any column as its text form in large_binary (what COPY reads)."""
    if not pa.types.is_string(col.type):
        col = col.cast(pa.string())
    return col.cast(pa.large_binary())


def merge_part(conn: psycopg.Connection[Any], part: Part, *, has_truncate: bool, has_unchanged: bool,
                has_key_change: bool, truncate_where: str | None = None) -> None:
    """Merge the staged chunk into the target: last change per key wins, TRUNCATE first (of a
    table the feed captures through a row filter, a DELETE of the rows the filter lets through:
    other feeds may fill the rest of the target, capture.md).

    An update that changed the key also deletes its old key (as a change just before it).
    """
    shape = part.shape
    target, stg = ident(shape.schema, shape.table), part.staging
    after: sql.Composable = sql.SQL("true")
    if has_truncate:
        row = conn.execute(sql.SQL("SELECT _lsn, _seq FROM {} WHERE _op = 't' ORDER BY _lsn DESC, _seq DESC "
                                   "LIMIT 1").format(stg)).fetchone()
        assert row is not None
        if truncate_where is None:
            conn.execute(sql.SQL("TRUNCATE {}").format(target))
        else:
            _delete_filtered(conn, target, shape, truncate_where)
        after = sql.SQL("(_lsn, _seq) > ({}, {})").format(sql.Literal(row[0]), sql.Literal(row[1]))
    if has_unchanged:
        _resolve_unchanged(conn, part, target, stg)
    keys = [ident(k) for k in shape.key]
    old_keys = [ident(f"_ok_{i}") for i in range(len(shape.key))]
    col_list = sql.SQL(", ").join(ident(c) for c in part.columns)
    rows = sql.SQL("SELECT _lsn, _seq, 1 AS _sub, _op, {col_list} FROM {stg} WHERE _op <> 't' AND {after}").format(
        col_list=col_list, stg=stg, after=after)
    if has_key_change:  # the old key's delete, just before the update
        rows = sql.SQL("{} UNION ALL SELECT _lsn, _seq, 0, 'd', {} FROM {} WHERE {} IS NOT NULL AND {}").format(
            rows, sql.SQL(", ").join(sql.SQL("{} AS {}").format(old_keys[shape.key.index(c)], ident(c))
                                     if c in shape.key else sql.SQL("NULL") for c in part.columns),
            stg, old_keys[0], after)
    statement = _merge_statement if conn.info.server_version >= MERGE_VERSION else _upsert_statement
    conn.execute(statement(target, part, _last(rows, keys), keys))


def _last(rows: sql.Composable, keys: list[sql.Identifier]) -> sql.Composed:
    """Of `rows`, the last change per key."""
    key_list = sql.SQL(", ").join(keys)
    return sql.SQL("SELECT DISTINCT ON ({k}) * FROM ({rows}) r ORDER BY {k}, _lsn DESC, _seq DESC, _sub DESC").format(
        k=key_list, rows=rows)


def _same_key(keys: list[sql.Identifier]) -> sql.Composed:
    """The target row `t` and the change `l` are of the same key."""
    return sql.SQL("({}) = ({})").format(sql.SQL(", ").join(sql.SQL("t.{}").format(k) for k in keys),
                                         sql.SQL(", ").join(sql.SQL("l.{}").format(k) for k in keys))


def _merge_statement(target: sql.Identifier, part: Part, last: sql.Composable,
                     keys: list[sql.Identifier]) -> sql.Composed:
    """One MERGE of `last` (each key's last change): each is joined to the target once, deleting,
    updating or inserting in that one pass (cheaper than a DELETE join and an upsert's conflict
    check each)."""
    non_key = [ident(c) for c in part.columns if c not in part.shape.key]
    matched = sql.SQL("UPDATE SET {}").format(sql.SQL(", ").join(
        sql.SQL("{0} = l.{0}").format(c) for c in non_key)) if non_key else sql.SQL("DO NOTHING")
    cols = [ident(c) for c in part.columns]
    return sql.SQL("""
        MERGE INTO {target} t USING ({last}) l ON {same_key}
        WHEN MATCHED AND l._op = 'd' THEN DELETE
        WHEN MATCHED THEN {matched}
        WHEN NOT MATCHED AND l._op <> 'd' THEN INSERT ({col_list}) VALUES ({values})
    """).format(target=target, last=last, same_key=_same_key(keys), matched=matched,
                col_list=sql.SQL(", ").join(cols), values=sql.SQL(", ").join(sql.SQL("l.{}").format(c) for c in cols))


def _upsert_statement(target: sql.Identifier, part: Part, last: sql.Composable,
                      keys: list[sql.Identifier]) -> sql.Composed:
    """Before PostgreSQL 15: the deletes as a join, then an upsert of the rest."""
    non_key = [c for c in part.columns if c not in part.shape.key]
    on_conflict = sql.SQL("DO UPDATE SET {}").format(sql.SQL(", ").join(
        sql.SQL("{0} = EXCLUDED.{0}").format(ident(c)) for c in non_key)) if non_key else sql.SQL("DO NOTHING")
    col_list = sql.SQL(", ").join(ident(c) for c in part.columns)
    return sql.SQL("""
        WITH last AS ({last}), deleted AS (
            DELETE FROM {target} t USING last l WHERE l._op = 'd' AND {same_key}
        )
        INSERT INTO {target} ({col_list}) SELECT {col_list} FROM last WHERE _op <> 'd'
        ON CONFLICT ({key_list}) {on_conflict}
    """).format(last=last, target=target, col_list=col_list, key_list=sql.SQL(", ").join(keys),
                on_conflict=on_conflict, same_key=_same_key(keys))


def _delete_filtered(conn: psycopg.Connection[Any], target: sql.Identifier, shape: ch.TableShape,
                     predicate: str) -> None:
    try:
        with conn.transaction():  # (a savepoint: the error below is the one that counts)
            conn.execute(sql.SQL("DELETE FROM {} WHERE ({})").format(target, sql.SQL(predicate)))  # (the user's SQL)
    except psycopg.Error as e:
        raise SinkError(f"a TRUNCATE of {shape.schema}.{shape.table} reached the replica, where the feed deletes "
                        f"the rows its row filter lets through, and the replica cannot evaluate the filter "
                        f"{predicate!r}: {(e.diag.message_primary or str(e)).strip()}",
                        "create on the replica what the filter uses (functions, types), then run the feed again"
                        ) from None


def _resolve_unchanged(conn: psycopg.Connection[Any], part: Part, target: sql.Identifier,
                       stg: sql.Identifier) -> None:
    """Fill columns an update left TOASTed-unchanged with the value they had just before.

    That value is the key's latest earlier change in this batch (looked up under the old key when
    the update changed the key), else the replica's current row. Rows whose predecessor is still
    unresolved wait for the next round, so chains of such updates resolve in order.
    """
    shape = part.shape
    keys = [ident(k) for k in shape.key]
    lookup = sql.SQL(", ").join(
        sql.SQL("coalesce(s.{}, s.{})").format(ident(f"_ok_{i}"), k) for i, k in enumerate(keys))
    p_keys = sql.SQL(", ").join(sql.SQL("p.{}").format(k) for k in keys)
    t_keys = sql.SQL(", ").join(sql.SQL("t.{}").format(k) for k in keys)
    for i, col in enumerate(shape.columns):
        c = ident(col)
        while True:
            cur = conn.execute(sql.SQL("""
                UPDATE {stg} s SET {c} = coalesce(
                    (SELECT p.{c} FROM {stg} p WHERE ({p_keys}) = ({lookup}) AND (p._lsn, p._seq) < (s._lsn, s._seq)
                     ORDER BY p._lsn DESC, p._seq DESC LIMIT 1),
                    (SELECT t.{c} FROM {target} t WHERE ({t_keys}) = ({lookup}))),
                  _unch = array_remove(s._unch, {i})
                WHERE {i} = ANY(s._unch) AND NOT EXISTS (
                    SELECT 1 FROM {stg} p WHERE ({p_keys}) = ({lookup}) AND (p._lsn, p._seq) < (s._lsn, s._seq)
                    AND {i} = ANY(p._unch))
            """).format(stg=stg, c=c, p_keys=p_keys, lookup=lookup, target=target, t_keys=t_keys,
                        i=sql.Literal(i)))
            if cur.rowcount == 0:
                break
