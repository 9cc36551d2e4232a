"""One runner per feed: an exclusive lock on the feed's state folder, and who holds it.

(The source holds a second, session advisory lock, so runners on other machines are refused too.)
"""
from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from .config import FeedState
from .errors import FeedBusy


@contextmanager
def state_lock(state: FeedState) -> Iterator[None]:
    """An exclusive lock on the feed's state folder for this process's lifetime."""
    state.dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FeedBusy(f"feed {state.dir.name} is already running: held by {_holder_of(fd)}",
                           "stop the other runner first, or use another --name or --state") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield
    finally:
        os.close(fd)


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
    """running (holder), paused, failed: reason (of the last run), or stopped."""
    who = holder(state)
    return f"running ({who})" if who else "paused" if state.paused else state.failure() or "stopped"
