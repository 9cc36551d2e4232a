"""A feed's replication slots: the one place that creates, reads, moves, copies and drops them.

A node's data slot (`changefeed_FEED[_NODE]`) is where the node's WAL is safe to give up: it moves
only forward, only to a position the sink committed (`release`, `advance`). A feed of several nodes
has a prepare slot beside it on each node (see postgres/twophase.py), moved with it.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg

from changefeed.core.lsn import Lsn, format_lsn, parse_lsn
from changefeed.errors import SlotLost, TransientError, start_over_hint
from changefeed.postgres.connect import one_row
from changefeed.spec.definition import SourceNode


@dataclass(frozen=True)
class SlotState:
    name: str
    plugin: str
    confirmed_flush: Lsn | None
    restart_lsn: Lsn | None
    active_pid: int | None
    wal_status: str | None
    invalidation: str | None
    two_phase: bool = False  # decodes prepared transactions at their PREPARE (see postgres/twophase.py)


def slot_state(conn: psycopg.Connection[Any], slot: str) -> SlotState | None:
    row = conn.execute(
        "SELECT slot_name, plugin, confirmed_flush_lsn::text, restart_lsn::text, active_pid, wal_status, "
        "to_jsonb(s) ->> 'invalidation_reason', coalesce((to_jsonb(s) ->> 'two_phase')::bool, false) "
        "FROM pg_replication_slots s WHERE slot_name = %s",
        (slot,)).fetchone()
    if row is None:
        return None

    def lsn(v: str | None) -> Lsn | None:
        return None if v is None else parse_lsn(v)

    return SlotState(row[0], row[1], lsn(row[2]), lsn(row[3]), row[4], row[5], row[6], row[7])


def create_slot(conn: psycopg.Connection[Any], slot: str, two_phase: bool = False, failover: bool = False) -> Lsn:
    """Create the pgoutput slot; returns the LSN from which it will deliver commits. `failover`
    (PostgreSQL 17+; ignored before): a slot standbys with `sync_replication_slots` keep a copy
    of, so that it survives the standby's promotion."""
    args = ", false, true" if two_phase else ""  # (temporary, two_phase): PostgreSQL 14+
    if failover and conn.info.server_version >= 170000:
        args = f", false, {str(two_phase).lower()}, true"  # (temporary, two_phase, failover)
    row = one_row(conn.execute(f"SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput'{args})",
                               (slot,)))
    return parse_lsn(row[0])


def check_slot_usable(state: SlotState | None, slot: str, checkpoint_lsn: int | None, feed: str) -> None:
    """Fail loudly when a slot the checkpoint depends on is gone or can no longer deliver."""
    if state is None:
        at = f" at {format_lsn(checkpoint_lsn)}" if checkpoint_lsn else ""
        raise SlotLost(f"replication slot {slot} is missing but feed {feed} has a checkpoint{at}; "
                       "changes after it may have been lost", start_over_hint(feed))
    if state.wal_status == "lost" or state.invalidation:
        needed = state.restart_lsn or checkpoint_lsn  # PostgreSQL clears restart_lsn when it invalidates
        after = f" after its checkpoint at {format_lsn(needed)}" if needed else ""
        raise SlotLost(
            f"replication slot {slot} was invalidated by PostgreSQL ({state.invalidation or 'WAL removed'}, "
            f"see max_slot_wal_keep_size): WAL feed {feed} needs{after} is gone", start_over_hint(feed))
    if state.plugin != "pgoutput":
        raise SlotLost(f"replication slot {slot} exists but uses plugin {state.plugin}, not pgoutput",
                       "drop that slot or choose another feed --name")


@contextmanager
def slot_errors(slot: str) -> Iterator[None]:
    """Decoding from `slot`: a slot in use is transient, a slot gone or invalidated is SlotLost."""
    try:
        yield
    except psycopg.errors.ObjectInUse as e:
        raise TransientError(f"replication slot {slot} is in use: {e}", "wait for the other reader to finish") from None
    except psycopg.errors.UndefinedObject as e:
        raise SlotLost(f"replication slot {slot} disappeared: {e}", _LOST_HINT) from None
    except psycopg.errors.ObjectNotInPrerequisiteState as e:
        raise SlotLost(f"replication slot {slot} can no longer deliver changes: {e}", _LOST_HINT) from None


_LOST_HINT = "changefeed status --name FEED shows why; the feed has to start over from a fresh snapshot"


def advance(conn: psycopg.Connection[Any], slot: str, lsn: Lsn) -> None:
    """Move the slot forward to `lsn` (the feed's WAL safe point: everything before it is committed
    downstream); a slot at or past it stays."""
    state = slot_state(conn, slot)
    if state is not None and state.confirmed_flush is not None and lsn > state.confirmed_flush:
        conn.execute("SELECT pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, format_lsn(lsn)))


class RestartMark:
    """Where a slot's reader may start again: a logical slot restarts decoding at its `restart_lsn`,
    which moves only to a running-transactions record its reader decoded and confirmed past, and the
    server writes one only every 15 s or so. Every peek, advance and stream start then decodes those
    seconds of WAL again before its window (bench/README.md, "restart marks"). `maybe` writes such a
    record (`pg_log_standby_snapshot`, PostgreSQL 16+) at most every `every` seconds, so that the
    restart position trails the confirmed one by about that much; where the role may not (it needs
    superuser or EXECUTE on that function), or on a standby, it stops trying: only slower."""

    def __init__(self, every: float = 1.0) -> None:
        self.every, self._at, self.refused = every, float("-inf"), False

    def maybe(self, conn: psycopg.Connection[Any]) -> None:
        if self.refused or time.monotonic() - self._at < self.every:
            return
        self._at = time.monotonic()
        try:
            conn.execute("SELECT pg_log_standby_snapshot()")
        except (psycopg.errors.InsufficientPrivilege, psycopg.errors.UndefinedFunction,
                psycopg.errors.ObjectNotInPrerequisiteState):
            self.refused = True


def release(conn: psycopg.Connection[Any], node: SourceNode, lsn: Lsn, multi_node: bool) -> None:
    """Give up `node`'s WAL before `lsn`, which the sink committed: its data slot, and on a feed
    of several nodes its prepare slot too."""
    advance(conn, node.slot, lsn)
    if multi_node:
        advance(conn, node.prepare_slot, lsn)


def copy_temporary(conn: psycopg.Connection[Any], slot: str, copy: str) -> None:
    """A temporary copy of `slot` (gone with the session): read ahead without moving `slot`."""
    conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s, true)", (slot, copy))


def copy(conn: psycopg.Connection[Any], slot: str, copy: str) -> None:
    """A lasting copy of `slot`, at its position: it keeps the WAL from there while `slot` moves on."""
    conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s, false)", (slot, copy))


def drop(conn: psycopg.Connection[Any], slot: str) -> None:
    conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
