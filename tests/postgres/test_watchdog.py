"""The stall watchdog (postgres.watchdog) against a real server behind a TCP proxy: a stalled path
is cut, a busy server is waited for, and a forked child (PySpark's workers) starts clean."""
from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest

from changefeed.errors import ConnectionFailed
from changefeed.postgres import watchdog
from changefeed.postgres.connect import connect, lost_connection
from changefeed.postgres.watchdog import WATCHDOG
from support.servers import Dbs
from tcp_proxy import TcpProxy


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watchdog, "PROBE_AFTER_S", 0.5)
    monkeypatch.setattr(watchdog, "PROBE_EVERY_S", 0.3)
    monkeypatch.setattr(watchdog, "PROBE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(watchdog, "_TICK_S", 0.1)


@pytest.fixture
def proxy(dbs: Dbs) -> Iterator[tuple[TcpProxy, str]]:
    port = int(re.search(r":(\d+)/", dbs.source).group(1))  # type: ignore[union-attr]
    with TcpProxy(port) as p:
        yield p, re.sub(r":\d+/", f":{p.port}/", dbs.source)


@pytest.mark.parametrize("probe_path", ["direct", "stalled too"])
def test_a_stalled_path_is_cut(dbs: Dbs, quick: None, proxy: tuple[TcpProxy, str], probe_path: str) -> None:
    """The query never reaches the server: probed directly, its backend is idle (twice); probed
    through the same stalled path, the server cannot be reached. Either way the wait ends."""
    p, uri = proxy
    conn = connect(uri, "source")
    if probe_path == "direct":
        conn.probe_uri = dbs.source  # type: ignore[attr-defined]
    p.stall()
    with pytest.raises(ConnectionFailed, match="the connection stalled") as e:
        with lost_connection("source"):
            conn.execute("SELECT 1")
    assert ("not running a query" if probe_path == "direct" else "got no answer either") in e.value.message
    assert WATCHDOG._awaited.get(id(conn)) is None
    conn.close()


def test_a_busy_server_is_waited_for(dbs: Dbs, quick: None) -> None:
    """Probed several times while the backend runs the query: never cut."""
    with connect(dbs.source, "source") as conn, lost_connection("source"):
        assert conn.execute("SELECT pg_sleep(2), 42").fetchone() == ("", 42)
    assert WATCHDOG.cut_reason() is None


def test_a_forked_child_starts_with_no_waits_and_its_own_thread() -> None:
    class Waiting:
        pass

    w = Waiting()
    WATCHDOG.begin(w)  # type: ignore[arg-type]
    try:
        pid = os.fork()
        if pid == 0:  # the child: no waits of the parent's, a thread of its own once it waits
            clean = WATCHDOG._awaited == {} and not WATCHDOG._started
            WATCHDOG.begin(w)  # type: ignore[arg-type]
            started = WATCHDOG._started and any(t.name == "changefeed-watchdog" for t in __import__(
                "threading").enumerate())
            WATCHDOG.end(w)  # type: ignore[arg-type]
            os._exit(0 if clean and started and WATCHDOG._awaited == {} else 1)
        assert os.waitpid(pid, 0)[1] == 0
        assert id(w) in WATCHDOG._awaited  # the parent's wait is untouched
    finally:
        WATCHDOG.end(w)  # type: ignore[arg-type]
