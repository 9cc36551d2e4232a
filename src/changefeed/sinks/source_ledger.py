"""The ledger of a sink with no place of its own to keep one (a webhook), on the feed's first
source node: every runner of the feed reaches it, so a standby on another host carries on from it.

A row per batch in `changefeed.delivered` (the same JSON line sinks.ledger.FileLedger keeps),
written by the Spark driver once every message of the batch was acknowledged, before Spark
records the batch as done and the slot moves on. It is written only while the runner's lease
term is the feed's (a runner frozen past its lease and woken records nothing, LeaseLost): the
last row is where the feed stands, and a runner without the feed's Spark checkpoint resumes from
its end offset. Its requests' cuts (sinks.webhook.cuts) live beside it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg

from changefeed.core.change import BatchProgress
from changefeed.core.offsets import Offset
from changefeed.errors import LeaseLost
from changefeed.postgres.connect import connect, lost_connection, missing, one_row, shared_ddl
from changefeed.sinks.ledger import FileLedger, _Entry, ends_after

DDL = """
CREATE SCHEMA IF NOT EXISTS changefeed;
CREATE TABLE IF NOT EXISTS changefeed.delivered (
    feed text NOT NULL,
    end_lsn bigint NOT NULL,
    batch_id bigint NOT NULL,
    entry text NOT NULL,
    epoch bigint,
    recorded_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (feed, end_lsn)
)"""


class SourceLedger(FileLedger):
    """FileLedger's entries, kept on the source at `uri`. `legacy`: the state folder's
    `delivered.jsonl` of a feed that kept its ledger there, taken in on `prepare`."""

    def __init__(self, uri: str, feed: str, legacy: Path | str | None = None) -> None:
        super().__init__(legacy or "")
        self.uri, self.feed, self.legacy = uri, feed, legacy
        self._cache: tuple[int, list[_Entry]] | None = None

    def prepare(self, tables: list[Any]) -> None:
        with connect(self.uri, "source") as conn, lost_connection("source"):
            if missing(conn, "changefeed.delivered"):
                shared_ddl(conn, DDL)
            if self.legacy and Path(self.legacy).exists() and one_row(conn.execute(
                    "SELECT NOT EXISTS (SELECT FROM changefeed.delivered WHERE feed = %s)", (self.feed,)))[0]:
                old = FileLedger(self.legacy)._entries()
                with conn.cursor() as cur:
                    cur.executemany("INSERT INTO changefeed.delivered (feed, end_lsn, batch_id, entry) VALUES "
                                    "(%s, %s, %s, %s) ON CONFLICT DO NOTHING",
                                    [(self.feed, e.progress.end_lsn, e.batch_id, e.line()) for e in old])

    def record(self, batch_id: int, progress: BatchProgress, began: float, done: float,
               epoch: int | None = None) -> None:
        """Record the batch (again: nothing changes) if term `epoch` still holds the feed's lease."""
        entry = _Entry(batch_id, progress, began, done).line()
        with connect(self.uri, "source") as conn, lost_connection("source"):
            with conn.transaction():
                if epoch is not None:
                    held = conn.execute("SELECT epoch FROM changefeed.leases WHERE feed = %s FOR SHARE",
                                        (self.feed,)).fetchone()
                    if held is not None and int(held[0]) != epoch:
                        raise LeaseLost(f"feed {self.feed}: this runner's lease (term {epoch}) was taken over by "
                                        f"term {held[0]}; batch {batch_id} was not recorded",
                                        "another runner took the feed over; this one stops", component="sink")
                conn.execute("INSERT INTO changefeed.delivered (feed, end_lsn, batch_id, entry, epoch) "
                             "VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                             (self.feed, progress.end_lsn, batch_id, entry, epoch))
                if not missing(conn, "changefeed.request_cuts"):  # the batches before it are never sent again
                    conn.execute("DELETE FROM changefeed.request_cuts WHERE feed = %s AND first_lsn < %s",
                                 (self.feed, progress.end_lsn))

    def _entries(self) -> list[_Entry]:
        """The recorded batches, read again only when a batch was added (a report asks several times)."""
        try:
            with connect(self.uri, "source", connect_timeout=3) as conn, lost_connection("source"):
                if missing(conn, "changefeed.delivered"):
                    return []
                count = int(one_row(conn.execute("SELECT count(*) FROM changefeed.delivered WHERE feed = %s",
                                                 (self.feed,)))[0])
                if self._cache is None or self._cache[0] != count:
                    lines = [r[0] for r in conn.execute(
                        "SELECT entry FROM changefeed.delivered WHERE feed = %s ORDER BY end_lsn", (self.feed,))]
                    self._cache = count, self._parse(lines)
        except psycopg.Error:
            return self._cache[1] if self._cache else []
        return self._cache[1]

    def forget(self) -> bool:
        with connect(self.uri, "source") as conn, lost_connection("source"):
            if missing(conn, "changefeed.delivered"):
                return False
            gone = conn.execute("DELETE FROM changefeed.delivered WHERE feed = %s", (self.feed,)).rowcount
            if not missing(conn, "changefeed.request_cuts"):
                conn.execute("DELETE FROM changefeed.request_cuts WHERE feed = %s", (self.feed,))
        if self.legacy:
            Path(self.legacy).unlink(missing_ok=True)
        self._cache = None
        return gone > 0

    def resume_offset(self) -> dict[str, Any] | None:
        """The last recorded batch's end offset: recorded only after every message of the batch was
        acknowledged, and before the slot moved past it, so resuming there loses nothing (the batch
        after it is sent again, with the same requests: sinks.webhook.cuts)."""
        entries = self._entries()
        return entries[-1].progress.offset if entries else None

    def batch_ends(self, after: Offset) -> list[Offset]:
        return ends_after(self._entries(), after)

    def fence(self, epoch: int, holder: str) -> bool:
        """The lease itself is the fence: requests and records check it (sinks.webhook.cuts, record)."""
        return True

