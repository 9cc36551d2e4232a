"""Finding a hung PostgreSQL connection and cutting it, so that a stall ends in an error the feed
retries instead of a wait that never ends.

TCP keepalives and `tcp_user_timeout` (postgres.connect) find a peer that stopped answering at
the TCP level: a dropped link, a host gone. A path that still answers TCP but never delivers the
answer (a stalled proxy, load balancer or pooler in between, a frozen server) looks alive to the
kernel. So every answer changefeed awaits for longer than `PROBE_AFTER_S` is checked through a
fresh connection to the same server, every `PROBE_EVERY_S`:

* that probe cannot connect and answer within `PROBE_TIMEOUT_S` (per step): the server is
  unreachable by this path, the awaited connection is cut at once;
* the server says the awaited backend is gone, or no longer running a query, twice in a row:
  its answer was lost on the way, the connection is cut;
* the backend is running the query: the server is busy (a long decode, a big merge), the wait
  goes on, however long.

Cutting shuts the connection's socket down: the waiting thread gets psycopg's connection error,
which `lost_connection` turns into a ConnectionFailed that names the stall.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import psycopg

PROBE_AFTER_S = 10.0
PROBE_EVERY_S = 5.0
PROBE_TIMEOUT_S = 5.0
_TICK_S = 1.0


class WatchedConnection(psycopg.Connection[Any]):
    """A psycopg connection whose awaited answers the process's watchdog checks (see the module)."""

    probe_uri: str = ""  # how to reach the same server again, credentials included
    answer_timeout: float | None = None  # a probe's own bound on each answer

    def wait(self, gen: Any, *args: Any, **kwargs: Any) -> Any:
        if self.answer_timeout is not None:
            kwargs["timeout"] = self.answer_timeout
            return super().wait(gen, *args, **kwargs)
        if not self.probe_uri:
            return super().wait(gen, *args, **kwargs)
        WATCHDOG.begin(self)
        try:
            return super().wait(gen, *args, **kwargs)
        finally:
            WATCHDOG.end(self)


@dataclass
class _Awaited:
    conn: WatchedConnection
    thread: int  # the waiting thread, to tell it why its connection broke
    since: float
    next_probe: float
    not_busy: int = 0  # probes in a row that found the backend gone or idle


class Watchdog:
    """One per process: a daemon thread that probes long waits (restarted in a forked child)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._awaited: dict[int, _Awaited] = {}
        self._cut: dict[int, str] = {}  # thread -> why its connection was cut
        self._pid = 0

    def begin(self, conn: WatchedConnection) -> None:
        now = time.monotonic()
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child (PySpark's workers): no thread here yet
                self._pid, self._awaited, self._cut = os.getpid(), {}, {}
                threading.Thread(target=self._run, name="changefeed-watchdog", daemon=True).start()
            self._awaited[id(conn)] = _Awaited(conn, threading.get_ident(), now, now + PROBE_AFTER_S)

    def end(self, conn: WatchedConnection) -> None:
        with self._lock:
            self._awaited.pop(id(conn), None)

    def cut_reason(self) -> str | None:
        """Why the calling thread's connection was cut, once (None: it was not)."""
        with self._lock:
            return self._cut.pop(threading.get_ident(), None)

    def _run(self) -> None:
        while True:
            time.sleep(_TICK_S)
            now = time.monotonic()
            with self._lock:
                due = [a for a in self._awaited.values() if a.next_probe <= now]
            for a in due:
                verdict = probe(a.conn)
                a.next_probe = time.monotonic() + PROBE_EVERY_S
                if verdict is None:
                    a.not_busy = 0
                    continue
                unreachable, reason = verdict
                a.not_busy += 1
                if unreachable or a.not_busy >= 2:
                    waited = time.monotonic() - a.since
                    with self._lock:
                        if self._awaited.get(id(a.conn)) is not a:
                            continue  # the answer came meanwhile
                        self._cut[a.thread] = f"no answer for {waited:.0f}s and {reason}: the connection stalled"
                    cut(a.conn)


def probe(conn: WatchedConnection) -> tuple[bool, str] | None:
    """None when the server is busy with the awaited query; else (whether the server could not be
    reached at all, what was found)."""
    pid = conn.info.backend_pid
    try:
        with WatchedConnection.connect(conn.probe_uri, autocommit=True, connect_timeout=max(2, int(PROBE_TIMEOUT_S)),
                                       application_name="changefeed probe") as check:
            check.answer_timeout = PROBE_TIMEOUT_S
            row = check.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    except psycopg.Error as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return True, f"a fresh connection to the same server got no answer either ({first})"
    if row is None:
        return False, f"the server has no backend {pid} any more"
    if row[0] != "active":
        return False, f"its backend {pid} is {row[0]}, not running a query"
    return None


def cut(conn: WatchedConnection) -> None:
    """Shut the connection's socket down: a thread waiting on it wakes up with a connection error."""
    try:
        dup = socket.fromfd(conn.pgconn.socket, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, psycopg.Error):
        return  # closed meanwhile
    try:
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        dup.close()


WATCHDOG = Watchdog()
