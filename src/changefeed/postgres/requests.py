"""Snapshot requests on the feed's first source node, where every runner of the feed reads them.

A request (`alter --add-tables`, `alter --add-node`, `snapshot`) made on any host reaches the
runner that is active, wherever it runs: a row of `changefeed.snapshot_requests`, numbered per
feed. The running feed takes in those numbered above what its checkpoint says it has taken
(core.snapshot.Cursor.requests), so a request is acted on once, also across restarts and
takeovers, and one made while the feed is stopped waits for its next run. A feed whose requests
were files in its state folder (core.requests.SnapshotRequests) has them taken in, numbers kept,
when it next reads or adds one.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from changefeed.core.requests import Request, SnapshotRequests
from changefeed.postgres.connect import first_node, missing, shared_ddl
from changefeed.spec.definition import FeedSpec
from changefeed.spec.state import FeedState

DDL = """
CREATE SCHEMA IF NOT EXISTS changefeed;
CREATE TABLE IF NOT EXISTS changefeed.snapshot_requests (
    feed text NOT NULL,
    no int NOT NULL,
    tables jsonb NOT NULL,
    made_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (feed, no)
);
ALTER TABLE changefeed.snapshot_requests ADD COLUMN IF NOT EXISTS only_sinks jsonb;
ALTER TABLE changefeed.snapshot_requests ADD COLUMN IF NOT EXISTS after_lsns jsonb;
ALTER TABLE changefeed.snapshot_requests ADD COLUMN IF NOT EXISTS first_read boolean"""
_COLUMNS = ("only_sinks", "after_lsns", "first_read")  # added after the table's first version


def _publishing_lock(feed: str) -> str:
    return f"changefeed:publishing:{feed}"


@contextmanager
def publishing(conn: psycopg.Connection[Any], feed: str) -> Iterator[None]:
    """Held (on the feed's first node, `conn`) while `alter --add-tables` publishes tables on each
    node of a feed of several and then queues their request: a runner fixes a batch's window end
    and takes requests in under the same lock, shared (SourceRequests.planning), so a window either
    ends before any of the publications or its batch takes the request in. (A feed of one node
    needs no lock: its request is made in the transaction that publishes the tables.)"""
    conn.execute("SELECT pg_advisory_lock(hashtext(%s))", (_publishing_lock(feed),))
    try:
        yield
    finally:
        _unlock(conn, "SELECT pg_advisory_unlock(hashtext(%s))", feed)


def _unlock(conn: psycopg.Connection[Any], query: str, feed: str) -> None:
    """Let the lock go; a session that cannot is closed, which lets it go too."""
    try:
        conn.execute(query, (_publishing_lock(feed),))
    except psycopg.Error:
        conn.close()


def forget(conn: psycopg.Connection[Any], feed: str) -> None:
    """The feed is removed, or made anew under its name: its requests go (a new feed's checkpoint
    counts from 0 and would take in an old one's)."""
    if not missing(conn, "changefeed.snapshot_requests"):
        conn.execute("DELETE FROM changefeed.snapshot_requests WHERE feed = %s", (feed,))


def void(conn: psycopg.Connection[Any], feed: str, sink: str) -> None:
    """Sink `sink` is removed from the feed: its requests read nothing (they keep their numbers,
    so that no later request takes one a checkpoint counts as taken in)."""
    if not missing(conn, "changefeed.snapshot_requests") and "only_sinks" in _later_columns(conn):
        conn.execute("UPDATE changefeed.snapshot_requests SET tables = '[]' WHERE feed = %s AND only_sinks = %s",
                     (feed, Jsonb([sink])))


@contextmanager
def on_source(spec: FeedSpec, state: FeedState) -> Iterator[SourceRequests]:
    """The feed's requests on a connection of their own to its first node (a command, not a runner)."""
    with first_node(spec) as conn:
        yield SourceRequests(lambda: conn, spec.name, state.requests)


class SourceRequests:
    """The feed's snapshot requests, through `conn` (a connection to its first source node, in
    autocommit mode); `legacy`: the state folder's requests folder of an older changefeed."""

    def __init__(self, conn: Callable[[], psycopg.Connection[Any]], feed: str, legacy: Path | str | None = None
                 ) -> None:
        self.conn, self.feed, self.legacy = conn, feed, legacy
        self._adopted = self._made = False
        self._present: set[str] = set()

    def add(self, tables: Sequence[str], only: Sequence[str] = (), after: Mapping[str, int] | None = None,
            first: bool = False) -> int:
        """Queue a request (for the sinks `only`, or all; for a batch from `after` on; `first`: see
        core.requests.Request.first); its number."""
        conn = self.conn()
        extra = {"only_sinks": Jsonb(list(only)) if only else None, "after_lsns": Jsonb(dict(after)) if after else None,
                 "first_read": True if first else None}
        extra = {k: v for k, v in extra.items() if v is not None}
        if not self._exists(conn) or not set(extra) <= self._columns(conn):
            shared_ddl(conn, DDL)
            self._made, self._present = True, set(_COLUMNS)
        self._adopt(conn)
        names = sql.SQL("").join(sql.SQL(", {}").format(sql.Identifier(k)) for k in extra)
        values = sql.SQL("").join(sql.SQL(", {}").format(sql.Placeholder(k)) for k in extra)
        while True:
            try:
                with conn.transaction():  # (a savepoint inside a caller's transaction: lifecycle.add_tables)
                    row = conn.execute(sql.SQL(
                        "INSERT INTO changefeed.snapshot_requests (feed, no, tables{}) SELECT %(feed)s, "
                        "coalesce(max(no), 0) + 1, %(tables)s{} FROM changefeed.snapshot_requests "
                        "WHERE feed = %(feed)s RETURNING no").format(names, values),
                        {"feed": self.feed, "tables": Jsonb(list(tables)), **extra}).fetchone()
                    assert row is not None, "an INSERT ... RETURNING of one row"
                    return int(row[0])
            except psycopg.errors.UniqueViolation:
                continue  # another request took that number at the same time

    @contextmanager
    def planning(self) -> Iterator[None]:
        """Held while a runner of a feed of several nodes fixes a batch's window end and takes the
        requests in (see publishing)."""
        conn = self.conn()
        conn.execute("SELECT pg_advisory_lock_shared(hashtext(%s))", (_publishing_lock(self.feed),))
        try:
            yield
        finally:
            _unlock(conn, "SELECT pg_advisory_unlock_shared(hashtext(%s))", self.feed)

    def after(self, taken: int) -> list[Request]:
        """Requests numbered above `taken`, in order."""
        conn = self.conn()
        if not self._exists(conn):
            return self._old().after(taken) if self.legacy else []
        self._adopt(conn)
        present = self._columns(conn)
        chosen = sql.SQL(", ").join(sql.Identifier(c) if c in present else sql.NULL for c in _COLUMNS)
        return [Request(int(no), list(tables), tuple(only or ()), tuple((after or {}).items()), bool(first))
                for no, tables, only, after, first in conn.execute(sql.SQL(
                    "SELECT no, tables, {} FROM changefeed.snapshot_requests WHERE feed = %s AND no > %s "
                    "ORDER BY no").format(chosen), (self.feed, taken))]

    def _columns(self, conn: psycopg.Connection[Any]) -> set[str]:
        """Which of the later columns the table has (an older one was made without them: the first
        request that needs one adds them)."""
        if len(self._present) < len(_COLUMNS):
            self._present = _later_columns(conn)
        return self._present

    def _exists(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether the table exists; asked until it does (it is read at every batch's planning)."""
        if not self._made:
            self._made = not missing(conn, "changefeed.snapshot_requests")
        return self._made

    def _old(self) -> SnapshotRequests:
        assert self.legacy is not None
        return SnapshotRequests(self.legacy)

    def _adopt(self, conn: psycopg.Connection[Any]) -> None:
        """Take in the state folder's request files once (a feed of an older changefeed)."""
        if self._adopted or not self.legacy:
            return
        old = self._old().after(0)
        if old:
            with conn.cursor() as cur:
                cur.executemany("INSERT INTO changefeed.snapshot_requests (feed, no, tables) VALUES (%s, %s, %s) "
                                "ON CONFLICT DO NOTHING", [(self.feed, r.no, json.dumps(r.tables)) for r in old])
            shutil.rmtree(self.legacy, ignore_errors=True)  # taken in once: the source holds them now
        self._adopted = True


def _later_columns(conn: psycopg.Connection[Any]) -> set[str]:
    return {str(r[0]) for r in conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass('changefeed.snapshot_requests') "
        "AND attname = ANY(%s) AND NOT attisdropped", (list(_COLUMNS),))}
