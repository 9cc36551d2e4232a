"""Before each webhook request: the runner's lease checked, and where the request is cut recorded.

A request goes out only while the runner's lease term holds the feed and has not run out (by the
source's clock): a runner frozen past its lease, or cut off, sends nothing once a standby may have
taken over. In the same statement, on the feed's first source node, the request's cut (the
position of its last message in its batch) is recorded under the batch's identity, the position
of its first change (`Batch.of`): a batch sent again (replayed after a crash, or planned anew by
the runner that took the feed over, which starts where the last recorded batch ended, as the
batch in flight did) is cut where it was cut before, so each request carries the same messages
and the same idempotency key, and an endpoint that remembers keys sees each change once. The
cuts of a batch are dropped once a later batch is recorded (sinks.source_ledger).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc

from changefeed.core import change as ch
from changefeed.errors import LeaseLost, TransientError
from changefeed.postgres.connect import connect, lost_connection, missing, shared_ddl

DDL = """
CREATE SCHEMA IF NOT EXISTS changefeed;
CREATE TABLE IF NOT EXISTS changefeed.request_cuts (
    feed text NOT NULL,
    batch text NOT NULL,
    first_lsn bigint NOT NULL,
    request int NOT NULL,
    last int NOT NULL,
    PRIMARY KEY (feed, batch, request)
)"""
POLL_S = 0.2  # while the lease ran out unrenewed: how often to look whether its runner renews it

_ADMIT = """
WITH lease AS (SELECT epoch, expires_at > clock_timestamp() AS live FROM changefeed.leases WHERE feed = %(feed)s),
cut AS (INSERT INTO changefeed.request_cuts (feed, batch, first_lsn, request, last)
        SELECT %(key)s, %(batch)s, %(lsn)s, %(request)s, %(last)s FROM lease
        WHERE epoch = %(epoch)s AND live AND %(request)s::int IS NOT NULL
        ON CONFLICT DO NOTHING)
SELECT epoch, live FROM lease"""


@dataclass(frozen=True)
class Batch:
    """A batch as every runner tells it: by its first change's position (lsn, xid, seq)."""

    lsn: int
    xid: int
    seq: int

    @property
    def key(self) -> str:
        return f"{self.lsn:X}.{self.xid}.{self.seq}"

    @classmethod
    def of(cls, rows: Any) -> "Batch | None":
        """The position of the first change among `rows` (a record batch), None if it has none."""
        data = pc.indices_nonzero(pc.invert(pc.is_in(rows.column("op"), value_set=_CONTROL)))
        if not len(data):
            return None
        i = data[0].as_py()
        return cls(*(int(rows.column(c)[i].as_py() or 0) for c in ("lsn", "xid", "seq")))


_CONTROL = pa.array([ch.RELATION, ch.PROGRESS])
_CONNS: dict[str, psycopg.Connection[Any]] = {}  # a worker process's connection per source URI


def ensure(uri: str) -> None:
    """The cuts table, made when the feed attaches."""
    with connect(uri, "source") as conn, lost_connection("source"):
        if missing(conn, "changefeed.request_cuts"):
            shared_ddl(conn, DDL)


class RequestLog:
    """A writer task's way to the feed's first source node: the lease is the feed's, the cuts its
    sink's (`key`, spec.sinks)."""

    def __init__(self, uri: str, feed: str, key: str, epoch: int, wait_s: float) -> None:
        self.uri, self.feed, self.key, self.epoch, self.wait_s = uri, feed, key, epoch, wait_s

    def cuts(self, batch: Batch) -> list[int]:
        """Where the batch's requests were cut before (the last message's position of each), in order."""
        with _session(self.uri) as conn:
            return [int(r[0]) for r in conn.execute(
                "SELECT last FROM changefeed.request_cuts WHERE feed = %s AND batch = %s ORDER BY request",
                (self.key, batch.key))]

    def admit(self, batch: Batch, request: int | None, last: int) -> None:
        """Record request `request` of `batch` as cut after message `last` (None: a request of no
        change, not recorded), if this runner's lease holds; LeaseLost if another term took the
        feed, TransientError if the lease ran out and its runner (this one, frozen or cut off
        meanwhile) did not renew it within `wait_s`."""
        waited = 0.0
        while True:
            with _session(self.uri) as conn:
                row = conn.execute(_ADMIT, {"feed": self.feed, "key": self.key, "batch": batch.key, "lsn": batch.lsn,
                                            "request": request, "last": last, "epoch": self.epoch}).fetchone()
            if row is None or int(row[0]) != self.epoch:
                held = "nobody (the lease was removed)" if row is None else f"term {row[0]}"
                raise LeaseLost(f"feed {self.feed}: this runner's lease (term {self.epoch}) is held by {held} now; "
                                "the webhook request was not sent", "another runner took the feed over; this one "
                                "stops", component="sink")
            if row[1]:
                return
            if waited >= self.wait_s:
                raise TransientError(f"feed {self.feed}: the runner's lease (term {self.epoch}) ran out unrenewed; "
                                     "no request is sent without it", "the runner renews it when it reaches the "
                                     "source again; the batch is sent again then", component="sink")
            time.sleep(POLL_S)
            waited += POLL_S


@contextmanager
def _session(uri: str) -> Iterator[psycopg.Connection[Any]]:
    """The worker process's connection to `uri` (made anew after it broke), in `lost_connection`."""
    conn = _CONNS.get(uri)
    if conn is None or conn.closed:
        conn = _CONNS[uri] = connect(uri, "source", connect_timeout=10)
    try:
        with lost_connection("source"):
            yield conn
    except BaseException:
        if conn.closed or conn.broken:
            _CONNS.pop(uri, None)
        raise
