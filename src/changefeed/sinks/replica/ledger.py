"""The replica's ledger: the `changefeed.progress` and `changefeed.snapshot_chunks` tables on the
replica, which say how far each feed's batches and snapshot chunks were applied (sinks.ledger).

They are written in the same transaction as the batch they record (replica/apply.py), so the
replica and its ledger never disagree; readers here create nothing.
"""
from __future__ import annotations

from typing import Any

import psycopg

from changefeed.core.nodes import DEFAULT_NODE
from changefeed.core.offsets import Offset
from changefeed.errors import LeaseLost
from changefeed.postgres.connect import ADVISORY_HELD, ddl_turn, missing, one_row
from changefeed.sinks.ledger import RATE_WINDOW_S, LastBatch
from changefeed.sinks.replica.merge import ensure_tables

META_SCHEMA = "changefeed"


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
    # end_offset: the batch's end offset (core.offsets), where the next batch starts: a runner
    # without the feed's Spark checkpoint resumes from it (spark.checkpoint.resume)
    _ensure_column(conn, "progress", "end_offset", "jsonb")
    # epoch: the lease term (postgres.lease) of the runner that applied the batch
    _ensure_column(conn, "progress", "epoch", "bigint")
    # One row per snapshot chunk applied: a chunk is applied once (the key refuses a second).
    # read_task: the Spark task attempt that read the chunk.
    conn.execute(
        f"CREATE TABLE IF NOT EXISTS {META_SCHEMA}.snapshot_chunks ("
        " feed text NOT NULL, chunk_no bigint NOT NULL, table_name text NOT NULL, rows bigint NOT NULL,"
        " read_lsn pg_lsn NOT NULL, batch_id bigint NOT NULL,"
        " applied_at timestamptz NOT NULL DEFAULT clock_timestamp(), read_task bigint, PRIMARY KEY (feed, chunk_no))")
    _ensure_column(conn, "snapshot_chunks", "read_task", "bigint")
    # folded: per feed, what the progress rows folded away held (fold_sub_windows), which the
    # ledger's totals add to the rows left
    conn.execute(
        f"CREATE TABLE IF NOT EXISTS {META_SCHEMA}.folded ("
        " feed text PRIMARY KEY, rows bigint NOT NULL, changes bigint NOT NULL, resolved_ts bigint NOT NULL)")
    # fences: per feed, the latest lease term (postgres.lease) that claimed the replica; a batch of
    # an earlier term is refused (check_fence), so a runner that lost its lease lands nothing.
    conn.execute(
        f"CREATE TABLE IF NOT EXISTS {META_SCHEMA}.fences ("
        " feed text PRIMARY KEY, epoch bigint NOT NULL, holder text NOT NULL,"
        " raised_at timestamptz NOT NULL DEFAULT clock_timestamp())")


def lock_feed(conn: psycopg.Connection[Any], feed: str) -> None:
    """The transaction lock that orders every write of `feed`'s bookkeeping on the replica: a
    batch's apply (replica/apply.py), a fence raised, a verify's repair."""
    conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"changefeed-sink:{feed}",))


FENCE_PATIENCE_S = 1.0  # how long a claim waits for a batch in flight before it ends that batch's session


def raise_fence(conn: psycopg.Connection[Any], feed: str, epoch: int, holder: str) -> None:
    """Claim the replica for lease term `epoch` (a runner that just took the lease, before its
    first batch; the ledger's tables exist, see ensure_meta): from this commit on, batches of
    earlier terms are refused. Waits for a batch being applied to end (it lands, or is refused,
    before the claim); one that does not end within FENCE_PATIENCE_S is an earlier term's runner
    frozen (or cut off) in the middle of its batch: its session is ended, the batch rolls back."""
    while True:
        try:
            with conn.transaction():
                conn.execute(f"SET LOCAL lock_timeout = '{int(FENCE_PATIENCE_S * 1000)}ms'")
                lock_feed(conn, feed)
                conn.execute(f"INSERT INTO {META_SCHEMA}.fences AS f (feed, epoch, holder) VALUES (%s, %s, %s) "
                             "ON CONFLICT (feed) DO UPDATE SET epoch = excluded.epoch, holder = excluded.holder, "
                             "raised_at = clock_timestamp() WHERE f.epoch < excluded.epoch", (feed, epoch, holder))
            return
        except psycopg.errors.LockNotAvailable:
            conn.execute(f"SELECT pg_terminate_backend(l.pid) FROM pg_locks l WHERE {ADVISORY_HELD} "
                         "AND l.pid <> pg_backend_pid()", (f"changefeed-sink:{feed}",))


def check_fence(conn: psycopg.Connection[Any], feed: str, epoch: int) -> None:
    """Inside a batch's transaction, after lock_feed: LeaseLost when a later lease term claimed
    the replica (the batch is rolled back by the caller, nothing of it lands)."""
    row = conn.execute(f"SELECT epoch, holder FROM {META_SCHEMA}.fences WHERE feed = %s", (feed,)).fetchone()
    if row is not None and int(row[0]) > epoch:
        raise LeaseLost(f"feed {feed}: this runner's lease (term {epoch}) was taken over by {row[1]} "
                        f"(term {row[0]}); the replica refused its batch",
                        "nothing of the batch was applied; the runner holding the lease goes on with the feed",
                        component="sink")


def _ensure_column(conn: psycopg.Connection[Any], table: str, column: str, type_: str, default: str = "") -> None:
    """Add a bookkeeping column that sinks made by an older version lack (existing rows get NULL,
    the default is for new ones). Only then: ALTER TABLE would lock out other feeds' batches."""
    if conn.execute(f"SELECT 1 FROM pg_attribute WHERE attrelid = '{META_SCHEMA}.{table}'::regclass "
                    "AND attname = %s AND NOT attisdropped", (column,)).fetchone():
        return
    conn.execute(f"ALTER TABLE {META_SCHEMA}.{table} ADD COLUMN IF NOT EXISTS {column} {type_}")
    if default:
        conn.execute(f"ALTER TABLE {META_SCHEMA}.{table} ALTER COLUMN {column} SET DEFAULT {default}")


def has_meta(conn: psycopg.Connection[Any], table: str) -> bool:
    """Whether the bookkeeping table `changefeed.TABLE` exists (readers create nothing)."""
    return not missing(conn, f"{META_SCHEMA}.{table}")


def applied_upto(conn: psycopg.Connection[Any], feed: str) -> int:
    """The end LSN of the last batch applied for `feed`, 0 if none (the progress table must exist)."""
    row = conn.execute(f"SELECT max(end_lsn) - '0/0'::pg_lsn FROM {META_SCHEMA}.progress WHERE feed = %s",
                       (feed,)).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def fold_sub_windows(conn: psycopg.Connection[Any], feed: str, keep_s: float = RATE_WINDOW_S) -> int:
    """Delete the progress rows of followed batches' sub-windows (low-latency mode: tens a
    second) applied more than `keep_s` ago, but each followed batch's last, adding what they
    held to the feed's `folded` row; returns how many went. Every reader of the ledger answers as
    before: the last row, a batch's end and the recent rate are kept, the totals add the folded.
    Run in a batch's transaction (its feed lock held)."""
    follow = "end_offset ? 'follow'"
    row = one_row(conn.execute(
        f"WITH gone AS (DELETE FROM {META_SCHEMA}.progress WHERE feed = %(feed)s AND {follow} "
        "AND applied_at < clock_timestamp() - make_interval(secs => %(keep)s) "
        f"AND end_lsn NOT IN (SELECT max(end_lsn) FROM {META_SCHEMA}.progress WHERE feed = %(feed)s AND {follow} "
        "GROUP BY end_offset ->> 'follow') RETURNING changes, resolved_ts), "
        "sums AS (SELECT count(*) AS n, coalesce(sum(changes), 0) AS c, coalesce(max(resolved_ts), 0) AS r "
        f"FROM gone), kept AS (INSERT INTO {META_SCHEMA}.folded AS f (feed, rows, changes, resolved_ts) "
        "SELECT %(feed)s, n, c, r FROM sums WHERE n > 0 ON CONFLICT (feed) DO UPDATE SET "
        "rows = f.rows + excluded.rows, changes = f.changes + excluded.changes, "
        "resolved_ts = greatest(f.resolved_ts, excluded.resolved_ts)) "
        "SELECT n FROM sums", {"feed": feed, "keep": keep_s}))
    return int(row[0])


def _folded(conn: psycopg.Connection[Any], feed: str) -> tuple[int, int, int]:
    """(rows, changes, the highest resolved ts) the feed's folded progress rows held (0s: none)."""
    if not has_meta(conn, "folded"):
        return 0, 0, 0
    row = conn.execute(f"SELECT rows, changes, resolved_ts FROM {META_SCHEMA}.folded WHERE feed = %s",
                       (feed,)).fetchone()
    return (int(row[0]), int(row[1]), int(row[2])) if row else (0, 0, 0)


class AppliedUpto:
    """`applied_upto` of one feed as a followed batch's read asks it (sinks.base.Recorded): on a
    connection of its own, opened at the first ask."""

    def __init__(self, uri: str, feed: str) -> None:
        self.uri, self.feed = uri, feed
        self._conn: psycopg.Connection[Any] | None = None

    def __call__(self) -> int:
        from changefeed.postgres.connect import connect

        if self._conn is None:
            self._conn = connect(self.uri, "sink", autocommit=True)
        return applied_upto(self._conn, self.feed)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


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
        """Create the ledger's tables and the missing targets, one feed at a time: feeds that start
        together on one replica (a table split over feeds by key ranges, capture.md) would
        otherwise race in CREATE ... IF NOT EXISTS, which PostgreSQL does not serialise."""
        with ddl_turn(self.conn):
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
        return LastBatch(int(row[0]), row[1], int(row[2]), int(row[3]) + _folded(self.conn, self.feed)[0],
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
        rows, changes, _ = _folded(self.conn, self.feed)
        return int(row[0]) + rows, int(row[1]) + changes

    def snapshot_totals(self) -> dict[str, tuple[int, int]]:
        if not has_meta(self.conn, "snapshot_chunks"):
            return {}
        return {r[0]: (int(r[1]), int(r[2])) for r in self.conn.execute(
            f"SELECT table_name, count(*), sum(rows) FROM {META_SCHEMA}.snapshot_chunks WHERE feed = %s "
            "GROUP BY table_name", (self.feed,))}

    def forget(self) -> bool:
        """Delete the feed's bookkeeping rows (its replica tables stay)."""
        deleted = False
        for table in ("progress", "snapshot_chunks", "folded"):
            if has_meta(self.conn, table):
                deleted |= self.conn.execute(f"DELETE FROM {META_SCHEMA}.{table} WHERE feed = %s",
                                             (self.feed,)).rowcount > 0
        if has_meta(self.conn, "fences"):
            self.conn.execute(f"DELETE FROM {META_SCHEMA}.fences WHERE feed = %s", (self.feed,))
        return deleted

    def resume_offset(self) -> dict[str, Any] | None:
        """The last progress row's end offset (read through to_jsonb: rows, and sinks, made before
        the column have none)."""
        if not has_meta(self.conn, "progress"):
            return None
        row = self.conn.execute(
            f"SELECT to_jsonb(p) -> 'end_offset' FROM {META_SCHEMA}.progress p WHERE feed = %s "
            "ORDER BY end_lsn DESC LIMIT 1", (self.feed,)).fetchone()
        return None if row is None or row[0] is None else dict(row[0])

    def batch_ends(self, after: Offset) -> list[Offset]:
        if not has_meta(self.conn, "progress"):
            return []
        rows = self.conn.execute(f"SELECT to_jsonb(p) -> 'end_offset' FROM {META_SCHEMA}.progress p WHERE feed = %s "
                                 "ORDER BY end_lsn", (self.feed,)).fetchall()
        ends = [Offset.from_json(dict(r[0])) for r in rows if r[0] is not None]
        return [o for o in ends if o.order > after.order]

    def fence(self, epoch: int, holder: str) -> bool:
        raise_fence(self.conn, self.feed, epoch, holder)
        return True

    def close(self) -> None:
        self.conn.close()
