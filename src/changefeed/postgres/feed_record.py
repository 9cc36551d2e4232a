"""What every runner of a feed reads on its first source node, beside the lease (postgres.lease):
the feed's definition, and the standbys waiting to take the feed over.

A runner stores the definition it runs (`changefeed.feeds`) when it attaches and when it changes
(`alter` on a running feed), so a standby on another host needs only the feed's name and the
source: it runs the definition the last active runner ran. Secrets in it are references or
encrypted (spec.secrets), as in `feed.json`: a standby's host needs the same environment or key.
Standbys note themselves in `changefeed.standbys` while they wait (`status` lists those seen in
the last few seconds). `pause` on any host marks the feed in `changefeed.paused`: the active
runner stops, and standbys wait instead of taking it over, until `resume`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from changefeed.postgres.connect import missing, shared_ddl

DDL = """
CREATE SCHEMA IF NOT EXISTS changefeed;
CREATE TABLE IF NOT EXISTS changefeed.feeds (
    feed text PRIMARY KEY,
    definition text NOT NULL,
    stored_by text NOT NULL,
    stored_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS changefeed.standbys (
    feed text NOT NULL,
    holder text NOT NULL,
    seen_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (feed, holder)
);
CREATE TABLE IF NOT EXISTS changefeed.paused (
    feed text PRIMARY KEY,
    paused_by text NOT NULL,
    paused_at timestamptz NOT NULL DEFAULT clock_timestamp()
)"""

SEEN_S = 5.0  # a standby not seen for this long is not listed any more (it polls several times a second)


@dataclass(frozen=True)
class Stored:
    """A feed's definition as stored on the source: its JSON (spec.definition.FeedSpec), by whom, when."""
    definition: str
    stored_by: str
    stored_at: str



def ensure(conn: psycopg.Connection[Any]) -> None:
    if missing(conn, "changefeed.feeds") or missing(conn, "changefeed.paused"):
        shared_ddl(conn, DDL)


def store(conn: psycopg.Connection[Any], feed: str, definition: str, by: str) -> None:
    """Store (or replace) the feed's definition; nothing is written when it is the same."""
    ensure(conn)
    conn.execute("INSERT INTO changefeed.feeds AS f (feed, definition, stored_by) VALUES (%s, %s, %s) "
                 "ON CONFLICT (feed) DO UPDATE SET definition = excluded.definition, stored_by = excluded.stored_by, "
                 "stored_at = clock_timestamp() WHERE f.definition IS DISTINCT FROM excluded.definition",
                 (feed, definition, by))


def load(conn: psycopg.Connection[Any], feed: str) -> Stored | None:
    """The feed's stored definition, None if it has none here (readers create nothing)."""
    if missing(conn, "changefeed.feeds"):
        return None
    row = conn.execute("SELECT definition, stored_by, stored_at::text FROM changefeed.feeds WHERE feed = %s",
                       (feed,)).fetchone()
    return None if row is None else Stored(str(row[0]), str(row[1]), str(row[2]))


def standing_by(conn: psycopg.Connection[Any], feed: str, holder: str) -> None:
    """Note (again) that `holder` stands by for the feed."""
    ensure(conn)
    conn.execute("INSERT INTO changefeed.standbys (feed, holder) VALUES (%s, %s) ON CONFLICT (feed, holder) "
                 "DO UPDATE SET seen_at = clock_timestamp()", (feed, holder))


def left(conn: psycopg.Connection[Any], feed: str, holder: str) -> None:
    """`holder` stopped standing by (it took the feed over, or stopped)."""
    if not missing(conn, "changefeed.feeds"):
        conn.execute("DELETE FROM changefeed.standbys WHERE feed = %s AND holder = %s", (feed, holder))


def standbys(conn: psycopg.Connection[Any], feed: str) -> list[str]:
    """The standbys seen in the last SEEN_S seconds, longest waiting first."""
    if missing(conn, "changefeed.feeds"):
        return []
    return [str(r[0]) for r in conn.execute(
        "SELECT holder FROM changefeed.standbys WHERE feed = %s AND seen_at > clock_timestamp() - "
        "make_interval(secs => %s) ORDER BY holder", (feed, SEEN_S))]


def pause(conn: psycopg.Connection[Any], feed: str, by: str) -> None:
    """Mark the feed paused for every runner: the active one stops, standbys do not take it over."""
    ensure(conn)
    conn.execute("INSERT INTO changefeed.paused (feed, paused_by) VALUES (%s, %s) ON CONFLICT (feed) DO NOTHING",
                 (feed, by))


def unpause(conn: psycopg.Connection[Any], feed: str) -> None:
    if not missing(conn, "changefeed.paused"):
        conn.execute("DELETE FROM changefeed.paused WHERE feed = %s", (feed,))


def paused_by(conn: psycopg.Connection[Any], feed: str) -> str | None:
    """Who paused the feed (`pause` on some host), None if it is not paused."""
    if missing(conn, "changefeed.paused"):
        return None
    row = conn.execute("SELECT paused_by FROM changefeed.paused WHERE feed = %s", (feed,)).fetchone()
    return None if row is None else str(row[0])


def forget(conn: psycopg.Connection[Any], feed: str) -> None:
    """The feed is removed: its definition, standbys and pause go."""
    if not missing(conn, "changefeed.feeds"):
        conn.execute("DELETE FROM changefeed.feeds WHERE feed = %s", (feed,))
        conn.execute("DELETE FROM changefeed.standbys WHERE feed = %s", (feed,))
    unpause(conn, feed)
