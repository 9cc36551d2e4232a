"""The replica table's shape, read and changed inside the batch's transaction (see core.schema_change).

Changing it there makes a followed schema change atomic with the changes around it: a batch that
fails (or stops at a change it cannot follow) leaves the replica table as it was.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import psycopg
from psycopg import sql

from changefeed.core import schema_change
from changefeed.core.change import TableShape
from changefeed.core.schema_change import Current, Step
from changefeed.errors import UnfollowableChange
from changefeed.postgres.source import split_table


class Follower:
    """Keeps one batch's replica tables in step with the shapes the stream brings, in its order.

    `resync`: tables whose re-read is requested (they follow any change); `renamed`: old -> new
    schema.table (rows under the old name go to the new); `keep_dropped`: a feed of several nodes.
    """

    def __init__(self, conn: psycopg.Connection[Any], feed: str, *, resync: frozenset[str],
                 renamed: dict[str, str], keep_dropped: bool) -> None:
        self.conn, self.feed, self.resync, self.renamed, self.keep_dropped = conn, feed, resync, renamed, keep_dropped
        self._followed: dict[tuple[str, str], TableShape] = {}  # the replica tables' shapes in this batch
        self._told: set[tuple[str, str]] = set()  # tables whose next shape a captured DDL event explained

    def relation(self, shape: TableShape, *, follow: bool) -> TableShape:
        """An `R` row's shape, under the table's new name if it was renamed; with `follow` (not
        applied before) the replica table takes it, unless it is a snapshot's (ahead of the stream)."""
        if f"{shape.schema}.{shape.table}" in self.renamed:
            schema, table = split_table(self.renamed[f"{shape.schema}.{shape.table}"])
            shape = replace(shape, schema=schema, table=table)
        if follow and not shape.ahead:
            self._follow(shape)
            self._told.discard((shape.schema, shape.table))
        return shape

    def ddl(self, event: dict[str, Any]) -> None:
        """A captured DDL event (postgres.ddl_capture): rename what it renamed, take the new shape
        at once, and let the table's next Relation follow as told."""
        new = (event["schema"], event["table"])
        if event["tag"] == "DROP TABLE":
            return  # the replica keeps the table and its rows
        old = (event["from_schema"], event["from_table"])
        rename(self.conn, old, new, [tuple(p) for p in event["renamed_columns"]])
        self._followed.pop(old, None)
        self._followed.pop(new, None)
        self._told.add(new)  # (also for the Relation that follows: a rewrite's updates)
        if event.get("columns") and event.get("key"):
            names, types, missing = zip(*event["columns"])
            self._follow(TableShape(*new, names, types, tuple(event["key"]), "", missing))

    def _follow(self, shape: TableShape) -> None:
        """Bring the replica table to the shape the stream says it has from here on, or stop."""
        key = (shape.schema, shape.table)
        if self._followed.get(key) == shape:
            return
        current = read(self.conn, *key)
        qualified = f"{shape.schema}.{shape.table}"
        if current is None:
            raise UnfollowableChange(
                f"table {qualified} has changes but is not on the replica: was it renamed on the source (or "
                "dropped on the replica)? nothing past it was applied",
                f"if it was renamed: changefeed alter --name {self.feed} --rename-table OLD={qualified}, then run "
                "the feed again")
        apply(self.conn, shape, schema_change.plan(self.feed, current, shape, resync=qualified in self.resync,
                                                   told=key in self._told, keep_dropped=self.keep_dropped))
        self._followed[key] = shape


def _gives_way(conn: psycopg.Connection[Any], old: tuple[str, str], new: tuple[str, str]) -> bool:
    """Whether nothing is in the way of renaming `old` to `new`: no table `new`, or an empty one,
    dropped here. A `new` with rows stops the feed (whose rows are whose, only the user knows)."""
    if read(conn, *new) is None:
        return True
    if conn.execute(sql.SQL("SELECT 1 FROM {} LIMIT 1").format(sql.Identifier(*new))).fetchone() is not None:
        raise UnfollowableChange(
            f"table {'.'.join(old)} was renamed to {'.'.join(new)} on the source, but the replica has both, "
            f"with rows in each; nothing past the rename was applied",
            f"keep the rows you want in {'.'.join(old)} on the replica and drop {'.'.join(new)} there (or the "
            "other way round, then drop the old one), and run the feed again")
    conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(*new)))
    return True


def read(conn: psycopg.Connection[Any], schema: str, table: str) -> Current | None:
    """The replica table's columns, types and primary key; None if there is no such table."""
    rows = conn.execute(
        "SELECT a.attname, format_type(a.atttypid, a.atttypmod), coalesce(k.ord, 0) FROM pg_attribute a "
        "JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
        "LEFT JOIN pg_index i ON i.indrelid = c.oid AND i.indisprimary "
        # (an int2vector's subscripts start at 0: its ordinality counts the key's columns from 1)
        "LEFT JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(attnum, ord) ON k.attnum = a.attnum "
        "WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p') AND a.attnum > 0 "
        "AND NOT a.attisdropped ORDER BY a.attnum", (schema, table)).fetchall()
    if not rows:
        return None
    key = tuple(name for name, _, at in sorted(rows, key=lambda r: r[2]) if at)
    return Current(tuple(r[0] for r in rows), tuple(r[1] for r in rows), key)


def apply(conn: psycopg.Connection[Any], shape: TableShape, steps: Sequence[Step]) -> None:
    """Run `steps` on the replica table of `shape`."""
    target = sql.Identifier(shape.schema, shape.table)
    for step in steps:
        column = sql.Identifier(step.column)
        if step.kind == "add" and step.missing is None:
            conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN {} {}").format(target, column, sql.SQL(step.type)))
        elif step.kind == "add":  # rows written before the column read as `missing` (no rewrite here either)
            conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN {} {} DEFAULT {}::{}").format(
                target, column, sql.SQL(step.type), sql.Literal(step.missing), sql.SQL(step.type)))
            conn.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN {} DROP DEFAULT").format(target, column))
        elif step.kind == "drop":
            conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN {}").format(target, column))
        elif step.kind == "type":
            using = sql.SQL("NULL") if step.reset else column
            conn.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN {} TYPE {} USING {}::{}").format(
                target, column, sql.SQL(step.type), using, sql.SQL(step.type)))
        elif step.kind == "key":
            _move_key(conn, shape, step.key)


def _move_key(conn: psycopg.Connection[Any], shape: TableShape, key: Sequence[str]) -> None:
    target = sql.Identifier(shape.schema, shape.table)
    name = conn.execute("SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'p'",
                        (target.as_string(conn),)).fetchone()
    if name is not None:
        conn.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(target, sql.Identifier(name[0])))
    conn.execute(sql.SQL("ALTER TABLE {} ADD PRIMARY KEY ({})").format(
        target, sql.SQL(", ").join(map(sql.Identifier, key))))


def rename(conn: psycopg.Connection[Any], old: tuple[str, str], new: tuple[str, str],
           columns: Sequence[tuple[str, str]]) -> None:
    """Rename the replica table `old` to `new` and its columns (old, new) as the source did; what is
    renamed already (a batch replayed) stays. An empty `new` beside `old` is the one a runner made
    for the feed's tables under their new names, started after the source's rename but before this
    message was applied: it gives way (else `old`'s rows would stay behind under the old name)."""
    if old != new and read(conn, *old) is not None and _gives_way(conn, old, new):
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(new[0])))
        if old[0] != new[0]:
            conn.execute(sql.SQL("ALTER TABLE {} SET SCHEMA {}").format(sql.Identifier(*old), sql.Identifier(new[0])))
        if old[1] != new[1]:
            conn.execute(sql.SQL("ALTER TABLE {} RENAME TO {}").format(sql.Identifier(new[0], old[1]),
                                                                    sql.Identifier(new[1])))
    current = read(conn, *new)
    if current is None:
        return
    names = list(current.columns)
    for a, b in columns:
        if a in names and b not in names:
            conn.execute(sql.SQL("ALTER TABLE {} RENAME COLUMN {} TO {}").format(
                sql.Identifier(*new), sql.Identifier(a), sql.Identifier(b)))
            names[names.index(a)] = b
