"""A feed's lease: which runner may write to the feed's sinks, until when, and in which term.

The lease is a row on the feed's first source node (`changefeed.leases`), where every runner of
the feed already connects (slot, publication): no other store to run. Time is the source server's
clock only (`clock_timestamp()`), so runners on hosts whose clocks disagree still agree on when a
lease ends. Each taking of the lease starts a new term (`epoch`, one more than the last); the
sinks remember the highest term that wrote to them (see sinks' fences) and refuse a batch of an
older one. The lease decides who should run; the fences make sure a runner that lost it (frozen,
cut off) can land nothing, whatever the clocks did meanwhile.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import psycopg

from changefeed.postgres.connect import missing, shared_ddl

DDL = """
CREATE SCHEMA IF NOT EXISTS changefeed;
CREATE TABLE IF NOT EXISTS changefeed.leases (
    feed text PRIMARY KEY,
    epoch bigint NOT NULL,
    holder text NOT NULL,
    expires_at timestamptz NOT NULL,
    lease_s double precision NOT NULL,
    taken_at timestamptz NOT NULL DEFAULT clock_timestamp()
)"""


def me() -> str:
    """This runner, as others are shown it: host and pid."""
    return f"pid {os.getpid()} on {socket.gethostname()}"


@dataclass(frozen=True)
class Lease:
    """The lease as the source has it: its term, who holds it, and how long it lasts on (negative:
    it ended that long ago, by the source's clock; a released lease has ended)."""
    epoch: int
    holder: str
    remaining_s: float
    lease_s: float

    @property
    def free(self) -> bool:
        return self.remaining_s <= 0

    @property
    def released(self) -> bool:
        """Ended by its runner's clean stop (release), not by time: that runner is on its way out."""
        return self.lease_s == 0



def ensure(conn: psycopg.Connection[Any]) -> None:
    """The lease table, made once per source database."""
    if missing(conn, "changefeed.leases"):
        shared_ddl(conn, DDL)


def current(conn: psycopg.Connection[Any], feed: str) -> Lease | None:
    """The feed's lease, None if it was never taken (or the table is not there)."""
    if missing(conn, "changefeed.leases"):
        return None
    row = conn.execute(
        "SELECT epoch, holder, extract(epoch FROM expires_at - clock_timestamp())::float8, lease_s "
        "FROM changefeed.leases WHERE feed = %s", (feed,)).fetchone()
    return None if row is None else Lease(int(row[0]), str(row[1]), float(row[2]), float(row[3]))


def take(conn: psycopg.Connection[Any], feed: str, lease_s: float, holder: str | None = None, *,
         force: bool = False) -> int | None:
    """Take the feed's lease if it is free (never taken, released, or ended by the source's
    clock), or with `force` whoever holds it (the caller knows its holder is gone: it holds the
    feed's session lock on the source, which a live runner keeps): the new term's epoch, or None
    while another runner holds it. Two runners taking at once get a term each in turn, never the
    same one: the row lock orders them."""
    ensure(conn)
    row = conn.execute(
        "INSERT INTO changefeed.leases AS l (feed, epoch, holder, expires_at, lease_s) "
        "VALUES (%(feed)s, 1, %(holder)s, clock_timestamp() + make_interval(secs => %(lease)s), %(lease)s) "
        "ON CONFLICT (feed) DO UPDATE SET epoch = l.epoch + 1, holder = excluded.holder, "
        "expires_at = excluded.expires_at, lease_s = excluded.lease_s, taken_at = clock_timestamp() "
        "WHERE l.expires_at <= clock_timestamp() OR %(force)s RETURNING epoch",
        {"feed": feed, "holder": holder or me(), "lease": lease_s, "force": force}).fetchone()
    return None if row is None else int(row[0])


def renew(conn: psycopg.Connection[Any], feed: str, epoch: int, lease_s: float) -> bool:
    """Extend the lease of term `epoch` by `lease_s` from now (the source's clock); False when
    the term is over: another runner took the lease. A lease that ended while nobody took it (its
    runner was frozen, or cut off, with no standby) is still this term's to extend: no one else
    wrote meanwhile, and the sinks' fences refuse the term once a later one writes."""
    return conn.execute(
        "UPDATE changefeed.leases SET expires_at = clock_timestamp() + make_interval(secs => %s) "
        "WHERE feed = %s AND epoch = %s RETURNING 1", (lease_s, feed, epoch)).fetchone() is not None


def release(conn: psycopg.Connection[Any], feed: str, epoch: int) -> None:
    """End the lease of term `epoch` now (a clean stop): a standby takes over at once. Its length
    becomes 0, which tells a release from a lease that ran out (Lease.released)."""
    conn.execute("UPDATE changefeed.leases SET expires_at = clock_timestamp(), lease_s = 0 "
                 "WHERE feed = %s AND epoch = %s", (feed, epoch))


def forget(conn: psycopg.Connection[Any], feed: str) -> None:
    """Drop the feed's lease row (the feed is removed)."""
    if not missing(conn, "changefeed.leases"):
        conn.execute("DELETE FROM changefeed.leases WHERE feed = %s", (feed,))
