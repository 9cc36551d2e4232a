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
class _Probing:
    """The watchdog thread's own record of one long wait."""

    next_probe: float
    not_busy: int = 0  # probes in a row that found the backend gone or idle


class Watchdog:
    """One per process: a daemon thread that probes long waits (started again in a forked child).

    `begin` and `end` run for every awaited answer, a COPY's every row included, so they only put
    and remove one entry of a dict (atomic under the GIL); the thread reads a copy of it."""

    def __init__(self) -> None:
        self._forked()
        os.register_at_fork(after_in_child=self._forked)  # PySpark's workers: no thread there yet

    def _forked(self) -> None:
        self._lock = threading.Lock()
        self._awaited: dict[int, tuple[WatchedConnection, int, float]] = {}  # id(conn) -> (conn, thread, since)
        self._cut: dict[int, str] = {}  # thread -> why its connection was cut
        self._started = False

    def begin(self, conn: WatchedConnection) -> None:
        if not self._started:
            self._start()
        self._awaited[id(conn)] = (conn, threading.get_ident(), time.monotonic())

    def end(self, conn: WatchedConnection) -> None:
        self._awaited.pop(id(conn), None)

    def _start(self) -> None:
        with self._lock:
            if not self._started:
                threading.Thread(target=self._run, name="changefeed-watchdog", daemon=True).start()
                self._started = True

    def cut_reason(self) -> str | None:
        """Why the calling thread's connection was cut, once (None: it was not)."""
        with self._lock:
            return self._cut.pop(threading.get_ident(), None)

    def _run(self) -> None:
        probing: dict[tuple[int, float], _Probing] = {}  # (id(conn), since) of the long waits
        while True:
            time.sleep(_TICK_S)
            now = time.monotonic()
            awaited = self._awaited.copy()
            long = {(key, since): (conn, thread) for key, (conn, thread, since) in awaited.items()
                    if now - since >= PROBE_AFTER_S}
            probing = {k: probing.get(k) or _Probing(now) for k in long}
            for (key, since), p in probing.items():
                if p.next_probe > now:
                    continue
                conn, thread = long[(key, since)]
                verdict = probe(conn)
                p.next_probe = time.monotonic() + PROBE_EVERY_S
                if verdict is None:
                    p.not_busy = 0
                    continue
                unreachable, reason = verdict
                p.not_busy += 1
                if unreachable or p.not_busy >= 2:
                    waited = time.monotonic() - since
                    with self._lock:
                        if self._awaited.get(key) is not awaited[key]:
                            continue  # the answer came meanwhile
                        self._cut[thread] = f"no answer for {waited:.0f}s and {reason}: the connection stalled"
                    cut(conn)


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
