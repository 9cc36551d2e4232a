"""The next batch's snapshot chunk boundaries, found while this batch is applied.

Planning a snapshot batch finds where each of its chunks ends with an index scan over the chunk's
keys (postgres.snapshot.chunk_boundary): on the driver, between two batches, while no task runs.
Any key inside the table's range ends a chunk correctly (a chunk reads what its key range holds
when it is read, and the stream brings what changes later), so the keys the next batch's plan
will ask for can be found while this batch is applied: a thread plans the next batch from the
cursor after this one, on connections of its own, and keeps the keys it found. The planner takes
a key from here only for exactly the question it asks (table, lower key, rows, upper key; the
row filter is the query's own); for anything else it scans itself, and keeps its own answers here too, so that a batch
planned again from the same cursor (one not started: --max-rate held it back) scans nothing
again. The thread never looks up where a table's read ends (that must be seen when its first
chunk is planned) nor anything not known yet: its plan stops there, and the planner does the rest.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from changefeed.core import snapshot
from changefeed.core.snapshot import Key

# (the thread's connection to the entry's node, entry, lower key, rows, upper key) -> the key
# ending a chunk of that many rows, or None (core.snapshot.Boundary, with a connection)
Find = Callable[[Any, str, Key | None, int, Key | None], Key | None]
CLOSE_WAIT_S = 5.0
KEPT = 4096  # answers kept at most (then forgotten all at once: any of them stays a correct boundary)
_Question = tuple[str, tuple[str, ...] | None, int, tuple[str, ...] | None]


class _Unknown(Exception):
    """The thread's plan needs what only the planner may find out: it stops there."""


def _question(entry: str, after: Key | None, rows: int, upto: Key | None) -> _Question:
    return entry, None if after is None else tuple(after), rows, None if upto is None else tuple(upto)


class BoundariesAhead:
    """`find` answers a boundary question on the thread's own connection to the entry's node
    (`node_of(entry)`), from `connect(node)` and kept for the next batches; `close` closes them."""

    def __init__(self, find: Find, connect: Callable[[str], Any], node_of: Callable[[str], str]) -> None:
        self._find, self._connect, self._node_of = find, connect, node_of
        self._found: dict[_Question, Key | None] = {}
        self._conns: dict[str, Any] = {}
        self._thread: threading.Thread | None = None

    def take(self, entry: str, after: Key | None, rows: int, upto: Key | None) -> tuple[bool, Key | None]:
        """(True, the key) if the thread found the answer to this question, else (False, None).
        Waits for a thread still at work: it scans what the planner would scan, and started first."""
        if self._thread is not None:
            self._thread.join()
        q = _question(entry, after, rows, upto)
        return (True, self._found[q]) if q in self._found else (False, None)

    def keep(self, entry: str, after: Key | None, rows: int, upto: Key | None, key: Key | None) -> None:
        """The planner's own answer to a question (asked again if its batch is planned again)."""
        self._found[_question(entry, after, rows, upto)] = key

    def start(self, cursor: snapshot.Cursor, chunks: Callable[[str], int | None], rows: int,
              alone: Callable[[str], bool | None]) -> None:
        """Plan the batch after the one that leaves `cursor` in a thread, keeping its boundaries.
        `chunks` and `alone` answer from what the planner knows already, None where it does not."""
        if self._thread is not None:
            self._thread.join()
        if len(self._found) > KEPT:
            self._found = {}
        if not cursor.pending:
            self.close()  # (the snapshot is done: no connection kept for it)
            return
        if cursor.after is None:
            return  # (the next chunk starts a table: its end is the planner's to find)
        self._thread = threading.Thread(target=self._plan, args=(cursor, chunks, rows, alone), daemon=True,
                                        name="changefeed-boundaries-ahead")
        self._thread.start()

    def _plan(self, cursor: snapshot.Cursor, chunks: Callable[[str], int | None], rows: int,
              alone: Callable[[str], bool | None]) -> None:
        def known(answer: Any) -> Any:
            if answer is None:
                raise _Unknown
            return answer

        def boundary(entry: str, after: Key | None, n: int, upto: Key | None) -> Key | None:
            node = self._node_of(entry)
            conn = self._conns.get(node)
            if conn is None or conn.closed:
                conn = self._conns[node] = self._connect(node)
            key = self._find(conn, entry, after, n, upto)
            self._found[_question(entry, after, n, upto)] = key
            return key

        def last(entry: str) -> Key | None:
            raise _Unknown

        with suppress(Exception):  # (best effort: what it did not find, the planner finds)
            cursor.plan(boundary, lambda e: known(chunks(e)), rows, lambda e: known(alone(e)), last)

    def close(self) -> None:
        """Close the thread's connections once it is done (one still scanning after CLOSE_WAIT_S,
        a daemon thread, keeps its connection until the process ends)."""
        if self._thread is not None:
            self._thread.join(CLOSE_WAIT_S)
            if self._thread.is_alive():
                return
        for conn in self._conns.values():
            with suppress(Exception):
                conn.close()
        self._conns = {}
