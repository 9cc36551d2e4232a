"""`changefeed verify` and `status` on a feed that is not running (issue 36): after --available-now,
SIGKILLed, paused; behind its source or not; with a run started meanwhile; with a server down."""
from __future__ import annotations

import fcntl
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from changefeed.local.postgres import LocalPostgres
from support.feeds import changefeed_cli, start_changefeed, wait_for
from support.servers import Dbs, fingerprint

pytestmark = pytest.mark.timeout(900)


def _verify(*args: str) -> tuple[int, dict, str]:
    out = changefeed_cli("verify", *args, "--json")
    return out.returncode, json.loads(out.stdout) if out.stdout.strip() else {}, out.stderr


def _setup(uri: str) -> None:
    with psycopg.connect(uri, autocommit=True) as c:
        c.execute("CREATE TABLE acct (id int PRIMARY KEY, balance bigint NOT NULL, note text)")
        c.execute("INSERT INTO acct SELECT g, 100, 'n' || g FROM generate_series(1, 2000) g")
        c.execute("CREATE TABLE log (id bigserial PRIMARY KEY, what text)")


def _write(uri: str, n: int) -> None:
    with psycopg.connect(uri, autocommit=True) as c:
        for i in range(n):
            with c.transaction():
                c.execute("UPDATE acct SET balance = balance - 1 WHERE id = %s", (1 + i % 2000,))
                c.execute("UPDATE acct SET balance = balance + 1 WHERE id = %s", (2000 - i % 2000,))
                c.execute("INSERT INTO log (what) VALUES ('w')")


def _held_by_verify(lock: Path) -> bool:
    """Whether a verify holds the feed's lock now (the file keeps its last holder's name after)."""
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return lock.read_text().startswith("verify,")
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def _same(dbs: Dbs) -> bool:
    return all(fingerprint(dbs.source, t) == fingerprint(dbs.sink, t) for t in ("public.acct", "public.log"))


@pytest.mark.slow
@pytest.mark.usefixtures("warm_spark")
def test_verify_a_stopped_feed_caught_up_behind_repaired_paused_and_held(dbs: Dbs, tmp_path: Path) -> None:
    _setup(dbs.source)
    state = str(tmp_path / "state")
    name = ["--name", dbs.name, "--state", state]
    copied = changefeed_cli("run", *name, "--source", dbs.source, "--sink", dbs.sink, "--tables",
                            "public.acct,public.log", "--capture-ddl", "--available-now")
    assert copied.returncode == 0, copied.stderr[-3000:]
    _write(dbs.source, 50)
    again = changefeed_cli("run", *name, "--available-now")
    assert again.returncode == 0 and _same(dbs), again.stderr[-3000:]

    # caught up: compared at once, without running the feed
    rc, report, err = _verify(*name)
    assert rc == 0 and report["equal"], (err, report)
    assert "not running" not in err, err
    with dbs.dst() as c:
        c.execute("UPDATE acct SET balance = balance + 7 WHERE id = 17")
    rc, report, err = _verify(*name)
    assert rc == 1 and [d["key"] for t in report["tables"] for d in t["differences"]] == ["(17)"], (err, report)
    rc, report, err = _verify(*name, "--repair")
    assert rc == 1 and sum(t["repaired"] for t in report["tables"]) == 1, (err, report)
    rc, report, err = _verify(*name)
    assert rc == 0 and report["equal"] and _same(dbs), (err, report)

    # behind its source (the last run SIGKILLed, changes after it): verify runs it up to a point
    log = tmp_path / "killed.log"
    p = start_changefeed("run", *name, "--master", "local[*]", log=log)  # its own Spark dies with it
    wait_for("the feed running", lambda: "running (until stopped)" in log.read_text(), log)
    _write(dbs.source, 100)
    wait_for("the changes applied", lambda: _same(dbs), log)
    p.send_signal(signal.SIGKILL)
    p.wait()
    _write(dbs.source, 100)
    rc, report, err = _verify(*name)
    assert rc == 0 and report["equal"] and "is not running: catching up" in err, (err, report)
    assert _same(dbs)  # it stopped at the point, which was after the last write
    status = json.loads(changefeed_cli("status", *name, "--json").stdout)
    assert status["state"] == "stopped" and status["lag_seconds"] == 0, status

    # a run started while verify holds the feed waits for it, then goes on from there; one stopped while it
    # waits ends cleanly (a service manager restarting the feed meanwhile)
    _write(dbs.source, 300)
    verify_log = tmp_path / "verify.log"
    verifying = start_changefeed("verify", *name, log=verify_log)
    lock = tmp_path / "state" / dbs.name / "run.lock"
    wait_for("verify to hold the feed", lambda: _held_by_verify(lock), verify_log)
    waiting, stopped = (start_changefeed("run", *name, *more, log=tmp_path / f"{what}.log")
                        for what, more in (("waiting", ["--available-now"]), ("stopped", [])))
    wait_for("the runners to wait", lambda: all("a verify holds it" in (tmp_path / f"{w}.log").read_text()
                                                for w in ("waiting", "stopped")), verify_log)
    stopped.send_signal(signal.SIGTERM)
    assert stopped.wait(timeout=60) == 0 and "stopped before it started" in (tmp_path / "stopped.log").read_text()
    assert verifying.wait(timeout=600) == 0 and "equal" in verify_log.read_text(), verify_log.read_text()[-3000:]
    assert waiting.wait(timeout=600) == 0 and _same(dbs), (tmp_path / "waiting.log").read_text()[-3000:]
    with dbs.src() as s, dbs.dst() as d:  # on from the point, exactly once
        assert s.execute("SELECT count(*) FROM log").fetchone() == d.execute("SELECT count(*) FROM log").fetchone()

    # behind and written to all along: caught up, then run once more up to a barrier at the point
    stop = threading.Event()
    writer = threading.Thread(target=lambda: [_write(dbs.source, 5) or time.sleep(0.05) for _ in iter(stop.is_set,
                                                                                                     True)])
    writer.start()
    try:
        rc, report, err = _verify(*name)
    finally:
        stop.set()
        writer.join()
    assert rc == 0 and report["equal"] and "running it up to" in err, (err, report)
    after = changefeed_cli("run", *name, "--available-now")
    assert after.returncode == 0 and _same(dbs), after.stderr[-3000:]

    # failed (the last run stopped on an error): verified like any stopped feed
    (tmp_path / "state" / dbs.name / "failed").write_text("sink: connection lost")
    assert json.loads(changefeed_cli("status", *name, "--json").stdout)["state"].startswith("failed")
    rc, report, err = _verify(*name)
    assert rc == 0 and report["equal"], (err, report)
    (tmp_path / "state" / dbs.name / "failed").unlink()

    # paused: compared when caught up; not moved when behind
    assert changefeed_cli("pause", *name).returncode == 0
    rc, report, err = _verify(*name)
    assert rc == 0 and report["equal"], (err, report)
    _write(dbs.source, 5)
    rc, report, err = _verify(*name)
    assert rc == 2 and "paused" in err and "bytes of WAL past" in err and "resume" in err, err
    assert not _same(dbs)


@pytest.fixture
def own_servers(tmp_path: Path) -> Iterator[tuple[LocalPostgres, LocalPostgres]]:
    source, sink = (LocalPostgres.start(tmp_path / name) for name in ("source", "sink"))
    yield source, sink
    for server in (source, sink):
        server.stop("immediate")


@pytest.mark.usefixtures("warm_spark")
def test_status_of_a_stopped_feed_with_a_server_down(own_servers: tuple[LocalPostgres, LocalPostgres],
                                                      tmp_path: Path) -> None:
    source, sink = own_servers
    _setup(source.uri())
    name = ["--name", "down", "--state", str(tmp_path / "state")]
    copied = changefeed_cli("run", *name, "--source", source.uri(), "--sink", sink.uri(), "--tables", "public.acct",
                            "--available-now")
    assert copied.returncode == 0, copied.stderr[-3000:]
    source.stop("immediate")
    shown = changefeed_cli("status", *name, "--json")
    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)
    assert status["state"] == "stopped" and status["batches"] >= 1 and status["checkpoint_lsn"], status
    assert status["slot_state"].startswith("unknown (") and "source" in status["unreachable"], status
    assert status["lag_seconds"] is None, status
    text = changefeed_cli("status", *name)
    assert text.returncode == 0 and "unknown: the source cannot be reached now" in text.stdout, text.stdout

    LocalPostgres.start(source.datadir, port=source.port)
    sink.stop("immediate")
    status = json.loads(changefeed_cli("status", *name, "--json").stdout)
    assert "sink" in status["unreachable"] and status["batches"] is None, status
    assert status["slot_state"].startswith("inactive"), status
    verified = changefeed_cli("verify", *name)
    assert verified.returncode == 2 and "sink" in verified.stderr and "Traceback" not in verified.stderr, \
        verified.stderr
