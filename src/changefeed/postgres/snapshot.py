"""Read a table's existing rows as snapshot chunks that fit into the change stream.

Why a chunk read at any time after its batch was planned is correct (no locks, no pause):

A chunk travels in the batch whose WAL window is [start, end) and is applied on the replica as
upserts (op `r`), in the same transaction as that window's changes. Read with an MVCC snapshot
S, a chunk holds each key's state after exactly the transactions S sees. If S sees every
transaction whose commit record starts before `end` (everything the replica holds once this batch
is applied), each chunk row is its key's state at some point at or after `end`, and every change
S does not see commits later, so it reaches the sinks in a later batch, after the row, in commit
order. A change S does see but that commits at or after `end` is left out of the windows that
bring it (core.judge), so each key's changes reach a sink once; where it is not (a batch read
again after a restart, whose S is gone: the read takes a snapshot of its own), it is a full row
image that leads, change by change, to the same state (an unchanged TOAST value is taken from
the row before it, which already holds that value). So no change is lost, each key ends equal to
the source, and once the stream has passed the chunk's read position the replica is again a
consistent cut.

S is taken by the planner once `end` was fixed (at a flushed position) and exported to the
batch's chunk reads (`export`), so S misses a transaction committed
before `end` only if that transaction's commit record was written but it is not yet visible: it
is still in S's in-progress list while the commit log already says committed (a commit waiting
for a synchronous standby). The first statement in S checks for exactly that and, if
found, tries again with a new snapshot.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from changefeed.core import change as ch
from changefeed.core.rate import Pace
from changefeed.core.snapshot import Key
from changefeed.errors import SourceNotReady, TransientError
from changefeed.postgres import copy_out, keyless_cut, row_filter
from changefeed.postgres.connect import insert_lsn, one_row
from changefeed.postgres.source import SourceTable, describe_tables, missing_values, split_table

STALL_RETRIES = 200  # snapshots retried while a commit is not yet visible (~10 s in all)
PACE_STEP_S = 0.05  # under --snapshot-rate, a read takes pieces of this much of its rate, each paced


def _range(table: SourceTable, lo: Key | None, hi: Key | None, where: str | None = None) -> sql.Composable:
    """WHERE clause for keys in (lo, hi], comparing as the key's btree order does, and the table's
    row filter `where` (postgres.row_filter)."""
    key = sql.SQL("({})").format(sql.SQL(", ").join(map(sql.Identifier, table.key)))
    types = [table.types[table.columns.index(k)] for k in table.key]

    def row(values: Key) -> sql.Composable:
        return sql.SQL("({})").format(sql.SQL(", ").join(
            sql.SQL("{}::{}").format(sql.Literal(v), sql.SQL(t)) for v, t in zip(values, types)))

    parts = ([sql.SQL("{} > {}").format(key, row(lo))] if lo is not None else []) + \
            ([sql.SQL("{} <= {}").format(key, row(hi))] if hi is not None else []) + \
            ([row_filter.clause(where)] if where else [])
    return sql.SQL(" WHERE ") + sql.SQL(" AND ").join(parts) if parts else sql.SQL("")


def _order(table: SourceTable, selected: sql.Composable) -> sql.Composable:
    """`selected` in key order; as it comes for a table without one (read whole, as one chunk:
    postgres.keyless_cut orders it where it matters)."""
    if not table.key:
        return selected
    return selected + sql.SQL(" ORDER BY ") + sql.SQL(", ").join(map(sql.Identifier, table.key))


def _key_text(table: SourceTable) -> sql.Composable:
    # aliased: ORDER BY a bare name would pick the text output column and sort as text
    return sql.SQL(", ").join(sql.SQL("{}::text AS {}").format(sql.Identifier(k), sql.Identifier(f"_k{i}"))
                              for i, k in enumerate(table.key))


def _keys(table: SourceTable, lo: Key | None, hi: Key | None, where: str | None = None) -> sql.Composable:
    """The table's keys in (lo, hi] as text, in key order."""
    return _order(table, sql.SQL("SELECT {} FROM {}{}").format(
        _key_text(table), sql.Identifier(table.schema, table.name), _range(table, lo, hi, where)))


def chunk_boundary(conn: psycopg.Connection[Any], table: SourceTable, after: Key | None, rows: int,
                   upto: Key | None = None, where: str | None = None) -> Key | None:
    """The key of the `rows`-th row after `after` in key order (up to `upto`), None if no row
    follows that one (the last chunk then runs to `upto` or the end: a table of exactly n chunks
    gets no empty n+1st). A table without a key is one chunk: no order splits it so that a row is
    read exactly once."""
    if not table.key:
        return None
    found = conn.execute(sql.SQL("{} OFFSET {} LIMIT 2").format(
        _keys(table, after, upto, where), sql.Literal(rows - 1))).fetchall()  # (no parameters: a row filter may hold %)
    return list(found[0]) if len(found) == 2 else None


def last_key(conn: psycopg.Connection[Any], table: SourceTable) -> Key | None:
    """The table's last key in key order (None: empty, or no key), seen by a snapshot that misses
    no written commit (_stable_snapshot: a row past it then commits later, and the stream brings it).
    Any row filter aside: a bound past the last row it lets through ends the read all the same,
    and the key's index answers. `conn` must be in autocommit mode."""
    if not table.key:
        return None
    order = sql.SQL(", ").join(sql.SQL("{} DESC").format(sql.Identifier(k)) for k in table.key)
    _stable_snapshot(conn)
    try:
        found = conn.execute(sql.SQL("SELECT {} FROM {} ORDER BY {} LIMIT 1").format(
            _key_text(table), sql.Identifier(table.schema, table.name), order)).fetchone()
    finally:
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.execute("ROLLBACK")
    return list(found) if found else None


def estimated_rows(conn: psycopg.Connection[Any], qualified: str) -> int | None:
    """The planner's row estimate for a table (None if it was never analysed)."""
    schema, name = split_table(qualified)
    row = conn.execute("SELECT c.reltuples FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                       "WHERE n.nspname = %s AND c.relname = %s", (schema, name)).fetchone()
    return int(row[0]) if row and row[0] >= 0 else None


def row_bytes(conn: psycopg.Connection[Any], qualified: str) -> float | None:
    """The table's bytes on disk per row (TOAST included, a partitioned table's over its
    partitions), from the planner's statistics: None if never analysed or empty."""
    schema, name = split_table(qualified)
    row = conn.execute("SELECT sum(pg_table_size(c.oid))::float8 / nullif(sum(greatest(c.reltuples, 0)), 0) "
                       "FROM pg_class r JOIN pg_namespace n ON n.oid = r.relnamespace JOIN pg_class c "
                       "ON c.oid = r.oid OR c.oid IN (SELECT relid FROM pg_partition_tree(r.oid) WHERE isleaf) "
                       "WHERE n.nspname = %s AND r.relname = %s AND c.relkind <> 'p'", (schema, name)).fetchone()
    return float(row[0]) if row and row[0] else None


def _shape(conn: psycopg.Connection[Any], table: SourceTable) -> ch.TableShape:
    oid, ident = one_row(conn.execute("SELECT oid, relreplident::text FROM pg_class WHERE oid = %s::regclass",
                                      (f'"{table.schema}"."{table.name}"',)))
    missing = missing_values(conn, oid)
    return ch.TableShape(table.schema, table.name, table.columns, table.types, table.key, ident,
                         tuple(missing.get(c) for c in table.columns), ahead=True)


def _stable_snapshot(conn: psycopg.Connection[Any]) -> None:
    """Open a REPEATABLE READ transaction whose snapshot misses no written commit (see above)."""
    for _ in range(STALL_RETRIES):
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        stalled = one_row(conn.execute(
            "SELECT array_agg(x::text) FROM pg_snapshot_xip(pg_current_snapshot()) x "
            "WHERE pg_xact_status(x) = 'committed'"))[0]
        if not stalled:
            return
        conn.execute("ROLLBACK")
        time.sleep(0.05)
    raise TransientError(f"transactions {', '.join(stalled)} committed on the source but stay invisible "
                         "(waiting for a synchronous standby?); a snapshot now could miss them",
                         "check synchronous replication on the source; the feed retries from its checkpoint")


@dataclass(frozen=True)
class Exported:
    """A snapshot a planner's transaction holds for a batch's chunk reads to import (`id`), its
    pg_current_snapshot() text, and a WAL position by which every commit it sees was written."""

    id: str
    snap: str
    hw: int
    files: Mapping[str, str]  # entry -> its table's storage in the snapshot (`storage`)


def export(conn: psycopg.Connection[Any], tables: Sequence[tuple[str, str, str]] = ()) -> Exported:
    """Open a transaction on `conn` (autocommit) in a snapshot that misses no written commit and
    export it: the batch's chunks are read in it, so the offset that plans them can say what they
    saw (core.judge) before they are read, with the storage of `tables` ((entry, schema, table))
    there. It lasts until `conn`'s transaction ends."""
    _stable_snapshot(conn)
    ident, snap = one_row(conn.execute("SELECT pg_export_snapshot(), pg_current_snapshot()::text"))
    return Exported(str(ident), str(snap), insert_lsn(conn), {name: storage(conn, schema, table)
                                                               for name, schema, table in tables})


def storage(conn: psycopg.Connection[Any], schema: str, table: str) -> str:
    """The files that hold a table's rows (its partitions' for a partitioned one), as the
    connection's snapshot sees them: a TRUNCATE gives the table new ones."""
    qualified = sql.Identifier(schema, table).as_string(conn)
    # (pg_inherits, not pg_partition_tree, which locks every partition until the transaction ends:
    # the planner's export transaction lasts a batch, and a DDL queued behind it would hold the
    # batch's own reads behind it)
    row = conn.execute("WITH RECURSIVE tree(oid) AS (SELECT %s::regclass::oid UNION ALL "
                       "SELECT i.inhrelid FROM pg_inherits i JOIN tree ON i.inhparent = tree.oid) "
                       "SELECT string_agg(c.relfilenode::text, ',' ORDER BY c.oid) FROM pg_class c "
                       "JOIN tree USING (oid)", (qualified,)).fetchone()
    return str(row[0]) if row and row[0] else ""


def _imported(conn: psycopg.Connection[Any], ident: str | None) -> bool:
    """Begin the read's transaction in the exported snapshot `ident`; False when it is gone (its
    planner ended: a batch a sink recorded, replayed after a restart; spark.checkpoint.resume
    plans the others anew), the transaction then not begun."""
    if ident is None:
        return False
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
    try:
        conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(ident)))
    except (psycopg.errors.UndefinedObject, psycopg.errors.InvalidParameterValue,
            psycopg.errors.ObjectNotInPrerequisiteState):
        conn.execute("ROLLBACK")
        return False
    return True


@dataclass(frozen=True)
class Cut:
    """A batch's window end on a node, with the node's slots (its own, then its lag slot) and
    publication (postgres.keyless_cut)."""

    slots: tuple[str, ...]
    publication: str
    window_end: int


@dataclass
class ChunkRead:
    """What reading a chunk found: its rows, a WAL position by which every commit its
    snapshot saw had been written (the replica is a consistent cut again once past it), and the
    snapshot (pg_current_snapshot() text; whether it was the planner's, `imported`)."""

    rows: int = 0
    read_lsn: int = 0
    snap: str = ""
    imported: bool = False


def read_chunk(conn: psycopg.Connection[Any], qualified: str, lo: Key | None, hi: Key | None,
               lsn: int, ts: int, result: ChunkRead, rows_per_batch: int,
               bytes_per_batch: int = 32 << 20, where: str | None = None, columns: list[str] | None = None,
               rate: tuple[float, float, float] = (0, 0, 0), cut: Cut | None = None,
               exported: str | None = None) -> Iterator[Any]:
    """The chunk's rows as Arrow record batches of `r` changes, an `R` row first; fills `result`.
    `rate`: at most so many (rows, bytes) per second, 0 = no limit, after so many rows at once (core.rate).
    `cut`: where the batch's window ends, and the slot that tells what changed since; a table
    without a key is turned back to it (postgres.keyless_cut). Without it (or with a key), rows
    are as the snapshot saw them: `exported`, the planner's (see `export`), while it lasts, else
    one of its own (a batch a sink recorded, replayed after a restart: the read saw more, core.judge).

    `conn` must be in autocommit mode; `lsn` and `ts` label the rows (the batch window's start,
    so a replayed batch skips them, and its resolved ts).
    """
    tables = describe_tables(conn, [qualified], {qualified: columns} if columns else None)
    table = tables[0]
    cut_slot = f"cfcut_{uuid.uuid4().hex[:16]}" if cut is not None and not table.key else None
    if cut is not None and cut_slot is not None:
        keyless_cut.prepare_copy(conn, cut.slots, cut_slot, cut.window_end)
    result.imported = cut_slot is None and _imported(conn, exported)
    if not result.imported:
        _stable_snapshot(conn)
    try:
        result.snap = one_row(conn.execute("SELECT pg_current_snapshot()::text"))[0]
        if cut is not None:  # the filter the stream applies where this snapshot reads (alter --where changes it)
            held, published = row_filter.published(conn, cut.publication, qualified)
            where = published if held else where
        result.read_lsn = insert_lsn(conn)  # past every commit the snapshot sees, asynchronous ones too
        undo = None if cut is None or cut_slot is None else keyless_cut.undo(
            conn, cut_slot, cut.publication, qualified, len(table.columns), cut.window_end, result.read_lsn,
            keyless_cut.seen(conn))
        shape = _shape(conn, table)
        selected: sql.Composable = sql.SQL("SELECT {} FROM {}{}").format(
            sql.SQL(", ").join(map(sql.Identifier, table.columns)), sql.Identifier(table.schema, table.name),
            _range(table, lo, hi, where))
        selected = _order(table, selected) if undo is None else keyless_cut.ordered(selected, table, undo)
        query = sql.SQL("COPY ({}) TO STDOUT").format(selected)
        first = True
        for block, n in _pieces(conn, query, undo, rows_per_batch, bytes_per_batch, rate):
            yield _rows(shape, block, n, lsn, ts, result.rows + (not first), first)  # (seq: the R row is 0)
            result.rows += n
            first = False
        if undo is not None:
            undo.check_done(qualified)
        if first:  # no row: the R row alone
            yield _rows(shape, b"", 0, lsn, ts, 0, True)
        conn.execute("COMMIT")
    except psycopg.errors.UndefinedTable:
        raise SourceNotReady(f"table {qualified} disappeared during its snapshot",
                             "remove it from the feed's tables, or re-create it") from None
    finally:
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.execute("ROLLBACK")
        if cut_slot is not None:
            with suppress(psycopg.Error):  # (temporary: gone with the session anyway, a lost one too)
                conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                             "WHERE slot_name = %s", (cut_slot,))


def _pieces(conn: psycopg.Connection[Any], query: sql.Composable, undo: keyless_cut.Undo | None, rows: int,
            size: int, rate: tuple[float, float, float]) -> Iterator[tuple[bytes, int]]:
    """The COPY's rows in pieces of newline-ended lines (postgres.copy_out), each at most `rows`
    rows and about `size` bytes; under a rate limit (see read_chunk), in pieces of PACE_STEP_S of
    it, each paced; without the lines `undo` turns back."""
    rows_pace = Pace(rate[0], rate[2]) if rate[0] else None
    bytes_pace = Pace(rate[1]) if rate[1] else None
    if rate[0]:
        rows = max(1, min(rows, int(rate[0] * PACE_STEP_S)))
    if rate[1]:
        size = max(1, min(size, int(rate[1] * PACE_STEP_S)))
    for block, n in copy_out.blocks(conn, query, rows, size):
        if rows_pace:
            rows_pace.took(n)
        if bytes_pace:
            bytes_pace.took(len(block))
        if undo is not None:
            kept = [line for line in block.split(b"\n")[:-1] if undo.keeps(line)]
            block, n = b"".join(line + b"\n" for line in kept), len(kept)
        if n:
            yield block, n


def _rows(shape: ch.TableShape, block: bytes, n: int, lsn: int, ts: int, seq0: int, describe: bool) -> Any:
    """A record batch of `r` rows with the `n` COPY lines of `block`, after an `R` row when `describe`."""
    import numpy as np
    import pyarrow as pa

    total = n + describe
    lines = copy_out.lines_array(block, n)

    def same(value: Any, kind: Any) -> Any:
        return pa.repeat(pa.scalar(value, kind), total)

    nulls = pa.nulls(total, pa.binary())
    op = pa.concat_arrays([pa.array([ch.RELATION]), pa.repeat(pa.scalar("r"), n)]) if describe else \
        pa.repeat(pa.scalar("r"), n)
    after = pa.concat_arrays([pa.nulls(1, pa.binary()), lines]) if describe else lines
    meta = pa.concat_arrays([pa.array([shape.to_meta()]), pa.nulls(n, pa.string())]) if describe else \
        pa.nulls(n, pa.string())
    columns = {"op": op, "schema": same(shape.schema, pa.string()), "table": same(shape.table, pa.string()),
               "lsn": same(lsn, pa.int64()), "seq": pa.array(np.arange(seq0, seq0 + total, dtype=np.int32)),
               "xid": same(0, pa.int64()), "commit_time": pa.nulls(total, pa.int64()),
               "commit_ts": same(ts, pa.int64()), "after": after, "before": nulls, "old_key": nulls,
               "unchanged": pa.nulls(total, pa.string()), "meta": meta}
    schema = ch.arrow_schema()
    return pa.RecordBatch.from_arrays([columns[f.name] for f in schema], schema=schema)
