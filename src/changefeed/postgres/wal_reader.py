"""How a feed reads its slots' WAL: one protocol, two ways of receiving a window.

The change builder (postgres/decode/builder.py) consumes a window `[start, end)` as blocks of pgoutput
messages; the planner cuts windows (a byte or change limit) and closes idle ones with heartbeats.
`PeekReader` (`--wal-reader peek`, the default) asks the SQL function
`pg_logical_slot_peek_binary_changes`, which decodes the whole window in the server before its
first row comes back. `StreamReader` (`--wal-reader stream`) receives a window over the streaming
replication protocol (postgres/replication.py): messages arrive while the server still decodes,
and neither side holds more than a bounded part of the window. The peek is the default because it
measured faster on every window size (bench/wal_readers.py): the walsender sends each message on
its own, which costs the server several times what decoding does. Both read from the slot's
position and confirm nothing: the slot moves only when the driver advances it after a sink commit.

Cutting and heartbeats are the same for both: a change limit is counted server-side (only LSNs
come back, see source.lsn_after_changes), a byte limit is a WAL page boundary, found without
decoding anything.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import psycopg

from changefeed.core.change import HEARTBEAT_PREFIX
from changefeed.core.lsn import Lsn
from changefeed.errors import ConfigError
from changefeed.postgres import source as src
from changefeed.spec.definition import WAL_READERS, SourceNode


class WalReader:
    """One node's WAL as the change builder and the planner need it."""

    name: ClassVar[str]

    def __init__(self) -> None:
        self._layout: tuple[int, int] | None = None  # the server's WAL page and segment size, once asked
        self.counted = 0  # changes in the window the last cut under a change limit made

    @property
    def block_size(self) -> int:
        """The server's WAL page size, once a byte limit cut a window or a window was streamed (else 0)."""
        return self._layout[0] if self._layout else 0

    def window(self, conn: psycopg.Connection[Any], node: SourceNode, role: str, at: int,
               end: int) -> Iterator[list[bytes]]:
        """Message blocks of what starts before `end`, from the slot's position `at` on (the
        caller moved the slot there: the window's start, or its two-phase hold). `conn` is an
        ordinary connection to the node, `role` names it in errors."""
        raise NotImplementedError

    def cut(self, conn: psycopg.Connection[Any], node: SourceNode, start: Lsn, upto: Lsn, *,
            max_bytes: int = 0, max_changes: int = 0, rows_only: bool = False) -> Lsn:
        """Where a window from `start` ends under a change limit (exact, wins; `rows_only`: counting
        row changes, not every message) or a byte limit, at most at `upto` (a flushed position).
        Under a change limit, `counted` is then how many the window holds (a transaction stays
        whole, so it may be more than the limit: --max-rate charges what was taken)."""
        self.counted = 0
        if upto <= start:
            return upto
        if max_changes:
            end, self.counted = src.lsn_after_changes(conn, node.slot, node.publication, start, upto, max_changes,
                                                      rows_only)
            return end
        if max_bytes and upto - start > max_bytes:
            self._layout = self._layout or src.wal_layout(conn)
            return Lsn(min(upto, src.page_cut(start, max_bytes, self._layout[0])))
        return upto

    def heartbeat(self, conn: psycopg.Connection[Any], pad: int = 0) -> tuple[Lsn, int]:
        """A flushed record boundary past everything written so far, and the server's clock then."""
        return src.heartbeat(conn, HEARTBEAT_PREFIX, pad)


class PeekReader(WalReader):
    name = "peek"

    def window(self, conn: psycopg.Connection[Any], node: SourceNode, role: str, at: int,
               end: int) -> Iterator[list[bytes]]:
        return src.peek(conn, node.slot, node.publication, end)


class StreamReader(WalReader):
    name = "stream"

    def window(self, conn: psycopg.Connection[Any], node: SourceNode, role: str, at: int,
               end: int) -> Iterator[list[bytes]]:
        from changefeed.postgres.replication import WindowStream

        self._layout = self._layout or src.wal_layout(conn)
        return WindowStream(node.uri, role, node.slot, node.publication, at, end, layout=self._layout).blocks()


READERS: dict[str, type[WalReader]] = {r.name: r for r in (PeekReader, StreamReader)}
assert tuple(READERS) == WAL_READERS
DEFAULT = WAL_READERS[0]


def wal_reader(name: str) -> WalReader:
    """A new reader of kind `name` (a ConfigError names the kinds there are)."""
    if name not in READERS:
        raise ConfigError(f"--wal-reader {name!r} is not a WAL reader", f"use one of: {', '.join(READERS)}")
    return READERS[name]()
