"""A source snapshot taken at a known WAL position: what `verify` compares the sink against.

A temporary logical slot created on a replication connection with `SNAPSHOT 'export'` returns
its consistent point X and exports a snapshot that sees exactly the transactions whose commit
record starts before X. A feed window [start, X) holds exactly those too (postgres/decode/builder.py),
so a sink whose checkpoint is X holds the state that snapshot sees: the two can be compared row
for row while both sides move on. The snapshot lives as long as the replication connection
stays open and idle; other sessions adopt it with SET TRANSACTION SNAPSHOT. Closing the
connection drops the slot (it is temporary), also when the process dies.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg

from changefeed.core.lsn import parse_lsn
from changefeed.errors import ConnectionFailed, SourceNotReady
from changefeed.postgres.connect import KEEPALIVES, redact
from changefeed.spec.secrets import resolve


@dataclass
class ConsistentPoint:
    lsn: int
    snapshot: str  # the exported snapshot's name
    conn: psycopg.Connection[Any]  # holds the snapshot (and the temporary slot) while open

    def close(self) -> None:
        self.conn.close()


def take(uri: str, role: str = "source", wait_prepared_s: float = 30.0) -> ConsistentPoint:
    """Create a temporary slot and its exported snapshot on the server at `uri`.

    Creating a logical slot waits for the transactions running at that moment to end: a long one
    delays it (as it delays any new slot). A prepared transaction runs until somebody decides it,
    so while one is pending on the server this waits up to `wait_prepared_s` for it to end, then
    refuses (SourceNotReady naming it) rather than wait without end."""
    try:
        conn = psycopg.connect(resolve(uri, f"the {role} URI", in_uri=True), autocommit=True,
                               replication="database", connect_timeout=10,
                               application_name="changefeed verify", **KEEPALIVES)
    except psycopg.OperationalError as e:
        text = str(e).strip()
        if "replication" in text:
            raise SourceNotReady(f"{role} {redact(uri)} refused a replication connection: {text}",
                                 "allow the user replication connections in pg_hba.conf (a line for database "
                                 "'replication') and give it the REPLICATION attribute", component=role) from None
        raise ConnectionFailed(f"cannot reach {role} {redact(uri)}: {text}", "check that the server is running",
                               component=role) from None
    _without_prepared(conn, uri, role, wait_prepared_s)
    name = f"changefeed_verify_{uuid.uuid4().hex[:12]}"
    res = conn.pgconn.exec_(f'CREATE_REPLICATION_SLOT "{name}" TEMPORARY LOGICAL pgoutput '
                            "(SNAPSHOT 'export')".encode())
    if res.status != psycopg.pq.ExecStatus.TUPLES_OK:
        message = res.error_message.decode(errors="replace").strip()
        conn.close()
        raise SourceNotReady(f"{role} {redact(uri)} cannot export a snapshot at a WAL position: {message}",
                             "free a replication slot and a WAL sender (max_replication_slots, max_wal_senders) "
                             "for the verification", component=role)
    lsn, snapshot = res.get_value(0, 1), res.get_value(0, 2)
    assert lsn is not None and snapshot is not None
    return ConsistentPoint(parse_lsn(lsn.decode()), snapshot.decode(), conn)


def _without_prepared(conn: psycopg.Connection[Any], uri: str, role: str, wait_s: float) -> None:
    """Wait (up to `wait_s`) until no transaction is left prepared on the server."""
    deadline = time.monotonic() + wait_s
    query = b"SELECT gid, database, extract(epoch FROM now() - prepared)::int FROM pg_prepared_xacts ORDER BY prepared"
    while True:
        res = conn.pgconn.exec_(query)  # (a replication connection takes the simple query protocol only)
        pending = [tuple((res.get_value(i, j) or b"").decode() for j in range(3)) for i in range(res.ntuples)]
        if not pending:
            return
        if time.monotonic() >= deadline:
            conn.close()
            names = ", ".join(f"{gid!r} (database {db}, for {age}s)" for gid, db, age in pending[:5])
            raise SourceNotReady(f"{role} {redact(uri)}: {len(pending)} prepared transaction(s) pending: {names}; a "
                                 "consistent point waits for every running transaction to end",
                                 "commit or roll them back (COMMIT PREPARED / ROLLBACK PREPARED 'gid'), then verify "
                                 "again", component=role)
        time.sleep(0.2)
