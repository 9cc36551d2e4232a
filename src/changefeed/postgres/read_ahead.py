"""Read-ahead: decode the next window while the sink still applies this one.

A peek decodes its whole window in the server before the first row comes back, and Spark plans
the next batch only once this one is committed, so without read-ahead every batch starts with
the server decoding while nothing else runs. When the planner can tell where the next window
will end (`predict`: a backlog cut by the byte limit, or the fixed end of an AvailableNow run),
the task that reads a window starts, once the server has answered its own peek, a thread that
decodes the next one into a spool file on the executor's host: a temporary copy of the slot
(`pg_copy_logical_replication_slot`), advanced to the next window's start, peeked up to its
predicted end. The feed's slot is neither read nor moved for it. A copy of a failover slot is not
a failover slot, so its decoding would not wait for the standbys the primary waits for
(`synchronized_standby_slots`): a window past what they have flushed is not read ahead, or a
failover could leave the sink with changes the new primary lacks.

The next window's task, wherever it runs on that host (any Python worker), takes the spool file
whose name is exactly its node, slot, publication, start and end, waiting for a read-ahead still
writing it; on any other host, for a window planned otherwise, or after any failure, it reads
its slot as before. The spool is never the only copy: the slot still holds the window until the
sink commits it, so a crash loses nothing, and a partial file is never taken (renamed into place
only when whole). A temporary slot goes away with its session, even after a SIGKILL.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import struct
import tempfile
import threading
import time
from array import array
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import IO, Any

from changefeed.core.lsn import Lsn, format_lsn
from changefeed.postgres import slots
from changefeed.postgres import source as src
from changefeed.postgres.connect import connect
from changefeed.spec.definition import SourceNode

SPOOL = Path(tempfile.gettempdir()) / "changefeed-read-ahead"
STALE_S = 600.0  # a spool file this old is nobody's any more
MAX_WINDOW_BYTES = 512 << 20  # a longer window (of WAL) is read by its own task: a spool file stays small
_HEADER = struct.Struct("<II")  # a block: its message count and their total bytes
_running = threading.Lock()  # one read-ahead at a time in a process


def predict(end: int, frontier: int, max_bytes: int, block: int, fixed: bool) -> int | None:
    """Where the window after one ending at `end` will end, if the planner's cut is certain:
    more than `max_bytes` (a page cut, see source.page_cut) before `frontier` (the latest flushed
    position the planner saw; later ones are further on), or `frontier` itself when it is
    `fixed` (an AvailableNow run plans every batch up to the same one). Else, or for a window
    longer than MAX_WINDOW_BYTES, None."""
    if frontier <= end:
        return None
    if max_bytes and block and frontier - end > max_bytes:
        page = src.page_cut(end, max_bytes, block)  # (past `frontier` if less than a page is left)
        if page <= frontier:
            return page if page - end <= MAX_WINDOW_BYTES else None
    return frontier if fixed and frontier - end <= MAX_WINDOW_BYTES else None


def _key(node: SourceNode) -> str:
    return hashlib.sha1(f"{node.uri}\0{node.slot}\0{node.publication}".encode()).hexdigest()[:16]


def _path(node: SourceNode, start: int, end: int) -> Path:
    return SPOOL / f"{_key(node)}-{start:016x}-{end:016x}"


def _forget_before(node: SourceNode, start: int) -> None:
    """Remove the node's spool files of windows before `start` (no later batch reads them), and
    any file left longer than STALE_S (a feed stopped or removed after its read-ahead)."""
    key, stale = _key(node), time.time() - STALE_S
    with suppress(OSError):
        for p in SPOOL.iterdir():
            with suppress(ValueError, OSError, IndexError):
                mine = p.name.startswith(key) and int(p.name.split("-")[1].split(".")[0], 16) < start
                if mine or p.stat().st_mtime < stale:
                    p.unlink()


def write_blocks(out: IO[bytes], blocks: Iterator[list[bytes]]) -> None:
    """Blocks of messages as a spool file holds them: per block its header, lengths, data."""
    for msgs in blocks:
        lengths = array("I", map(len, msgs))
        data = b"".join(msgs)
        out.write(_HEADER.pack(len(msgs), len(data)))
        out.write(lengths.tobytes())
        out.write(data)


def read_blocks(f: IO[bytes]) -> Iterator[list[bytes]]:
    """The blocks write_blocks wrote, one at a time (a window is never held whole)."""
    while header := f.read(_HEADER.size):
        n, total = _HEADER.unpack(header)
        lengths = array("I")
        lengths.frombytes(f.read(4 * n))
        data, msgs, at = f.read(total), [], 0
        for size in lengths:
            msgs.append(data[at:at + size])
            at += size
        yield msgs


def take(node: SourceNode, start: int, end: int) -> Iterator[list[bytes]] | None:
    """The window [start, end) of `node` from the spool, if a read-ahead decoded exactly it
    (waiting for one still writing it); None otherwise. The file is gone once read."""
    _forget_before(node, start)
    path = _path(node, start, end)
    part = path.with_suffix(".part")
    with suppress(OSError), open(part, "rb") as writing:
        fcntl.flock(writing, fcntl.LOCK_SH)  # the writer holds LOCK_EX until its file is whole
    with suppress(OSError):
        part.unlink()  # (a writer that died left it)
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed by the generator)
    except OSError:
        return None
    path.unlink()
    return _blocks_of(f)


def _blocks_of(f: IO[bytes]) -> Iterator[list[bytes]]:
    with f:
        yield from read_blocks(f)


def begin(node: SourceNode, role: str, start: Lsn, end: int) -> bool:
    """Start decoding [start, end) of `node` into the spool in a thread of this process, unless
    a read-ahead runs here already or the spool cannot be written. True if it started."""
    if not _running.acquire(blocking=False):
        return False
    try:
        SPOOL.mkdir(parents=True, exist_ok=True)
        _forget_before(node, start)
        part = _path(node, start, end).with_suffix(".part")
        out = open(part, "xb")  # noqa: SIM115 (closed by the thread)
        fcntl.flock(out, fcntl.LOCK_EX)  # taken before the next task can look
    except OSError:
        _running.release()
        return False
    threading.Thread(target=_read_ahead, args=(node, role, start, end, part, out), daemon=True,
                     name="changefeed-read-ahead").start()
    return True


def _read_ahead(node: SourceNode, role: str, start: Lsn, end: int, part: Path, out: IO[bytes]) -> None:
    """The thread: a temporary copy of the slot at `start`, peeked up to `end`. Any failure
    (no free slot, the server gone) leaves no file: the window's task reads the slot itself."""
    try:
        with connect(node.uri, role) as conn:
            _spool(conn, node, start, end, out)
        part.rename(part.with_suffix(""))
    except Exception:  # noqa: BLE001 (best effort: the slot is the copy that counts)
        with suppress(OSError):
            part.unlink()
    finally:
        _running.release()
        out.close()  # its lock goes with it: the file is in place, or gone, by then


def standbys_have(conn: Any, end: int) -> bool:
    """Whether every physical slot of `synchronized_standby_slots` (PostgreSQL 17+) exists and
    its standby flushed the WAL up to `end` (a slot missing, or not reserving WAL: not)."""
    setting = conn.execute("SELECT current_setting('synchronized_standby_slots', true)").fetchone()[0]
    names = [n.strip() for n in (setting or "").split(",") if n.strip()]
    if not names:
        return True
    caught_up = conn.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name = ANY(%s) AND "
                             "restart_lsn >= %s::pg_lsn", (names, format_lsn(end))).fetchone()[0]
    return int(caught_up) == len(set(names))


def _spool(conn: Any, node: SourceNode, start: Lsn, end: int, out: IO[bytes]) -> None:
    if not standbys_have(conn, end):
        raise RuntimeError("the standbys have not flushed the window yet: the slot's own read waits for them")
    copy = f"changefeed_ahead_{os.getpid()}_{os.urandom(4).hex()}"  # dropped with the session
    slots.copy_temporary(conn, node.slot, copy)
    at = slots.slot_state(conn, copy)
    if at is None or at.confirmed_flush is None or at.confirmed_flush > start:
        raise RuntimeError("the slot is past the window: the read-ahead is of no use")
    slots.advance(conn, copy, start)
    at = slots.slot_state(conn, copy)
    if at is None or at.confirmed_flush != start:
        raise RuntimeError("the copy did not reach the window's start")
    write_blocks(out, src.peek(conn, copy, node.publication, end))
    out.flush()
