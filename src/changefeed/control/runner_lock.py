"""One runner per feed: an exclusive lock on the feed's state folder, and who holds it.

(The source holds a second, session advisory lock, so runners on other machines are refused too.)
"""
from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

from changefeed.errors import FeedBusy
from changefeed.postgres import lease
from changefeed.spec.state import FeedState

VERIFY = "verify"  # what a verify holding a stopped feed writes first into the lock file


class Stopped(Exception):
    """Stopped (SIGINT/SIGTERM) while waiting for a verify to let go of the feed."""


@contextmanager
def state_lock(state: FeedState, *, by: str = "", stop: threading.Event | None = None,
               report: Callable[[str], None] | None = None) -> Iterator[None]:
    """An exclusive lock on the feed's state folder for this process's lifetime; `by` names the
    holder for others (verify). With `stop`, a lock held by a verify (a short hold of a stopped
    feed) is waited for, until `stop` is set (then Stopped); any other holder is refused.

    A first run or `create` that ends before the feed was stored (bad input, a server that cannot
    be used, the feed busy elsewhere) takes the folder away again: nothing stays that `list`,
    `status` or `remove` could not show."""
    state.make()
    fd = os.open(state.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
    held = False
    try:
        _take(fd, state, stop, report)
        held = True
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{by + ', ' if by else ''}{lease.me()}".encode(), 0)
        yield
    finally:
        if held and not state.spec_file.exists():  # still ours: unlinked before the lock goes
            for leftover in (state.lock_file, state.failed_file):
                leftover.unlink(missing_ok=True)
            with suppress(OSError):  # only if nothing else is in it
                state.dir.rmdir()
        os.close(fd)


def _take(fd: int, state: FeedState, stop: threading.Event | None, report: Callable[[str], None] | None) -> None:
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            who = _holder_of(fd)
        if stop is None or not who.startswith(VERIFY + ","):
            raise FeedBusy(f"feed {state.dir.name} is already running: held by {who}",
                           "stop the other runner first, or use another --name or --state")
        if not told and report is not None:
            report(f"feed {state.dir.name}: a verify holds it ({who}); starting when it is done")
            told = True
        if stop.wait(0.2):
            raise Stopped()


def _holder_of(fd: int) -> str:
    """What the runner holding the lock file wrote into it."""
    return os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"


def holder(state: FeedState) -> str | None:
    """Who runs the feed now (from the state folder's lock), None if nobody does."""
    if not state.lock_file.exists():
        return None
    fd = os.open(state.lock_file, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return _holder_of(fd)
    finally:
        os.close(fd)


def run_state(state: FeedState) -> str:
    """running (holder), with what it is retrying if a fault lasts; paused, failed: reason (of the
    last run), or stopped."""
    from changefeed.control.retry import read_note

    who = holder(state)
    if who:
        retrying = read_note(state.retrying_file)
        return f"running ({who}), {retrying.describe()}" if retrying else f"running ({who})"
    return "paused" if state.paused else state.failure() or "stopped"
