"""A snapshot chunk of a table without a key, turned back to its batch's window end.

A chunk of a keyed table may see changes that commit after its batch's window end; they reach the
sinks again later, and applying them again by key ends at the same state (postgres.snapshot). A
table without a key (REPLICA IDENTITY FULL) has nothing that makes that idempotent: a row inserted
after the window end and seen by the snapshot would reach a consumer twice, as `r` and as `c`.

So the chunk's rows are turned back to the window end W. The changes to the table that the
snapshot S saw and that commit at or after W are read from the WAL, from a temporary copy of the
feed's slot (the slot itself stays where it is, and may be read by another task meanwhile), up to
a position past every commit S sees; they are undone on the rows read: a row one of them inserted
is left out, a row one deleted is put back (REPLICA IDENTITY FULL sends the old row whole). What
is left is the table's rows at W as a multiset, duplicates included, whenever the chunk is read
(a replayed batch gets the same rows), and the stream from W on applies to it exactly once.

Which transactions S saw is told by S itself (its xmin, xmax and in-progress list), not by
positions: a commit can be written before a snapshot and become visible only after it.
Rows are compared as the COPY text lines both the read and the decoding make, in one session.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from changefeed.core.copytext import join_line, split_line
from changefeed.core.lsn import format_lsn, parse_lsn
from changefeed.errors import SourceNotReady, TransientError
from changefeed.postgres import slots
from changefeed.postgres.connect import one_row
from changefeed.postgres.decode import pgoutput as po
from changefeed.postgres.source import SourceTable

PEEK_FETCH = 5000  # decoded messages fetched at once
FLUSH_WAIT_S = 30.0  # how long the WAL may take to be flushed up to the snapshot's position
_XID_MASK = 0xFFFFFFFF
_WANTED = frozenset(b"BCRIUDT")  # what says which transaction, table and rows (not Type, Origin, ...)
_ROWS = frozenset(b"IUDT")


@dataclass
class Undo:
    """What turns the rows a snapshot read back to the window end: lines to leave out (each as
    often as counted) and lines to put back."""

    drop: Counter[bytes] = field(default_factory=Counter)
    add: Counter[bytes] = field(default_factory=Counter)

    def keeps(self, line: bytes) -> bool:
        """Whether a line read stays (False: one of its copies is left out, once)."""
        if self.drop[line] > 0:
            self.drop[line] -= 1
            return False
        return True

    def put_back(self) -> list[bytes]:
        return [line for line, n in sorted(self.add.items()) for _ in range(n)]

    def check_done(self, table: str) -> None:
        """Every line to leave out was read: otherwise the undo and the read disagree."""
        left = sum(n for n in self.drop.values() if n > 0)
        if left:
            raise TransientError(f"the snapshot of {table} (a table without a key) lacks {left} row(s) that "
                                 "changes after the batch's window end inserted: it cannot be turned back to the "
                                 "window end", "the feed retries the batch; if this repeats, report it")


@dataclass(frozen=True)
class Seen:
    """Which transactions an MVCC snapshot sees (32-bit xids, as pgoutput gives them)."""

    xmin: int
    xmax: int
    xip: frozenset[int]

    def sees(self, xid: int) -> bool:
        if _precedes(xid, self.xmin):
            return True
        return _precedes(xid, self.xmax) and xid not in self.xip


def ordered(selected: sql.Composable, table: SourceTable, undo_: Undo) -> sql.Composable:
    """The rows `selected` reads with the ones `undo_` puts back, in one order whatever snapshot
    was read (by each row's text): a batch read again after a crash sends the same rows in the
    same order, so that a webhook's requests get the same idempotency keys as before. (The rows
    left out are equal to the ones that stay: which copy goes does not change the order.)"""
    put_back = [sql.SQL("({})").format(sql.SQL(", ").join(
        sql.SQL("{}::{}").format(sql.Literal(None if v is None else v.decode()), sql.SQL(t))
        for v, t in zip(split_line(line), table.types))) for line in undo_.put_back()]
    union = sql.SQL(" UNION ALL VALUES {}").format(sql.SQL(", ").join(put_back)) if put_back else sql.SQL("")
    columns = sql.SQL(", ").join(map(sql.Identifier, table.columns))
    return sql.SQL('SELECT {} FROM ({}{}) AS rows ORDER BY ROW({})::text COLLATE "C"').format(
        columns, selected, union, columns)


def _precedes(a: int, b: int) -> bool:
    """a < b in xid order, across wraparound (as TransactionIdPrecedes)."""
    return ((a - b) & _XID_MASK) >= 0x80000000


def prepare_copy(conn: psycopg.Connection[Any], candidates: Sequence[str], copy: str, window_end: int) -> None:
    """A temporary copy of the first of the feed's slots `candidates` that is at or before
    `window_end` (a slot past it cannot show what follows; the lag slot of a sink the others went
    on without, control.lag_budget, can), made before the snapshot: not in its transaction."""
    for slot in candidates:
        state = slots.slot_state(conn, slot)
        if state is not None and state.confirmed_flush is not None and state.confirmed_flush <= window_end:
            with slots.slot_errors(slot):
                slots.copy_temporary(conn, slot, copy)
            return
    raise TransientError(f"no replication slot of {', '.join(candidates)} is at or before the window end "
                         f"{format_lsn(window_end)} of a snapshot chunk of a table without a key",
                         "the feed retries from its checkpoint")


def seen(conn: psycopg.Connection[Any]) -> Seen:
    """The open REPEATABLE READ transaction's snapshot."""
    xmin, xmax, xip = one_row(conn.execute(
        "SELECT pg_snapshot_xmin(s)::text, pg_snapshot_xmax(s)::text, "
        "ARRAY(SELECT x::text FROM pg_snapshot_xip(s) x) FROM pg_current_snapshot() s"))
    return Seen(int(xmin) & _XID_MASK, int(xmax) & _XID_MASK, frozenset(int(x) & _XID_MASK for x in xip))


def undo(conn: psycopg.Connection[Any], copy: str, publication: str, qualified: str, columns: int,
         window_end: int, upto: int, snapshot: Seen) -> Undo:
    """The undo of the changes to `qualified` that commit at or after `window_end` in transactions
    `snapshot` sees, all of which commit before `upto` (read in the snapshot's transaction).

    The peek decodes only WAL flushed already, so it first waits for the flush to pass `upto`
    (a commit that does not wait for its flush, synchronous_commit off, is visible before it)."""
    _wait_flushed(conn, upto)
    out, relations = Undo(), {}
    txn: list[tuple[int, bytes]] = []  # the open transaction's changes to the table: (+1 | -1 | 0 truncate, row)
    begin: po.Begin | None = None
    with conn.transaction(), conn.cursor(name="changefeed_keyless_cut", binary=True) as cur:  # (a savepoint in
        # the snapshot's transaction)
        cur.itersize = PEEK_FETCH
        cur.execute("SELECT data FROM pg_logical_slot_peek_binary_changes(%s, %s::pg_lsn, NULL, "
                    "'proto_version', '1', 'publication_names', %s)", (copy, format_lsn(upto), publication))
        for (data,) in cur:
            if data[0] not in _WANTED or data[0] in _ROWS and begin is not None and begin.final_lsn < window_end:
                continue  # (a change in the window itself, or a message that names no row: not decoded)
            msg = po.decode(bytes(data))
            if isinstance(msg, po.Begin):
                begin, txn = msg, []
            elif isinstance(msg, po.Relation):
                relations[msg.oid] = f"{msg.schema}.{msg.name}"
            elif isinstance(msg, (po.Insert, po.Update, po.Delete)):
                if relations.get(msg.relation_oid) == qualified:
                    txn.extend(_signed(msg, qualified, columns))
            elif isinstance(msg, po.Truncate):
                if any(relations.get(o) == qualified for o in msg.relation_oids):
                    txn.append((0, b""))  # everything before it is gone from what the snapshot read
            elif isinstance(msg, po.Commit) and begin is not None:
                if begin.final_lsn >= window_end and snapshot.sees(begin.xid):
                    _count(out, txn)
                begin, txn = None, []
    return out


def _signed(msg: po.Insert | po.Update | po.Delete, qualified: str, columns: int) -> list[tuple[int, bytes]]:
    """A change as rows it added (+1) and removed (-1)."""
    if isinstance(msg, po.Insert):
        return [(1, _line(msg.new, None, qualified, columns))]
    if msg.old is None or msg.old_is_key:
        raise SourceNotReady(f"table {qualified} has no key and its old rows do not come whole: its REPLICA "
                             "IDENTITY is no longer FULL", f"ALTER TABLE {qualified} REPLICA IDENTITY FULL")
    old = _line(msg.old, None, qualified, columns)
    if isinstance(msg, po.Delete):
        return [(-1, old)]
    return [(-1, old), (1, _line(msg.new, msg.old, qualified, columns))]


def _line(values: list[po.Value], old: list[po.Value] | None, qualified: str, columns: int) -> bytes:
    """A tuple as the COPY line the snapshot reads (an unchanged TOAST value taken from the old row)."""
    if len(values) != columns:
        raise SourceNotReady(f"the columns of {qualified} (a table without a key) changed while its snapshot was "
                             "read: its rows cannot be turned back to the batch's window end",
                             "run the feed again once the change is done; if this repeats, remove the feed and create "
                             "it again (the table's rows are read anew)")
    filled: list[bytes | None] = []
    for i, v in enumerate(values):
        v = old[i] if v is po.UNCHANGED and old is not None else v
        if not (v is None or isinstance(v, bytes)):
            raise SourceNotReady(f"a change to {qualified} left a TOASTed value out of both its rows",
                                 f"ALTER TABLE {qualified} REPLICA IDENTITY FULL")
        filled.append(v)
    return join_line(filled)


def _count(out: Undo, txn: list[tuple[int, bytes]]) -> None:
    """Undo a transaction the snapshot saw: what it added is left out, what it removed put back
    (a truncate: the rows before it are no longer in the read, so nothing before it is undone)."""
    last_truncate = max((i for i, (sign, _) in enumerate(txn) if sign == 0), default=-1)
    if last_truncate >= 0:
        out.drop.clear()
        out.add.clear()
    for sign, line in txn[last_truncate + 1:]:
        if sign > 0:
            if out.add[line] > 0:
                out.add[line] -= 1
            else:
                out.drop[line] += 1
        elif out.drop[line] > 0:
            out.drop[line] -= 1
        else:
            out.add[line] += 1


def _wait_flushed(conn: psycopg.Connection[Any], upto: int) -> None:
    deadline = time.monotonic() + FLUSH_WAIT_S
    while parse_lsn(one_row(conn.execute("SELECT pg_current_wal_flush_lsn()::text"))[0]) < upto:
        if time.monotonic() > deadline:
            raise TransientError(f"the source has not flushed its WAL up to {format_lsn(upto)} in {FLUSH_WAIT_S:.0f} s",
                                 "the feed retries from its checkpoint")
        time.sleep(0.01)

