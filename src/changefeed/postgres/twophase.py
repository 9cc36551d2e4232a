"""Two-phase decoding on a source node: the slot, the checks, and the scan for the planner.

A feed of several nodes creates its slots with `two_phase` (PostgreSQL 15+), so a prepared
transaction's part shows its global id (gid) at its PREPARE and at its COMMIT or ROLLBACK
PREPARED: that is what lets core.distributed deliver the parts of one distributed transaction in
one batch. Without it pgoutput decodes a prepared part only at its COMMIT PREPARED, as a plain
transaction that carries no gid. The planner reads a node's two-phase events with `events`,
which decodes inside the server and returns only those messages, never row data.

A node whose `max_prepared_transactions` is 0 cannot prepare anything: it is not scanned.
"""
from __future__ import annotations

from typing import Any

import psycopg

from ..core import distributed as dist
from ..core.lsn import format_lsn
from ..errors import SourceNotReady
from . import pgoutput as po
from .source import slot_errors

MIN_VERSION = 150000


def check(conn: psycopg.Connection[Any]) -> None:
    """A two-phase slot can be created here now: PostgreSQL 15+, and no transaction is left
    prepared (creating a logical slot waits until every running transaction has ended, and a
    prepared one ends only when somebody commits or rolls it back)."""
    version = conn.info.server_version
    if version < MIN_VERSION:
        raise SourceNotReady(f"PostgreSQL {version // 10000} cannot decode prepared transactions with their gid "
                             "(two-phase slots need 15 or newer)", "upgrade the server, or leave it out of the feed")
    pending = conn.execute("SELECT gid, prepared::text FROM pg_prepared_xacts WHERE database = current_database() "
                           "ORDER BY prepared").fetchall()
    if pending:
        names = ", ".join(f"{gid!r} (since {at})" for gid, at in pending[:5])
        raise SourceNotReady(f"{len(pending)} prepared transaction(s) wait for COMMIT/ROLLBACK PREPARED: {names}; "
                             "a replication slot cannot be created before they end",
                             "finish them (COMMIT PREPARED or ROLLBACK PREPARED 'gid'), then run again")


def capable(conn: psycopg.Connection[Any]) -> bool:
    """Whether the server can prepare transactions at all (max_prepared_transactions > 0)."""
    return int(conn.execute("SHOW max_prepared_transactions").fetchone()[0]) > 0  # type: ignore[index]


def waiting(conn: psycopg.Connection[Any]) -> list[tuple[str, float]]:
    """The node's prepared transactions not decided yet: (gid, seconds since PREPARE), oldest first."""
    return [(gid, float(age)) for gid, age in conn.execute(
        "SELECT gid, extract(epoch FROM now() - prepared) FROM pg_prepared_xacts "
        "WHERE database = current_database() ORDER BY prepared").fetchall()]


def events(conn: psycopg.Connection[Any], slot: str, publication: str, upto: int) -> tuple[dist.Event, ...]:
    """The two-phase events from the slot's position up to `upto` (a record boundary), in WAL order."""
    with slot_errors(slot):
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, %s::pg_lsn, NULL, 'proto_version', '1', "
            "'publication_names', %s) WHERE get_byte(data, 0) IN (98, 75, 114)",  # b, K, r
            (slot, format_lsn(upto), publication)).fetchall()
    out = []
    for (data,) in rows:
        msg = po.decode(bytes(data))
        if isinstance(msg, po.BeginPrepare):
            out.append(dist.Event(dist.PREPARE, msg.gid, msg.prepare_lsn, msg.end_lsn, msg.prepare_time_us))
        elif isinstance(msg, po.CommitPrepared):
            out.append(dist.Event(dist.COMMIT, msg.gid, msg.commit_lsn, msg.end_lsn, msg.commit_time_us))
        elif isinstance(msg, po.RollbackPrepared):
            out.append(dist.Event(dist.ROLLBACK, msg.gid, msg.end_lsn - 1, msg.end_lsn, msg.rollback_time_us))
    return tuple(out)
