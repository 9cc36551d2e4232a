"""PostgreSQL replica sink: exactly-once, consistent-cut apply of change batches.

A batch (one Spark micro-batch, one writer task) is applied by one `BatchApplier` in ONE target
transaction: it takes the feed's lock, reads how far the replica already is, then, chunk by
chunk as the change rows stream in, COPYs each table's rows into a temporary staging table and
merges them set-based (TRUNCATE first where one occurred, unchanged TOAST values resolved, per
key only the last change, columns the source added). Long runs of consecutive inserts (and of
snapshot reads, which insert a key the replica lacks) skip the staging table: they are COPYed
straight into the target (see insert_run), which costs the target database about a third of an
upsert. Rows before the replica's position (the
end of the last batch it applied) are skipped, so a replayed batch changes nothing. The progress
row goes into the same transaction. So the replica moves from one source commit boundary to the
next, never between, and merging overlaps with reading the rest of the batch.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql
from psycopg.types.json import Jsonb

from changefeed import faults
from changefeed.core import change as ch
from changefeed.core.copytext import NULL
from changefeed.core.lsn import format_lsn
from changefeed.core.nodes import DEFAULT_NODE
from changefeed.errors import ChangefeedError, SinkError
from changefeed.postgres.connect import one_row
from changefeed.postgres.ddl_capture import PREFIX as DDL_PREFIX
from changefeed.sinks.ledger import RATE_WINDOW_S, LastBatch
from changefeed.sinks.replica import shape as replica_shape
from changefeed.sinks.replica.insert_run import INSERT_RUN_ROWS, DirectCopy, insert_runs, terminated, write_lines

META_SCHEMA = "changefeed"
SESSION_MEMORY = "256MB"
APPLIED_OPS = ("c", "u", "r", "d", "t")

def ident(*names: str) -> sql.Identifier:
    return sql.Identifier(*names)


def ensure_meta(conn: psycopg.Connection[Any]) -> None:
    conn.execute(f"CREATE SCHEMA IF NOT EXISTS {META_SCHEMA}")
    conn.execute(
        f"CREATE TABLE IF NOT EXISTS {META_SCHEMA}.progress ("
        " feed text NOT NULL, batch_id bigint NOT NULL, end_lsn pg_lsn NOT NULL, resolved_ts bigint NOT NULL,"
        " commit_time timestamptz, changes bigint NOT NULL, applied_at timestamptz NOT NULL DEFAULT clock_timestamp(),"
        " began_at timestamptz DEFAULT now(), PRIMARY KEY (feed, end_lsn))")
    # began_at: now() is the batch transaction's start, so applied_at - began_at is its apply time.
    _ensure_column(conn, "progress", "began_at", "timestamptz", default="now()")
    # positions: each node's end LSN, on a feed of several nodes (its end_lsn is then the batch's
    # resolved ts, see core.change.BatchProgress); NULL on a one-node feed.
    _ensure_column(conn, "progress", "positions", "jsonb")
    # reads: which Spark task read each of the batch's input partitions, and when (core.change.BatchProgress)
    _ensure_column(conn, "progress", "reads", "jsonb")
    # One row per snapshot chunk applied: a chunk is applied once (the key refuses a second).
    # read_task: the Spark task attempt that read the chunk.
    conn.execute(
        f"CREATE TABLE IF NOT EXISTS {META_SCHEMA}.snapshot_chunks ("
        " feed text NOT NULL, chunk_no bigint NOT NULL, table_name text NOT NULL, rows bigint NOT NULL,"
        " read_lsn pg_lsn NOT NULL, batch_id bigint NOT NULL,"
        " applied_at timestamptz NOT NULL DEFAULT clock_timestamp(), read_task bigint, PRIMARY KEY (feed, chunk_no))")
    _ensure_column(conn, "snapshot_chunks", "read_task", "bigint")


def _ensure_column(conn: psycopg.Connection[Any], table: str, column: str, type_: str, default: str = "") -> None:
    """Add a bookkeeping column that sinks made by an older version lack (existing rows get NULL,
    the default is for new ones). Only then: ALTER TABLE would lock out other feeds' batches."""
    if conn.execute(f"SELECT 1 FROM pg_attribute WHERE attrelid = '{META_SCHEMA}.{table}'::regclass "
                    "AND attname = %s AND NOT attisdropped", (column,)).fetchone():
        return
    conn.execute(f"ALTER TABLE {META_SCHEMA}.{table} ADD COLUMN IF NOT EXISTS {column} {type_}")
    if default:
        conn.execute(f"ALTER TABLE {META_SCHEMA}.{table} ALTER COLUMN {column} SET DEFAULT {default}")


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


def has_meta(conn: psycopg.Connection[Any], table: str) -> bool:
    """Whether the bookkeeping table `changefeed.TABLE` exists (readers create nothing)."""
    return one_row(conn.execute(f"SELECT to_regclass('{META_SCHEMA}.{table}')"))[0] is not None


def applied_upto(conn: psycopg.Connection[Any], feed: str) -> int:
    """The end LSN of the last batch applied for `feed`, 0 if none (the progress table must exist)."""
    row = conn.execute(f"SELECT max(end_lsn) - '0/0'::pg_lsn FROM {META_SCHEMA}.progress WHERE feed = %s",
                       (feed,)).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


# progress rows with their began_at as b.began (NULL on a sink made before the column)
_PROGRESS_BEGAN = (f"{META_SCHEMA}.progress p CROSS JOIN LATERAL "
                   "(SELECT (to_jsonb(p) ->> 'began_at')::timestamptz AS began) b")


class ReplicaLedger:
    """The replica's ledger (sinks.ledger): its `changefeed.*` tables, on an open connection.

    Readers create nothing: on a sink never prepared they answer "nothing recorded"."""

    def __init__(self, conn: psycopg.Connection[Any], feed: str) -> None:
        self.conn, self.feed = conn, feed

    def check(self) -> None:
        """Nothing more to check: the connection is open."""

    def prepare(self, tables: list[Any]) -> None:
        ensure_meta(self.conn)
        ensure_tables(self.conn, tables)

    def notes(self) -> list[str]:
        return []

    def checkpoint(self) -> dict[str, int] | None:
        """From the last progress row: its `positions`, or for a one-node feed (and rows written
        before nodes existed) its end LSN as node n1's. Read through to_jsonb: a sink made before
        the column has none until its feed runs again."""
        if not has_meta(self.conn, "progress"):
            return None
        row = self.conn.execute(
            f"SELECT end_lsn - '0/0'::pg_lsn, to_jsonb(p) -> 'positions' FROM {META_SCHEMA}.progress p "
            "WHERE feed = %s ORDER BY end_lsn DESC LIMIT 1", (self.feed,)).fetchone()
        if row is None:
            return None
        return {str(k): int(v) for k, v in row[1].items()} if row[1] else {DEFAULT_NODE: int(row[0])}

    def last_resolved_ts(self) -> int | None:
        if not has_meta(self.conn, "progress"):
            return None
        row = self.conn.execute(f"SELECT max(resolved_ts) FROM {META_SCHEMA}.progress WHERE feed = %s",
                                (self.feed,)).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def last_batch(self) -> LastBatch | None:
        """began_at is read through to_jsonb: a sink made before it existed has no such column until
        its feed runs again. Rows older than the column have no duration."""
        if not has_meta(self.conn, "progress"):
            return None
        row = self.conn.execute(
            "SELECT end_lsn - '0/0'::pg_lsn, coalesce(commit_time, (SELECT max(commit_time) FROM "
            f"{META_SCHEMA}.progress WHERE feed = %s))::text, resolved_ts, "
            f"(SELECT count(*) FROM {META_SCHEMA}.progress WHERE feed = %s), "
            "extract(epoch FROM applied_at - b.began) "
            f"FROM {_PROGRESS_BEGAN} WHERE feed = %s ORDER BY end_lsn DESC LIMIT 1", (self.feed,) * 3).fetchone()
        if row is None:
            return None
        return LastBatch(int(row[0]), row[1], int(row[2]), int(row[3]),
                         None if row[4] is None else round(float(row[4]), 3))

    def recent_rate(self) -> float:
        if not has_meta(self.conn, "progress"):
            return 0.0
        row = one_row(self.conn.execute(
            "SELECT coalesce(sum(changes), 0), extract(epoch FROM now() - greatest(now() - make_interval(secs => %s), "
            f"min(least(b.began, applied_at)))) FROM {_PROGRESS_BEGAN} "
            "WHERE feed = %s AND applied_at > now() - make_interval(secs => %s)",
            (RATE_WINDOW_S, self.feed, RATE_WINDOW_S)))
        return round(int(row[0]) / max(float(row[1] or 0), 1.0), 1)

    def totals(self) -> tuple[int, int]:
        if not has_meta(self.conn, "progress"):
            return 0, 0
        row = one_row(self.conn.execute(f"SELECT count(*), coalesce(sum(changes), 0) FROM {META_SCHEMA}.progress "
                                        "WHERE feed = %s", (self.feed,)))
        return int(row[0]), int(row[1])

    def snapshot_totals(self) -> dict[str, tuple[int, int]]:
        if not has_meta(self.conn, "snapshot_chunks"):
            return {}
        return {r[0]: (int(r[1]), int(r[2])) for r in self.conn.execute(
            f"SELECT table_name, count(*), sum(rows) FROM {META_SCHEMA}.snapshot_chunks WHERE feed = %s "
            "GROUP BY table_name", (self.feed,))}

    def forget(self) -> bool:
        """Delete the feed's bookkeeping rows (its replica tables stay)."""
        deleted = False
        for table in ("progress", "snapshot_chunks"):
            if has_meta(self.conn, table):
                deleted |= self.conn.execute(f"DELETE FROM {META_SCHEMA}.{table} WHERE feed = %s",
                                             (self.feed,)).rowcount > 0
        return deleted

    def close(self) -> None:
        self.conn.close()


@dataclass
class Applied:
    """What a batch did to the replica: `applied` is False for a batch recorded before."""

    batch_id: int
    end_lsn: int
    changes: int
    applied: bool


@dataclass
class _Part:
    """A temporary staging table for one table shape; it holds one chunk of rows at a time."""

    shape: ch.TableShape
    staging: sql.Identifier
    copy_sql: sql.Composed
    insert_sql: sql.Composed
    nulls: Any
    key_nulls: Any
    columns: tuple[str, ...]  # of the shape's, those the target has (all but for a snapshot's shape ahead)


class BatchApplier:
    """Applies one batch's change rows, in stream order, in one transaction on `conn`.

    Use: `begin()`, `add(record_batch)` for each chunk, then `commit()`; `rollback()` on failure.

    Rows are ordered by their (lsn, seq). `in_stream_order` (a batch of several nodes, put in one
    order by core.merge): their `lsn` is their position in that order, not a WAL position, so no
    row is skipped as applied before; the writer asks `covers` whether the whole batch was.
    """

    def __init__(self, conn: psycopg.Connection[Any], feed: str, batch_id: int, *,
                 in_stream_order: bool = False, resync: frozenset[str] = frozenset(),
                 renamed: dict[str, str] | None = None) -> None:
        assert conn.autocommit, "the applier opens its own transaction"
        self.conn, self.feed, self.batch_id = conn, feed, batch_id
        self.in_stream_order = in_stream_order
        self.follower = replica_shape.Follower(conn, feed, resync=resync, renamed=renamed or {},
                                               keep_dropped=in_stream_order)
        self.done = 0
        self._shapes: dict[tuple[str, str], ch.TableShape] = {}
        self._parts: dict[ch.TableShape, _Part] = {}
        self._progress: list[ch.Progress] = []
        self._direct = DirectCopy(conn)  # runs of new rows COPYed straight into their target

    def begin(self) -> None:
        # Session memory for the staging tables and the per-chunk sorts: spilling them to disk
        # cost ~30% of the apply rate (temp_buffers must be set before the first temporary table).
        self.conn.execute(f"SET temp_buffers = '{SESSION_MEMORY}'")
        self.conn.execute("BEGIN")
        self.conn.execute(f"SET LOCAL work_mem = '{SESSION_MEMORY}'")
        # The batch counts as applied once this commits (Spark logs it, the slot moves past it): the
        # commit must be durable even where the replica's default is synchronous_commit=off, or a
        # replica crash would lose batches nothing replays. Stronger settings (standbys) are kept.
        self.conn.execute("SELECT set_config('synchronous_commit', CASE current_setting('synchronous_commit') "
                          "WHEN 'off' THEN 'local' ELSE current_setting('synchronous_commit') END, true)")
        self.conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"changefeed-sink:{self.feed}",))
        self.done = applied_upto(self.conn, self.feed)

    def add(self, rb: Any) -> None:
        """Apply one chunk. Control rows cut it into segments: an `R` row sets its table's shape
        for the rows after it, a `P` row is progress."""
        ops = rb.column("op")
        control = pc.indices_nonzero(pc.is_in(ops, value_set=_CONTROL_OPS)).to_pylist()
        start = 0
        for i in [*control, rb.num_rows]:
            if i > start:
                self._apply_segment(rb.slice(start, i - start))
            start = i + 1
            if i == rb.num_rows:
                break
            op, schema, table, meta = (rb.column(n)[i].as_py() for n in ("op", "schema", "table", "meta"))
            if op != ch.PROGRESS:
                self._end_run()  # a shape or a schema change may alter the table
            new = self.in_stream_order or rb.column("lsn")[i].as_py() >= self.done  # not applied before
            if op == ch.MESSAGE:
                if new and json.loads(meta).get("prefix") == DDL_PREFIX:
                    self.follower.ddl(json.loads(rb.column("after")[i].as_py()))
            elif op == ch.RELATION:
                self._shapes[(schema, table)] = self.follower.relation(
                    ch.TableShape.from_meta(schema, table, meta), follow=new)
            else:
                self._progress.append(ch.Progress.from_meta(meta))

    def covers(self, progress: ch.BatchProgress) -> bool:
        """Whether the replica recorded this batch (or a later one) before."""
        return progress.end_lsn <= self.done

    def commit(self) -> Applied:
        """Record progress and commit; a batch the replica already covers commits nothing new."""
        try:
            p = ch.BatchProgress.of(self._progress)
            self._end_run()
        except ChangefeedError:
            self.rollback()
            raise
        applied = p.end_lsn > self.done
        if applied:
            self.conn.execute(
                f"INSERT INTO {META_SCHEMA}.progress (feed, batch_id, end_lsn, resolved_ts, commit_time, changes, "
                "positions, reads) VALUES (%s, %s, %s::pg_lsn, %s, to_timestamp(%s / 1e6), %s, %s, %s)",
                (self.feed, self.batch_id, format_lsn(p.end_lsn), p.resolved_ts, p.last_commit_time, p.changes,
                 Jsonb(p.positions) if p.positions else None, Jsonb(list(p.reads)) if p.reads else None))
            if p.chunks:
                with self.conn.cursor() as cur:
                    cur.executemany(
                        f"INSERT INTO {META_SCHEMA}.snapshot_chunks (feed, chunk_no, table_name, rows, read_lsn, "
                        "batch_id, read_task) VALUES (%s, %s, %s, %s, %s::pg_lsn, %s, %s)",
                        [(self.feed, c["no"], c["table"], c["rows"], format_lsn(c["read_lsn"]), self.batch_id,
                          c.get("task")) for c in p.chunks])
            faults.reach("before_sink_commit")
        self.conn.execute("COMMIT")
        faults.reach("after_sink_commit")
        return Applied(self.batch_id, p.end_lsn, p.changes, applied)

    def rollback(self) -> None:
        if not self.conn.closed:
            self._direct.abandon()
            self.conn.execute("ROLLBACK")

    def _apply_segment(self, rows: Any) -> None:
        """Apply a run of rows with no control row among them, table by table."""
        keep = pc.is_in(rows.column("op"), value_set=_APPLIED_OPS)
        if self.done and not self.in_stream_order:
            keep = pc.and_(keep, pc.greater_equal(rows.column("lsn"), self.done))  # applied before: skip
        if not pc.all(keep).as_py():  # (a filter copies every column: only when it drops rows)
            rows = rows.filter(keep)
        if rows.num_rows == 0:
            return
        schemas, names_ = rows.column("schema"), rows.column("table")
        first = (schemas[0].as_py(), names_[0].as_py())
        if pc.all(pc.equal(schemas, first[0])).as_py() and pc.all(pc.equal(names_, first[1])).as_py():
            names, tables = None, ["\0".join(first)]  # one table (the common case: no per-row join)
        else:
            names = pc.binary_join_element_wise(schemas, names_, "\0")  # no name holds NUL
            tables = names.unique().to_pylist()
        for name in tables:
            schema, _, table = name.partition("\0")
            key = (schema, table)
            shape = self._shapes.get(key)
            if shape is None:
                raise SinkError(f"change for {key[0]}.{key[1]} before its description (R row)",
                                "this is a bug in the change stream; report it")
            mine = rows if names is None or len(tables) == 1 else rows.filter(pc.equal(names, name))
            part = self._parts.get(shape) or self._new_part(shape)
            if part.columns != shape.columns:
                self._direct.refused.add(shape)  # (a direct COPY writes every column of the shape)
            for lo, hi, inserts in insert_runs(mine.column("op"), INSERT_RUN_ROWS):
                run = mine.slice(lo, hi - lo)
                if not (inserts and self._insert(part, run)):
                    self._merge(part, run)

    def _merge(self, part: _Part, rows: Any) -> None:
        """Stage the rows and merge them into the target."""
        self._end_run()
        self._copy(part, rows)
        _apply_part(self.conn, part, has_truncate=bool(pc.any(pc.equal(rows.column("op"), "t")).as_py()),
                    has_unchanged=rows.column("unchanged").null_count < rows.num_rows,
                    has_key_change=rows.column("old_key").null_count < rows.num_rows)
        self.conn.execute(sql.SQL("TRUNCATE {}").format(part.staging))

    def _insert(self, part: _Part, rows: Any) -> bool:
        """COPY a run of inserts straight into the target, in the open run if it is this table's
        (see insert_run); False (nothing done) when it must be merged."""
        if not self._direct.continues(part.shape):
            self._end_run()
        return self._direct.add(part.shape, part.insert_sql, rows)

    def _end_run(self) -> None:
        """End the open insert run; if its COPY met a key there already, merge its rows instead."""
        failed = self._direct.close()
        if failed is not None:
            for rows in failed[1]:
                self._merge(self._parts[failed[0]], rows)

    @property
    def inserted_directly(self) -> int:
        """Rows COPYed straight into their target."""
        return self._direct.rows

    def _new_part(self, shape: ch.TableShape) -> _Part:
        staging = ident(f"changefeed_stage_{len(self._parts)}")
        target_types = [sql.SQL("{} {}").format(ident(c), sql.SQL(t)) for c, t in zip(shape.columns, shape.types)]
        key_types = [sql.SQL("{} {}").format(ident(f"_ok_{i}"), sql.SQL(shape.types[shape.columns.index(k)]))
                     for i, k in enumerate(shape.key)]
        self.conn.execute(sql.SQL(
            "CREATE TEMPORARY TABLE {} (_lsn bigint, _seq int, _op text, _unch int[], {}) ON COMMIT DROP").format(
            staging, sql.SQL(", ").join(target_types + key_types)))
        columns = shape.columns
        if shape.ahead:  # a snapshot's shape: the stream brings the change to the table later
            current = replica_shape.read(self.conn, shape.schema, shape.table)
            columns = tuple(c for c in shape.columns if current is None or c in current.columns)
        part = _Part(shape, staging, sql.SQL("COPY {} FROM STDIN").format(staging),
                     sql.SQL("COPY {} ({}) FROM STDIN").format(
                         ident(shape.schema, shape.table), sql.SQL(", ").join(map(ident, shape.columns))),
                     pa.scalar(b"\t".join([NULL] * len(shape.columns)), pa.large_binary()),
                     pa.scalar(b"\t".join([NULL] * len(shape.key)), pa.large_binary()), columns)
        self._parts[shape] = part
        return part

    def _copy(self, part: _Part, rows: Any) -> None:
        """COPY rows into the part's staging table, as lines built column-wise by Arrow kernels:
        `lsn seq op unchanged values old_key`, where values are the new row (the old one for
        deletes) and NULLs fill what a row does not have."""
        lines = pc.binary_join_element_wise(
            _text(rows.column("lsn")), _text(rows.column("seq")), _text(rows.column("op")),
            _text(pc.fill_null(rows.column("unchanged"), NULL.decode())),
            pc.coalesce(_large(rows.column("after")), _large(rows.column("before")), part.nulls),
            terminated(pc.coalesce(_large(rows.column("old_key")), part.key_nulls)),
            _TAB)
        _copy_lines(self.conn, part.copy_sql, lines)


def _copy_lines(conn: psycopg.Connection[Any], copy_sql: sql.Composed, lines: Any) -> None:
    """COPY a large_binary array of complete lines."""
    with conn.cursor().copy(copy_sql) as copy:
        write_lines(copy, lines)


_CONTROL_OPS = pa.array([ch.RELATION, ch.PROGRESS, ch.MESSAGE])
_APPLIED_OPS = pa.array(APPLIED_OPS)
_TAB = pa.scalar(b"\t", pa.large_binary())


def _large(col: Any) -> Any:
    return col.cast(pa.large_binary())


def _text(col: Any) -> Any:
    """Any column as its text form in large_binary (what COPY reads)."""
    if not pa.types.is_string(col.type):
        col = col.cast(pa.string())
    return col.cast(pa.large_binary())


def _apply_part(conn: psycopg.Connection[Any], part: _Part, *, has_truncate: bool, has_unchanged: bool,
                has_key_change: bool) -> None:
    """Merge the staged chunk into the target: last change per key wins, TRUNCATE first.

    An update that changed the key also deletes its old key (as a change just before it).
    """
    shape = part.shape
    target, stg = ident(shape.schema, shape.table), part.staging
    after: sql.Composable = sql.SQL("true")
    if has_truncate:
        row = conn.execute(sql.SQL("SELECT _lsn, _seq FROM {} WHERE _op = 't' ORDER BY _lsn DESC, _seq DESC "
                                   "LIMIT 1").format(stg)).fetchone()
        assert row is not None
        conn.execute(sql.SQL("TRUNCATE {}").format(target))
        after = sql.SQL("(_lsn, _seq) > ({}, {})").format(sql.Literal(row[0]), sql.Literal(row[1]))
    if has_unchanged:
        _resolve_unchanged(conn, part, target, stg)
    cols = [ident(c) for c in part.columns]
    keys = [ident(k) for k in shape.key]
    old_keys = [ident(f"_ok_{i}") for i in range(len(shape.key))]
    key_list = sql.SQL(", ").join(keys)
    col_list = sql.SQL(", ").join(cols)
    non_key = [c for c in part.columns if c not in shape.key]
    on_conflict = sql.SQL("DO UPDATE SET {}").format(sql.SQL(", ").join(
        sql.SQL("{0} = EXCLUDED.{0}").format(ident(c)) for c in non_key)) if non_key else sql.SQL("DO NOTHING")
    conn.execute(sql.SQL("""
        WITH rows AS (
            SELECT _lsn, _seq, 1 AS _sub, _op, {col_list} FROM {stg} WHERE _op <> 't' AND {after}
            {old_key_deletes}
        ), last AS (
            SELECT DISTINCT ON ({key_list}) * FROM rows ORDER BY {key_list}, _lsn DESC, _seq DESC, _sub DESC
        ), deleted AS (
            DELETE FROM {target} t USING last l WHERE l._op = 'd' AND ({t_keys}) = ({l_keys})
        )
        INSERT INTO {target} ({col_list}) SELECT {col_list} FROM last WHERE _op <> 'd'
        ON CONFLICT ({key_list}) {on_conflict}
    """).format(
        col_list=col_list, stg=stg, after=after, key_list=key_list, target=target, on_conflict=on_conflict,
        old_key_deletes=sql.SQL("UNION ALL SELECT _lsn, _seq, 0, 'd', {} FROM {} WHERE {} IS NOT NULL AND {}").format(
            sql.SQL(", ").join(sql.SQL("{} AS {}").format(old_keys[shape.key.index(c)], ident(c)) if c in shape.key
                               else sql.SQL("NULL") for c in part.columns),
            stg, old_keys[0], after) if has_key_change else sql.SQL(""),
        t_keys=sql.SQL(", ").join(sql.SQL("t.{}").format(k) for k in keys),
        l_keys=sql.SQL(", ").join(sql.SQL("l.{}").format(k) for k in keys),
    ))


def _resolve_unchanged(conn: psycopg.Connection[Any], part: _Part, target: sql.Identifier,
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
