"""Runs of new rows COPYed straight into their target table, past the staging table and the merge.

A long run of consecutive inserts, or of snapshot reads (`r`: a key's whole row, which for a key
the replica lacks is an insert), costs the target about a third of an upsert when COPYed straight
in. Whether every key is new is what the COPY finds out: a key there already (the replica held
rows of its own, a change got there first) fails it, the run's savepoint is rolled back and its
rows are merged instead, as are the table's later runs in this batch.

A run stays open across the chunks the sink hands over, until another table's rows, a control
row, a merge or the commit comes, or it holds RUN_MAX_BYTES: a snapshot chunk that arrives in
pieces streams into one COPY (one savepoint) while its next piece is being read.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.compute as pc

from changefeed import faults

# An insert run at least this long is COPYed straight into the target (shorter ones are merged
# with their neighbours: a statement per run would cost more than it saves).
INSERT_RUN_ROWS = 500
# Ops that may make a run: an insert, and a snapshot read.
INSERT_OPS = ("c", "r")
# Each run is a savepoint (a subtransaction, so that a conflicting row can fall back to the
# merge). PostgreSQL caches 64 subtransactions per transaction; past that, every reader of the
# replica pays for looking them up while the batch is open. So a batch makes at most this many.
INSERT_RUNS_PER_BATCH = 48
# A run's rows are kept until its COPY ends (they are merged if it fails): this bounds them.
RUN_MAX_BYTES = 64 << 20

_INSERT_OPS = pa.array(INSERT_OPS)
_NL, _EMPTY = (pa.scalar(b, pa.large_binary()) for b in (b"\n", b""))


def insert_runs(ops: Any, min_rows: int) -> list[tuple[int, int, bool]]:
    """Cut a table's change rows, in order, into [lo, hi) runs that cover them: runs of at least
    `min_rows` consecutive inserts or snapshot reads (True, see INSERT_OPS) and the rows between
    them (False).

    Applied one after the other, in order, the runs do what the rows do, whatever their keys. An
    insert run needs no last-change-per-key step: a COPY that succeeds found every key new and
    each once (a key twice, or one already on the replica, fails the COPY, and the run is merged),
    and for a new key an insert and an upsert are the same.
    """
    is_insert = pc.is_in(ops, value_set=_INSERT_OPS).to_numpy(zero_copy_only=False)
    n = len(is_insert)
    edges = np.flatnonzero(is_insert[1:] != is_insert[:-1]) + 1
    starts = np.concatenate(([0], edges)).astype(np.int64)
    ends = np.concatenate((edges, [n])).astype(np.int64)
    long = np.flatnonzero(is_insert[starts] & (ends - starts >= min_rows)) if n else np.empty(0, np.intp)
    runs: list[tuple[int, int, bool]] = []
    at = 0
    for i in long:
        lo, hi = int(starts[i]), int(ends[i])
        if lo > at:
            runs.append((at, lo, False))
        runs.append((lo, hi, True))
        at = hi
    if at < n:
        runs.append((at, n, False))
    return runs


def terminated(col: Any) -> Any:
    """Each value of a column of COPY lines as large_binary with a newline after it: complete lines."""
    return pc.binary_join_element_wise(col.cast(pa.large_binary()), _EMPTY, _NL)


def write_lines(copy: Any, lines: Any) -> None:
    """Write a large_binary array of complete lines to an open COPY, from its data buffer as it is."""
    offsets = lines.buffers()[1]
    first, last = (int.from_bytes(offsets[i * 8:i * 8 + 8], "little")
                   for i in (lines.offset, lines.offset + len(lines)))
    copy.write(memoryview(lines.buffers()[2])[first:last])


class DirectCopy:
    """A batch's insert runs on its connection: at most one open at a time.

    `add(key, copy_sql, rows)` COPYs rows into the run of `key` (a table shape), opening one if
    none is open for it; False means the caller merges them instead. `close()` ends the open run:
    None when its COPY succeeded, else (key, its rows) for the caller to merge. `abandon()` drops it
    (the batch rolls back)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.left = INSERT_RUNS_PER_BATCH
        self.refused: set[Any] = set()  # keys whose run met a row already there: merged from then on
        self.rows = 0  # rows COPYed straight in and kept
        self._key: Any = None
        self._cm: Any = None
        self._copy: Any = None
        self._kept: list[Any] = []
        self._bytes = 0

    def continues(self, key: Any) -> bool:
        """Whether rows of `key` would go into the run open now (anything else closes it first)."""
        return self._cm is not None and self._key == key and self._bytes < RUN_MAX_BYTES

    def add(self, key: Any, copy_sql: Any, rows: Any) -> bool:
        if not self.continues(key):
            assert self._cm is None, "close the open run first"
            if self.left <= 0 or key in self.refused:
                return False
            self.left -= 1
            self.conn.execute("SAVEPOINT changefeed_insert_run")
            self._key, self._cm = key, self.conn.cursor().copy(copy_sql)
            self._copy = self._cm.__enter__()
        write_lines(self._copy, terminated(rows.column("after")))
        self._kept.append(rows)
        self._bytes += rows.nbytes
        return True

    def close(self) -> tuple[Any, list[Any]] | None:
        if self._cm is None:
            return None
        cm, key, kept = self._cm, self._key, self._kept
        self._cm = self._copy = self._key = None
        self._kept, self._bytes = [], 0
        try:
            cm.__exit__(None, None, None)
        except psycopg.errors.UniqueViolation:
            self.conn.execute("ROLLBACK TO SAVEPOINT changefeed_insert_run")
            self.refused.add(key)
            return key, kept
        faults.reach("insert_run")
        self.conn.execute("RELEASE SAVEPOINT changefeed_insert_run")
        self.rows += sum(rb.num_rows for rb in kept)
        return None

    def abandon(self) -> None:
        if self._cm is not None:
            cm, self._cm, self._copy, self._key, self._kept = self._cm, None, None, None, []
            try:
                cm.__exit__(RuntimeError, RuntimeError("the batch rolls back"), None)  # CopyFail
            except (psycopg.Error, RuntimeError):
                pass
