"""Whether keys fall in key ranges, in the order PostgreSQL gives the key's types and collations.

A snapshot chunk is the key range (lo, hi] as the table's btree orders it (postgres.snapshot);
a change judged against a chunk (core.judge) must be placed by the same order: integers are not
ordered as their text, nor text under a collation as its bytes. So the server compares: the
keys travel as text arrays, each cast to its column's type with its column's collation.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import psycopg
from psycopg import sql

from changefeed.core import change as ch
from changefeed.core.copytext import split_line
from changefeed.core.judge import DROPPABLE, Judge, everything
from changefeed.core.snapshot import Key
from changefeed.postgres.source import SourceTable, describe_tables


class KeyOrder:
    """The key columns of one table as the server compares them."""

    def __init__(self, conn: psycopg.Connection[Any], table: SourceTable) -> None:
        self.table = table
        types = [table.types[table.columns.index(k)] for k in table.key]
        collations = dict(conn.execute(
            "SELECT a.attname, quote_ident(n.nspname) || '.' || quote_ident(c.collname) FROM pg_attribute a "
            "JOIN pg_collation c ON c.oid = a.attcollation JOIN pg_namespace n ON n.oid = c.collnamespace "
            "WHERE a.attrelid = %s::regclass AND a.attnum > 0",
            (f'"{table.schema}"."{table.name}"',)).fetchall())
        self._casts = [(t, collations.get(k)) for k, t in zip(table.key, types)]

    def _typed(self, values: Sequence[sql.Composable]) -> sql.Composable:
        parts = [sql.SQL("{}::{}").format(v, sql.SQL(t))
                 + (sql.SQL(" COLLATE {}").format(sql.SQL(c)) if c else sql.SQL(""))
                 for v, (t, c) in zip(values, self._casts)]
        return sql.SQL("ROW({})").format(sql.SQL(", ").join(parts))

    def inside(self, conn: psycopg.Connection[Any], keys: Sequence[Key],
               ranges: Sequence[tuple[Key | None, Key | None]]) -> list[bool]:
        """For each key, whether it lies in one of `ranges` ((lo, hi], None open)."""
        if not keys or not ranges:
            return [False] * len(keys)
        if any(lo is None and hi is None for lo, hi in ranges):
            return [True] * len(keys)
        n = len(self._casts)
        names = [sql.Identifier(f"k{i}") for i in range(n)]
        key = self._typed(names)
        conds = []
        for lo, hi in ranges:
            parts = ([sql.SQL("{} > {}").format(key, self._typed([sql.Literal(v) for v in lo]))] if lo is not None
                     else []) + \
                    ([sql.SQL("{} <= {}").format(key, self._typed([sql.Literal(v) for v in hi]))] if hi is not None
                     else [])
            conds.append(sql.SQL("({})").format(sql.SQL(" AND ").join(parts)))
        query = sql.SQL("SELECT u.i FROM unnest({}) AS u(i, {}) WHERE {}").format(
            sql.SQL(", ").join([sql.SQL("%s::int[]")] + [sql.SQL("%s::text[]")] * n),
            sql.SQL(", ").join(names), sql.SQL(" OR ").join(conds))
        columns = [list(range(len(keys)))] + [[k[j] for k in keys] for j in range(n)]
        found = {r[0] for r in conn.execute(query, columns).fetchall()}
        return [i in found for i in range(len(keys))]


class Judging:
    """One window read's judge (core.judge) applied to its record batches: the changes a snapshot
    read holds already are left out, a key change with one half left out becomes its other half.
    The server is asked on a connection of its own, opened for the first batch with a change to
    judge."""

    def __init__(self, judge: Judge, connect: Callable[[], psycopg.Connection[Any]]) -> None:
        self.judge, self._connect = judge, connect
        self._conn: psycopg.Connection[Any] | None = None
        self._orders: dict[str, KeyOrder] = {}
        self._shapes: dict[str, ch.TableShape] = {}
        self._truncated: set[str] = set()  # tables truncated earlier in the window (Judge.ranges)
        self.dropped = 0

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    def _order(self, table: str) -> KeyOrder:
        if table not in self._orders:
            conn = self._connection()
            self._orders[table] = KeyOrder(conn, describe_tables(conn, [table])[0])
        return self._orders[table]

    def apply(self, rows: Any) -> Any:
        """`rows` without the changes the judge drops."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        if not self.judge or not len(rows):
            return rows
        ops = rows.column("op")
        for i in np.flatnonzero(pc.equal(ops, ch.RELATION).to_numpy(zero_copy_only=False)).tolist():
            schema, table = rows.column("schema")[i].as_py(), rows.column("table")[i].as_py()
            self._shapes[f"{schema}.{table}"] = ch.TableShape.from_meta(schema, table, rows.column("meta")[i].as_py())
        names = pc.binary_join_element_wise(rows.column("schema"), rows.column("table"), ".")
        truncated = {name: -1 for name in self._truncated}  # table -> the row of its first truncate
        for i in np.flatnonzero(pc.equal(ops, "t").to_numpy(zero_copy_only=False)).tolist():
            truncated.setdefault(names[i].as_py(), i)
        self._truncated |= truncated.keys()
        judged = pc.and_(pc.is_in(ops, pa.array(sorted(DROPPABLE))),
                         pc.is_in(names, pa.array(sorted(self.judge.tables()))))
        at = np.flatnonzero(pc.fill_null(judged, False).to_numpy(zero_copy_only=False)).tolist()
        candidates: dict[str, list[int]] = {}
        for i in at:
            candidates.setdefault(names[i].as_py(), []).append(i)
        new_out: set[int] = set()  # rows whose new key's half is left out (an insert's, an update's)
        old_out: set[int] = set()  # rows whose old key's half is (a delete's, a key change's)
        for name, ids in candidates.items():
            new, old = self._judged(name, ids, rows, truncated.get(name, len(rows)))
            new_out |= new
            old_out |= old
        if not new_out and not old_out:
            return rows
        return self._without(rows, new_out, old_out)

    def _without(self, rows: Any, new_out: set[int], old_out: set[int]) -> Any:
        """`rows` with the halves judged out: a row all of whose halves are goes, a key change
        that keeps one half becomes it (an unchanged TOASTed value the sink takes from the old
        row keeps the key change whole)."""
        import numpy as np
        import pyarrow as pa

        moved = rows.column("old_key").is_valid().to_pylist()
        ops = rows.column("op").to_pylist()
        unchanged = rows.column("unchanged").is_valid().to_pylist()
        keep = np.ones(len(rows), dtype=bool)
        to_delete, to_insert = [], []
        for i in new_out | old_out:
            if not moved[i] or (i in new_out and i in old_out):
                keep[i] = False
            elif i in new_out:
                to_delete.append(i)
            elif not unchanged[i]:
                to_insert.append(i)
        self.dropped += int(len(rows) - keep.sum())
        if to_delete or to_insert:
            after, before = rows.column("after").to_pylist(), rows.column("before").to_pylist()
            old_key = rows.column("old_key").to_pylist()
            for i in to_delete:
                ops[i], after[i], old_key[i] = "d", None, None
            for i in to_insert:
                ops[i], before[i], old_key[i] = "c", None, None
            for column, values in (("op", pa.array(ops, pa.string())), ("after", pa.array(after, pa.binary())),
                                   ("before", pa.array(before, pa.binary())),
                                   ("old_key", pa.array(old_key, pa.binary()))):
                rows = rows.set_column(rows.schema.get_field_index(column), column, values)
        return rows if keep.all() else rows.filter(pa.array(keep))

    def _judged(self, name: str, at: list[int], rows: Any, truncated: int) -> tuple[set[int], set[int]]:
        """Of the changes at `at` to table `name`, those whose new key's half and those whose old
        key's half the judge leaves out (past row `truncated`, a truncate of the table: by the
        ranges still to be read only)."""
        shape = self._shapes[name]
        columns = [shape.columns.index(k) for k in shape.key]
        ops, xids = rows.column("op").take(at).to_pylist(), rows.column("xid").take(at).to_pylist()
        halves: dict[tuple[Any, ...], list[tuple[int, bool, Key | None]]] = {}
        for i, op, xid in zip(at, ops, xids):
            ranges = self.judge.ranges(name, xid, read=i < truncated)
            if not ranges:
                continue
            spec = tuple((tuple(lo or ()), tuple(hi or ()), lo is None, hi is None) for lo, hi in ranges)
            line = rows.column("before" if op == "d" else "after")[i].as_py()
            halves.setdefault(spec, []).append((i, op != "d", _key(split_line(line), columns)))
            old = rows.column("old_key")[i].as_py() if op == "u" else None
            if old is not None:
                halves[spec].append((i, False, _key(split_line(old), range(len(columns)))))
        new_out: set[int] = set()
        old_out: set[int] = set()
        for spec, found in halves.items():
            ranges = [(None if lo_open else list(lo), None if hi_open else list(hi))
                      for lo, hi, lo_open, hi_open in spec]
            hits = [True] * len(found) if everything(ranges) else \
                self._order(name).inside(self._connection(), [k or [] for _, _, k in found], ranges)
            for (i, is_new, _), hit in zip(found, hits):
                if hit:
                    (new_out if is_new else old_out).add(i)
        return new_out, old_out

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None:
            self._conn = self._connect()
        return self._conn


def _key(values: Sequence[bytes | None], columns: Iterable[int]) -> Key:
    """The key's text values at `columns` of a row's values."""
    return [(values[k] or b"").decode() for k in columns]
