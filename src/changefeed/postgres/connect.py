"""Open PostgreSQL connections, turning driver failures into typed, actionable errors.

Every connection has TCP keepalives (probes after 10 s idle, every 5 s, 3 unanswered: a silent
peer is found within about 25 s), `tcp_user_timeout` (data unacknowledged for 30 s drops the
connection) and the process's watchdog (postgres.watchdog: an answer awaited for long is checked
through a fresh connection), so a network stall ends in an error the feed retries, never in a hang.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg
from psycopg import pq

from changefeed.core.lsn import Lsn, parse_lsn
from changefeed.errors import AuthenticationFailed, ChangefeedError, ConfigError, ConnectionFailed
from changefeed.postgres.watchdog import WATCHDOG, WatchedConnection
from changefeed.spec.definition import FeedSpec
from changefeed.spec.secrets import resolve

_Row = TypeVar("_Row")


def redact(uri: str) -> str:
    """The URI with its password hidden, fit for messages and logs."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<unparsable URI>"
    if parts.password is None:
        return uri
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


# libpq connection parameters (psycopg.connect takes them as **kwargs: Any)
KEEPALIVES: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
                              "tcp_user_timeout": 30_000}


@contextmanager
def lost_connection(role: str) -> Iterator[None]:
    """Work on a `role` server's connection: losing it (the server restarted or crashed, the backend
    terminated, the network dropped or stalled) is ConnectionFailed, which the feed retries; our
    own errors raised meanwhile are the `role`'s unless they name another part."""
    try:
        yield
    except ChangefeedError as e:
        e.component = e.component or role
        raise
    except psycopg.OperationalError as e:
        first = WATCHDOG.cut_reason() or (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConnectionFailed(f"lost the connection to the {role}: {first}",
                               f"changefeed retries until the {role} is back", component=role) from None


def connect(uri: str, role: str, *, autocommit: bool = True, **kwargs: Any) -> psycopg.Connection[Any]:
    """Connect to `uri` (its secret references resolved here, see secrets.py); `role` ("source",
    "sink") names the server in error messages."""
    if not uri.startswith(("postgresql://", "postgres://")):
        raise ConfigError(f"{role} URI {redact(uri)!r} is not a PostgreSQL URI",
                          "write it as postgresql://USER:PASSWORD@HOST:PORT/DBNAME")
    resolved = resolve(uri, f"the {role} URI", in_uri=True)
    try:
        conn = WatchedConnection.connect(resolved, autocommit=autocommit, application_name="changefeed",
                                         **{"connect_timeout": 10, **KEEPALIVES, **kwargs})
        conn.probe_uri = resolved
        return conn
    except psycopg.ProgrammingError as e:
        raise ConfigError(f"{role} URI {redact(uri)!r} is malformed: {e}",
                          "write it as postgresql://USER:PASSWORD@HOST:PORT/DBNAME") from None
    except psycopg.OperationalError as e:
        text = str(e)
        if "password authentication failed" in text or "no password supplied" in text \
                or "authentication failed" in text or "role \"" in text and "does not exist" in text:
            raise AuthenticationFailed(f"{role} {redact(uri)} refused the credentials: {text.strip()}",
                                       _credentials_hint(uri)) from None
        if "database \"" in text and "does not exist" in text:
            raise ConfigError(f"{role} {redact(uri)}: {text.strip()}", "create the database or fix the URI") from None
        raise ConnectionFailed(f"cannot reach {role} {redact(uri)}: {text.strip()}",
                               "check host and port, and that the server is running and accepts TCP connections",
                               component=role) from None


# pg_locks rows (as `l`) of a granted advisory lock taken with hashtext(KEY), KEY the parameter:
# how changefeed finds the session holding one of its locks (a feed's runner, a replica batch)
ADVISORY_HELD = "l.locktype = 'advisory' AND l.granted AND l.objid = (hashtext(%s)::bigint & 4294967295)::oid"


@contextmanager
def first_node(spec: FeedSpec, **kwargs: Any) -> Iterator[psycopg.Connection[Any]]:
    """A connection of its own to the feed's first source node, where every runner of the feed
    finds its lease, definition, snapshot requests and pause; losing it is ConnectionFailed."""
    node = spec.sources[0]
    role = spec.role(node.name)
    with connect(node.uri, role, **kwargs) as conn, lost_connection(role):
        yield conn


def server_version(conn: psycopg.Connection[Any]) -> int:
    """The server's version as a number, e.g. 180001 (what a feature needs is checked against it):
    libpq's, from the connection's start, so asking costs no round trip (snapshot reads ask per chunk)."""
    return int(conn.info.server_version)


@contextmanager
def ddl_turn(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """A transaction for changefeed's own CREATE ... IF NOT EXISTS, one runner at a time per database:
    feeds that start together on one database (a table split over feeds, capture.md) would
    otherwise race in them, which PostgreSQL does not serialise (a unique violation in the catalog).
    The turn is a session lock taken before the transaction begins, not a transaction lock: a
    transaction that began before the previous holder committed may still find the schema missing
    in its catalog cache, and create it again (tests/postgres/test_shared_ddl.py). Inside a
    caller's transaction it is a transaction lock, held until that transaction ends."""
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        with conn.transaction():  # inside a caller's transaction: the turn lasts to its end
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('changefeed:ddl'))")
            yield
        return
    conn.execute("SELECT pg_advisory_lock(hashtext('changefeed:ddl'))")
    try:
        with conn.transaction():
            yield
    finally:
        conn.execute("SELECT pg_advisory_unlock(hashtext('changefeed:ddl'))")


def shared_ddl(conn: psycopg.Connection[Any], ddl: str) -> None:
    """Run `ddl` (changefeed's own CREATE ... IF NOT EXISTS statements) in its turn (ddl_turn)."""
    with ddl_turn(conn):
        conn.execute(ddl)


def missing(conn: psycopg.Connection[Any], table: str) -> bool:
    """Whether `table` (schema.name) does not exist: readers of changefeed's own tables create nothing."""
    return bool(one_row(conn.execute("SELECT to_regclass(%s) IS NULL", (table,)))[0])


def one_row(cur: psycopg.Cursor[_Row]) -> _Row:
    """The row of a query that always gives one (SHOW, an aggregate, a function call)."""
    row = cur.fetchone()
    assert row is not None, "a query that always gives one row gave none"
    return row


def insert_lsn(conn: psycopg.Connection[Any]) -> Lsn:
    """A WAL position past every commit so far: where WAL is inserted, not where it is written
    (`pg_current_wal_lsn`). Under `synchronous_commit = off` a commit is visible before its record
    is written out, so only the insert position is sure to lie past it."""
    return parse_lsn(one_row(conn.execute("SELECT pg_current_wal_insert_lsn()::text"))[0])


def _credentials_hint(uri: str) -> str:
    """What to check when a server refused the credentials: without a password in the URI, libpq
    looked in its password file, which it skips when others may read it."""
    from urllib.parse import urlsplit

    if urlsplit(uri).password is not None:
        return "check the user and the password (or the variable ${VAR} that holds it) in the URI"
    from changefeed.spec.secrets import passfile_problem

    problem = passfile_problem()
    return (f"the URI has no password and {problem}" if problem else
            "the URI has no password: put it in ~/.pgpass (or the file PGPASSFILE names, mode 0600), or in the URI "
            "by reference, postgresql://USER:${VAR}@HOST/DB")

