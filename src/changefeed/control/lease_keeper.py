"""The runner's hold on its lease (postgres.lease): take it in a new term when the feed starts,
claim the sinks for that term (their fences), renew it every third of its length on a connection
of its own, and end it when the run ends cleanly, so that a standby need not wait it out.

Renewing is liveness, not safety: a runner that cannot renew (frozen, cut off from the source)
may still try to write, and the sinks' fences refuse it once a later term claimed them. Losing
the lease (a renewal finds another term) ends this run with LeaseLost.
"""
from __future__ import annotations

import threading
from typing import Any

import psycopg

from changefeed.errors import ChangefeedError, LeaseLost
from changefeed.postgres import lease
from changefeed.postgres.connect import connect, lost_connection
from changefeed.sinks.ledger import Ledger
from changefeed.spec.definition import FeedSpec


def take(spec: FeedSpec, conn: Any, ledger: Ledger) -> int:
    """Take the feed's lease in a new term and claim the sink for it; the term. `conn` holds the
    feed's session lock on the first source node: whoever held the lease before is gone (a live
    runner keeps that lock), so the lease is taken whatever its time left."""
    epoch = lease.take(conn, spec.name, spec.lease_s, force=True)
    assert epoch is not None, "a forced take always gets a term"
    ledger.fence(epoch, lease.me())
    return epoch


def lost(spec: FeedSpec, epoch: int, held: lease.Lease | None) -> LeaseLost:
    who = f"{held.holder} (term {held.epoch})" if held else "nobody (the lease was removed)"
    return LeaseLost(f"feed {spec.name}: this runner's lease (term {epoch}) is held by {who} now",
                     "another runner took the feed over; this one stops and writes nothing more", component="lease")


def check_still_held(spec: FeedSpec, epoch: int) -> None:
    """LeaseLost if another runner took the feed after term `epoch` (a runner back from a fault).
    A later term of this runner's own is no other's: an attempt that took it and then failed on
    the next step (each take checked this first, so no other term came in between)."""
    with connect(spec.sources[0].uri, "source") as conn, lost_connection("source"):
        held = lease.current(conn, spec.name)
    if held is None or (held.epoch != epoch and held.holder != lease.me()):
        raise lost(spec, epoch, held)


class Keeper:
    """Renews the lease of term `epoch` in a thread until `close`; `error` is set once another
    term holds it. A renewal that fails on the connection is tried again on a new one when the
    next is due (the runner's own checks meet an unreachable source).

    It starts as soon as the term is taken: Spark's start may outlast a short lease, and a standby
    must not take a live runner's feed meanwhile."""

    def __init__(self, spec: FeedSpec, epoch: int) -> None:
        self.spec, self.epoch = spec, epoch
        self.error: LeaseLost | None = None
        self.closed = False
        self._stop = threading.Event()
        self._conn: psycopg.Connection[Any] | None = None
        self._thread = threading.Thread(target=self._run, name="changefeed-lease", daemon=True)
        self._thread.start()

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.spec.sources[0].uri, "source", autocommit=True)
        return self._conn

    def _run(self) -> None:
        every = self.spec.lease_s / 3
        while not self._stop.wait(every):
            try:
                conn = self._connection()
                if not lease.renew(conn, self.spec.name, self.epoch, self.spec.lease_s):
                    self.error = lost(self.spec, self.epoch, lease.current(conn, self.spec.name))
                    return
            except (ChangefeedError, psycopg.Error):
                if self._conn is not None:
                    self._conn.close()
                self._conn = None  # the next turn connects again

    def check(self) -> None:
        """LeaseLost once the lease is another term's."""
        if self.error is not None:
            raise self.error

    def close(self, release: bool) -> None:
        """Stop renewing; with `release` (a clean stop) end the lease now. Once only: later calls
        (the attempt's own close after a clean stop) do nothing."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        self._thread.join()
        try:
            if release and self.error is None:
                lease.release(self._connection(), self.spec.name, self.epoch)
        except (ChangefeedError, psycopg.Error):
            pass  # it ends by itself
        finally:
            if self._conn is not None:
                self._conn.close()
