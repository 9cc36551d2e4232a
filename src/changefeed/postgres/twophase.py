"""Two-phase commit on the nodes of a feed of several nodes: the checks, the prepare slot, the scan.

A feed reads each node's changes from its slot without two-phase decoding: PostgreSQL sends a
prepared transaction's rows at its COMMIT PREPARED, like any commit, wherever the slot was at its
PREPARE (the server keeps the WAL from the transaction's start while it is prepared). But that
commit carries no gid, so nothing would tell which commits are parts of one distributed
transaction. Each node therefore has a second slot, its *prepare slot*, with two-phase decoding
(PostgreSQL 15+): it shows every PREPARE, COMMIT PREPARED and ROLLBACK PREPARED with its gid. The
feed creates it before the node's slot, so that it has seen everything the slot delivers, and
moves it with the slot; nothing reads its row data.

The planner's `scan` decodes a range inside the server and returns one row per commit and per
two-phase record, never row data: the commits' positions and times are what core.distributed cuts
the batch by, the two-phase records what it keeps distributed transactions whole by.
"""
from __future__ import annotations

from typing import Any

import psycopg

from changefeed.core import distributed as dist
from changefeed.core.lsn import format_lsn
from changefeed.errors import SourceNotReady
from changefeed.postgres.decode import pgoutput as po
from changefeed.postgres.slots import slot_errors

MIN_VERSION = 150000
_B, _C, _b, _P, _K, _r = b"BCbPKr"


def check(conn: psycopg.Connection[Any]) -> None:
    """Slots can be created here now: PostgreSQL 15+ (two-phase decoding), and no transaction is
    left prepared (creating a logical slot waits until every running transaction has ended, and a
    prepared one ends only when somebody commits or rolls it back)."""
    version = conn.info.server_version
    if version < MIN_VERSION:
        raise SourceNotReady(f"PostgreSQL {version // 10000} cannot decode prepared transactions with their gid "
                             "(a feed of several nodes needs 15 or newer on every node)",
                             "upgrade the server, or leave it out of the feed")
    pending = waiting(conn)
    if pending:
        names = ", ".join(f"{gid!r} (for {age:.0f}s)" for gid, age in pending[:5])
        raise SourceNotReady(f"{len(pending)} prepared transaction(s) wait for COMMIT/ROLLBACK PREPARED: {names}; "
                             "a replication slot cannot be created before they end",
                             "finish them (COMMIT PREPARED or ROLLBACK PREPARED 'gid'), then run again")


def waiting(conn: psycopg.Connection[Any]) -> list[tuple[str, float]]:
    """The node's prepared transactions not decided yet: (gid, seconds since PREPARE), oldest first."""
    return [(gid, float(age)) for gid, age in conn.execute(
        "SELECT gid, extract(epoch FROM now() - prepared) FROM pg_prepared_xacts "
        "WHERE database = current_database() ORDER BY prepared").fetchall()]


def still_prepared(conn: psycopg.Connection[Any], gids: list[str]) -> set[str]:
    """Which of `gids` are still prepared on the node's server (a cheap check while a plan waits)."""
    return {gid for (gid,) in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE gid = ANY(%s)",
                                           (gids,)).fetchall()}


def scan(conn: psycopg.Connection[Any], slot: str, publication: str, start: int,
         upto: int) -> tuple[dist.Event, ...]:
    """The commits and two-phase records of the prepare slot `slot` that start in [start, upto)
    (`upto` a record boundary or any position: a record that straddles it counts, as a peek up to
    it decodes it), in WAL order, each with the number of captured messages it carries."""
    with slot_errors(slot):
        rows = conn.execute(
            "SELECT o, get_byte(data, 0), CASE WHEN get_byte(data, 0) IN (66, 98, 75, 114) THEN data END "
            "FROM pg_logical_slot_peek_binary_changes(%s, %s::pg_lsn, NULL, 'proto_version', '1', "
            "'publication_names', %s) WITH ORDINALITY AS m(lsn, xid, data, o) "
            "WHERE get_byte(data, 0) IN (66, 67, 98, 80, 75, 114)",  # B C b P K r
            (slot, format_lsn(upto), publication)).fetchall()
    out: list[dist.Event] = []
    opened: tuple[int, po.PgOutputMessage] | None = None  # a B or b message and its ordinal, until its C or P
    for ordinal, kind, data in rows:
        if kind in (_B, _b):
            opened = (ordinal, po.decode(bytes(data)))
        elif kind in (_C, _P) and opened is not None:
            first, msg = opened
            opened = None
            changes = ordinal - first - 1
            if isinstance(msg, po.Begin):
                out.append(dist.Event(dist.COMMIT, msg.final_lsn, msg.commit_time_us, xid=msg.xid, changes=changes))
            elif isinstance(msg, po.BeginPrepare):
                out.append(dist.Event(dist.PREPARE, msg.prepare_lsn, msg.prepare_time_us, msg.gid, msg.xid, changes))
        elif kind == _K:
            msg = po.decode(bytes(data))
            assert isinstance(msg, po.CommitPrepared)
            if out and out[-1].kind == dist.PREPARE and out[-1].gid == msg.gid and out[-1].start < start:
                # PREPAREd before the slot's two-phase point: PostgreSQL sends it again right here
                out[-1] = dist.Event(dist.PREPARE, msg.commit_lsn - 1, out[-1].time_us, msg.gid, msg.xid,
                                     out[-1].changes)
            out.append(dist.Event(dist.COMMIT_PREPARED, msg.commit_lsn, msg.commit_time_us, msg.gid, msg.xid))
        elif kind == _r:
            msg = po.decode(bytes(data))
            assert isinstance(msg, po.RollbackPrepared)
            out.append(dist.Event(dist.ROLLBACK_PREPARED, msg.end_lsn - 1, msg.rollback_time_us, msg.gid, msg.xid))
    return tuple(e for e in out if e.start >= start)
