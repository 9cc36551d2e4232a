"""Read a slot's WAL window over the streaming replication protocol (`START_REPLICATION ... LOGICAL`).

The server decodes and sends as it goes, so the first messages arrive while it still decodes the
rest (a SQL peek decodes the whole window before it returns a first row). A thread of its own
receives the stream into a bounded queue of message blocks, answers the server's keepalives and
sends a status update every `STATUS_INTERVAL_S`, also while the consumer (the change builder, the
sink behind it) is busy: the server never drops the connection for a slow sink. An update asks
for an answer when the server has been quiet for an interval; a server quiet for `SILENT_S`
despite that is behind a stalled path (see postgres.watchdog): the connection is given up, which
the feed retries like any lost connection.

What the stream confirms: nothing new. Every status update reports the position the slot already
holds (the window's read position), so the slot moves only where it always did, when the driver
advances it after a sink commit. The window ends where a peek up to `end` would end (see
postgres/decode/builder.py): the stream stops at the first keepalive whose WAL end is at or past `end`
(every record that starts before `end` was decoded and sent by then), or at a non-transactional
message whose record starts at or past `end` (one that straddles `end` is the window's); a
transaction committed past `end` is recognised and dropped by the change builder, which stops
reading there.

Why this client and not psycopg2's `LogicalReplicationConnection`: psycopg2, on a keepalive that
follows no data, forwards the flush position it reports to the server's WAL end, which would move
the slot past what the sinks committed; and it would be a second PostgreSQL driver. The protocol
part is small (three message layouts, PostgreSQL docs "Streaming Replication Protocol"): this
module speaks it through psycopg 3's libpq binding, which does the connection, TLS and
authentication.
"""
from __future__ import annotations

import queue
import select
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import pq
from psycopg.pq.abc import PGconn, PGresult

from changefeed.core.hlc import PG_EPOCH_US
from changefeed.core.lsn import format_lsn
from changefeed.postgres.connect import connect, lost_connection
from changefeed.postgres.slots import slot_errors
from changefeed.postgres.wal_layout import message_record_length, starts_before

STATUS_INTERVAL_S = 10.0  # well inside the server's wal_sender_timeout (60 s by default)
CONFIRM_S = 1.0  # a position newly confirmed goes to the server within about this long (see confirm)
SILENT_S = 30.0  # nothing heard for this long, pings unanswered: the path is stalled, the stream is cut
BLOCK_MESSAGES = 5000  # most messages per block handed to the builder
BLOCK_BYTES = 8 << 20
QUEUE_BLOCKS = 8  # blocks received ahead of the builder: the prefetch bound (at most 64 MB)
IN_USE_WAIT_S = 5.0
END_WAIT_S = 5.0
_PAUSE_S = 0.002  # a block goes to the builder early when the server pauses this long
_POLL_S = 0.5

_XLOG_DATA = struct.Struct("!QQq")  # after 'w': data start, WAL end, send time
_LENGTH = struct.Struct("!i")  # a pgoutput Message's content length, after its prefix
_KEEPALIVE = struct.Struct("!Qq?")  # after 'k': WAL end, send time, reply requested
_STATUS = struct.Struct("!cQQQq?")  # 'r': written, flushed, applied, client time, reply requested
_W, _K, _M = ord("w"), ord("k"), ord("M")


def start_command(slot: str, publication: str, at: int) -> bytes:
    """START_REPLICATION with the options of postgres.source.peek, so both give the same messages."""
    def literal(text: str) -> str:
        return "'" + text.replace("'", "''") + "'"

    ident = '"' + slot.replace('"', '""') + '"'
    return (f"START_REPLICATION SLOT {ident} LOGICAL {format_lsn(at)} (proto_version '1', "
            f"publication_names {literal(publication)}, messages 'true')").encode()


def status_update(position: int, ping: bool = False) -> bytes:
    """A standby status update reporting `position` as written, flushed and applied; `ping` asks
    the server to answer at once (with a keepalive)."""
    now = int(time.time() * 1_000_000) - PG_EPOCH_US
    return _STATUS.pack(b"r", position, position, position, now, ping)


def past_end(data: memoryview | bytes, end: int, page: int, segment: int) -> bool:
    """Whether XLogData `data` (its 'w' header included) is a non-transactional message whose
    record starts at or after `end` (a peek up to `end` does not decode it; one that straddles
    `end` it does: see wal_layout). `page` and `segment`: the server's WAL page and segment size."""
    if data[25] != _M or data[26] & 1:  # not a pgoutput Message, or a transactional one
        return False
    record_end: int = _XLOG_DATA.unpack_from(data, 1)[0]
    if record_end <= end:
        return False
    prefix_end = bytes(data[35:]).index(b"\0") + 35  # 'M', flags, LSN, then the prefix
    (content_length,) = _LENGTH.unpack_from(data, prefix_end + 1)
    length = message_record_length(bytes(data[35:prefix_end]), content_length)
    return not starts_before(record_end, length, end, page, segment)


class WindowStream:
    """The pgoutput messages of slot `slot` from `at` (the slot's position) to the window's `end`,
    received over a replication connection of its own (see the module docstring)."""

    def __init__(self, uri: str, role: str, slot: str, publication: str, at: int, end: int, *,
                 layout: tuple[int, int], status_interval: float = STATUS_INTERVAL_S, silent: float = SILENT_S,
                 linger: float | None = None, **connect_kwargs: Any) -> None:
        self.uri, self.role, self.slot, self.publication, self.at, self.end = uri, role, slot, publication, at, end
        self.confirmed = self._reported = at  # the position the status updates report as flushed (see confirm)
        self.linger = linger  # the longest a message waits in a block for more (None: until the server pauses)
        self.page, self.segment = layout  # the server's WAL page and segment size (see past_end)
        self.status_interval, self.silent, self.connect_kwargs = status_interval, silent, connect_kwargs
        self._queue: queue.Queue[list[bytes] | BaseException | None] = queue.Queue(QUEUE_BLOCKS)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pg: PGconn | None = None
        self._sent_at = self._heard_at = 0.0
        self.updates = 0  # status updates sent (tests)

    def blocks(self, idle: float | None = None) -> Iterator[list[bytes]]:
        """Blocks of messages in the order the server sent them; the stream closes when the
        iteration ends, also early (the builder saw the window's end). With `idle`, an empty
        block comes after that many seconds without one (a follower looks at its clock)."""
        self._thread = threading.Thread(target=self._receive, name=f"wal-stream-{self.slot}", daemon=True)
        self._thread.start()
        try:
            while True:
                try:
                    item = self._queue.get(timeout=idle)
                except queue.Empty:
                    yield []
                    continue
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._stop.set()
            self._thread.join()

    def confirm(self, lsn: int) -> None:
        """Report `lsn` as flushed from the next status update on: only a position every change
        before which is recorded where the feed's changes go (a sink's ledger), so that the server
        may release the WAL before it while a followed window stays open (postgres.follow)."""
        self.confirmed = max(self.confirmed, lsn)

    def backlogged(self) -> bool:
        """Whether more blocks were received than the consumer took."""
        return not self._queue.empty()

    # -- the receiving thread ------------------------------------------------------------
    def _receive(self) -> None:
        try:
            with lost_connection(self.role), slot_errors(self.slot):
                conn = connect(self.uri, self.role, replication="database", **self.connect_kwargs)
                conn.pgconn.nonblocking = 1
                try:
                    self._start(conn.pgconn)
                    self._stream(conn.pgconn)
                    _end(conn.pgconn)
                finally:
                    conn.close()
            self._put(None)
        except BaseException as e:  # handed to the consumer, raised there
            self._put(e)

    def _put(self, item: list[bytes] | BaseException | None) -> bool:
        """Queue `item`; False if the consumer stopped meanwhile. While the queue is full the
        server is not listened to (its silence then says nothing), but status updates go on."""
        waited = False
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                if waited:
                    self._heard_at = time.monotonic()
                return True
            except queue.Full:
                waited = True
                if self._pg is not None and time.monotonic() - self._sent_at >= self.status_interval:
                    self._send_status()
        return False

    def _start(self, pg: PGconn) -> None:
        """START_REPLICATION; a slot still held by a reader that is ending (the previous window's
        walsender, a killed task's) is waited for, up to `IN_USE_WAIT_S`."""
        waited_until = time.monotonic() + IN_USE_WAIT_S
        while True:
            pg.send_query(start_command(self.slot, self.publication, self.at))
            error = None
            while (result := _result(pg, time.monotonic() + self.silent)) is not None:
                if result.status == pq.ExecStatus.COPY_BOTH:
                    self._pg = pg
                    self._sent_at = self._heard_at = time.monotonic()
                    return
                if result.status == pq.ExecStatus.FATAL_ERROR:
                    error = _error(result)
            if not isinstance(error, psycopg.errors.ObjectInUse) or time.monotonic() > waited_until:
                raise error or psycopg.OperationalError(f"START_REPLICATION gave no stream: {pg.get_error_message()}")
            time.sleep(0.05)

    def _stream(self, pg: PGconn) -> None:
        block: list[bytes] = []
        size = 0
        due = float("inf")  # when the block goes, however busy the server is (`linger`)
        while not self._stop.is_set():
            n, data = pg.get_copy_data(1)
            if n > 0:
                self._heard_at = time.monotonic()
                kind = data[0]
                if kind == _W:
                    if past_end(data, self.end, self.page, self.segment):
                        break
                    if not block and self.linger is not None:
                        due = time.monotonic() + self.linger
                    block.append(bytes(data[25:]))
                    size += n
                    if len(block) < BLOCK_MESSAGES and size < BLOCK_BYTES and time.monotonic() < due:
                        continue
                elif kind == _K:
                    wal_end, _, reply = _KEEPALIVE.unpack_from(data, 1)
                    if wal_end >= self.end:
                        break
                    if reply:
                        self._send_status()
                    continue
                else:
                    continue
            elif n == 0:  # nothing complete buffered: wait; hand the block over if the server pauses
                if block and not select.select([pg.socket], [], [], _PAUSE_S)[0]:
                    if not self._put(block):
                        return
                    block, size, due = [], 0, float("inf")
                self._keep_alive()
                select.select([pg.socket], [], [], _POLL_S)
                pg.consume_input()
                continue
            else:  # -1: the server ended the stream; -2: an error
                result = _result(pg)
                if result is not None and result.status == pq.ExecStatus.FATAL_ERROR:
                    raise _error(result)
                raise psycopg.OperationalError(f"the replication stream ended early: {pg.get_error_message()}")
            if not self._put(block):
                return
            block, size, due = [], 0, float("inf")
        if block:
            self._put(block)

    def _keep_alive(self) -> None:
        """A status update when one is due, asking for an answer if the server is quiet; a server
        quiet for too long is behind a stalled path (the connection is this thread's: called from
        it only)."""
        now = time.monotonic()
        if now - self._heard_at >= self.silent:
            raise psycopg.OperationalError(f"the walsender sent nothing for {self.silent:.0f} s, not even an "
                                           "answer to a keepalive: the connection is stalled")
        if now - self._sent_at >= self.status_interval or \
                self.confirmed > self._reported and now - self._sent_at >= CONFIRM_S:
            self._send_status(ping=now - self._heard_at >= self.status_interval)

    def _send_status(self, ping: bool = False) -> None:
        assert self._pg is not None
        self._reported = self.confirmed
        self._pg.put_copy_data(status_update(self._reported, ping))
        _flush(self._pg)
        self._sent_at = time.monotonic()
        self.updates += 1


def _end(pg: PGconn) -> None:
    """End the stream the polite way (CopyDone, then what the server still sent): the server
    releases the slot before this returns, so the next window's reader finds it free. A server
    slow to end is left to notice the closed connection."""
    pg.put_copy_end()
    _flush(pg)
    deadline = time.monotonic() + END_WAIT_S
    while (n := pg.get_copy_data(1)[0]) >= 0 and time.monotonic() < deadline:
        if n == 0:
            select.select([pg.socket], [], [], _POLL_S)
            pg.consume_input()
    if n < 0:
        while _result(pg, deadline) is not None:  # CommandComplete: the slot is released
            pass


def _result(pg: PGconn, deadline: float = float("inf")) -> PGresult | None:
    """PQgetResult without blocking inside libpq, which would hold the GIL (and every thread of
    the process) until the server answers; waiting happens in select, which lets go of it.
    A deadline passed or the socket closed is a lost connection."""
    while pg.is_busy():
        if time.monotonic() > deadline:
            return None
        select.select([pg.socket], [], [], _POLL_S)
        pg.consume_input()
    return pg.get_result()


def _flush(pg: PGconn) -> None:
    """Send what libpq buffered, waiting in select (see _result) while the socket is full."""
    while pg.flush():
        select.select([], [pg.socket], [], _POLL_S)


def _error(result: PGresult) -> psycopg.Error:
    """The server's error as the psycopg exception of its SQLSTATE (slot_errors maps the slot's)."""
    state = (result.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode()
    message = (result.error_message or b"").decode(errors="replace").strip()
    try:
        return psycopg.errors.lookup(state)(message)
    except KeyError:
        return psycopg.OperationalError(message)

