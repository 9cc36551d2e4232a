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
import time
from dataclasses import dataclass
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql
from psycopg.types.json import Jsonb

from changefeed import faults
from changefeed.core import change as ch
from changefeed.core import followed
from changefeed.core.copytext import NULL
from changefeed.core.lsn import format_lsn
from changefeed.errors import ChangefeedError, IncompleteBatch, SinkError
from changefeed.postgres.ddl_capture import PREFIX as DDL_PREFIX
from changefeed.sinks.replica import merge
from changefeed.sinks.replica import shape as replica_shape
from changefeed.sinks.replica.insert_run import INSERT_RUN_ROWS, DirectCopy, insert_runs
from changefeed.sinks.replica.ledger import META_SCHEMA, applied_upto, check_fence, fold_sub_windows, lock_feed

SESSION_MEMORY = "256MB"
APPLIED_OPS = ("c", "u", "r", "d", "t")
FOLD_EVERY_S = 10.0  # low-latency mode: how often a sub-window's transaction folds the older ones' progress rows
_folded_at = [float("-inf")]  # when this process folded last (monotonic)
_CONTROL_OPS = pa.array([ch.RELATION, ch.PROGRESS, ch.MESSAGE])
_APPLIED_OPS = pa.array(APPLIED_OPS)


@dataclass
class Applied:
    """What a batch did to the replica: `applied` is False for a batch recorded before. `offset`:
    its end offset as recorded (core.offsets), where a followed batch's next one starts."""

    batch_id: int
    end_lsn: int
    changes: int
    applied: bool
    offset: dict[str, Any] | None = None

    @classmethod
    def of(cls, batch_id: int, parts: "list[Applied]") -> "Applied":
        """What a followed batch's sub-windows did together (core.followed)."""
        return cls(batch_id, max((p.end_lsn for p in parts), default=0), sum(p.changes for p in parts),
                   any(p.applied for p in parts), next((p.offset for p in reversed(parts) if p.offset), None))


class BatchApplier:
    """Applies one batch's change rows, in stream order, in one transaction on `conn`.

    Use: `begin()`, `add(record_batch)` for each chunk, then `commit()`; `rollback()` on failure.

    Rows are ordered by their (lsn, seq). `in_stream_order` (a batch of several nodes, put in one
    order by core.merge): their `lsn` is their position in that order, not a WAL position, so no
    row is skipped as applied before; the writer asks `covers` whether the whole batch was.
    """

    def __init__(self, conn: psycopg.Connection[Any], feed: str, batch_id: int, *,
                 in_stream_order: bool = False, resync: frozenset[str] = frozenset(),
                 renamed: dict[str, str] | None = None, epoch: int | None = None,
                 row_filters: dict[str, str] | None = None) -> None:
        assert conn.autocommit, "the applier opens its own transaction"
        self.conn, self.feed, self.batch_id = conn, feed, batch_id
        self.epoch = epoch  # the runner's lease term (postgres.lease); None: a run that holds none
        self.in_stream_order = in_stream_order
        self.row_filters = row_filters or {}  # a TRUNCATE of a filtered table deletes the filter's rows only
        self.follower = replica_shape.Follower(conn, feed, resync=resync, renamed=renamed or {},
                                               keep_dropped=in_stream_order)
        self.done = 0
        self._shapes: dict[tuple[str, str], ch.TableShape] = {}
        self._parts: dict[ch.TableShape, merge.Part] = {}
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
        lock_feed(self.conn, self.feed)  # held to the commit: a fence raised meanwhile waits for it
        if self.epoch is not None:
            try:
                check_fence(self.conn, self.feed, self.epoch)
            except ChangefeedError:
                self.rollback()
                raise
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
                # (sub-windows committed together, the writer's group commit, count as one)
                self._progress = followed.folded([*self._progress, ch.Progress.from_meta(meta)])

    def whole(self) -> bool:
        """Whether the `P` rows added so far are every input partition's of a batch (or of a
        followed batch's sub-window, core.followed): what is added can be committed."""
        try:
            ch.BatchProgress.of(self._progress)
        except IncompleteBatch:
            return False
        return True

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
                "positions, reads, end_offset, epoch) "
                "VALUES (%s, %s, %s::pg_lsn, %s, to_timestamp(%s / 1e6), %s, %s, %s, %s, %s)",
                (self.feed, self.batch_id, format_lsn(p.end_lsn), p.resolved_ts, p.last_commit_time, p.changes,
                 Jsonb(p.positions) if p.positions else None, Jsonb(list(p.reads)) if p.reads else None,
                 Jsonb(p.offset) if p.offset else None, self.epoch))
            if p.chunks:
                with self.conn.cursor() as cur:
                    cur.executemany(
                        f"INSERT INTO {META_SCHEMA}.snapshot_chunks (feed, chunk_no, table_name, rows, read_lsn, "
                        "batch_id, read_task) VALUES (%s, %s, %s, %s, %s::pg_lsn, %s, %s)",
                        [(self.feed, c["no"], c["table"], c["rows"], format_lsn(c["read_lsn"]), self.batch_id,
                          c.get("task")) for c in p.chunks])
            if p.offset and p.offset.get("follow") and time.monotonic() - _folded_at[0] >= FOLD_EVERY_S:
                fold_sub_windows(self.conn, self.feed)  # (low-latency mode: a row per sub-window)
                _folded_at[0] = time.monotonic()
            faults.reach("before_sink_commit")
        self.conn.execute("COMMIT")
        faults.reach("after_sink_commit")
        return Applied(self.batch_id, p.end_lsn, p.changes, applied, p.offset)

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

    def _merge(self, part: merge.Part, rows: Any) -> None:
        """Stage the rows and merge them into the target."""
        self._end_run()
        merge.copy_rows(self.conn, part, rows)
        merge.merge_part(self.conn, part, has_truncate=bool(pc.any(pc.equal(rows.column("op"), "t")).as_py()),
                         truncate_where=self.row_filters.get(f"{part.shape.schema}.{part.shape.table}"),
                    has_unchanged=rows.column("unchanged").null_count < rows.num_rows,
                    has_key_change=rows.column("old_key").null_count < rows.num_rows)
        self.conn.execute(sql.SQL("TRUNCATE {}").format(part.staging))

    def _insert(self, part: merge.Part, rows: Any) -> bool:
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

    def _new_part(self, shape: ch.TableShape) -> merge.Part:
        self._end_run()  # (an open COPY holds the connection: no other statement waits behind it)
        staging = merge.ident(f"changefeed_stage_{len(self._parts)}")
        target_types = [sql.SQL("{} {}").format(merge.ident(c), sql.SQL(t)) for c, t in zip(shape.columns, shape.types)]
        key_types = [sql.SQL("{} {}").format(merge.ident(f"_ok_{i}"), sql.SQL(shape.types[shape.columns.index(k)]))
                     for i, k in enumerate(shape.key)]
        self.conn.execute(sql.SQL(
            "CREATE TEMPORARY TABLE {} (_lsn bigint, _seq int, _op text, _unch int[], {}) ON COMMIT DROP").format(
            staging, sql.SQL(", ").join(target_types + key_types)))
        columns = shape.columns
        if shape.ahead:  # a snapshot's shape: the stream brings the change to the table later
            current = replica_shape.read(self.conn, shape.schema, shape.table)
            columns = tuple(c for c in shape.columns if current is None or c in current.columns)
        computed = merge.generated_columns(self.conn, shape.schema, shape.table)  # (the replica computes them)
        columns = tuple(c for c in columns if c not in computed)
        part = merge.Part(shape, staging, sql.SQL("COPY {} FROM STDIN").format(staging),
                     sql.SQL("COPY {} ({}) FROM STDIN").format(
                         merge.ident(shape.schema, shape.table), sql.SQL(", ").join(map(merge.ident, shape.columns))),
                     pa.scalar(b"\t".join([NULL] * len(shape.columns)), pa.large_binary()),
                     pa.scalar(b"\t".join([NULL] * len(shape.key)), pa.large_binary()), columns)
        self._parts[shape] = part
        return part
