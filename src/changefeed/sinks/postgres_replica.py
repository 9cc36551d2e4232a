"""PostgreSQL replica sink: exactly-once, consistent-cut apply of change batches.

Two halves, matching Spark's writer protocol:
* `stage` (on executors): COPY each table's change rows, as they come, into a fresh unlogged
  staging table; returns what it staged. Safe to repeat: every attempt stages into new tables.
* `apply_batch` (on the driver, once per batch): in ONE transaction, skip the batch if the
  progress table already covers it; otherwise resolve unchanged TOAST values, apply per key only
  the last change (TRUNCATE first where one occurred), add columns the source added, and record
  progress. So the replica moves from one source commit boundary to the next, never between.
"""
from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from ..core import change as ch
from ..core.copytext import NULL
from ..core.lsn import format_lsn
from .. import faults
from ..errors import SinkError

STAGE_SCHEMA = "changefeed_stage"
META_SCHEMA = "changefeed"
APPLIED_OPS = ("c", "u", "r", "d", "t")


@dataclass
class StagedPart:
    """One staging table: a contiguous run of one table's changes with one shape."""

    shape: ch.TableShape
    staging: str
    first: tuple[int, int]
    rows: int = 0
    has_unchanged: bool = False
    has_truncate: bool = False


@dataclass
class Staged:
    """What one writer task staged: its parts, and the progress rows it saw."""

    parts: list[StagedPart] = field(default_factory=list)
    progress: list[ch.Progress] = field(default_factory=list)


def ident(*names: str) -> sql.Identifier:
    return sql.Identifier(*names)


def ensure_meta(conn: psycopg.Connection[Any]) -> None:
    conn.execute(f"CREATE SCHEMA IF NOT EXISTS {META_SCHEMA}; CREATE SCHEMA IF NOT EXISTS {STAGE_SCHEMA}")
    conn.execute(
        f"CREATE TABLE IF NOT EXISTS {META_SCHEMA}.progress ("
        " feed text NOT NULL, batch_id bigint NOT NULL, end_lsn pg_lsn NOT NULL, resolved_ts bigint NOT NULL,"
        " commit_time timestamptz, changes bigint NOT NULL, applied_at timestamptz NOT NULL DEFAULT now(),"
        " PRIMARY KEY (feed, end_lsn))")


def ensure_tables(conn: psycopg.Connection[Any], tables: Iterable[Any]) -> None:
    """Create missing target tables with the source's columns, types and key."""
    for t in tables:
        cols = [sql.SQL("{} {}").format(ident(c), sql.SQL(ty)) for c, ty in zip(t.columns, t.types)]
        cols.append(sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(map(ident, t.key))))
        try:
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident(t.schema)))
            conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
                ident(t.schema, t.name), sql.SQL(", ").join(cols)))
        except psycopg.Error as e:
            raise SinkError(f"cannot create target table {t.schema}.{t.name}: {e}".strip(),
                            "create the types it uses on the sink, or create the table yourself") from None


def drop_stale_staging(conn: psycopg.Connection[Any], feed: str) -> None:
    """Drop staging tables left by a crashed run of `feed` (only one runner exists at a time)."""
    names = [r[0] for r in conn.execute(
        "SELECT tablename FROM pg_tables WHERE schemaname = %s AND tablename LIKE %s",
        (STAGE_SCHEMA, f"{_stage_prefix(feed)}%"))]
    for n in names:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(ident(STAGE_SCHEMA, n)))


def _stage_prefix(feed: str) -> str:
    return f"{feed[:30]}_".replace("%", "_")


# -- executors: staging -----------------------------------------------------------------------

class _Stager:
    """Streams rows of one part into its staging table, one COPY per megabyte.

    Several parts are open at once on one connection, so no COPY may stay open between rows.
    """

    def __init__(self, conn: psycopg.Connection[Any], feed: str, shape: ch.TableShape, first: tuple[int, int]):
        self.part = StagedPart(shape, f"{_stage_prefix(feed)}{uuid.uuid4().hex[:16]}", first)
        target_types = [sql.SQL("{} {}").format(ident(c), sql.SQL(t)) for c, t in zip(shape.columns, shape.types)]
        key_types = [sql.SQL("{} {}").format(ident(f"_ok_{i}"), sql.SQL(shape.types[shape.columns.index(k)]))
                     for i, k in enumerate(shape.key)]
        conn.execute(sql.SQL("CREATE UNLOGGED TABLE {} (_lsn bigint, _seq int, _op text, _unch int[], {})").format(
            ident(STAGE_SCHEMA, self.part.staging), sql.SQL(", ").join(target_types + key_types)))
        self._conn = conn
        self._copy_sql = sql.SQL("COPY {} FROM STDIN").format(ident(STAGE_SCHEMA, self.part.staging))
        self._nulls = b"\t".join([NULL] * len(shape.columns))
        self._key_nulls = b"\t".join([NULL] * len(shape.key))
        self._buf: list[bytes] = []
        self._size = 0

    def add(self, op: str, lsn: int, seq: int, after: bytes | None, before: bytes | None,
            old_key: bytes | None, unchanged: str | None) -> None:
        values = after if after is not None else before if before is not None else self._nulls
        line = b"%d\t%d\t%s\t%s\t%s\t%s\n" % (lsn, seq, op.encode(), unchanged.encode() if unchanged else NULL,
                                               values, old_key if old_key is not None else self._key_nulls)
        self._buf.append(line)
        self._size += len(line)
        self.part.rows += 1
        if unchanged:
            self.part.has_unchanged = True
        elif op == "t":
            self.part.has_truncate = True
        if self._size > 1 << 20:
            self._flush()

    def _flush(self) -> None:
        if self._buf:
            with self._conn.cursor().copy(self._copy_sql) as copy:
                copy.write(b"".join(self._buf))
        self._buf, self._size = [], 0

    def close(self) -> StagedPart:
        self._flush()
        return self.part


def stage(conn: psycopg.Connection[Any], feed: str, batches: Iterator[Any]) -> Staged:
    """Stage the change rows of one writer task (Arrow record batches, in stream order)."""
    staged = Staged()
    shapes: dict[tuple[str, str], ch.TableShape] = {}
    open_stagers: dict[tuple[str, str], _Stager] = {}
    with conn.transaction():
        for rb in batches:
            cols = [rb.column(n).to_pylist() for n in
                    ("op", "schema", "table", "lsn", "seq", "after", "before", "old_key", "unchanged", "meta")]
            for op, schema, table, lsn, seq, after, before, old_key, unchanged, meta in zip(*cols):
                if op in APPLIED_OPS:
                    key = (schema, table)
                    st = open_stagers.get(key)
                    if st is None:
                        if key not in shapes:
                            raise SinkError(f"change for {schema}.{table} before its description (R row)",
                                            "this is a bug in the change stream; report it")
                        st = open_stagers[key] = _Stager(conn, feed, shapes[key], (lsn, seq))
                    st.add(op, lsn, seq, after, before, old_key, unchanged)
                elif op == ch.RELATION:
                    shape = ch.TableShape.from_meta(schema, table, meta)
                    if shapes.get((schema, table)) != shape:
                        shapes[(schema, table)] = shape
                        if (schema, table) in open_stagers:  # new shape: later rows go to a new part
                            staged.parts.append(open_stagers.pop((schema, table)).close())
                elif op == ch.PROGRESS:
                    staged.progress.append(ch.Progress.from_meta(meta))
        staged.parts.extend(st.close() for st in open_stagers.values())
    return staged


# -- driver: apply one batch -------------------------------------------------------------------

def checkpoint_lsn(conn: psycopg.Connection[Any], feed: str) -> int | None:
    """The feed's checkpoint on this sink, None if it has none (read-only: creates nothing)."""
    if not conn.execute(f"SELECT to_regclass('{META_SCHEMA}.progress')").fetchone()[0]:  # type: ignore[index]
        return None
    return applied_upto(conn, feed) or None


def applied_upto(conn: psycopg.Connection[Any], feed: str) -> int:
    row = conn.execute(f"SELECT max(end_lsn) - '0/0'::pg_lsn FROM {META_SCHEMA}.progress WHERE feed = %s",
                       (feed,)).fetchone()
    return int(row[0]) if row and row[0] is not None else 0  # type: ignore[index]


def apply_batch(conn: psycopg.Connection[Any], feed: str, batch_id: int, staged: list[Staged]) -> bool:
    """Apply one batch atomically; False if the progress table shows it was applied before."""
    progress = [p for s in staged for p in s.progress]
    parts = sorted((p for s in staged for p in s.parts), key=lambda p: p.first)
    if not progress:
        drop_staging(conn, parts)
        raise SinkError(f"batch {batch_id} carries no progress row", "this is a bug in the change stream; report it")
    end = max(p.end_lsn for p in progress)
    applied = False
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"changefeed-sink:{feed}",))
        done = applied_upto(conn, feed)
        if end > done:
            for part in parts:
                _apply_part(conn, part, done)
            times = [p.last_commit_time for p in progress if p.last_commit_time is not None]
            conn.execute(
                f"INSERT INTO {META_SCHEMA}.progress (feed, batch_id, end_lsn, resolved_ts, commit_time, changes) "
                "VALUES (%s, %s, %s::pg_lsn, %s, to_timestamp(%s / 1e6), %s)",
                (feed, batch_id, format_lsn(end), max(p.resolved_ts for p in progress),
                 max(times) if times else None, sum(p.changes for p in progress)))
            applied = True
            faults.reach("before_sink_commit")
        drop_staging(conn, parts)
    faults.reach("after_sink_commit")
    return applied


def drop_staging(conn: psycopg.Connection[Any], parts: Iterable[StagedPart]) -> None:
    for p in parts:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(ident(STAGE_SCHEMA, p.staging)))


def _apply_part(conn: psycopg.Connection[Any], part: StagedPart, done: int) -> None:
    shape = part.shape
    target, stg = ident(shape.schema, shape.table), ident(STAGE_SCHEMA, part.staging)
    _add_new_columns(conn, shape, target)
    after = sql.SQL("_lsn > {}").format(sql.Literal(done))
    if part.has_truncate:
        row = conn.execute(sql.SQL("SELECT _lsn, _seq FROM {} WHERE _op = 't' AND {} ORDER BY _lsn DESC, _seq DESC "
                                   "LIMIT 1").format(stg, after)).fetchone()
        if row:
            conn.execute(sql.SQL("TRUNCATE {}").format(target))
            after = sql.SQL("(_lsn, _seq) > ({}, {})").format(sql.Literal(row[0]), sql.Literal(row[1]))
    if part.has_unchanged:
        _resolve_unchanged(conn, part, target, stg)
    cols = [ident(c) for c in shape.columns]
    keys = [ident(k) for k in shape.key]
    old_keys = [ident(f"_ok_{i}") for i in range(len(shape.key))]
    key_list = sql.SQL(", ").join(keys)
    col_list = sql.SQL(", ").join(cols)
    non_key = [c for c in shape.columns if c not in shape.key]
    on_conflict = sql.SQL("DO UPDATE SET {}").format(sql.SQL(", ").join(
        sql.SQL("{0} = EXCLUDED.{0}").format(ident(c)) for c in non_key)) if non_key else sql.SQL("DO NOTHING")
    conn.execute(sql.SQL("""
        WITH rows AS (
            SELECT _lsn, _seq, 1 AS _sub, _op, {col_list} FROM {stg} WHERE _op <> 't' AND {after}
            UNION ALL
            SELECT _lsn, _seq, 0, 'd', {old_as_keys} FROM {stg} WHERE {ok0} IS NOT NULL AND {after}
        ), last AS (
            SELECT DISTINCT ON ({key_list}) * FROM rows ORDER BY {key_list}, _lsn DESC, _seq DESC, _sub DESC
        ), deleted AS (
            DELETE FROM {target} t USING last l WHERE l._op = 'd' AND ({t_keys}) = ({l_keys})
        )
        INSERT INTO {target} ({col_list}) SELECT {col_list} FROM last WHERE _op <> 'd'
        ON CONFLICT ({key_list}) {on_conflict}
    """).format(
        col_list=col_list, stg=stg, after=after, key_list=key_list, target=target, on_conflict=on_conflict,
        old_as_keys=sql.SQL(", ").join(
            sql.SQL("{} AS {}").format(old_keys[shape.key.index(c)], ident(c)) if c in shape.key
            else sql.SQL("NULL") for c in shape.columns),
        ok0=old_keys[0],
        t_keys=sql.SQL(", ").join(sql.SQL("t.{}").format(k) for k in keys),
        l_keys=sql.SQL(", ").join(sql.SQL("l.{}").format(k) for k in keys),
    ))


def _add_new_columns(conn: psycopg.Connection[Any], shape: ch.TableShape, target: sql.Identifier) -> None:
    """Add columns the source added since; rows that predate them get the source's missing value."""
    have = {r[0] for r in conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped",
        (f'"{shape.schema}"."{shape.table}"',))}
    missing = shape.missing or (None,) * len(shape.columns)
    for c, t, m in zip(shape.columns, shape.types, missing):
        if c in have:
            continue
        if m is None:
            conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN {} {}").format(target, ident(c), sql.SQL(t)))
        else:
            conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN {} {} DEFAULT {}::{}").format(
                target, ident(c), sql.SQL(t), sql.Literal(m), sql.SQL(t)))
            conn.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN {} DROP DEFAULT").format(target, ident(c)))


def _resolve_unchanged(conn: psycopg.Connection[Any], part: StagedPart, target: sql.Identifier,
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
