"""Which window changes a snapshot read already holds, so that no appending sink gets them twice.

A chunk read in the MVCC snapshot S holds each key's state after exactly the transactions S saw.
A change the WAL brings later for a key of that range was either seen by S (its image is in the
chunk already: sent again, a change log would show it twice) or not (it follows the chunk row).
"Saw" is S's own verdict on the change's transaction id (core.visibility), not LSN order. Per
key, the changes S saw come first: a transaction that writes a key another one wrote waits for
it to end, so it cannot be seen while the other is not.

Only first reads are judged (core.snapshot.Cursor.first_reads: the tables of the feed's first run,
and a table brought into the feed whose request was taken in before any change of it was sent: the
sinks held nothing of the table before). There every change S saw is left out, deletes included:
the sink has no row to delete, the read none to give, and a key a seen transaction deleted and
inserted again is in the read. A read of a table the sinks hold already (a request, a new row
filter, an attached partition, a sink added) is not: S may lack a key the sink holds, and only its
seen delete removes it; its seen changes are sent again after it, full row images that lead to the
same state (repeats, never a loss).

A batch's windows are judged against:
* `reads`: the chunks read so far whose snapshots may still have seen changes the stream has
  yet to bring (a read is carried in the offsets until the stream passes `hw`, a WAL position
  by which every commit S saw was written). A change to a key of a read's range whose
  transaction S saw is dropped.
* `covered`: the key ranges still to be read (the rest of the table being read, up to where its
  read ends, and every table waiting for its read): a snapshot taken later reads them, after
  this window's end, and sees every change in it. Such changes are dropped too.
An update that moved a row to another key is judged by halves: the old key's (a delete) and the
new key's (an insert); a change with one half left out becomes the other half.

Pure: the key comparison (PostgreSQL's order of the key's types) is the caller's
(postgres.key_ranges); here ranges are merged, carried and matched against transaction ids.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from changefeed.core.snapshot import Chunk, Cursor, Key, node_of
from changefeed.core.visibility import Snap

DROPPABLE = frozenset("cud")


@dataclass(frozen=True)
class Read:
    """A snapshot read of the key range (lo, hi] of a snapshot entry (a table, or NODE:table),
    in the snapshot `snap` (pg_current_snapshot() text), every commit it saw written before `hw`."""

    entry: str
    lo: Key | None
    hi: Key | None
    snap: str
    hw: int

    def to_json(self) -> list[Any]:
        return [self.entry, self.lo, self.hi, self.snap, self.hw]

    @classmethod
    def from_json(cls, v: Sequence[Any]) -> Read:
        return cls(str(v[0]), v[1], v[2], str(v[3]), int(v[4]))


def reads_of(chunks: Iterable[Chunk], snaps: Mapping[str, tuple[str, int]], default_node: str,
             keyless: Iterable[str] = ()) -> list[Read]:
    """The reads of a batch's chunks, each in its node's exported snapshot (`snaps`: node ->
    (snapshot text, hw)), neighbouring chunks of a table merged. Chunks read for some sinks
    alone, of a table the sinks may hold already (not `first`), of an entry in `keyless` (read in
    their own snapshot, turned back to the window end: postgres.keyless_cut) or of a node without
    an export are not judged."""
    out: list[Read] = []
    skip = set(keyless)
    for c in sorted(chunks, key=lambda c: c.no):
        node = node_of(c.table, default_node)[0]
        if c.only or not c.first or c.table in skip or node not in snaps:
            continue
        snap, hw = snaps[node]
        last = out[-1] if out else None
        if last is not None and last.entry == c.table and last.snap == snap and last.hi == c.lo and c.lo is not None:
            out[-1] = Read(c.table, last.lo, c.hi, snap, max(hw, last.hw))
        else:
            out.append(Read(c.table, c.lo, c.hi, snap, hw))
    return out


def carried(reads: Iterable[Read], starts: Mapping[str, int], default_node: str) -> list[Read]:
    """The reads a batch starting at `starts` (node -> LSN) still judges: those whose `hw` the
    stream has not passed on their node (a node no longer in the feed drops its reads)."""
    return [r for r in reads if starts.get(node_of(r.entry, default_node)[0], 1 << 64) < r.hw]


@dataclass(frozen=True)
class Judge:
    """What one node's window is judged against: per table (schema.table), the reads of its
    ranges and the ranges still to be read (lo, hi; None is open)."""

    reads: Mapping[str, tuple[tuple[Key | None, Key | None, Snap], ...]]
    covered: Mapping[str, tuple[tuple[Key | None, Key | None], ...]]

    @classmethod
    def of(cls, node: str, reads: Iterable[Read], cursor: Cursor, keyless: Iterable[str] = ()) -> Judge:
        """Node `node`'s judge from a batch's reads and the snapshot cursor after it."""
        by_table: dict[str, list[tuple[Key | None, Key | None, Snap]]] = {}
        for r in reads:
            on, table = node_of(r.entry, node)
            if on == node:
                by_table.setdefault(table, []).append((r.lo, r.hi, Snap.parse(r.snap)))
        covered: dict[str, list[tuple[Key | None, Key | None]]] = {}
        skip = set(keyless)
        for i, (entry, every, first) in enumerate(zip(cursor.pending, cursor.only or ("",) * len(cursor.pending),
                                                      cursor.first_reads())):
            on, table = node_of(entry, node)
            if not first or on != node or every or table in skip:
                continue
            covered.setdefault(table, []).append((cursor.after, cursor.upto) if i == 0 else (None, None))
        return cls({t: tuple(v) for t, v in by_table.items()}, {t: tuple(v) for t, v in covered.items()})

    def __bool__(self) -> bool:
        return bool(self.reads or self.covered)

    def tables(self) -> frozenset[str]:
        return frozenset(self.reads) | frozenset(self.covered)

    def ranges(self, table: str, xid: int, read: bool = True) -> list[tuple[Key | None, Key | None]]:
        """The ranges of `table` in which a change of transaction `xid` is dropped: those still
        to be read, and (`read`) those of reads whose snapshot saw it. Past a TRUNCATE of the
        table, not those of reads: the truncate empties their rows in the sinks, so what a read
        saw after it must come again."""
        return list(self.covered.get(table, ())) + [(lo, hi) for lo, hi, snap in self.reads.get(table, ())
                                                     if read and snap.sees(xid)]


def everything(ranges: Sequence[tuple[Key | None, Key | None]]) -> bool:
    """Whether the ranges hold every key (a table still to be read whole)."""
    return any(lo is None and hi is None for lo, hi in ranges)


class Truncates:
    """Whether a read's table can have been truncated after its batch's window end, seen by the
    read (its storage, postgres.snapshot.storage, is new with each TRUNCATE): then the truncate
    comes in a later window and empties the rows the read gave the sinks, so the changes the read
    saw after it must come again, and the read is not carried into later windows. The planner
    notes each table's storage with the WAL insert position at the time; a read is carried only
    if its storage was noted at or before its window's end (no truncate between)."""

    def __init__(self) -> None:
        self._since: dict[str, tuple[str, int]] = {}  # entry -> (storage, the earliest LSN it was noted at)

    def note(self, entry: str, storage: str, lsn: int) -> None:
        seen = self._since.get(entry)
        if seen is None or seen[0] != storage:
            self._since[entry] = (storage, lsn)

    def steady(self, entry: str, storage: str, end: int) -> bool:
        """Whether `entry`'s table held `storage` already at WAL position `end`."""
        seen = self._since.get(entry)
        return bool(storage) and seen is not None and seen[0] == storage and seen[1] <= end
