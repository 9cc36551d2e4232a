"""A standby (`run --standby`) on its own state folder takes a feed over when its active runner is
SIGKILLed or frozen past its lease, and carries on exactly once from the replica's ledger; the
old runner, once woken, lands nothing and stops with LeaseLost."""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psycopg
import pytest

from changefeed.postgres import lease
from support.feeds import assert_no_traceback, changefeed_cli, kill_running, start_changefeed, wait_for
from support.servers import Dbs, fingerprint
from support.standby import taken_over_while_frozen
from support.writers import moving_money, replicated, writing

pytestmark = pytest.mark.timeout(900)

ACCOUNTS, BALANCE = 40, 1000



def _replicated(dbs: Dbs) -> int:
    return replicated(dbs.sink)


def _money_whole(dbs: Dbs) -> None:
    """The replica, at whatever batch it is, never holds a transfer in half."""
    with psycopg.connect(dbs.sink) as d:
        total = d.execute("SELECT sum(balance), count(*) FROM accounts").fetchone()
    assert total == (ACCOUNTS * BALANCE, ACCOUNTS), total


def _setup(dbs: Dbs) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        c.execute("INSERT INTO accounts SELECT g, %s FROM generate_series(0, %s) g", (BALANCE, ACCOUNTS - 1))
        c.execute("CREATE TABLE ledger (id bigint PRIMARY KEY, v text)")


def _stop_all(*procs: subprocess.Popen[bytes]) -> None:
    kill_running(list(procs))


def with_signal(p: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def test_a_standby_takes_over_each_time_the_active_runner_is_killed(dbs: Dbs, tmp_path: Path) -> None:
    _setup(dbs)
    states = [tmp_path / "host-a", tmp_path / "host-b"]
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    written: list[int] = [0]
    # Five kills: at random, and where the active runner reaches a fault point between the sink's
    # commit and the slot's advance (it is started with that point set, and kills itself there).
    kills = ["random", "after_sink_commit:40", "random", "before_sink_commit:40", "random"]

    def kill_env(i: int) -> dict[str, str]:
        if i >= len(kills) or kills[i] == "random":
            return {}
        (tmp_path / f"faults{i}").mkdir()
        return {"CHANGEFEED_KILL_AT": kills[i], "CHANGEFEED_FAULT_DIR": str(tmp_path / f"faults{i}")}

    with writing(moving_money(ACCOUNTS, 3), dbs.source, written):
        runners = [start_changefeed("run", "--name", dbs.name, "--state", str(states[0]), "--source", dbs.source,
                                    "--sink", dbs.sink, "--tables", "public.accounts,public.ledger", "--lease", "4s",
                                    log=logs[0], env=kill_env(0))]
        try:
            wait_for("rows on the replica", lambda: _replicated(dbs) > 50, logs[0])
            # the standby needs only the name and the source: the definition is on the source
            runners.append(start_changefeed("run", "--standby", "--name", dbs.name, "--state", str(states[1]),
                                            "--source", dbs.source, log=logs[1], env=kill_env(1)))
            wait_for("the standby to wait", lambda: "standing by; active: pid " in logs[1].read_text(), logs[1])
            listed = changefeed_cli("status", "--name", dbs.name, "--state", str(states[0]))
            assert "standby: pid " in listed.stdout and f"active: pid {runners[0].pid} " in listed.stdout, listed
            listed = changefeed_cli("list", "--state", str(states[0]))
            assert f"active pid {runners[0].pid} " in listed.stdout and "; standby pid " in listed.stdout, listed
            active = 0
            for kill, point in enumerate(kills):
                standby = 1 - active
                before_log = logs[standby].read_text().count("taking the feed over")
                if point == "random":
                    time.sleep(random.uniform(0.5, 2.5))
                    with_signal(runners[active], signal.SIGKILL)  # the whole runner: driver, JVM, workers
                assert runners[active].wait(timeout=180) == -signal.SIGKILL, (point, logs[active].read_text()[-3000:])
                at_kill = _replicated(dbs)
                killed = time.monotonic()
                wait_for("the standby to take over", lambda: logs[standby].read_text().count("taking the feed over")
                         > before_log, logs[standby], timeout=120)
                wait_for("new rows applied by the new active runner", lambda: _replicated(dbs) > at_kill + 20,
                         logs[standby], timeout=180)
                print(f"takeover {kill + 1}: {time.monotonic() - killed:.1f}s from the kill to new rows")
                _money_whole(dbs)
                # the killed host comes back as a standby (its own state folder, its stale checkpoint)
                def turns(text: str) -> int:  # standing by, or taking over at once (the other one died meanwhile)
                    return text.count("standing by; active") + text.count("taking the feed over")

                stood = turns(logs[active].read_text())
                runners[active] = start_changefeed("run", "--standby", "--name", dbs.name, "--state",
                                                   str(states[active]), log=logs[active], env=kill_env(kill + 2))
                wait_for("the old runner to stand by", lambda: turns(logs[active].read_text()) > stood,
                         logs[active], timeout=120)
                active = standby
        except BaseException:
            _stop_all(*runners)
            raise
    try:
        # A clean stop of the active runner (its own process: it stops its JVM) ends its lease: the
        # standby takes over at once, without ending the stopping runner's sessions under it.
        taken = logs[1 - active].read_text().count("taking the feed over")
        runners[active].send_signal(signal.SIGTERM)
        assert runners[active].wait(timeout=120) == 0, logs[active].read_text()[-3000:]
        wait_for("the standby to take over from the clean stop", lambda: logs[1 - active].read_text().count(
            "taking the feed over") > taken, logs[1 - active], timeout=60)
        wait_for("the replica to catch up", lambda: fingerprint(dbs.source, "public.ledger")
                 == fingerprint(dbs.sink, "public.ledger"), logs[1 - active], timeout=180)
        runners[1 - active].send_signal(signal.SIGTERM)
        assert runners[1 - active].wait(timeout=120) == 0, logs[1 - active].read_text()[-3000:]
    finally:
        _stop_all(*runners)
    assert fingerprint(dbs.source, "public.accounts") == fingerprint(dbs.sink, "public.accounts")
    _money_whole(dbs)
    with dbs.dst() as d:
        rows, ends = d.execute("SELECT count(*), count(DISTINCT end_lsn) FROM changefeed.progress WHERE feed = %s",
                               (dbs.name,)).fetchone()  # type: ignore[misc]
        chunks = d.execute("SELECT count(*), count(DISTINCT table_name) FROM changefeed.snapshot_chunks "
                           "WHERE feed = %s", (dbs.name,)).fetchone()
    assert rows == ends, "a batch was recorded twice"
    assert chunks == (2, 2), f"the snapshot was read again by a runner that took over: {chunks}"
    with dbs.src() as c:
        held = lease.current(c, dbs.name)
    assert held is not None and held.epoch >= 5 and held.released, held  # a term per takeover; released at the end
    for log in logs:
        assert_no_traceback(log.read_text())


def test_a_frozen_runner_is_taken_over_by_a_standby_and_lands_nothing_when_woken(dbs: Dbs, tmp_path: Path,
                                                                                  spark_server: str) -> None:
    _setup(dbs)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    written: list[int] = [0]
    with writing(moving_money(ACCOUNTS, 3), dbs.source, written):
        # frozen in the middle of a batch: its transaction on the replica open, holding the feed's lock there
        a = start_changefeed("run", "--name", dbs.name, "--state", str(tmp_path / "a"), "--source", dbs.source,
                             "--sink", dbs.sink, "--tables", "public.accounts,public.ledger", "--lease", "3s",
                             log=logs[0], env={"CHANGEFEED_STOP_AT": "before_sink_commit:3",
                                               "CHANGEFEED_FAULT_DIR": str(tmp_path),
                                               "CHANGEFEED_FAULT_ARMED": str(tmp_path / "armed")})
        b: subprocess.Popen[bytes] | None = None
        try:
            wait_for("rows on the replica", lambda: _replicated(dbs) > 50, logs[0])
            b = start_changefeed("run", "--standby", "--name", dbs.name, "--state", str(tmp_path / "b"), "--source",
                                 dbs.source, "--master", spark_server, log=logs[1])
            wait_for("the standby to wait", lambda: "standing by; active: pid " in logs[1].read_text(), logs[1])
            (tmp_path / "armed").touch()  # it freezes from now on, a standby waiting
            claimed = taken_over_while_frozen(dbs, a, logs, tmp_path, lambda: _replicated(dbs))
        except BaseException:
            _stop_all(a, *([b] if b else []))
            raise
    assert b is not None
    try:
        wait_for("the replica to catch up", lambda: fingerprint(dbs.source, "public.ledger")
                 == fingerprint(dbs.sink, "public.ledger"), logs[1], timeout=180)
        b.send_signal(signal.SIGTERM)
        assert b.wait(timeout=120) == 0, logs[1].read_text()[-3000:]
    finally:
        _stop_all(a, b)
    text = logs[0].read_text()
    assert re.search(r"lease \(term 1\)[^\n]*(held by|taken over by) pid \d+", text), text[-3000:]
    assert_no_traceback(text)
    with dbs.dst() as d:
        late = d.execute("SELECT count(*) FROM changefeed.progress WHERE feed = %s AND applied_at > %s "
                         "AND epoch < %s", (dbs.name, claimed[1], claimed[0])).fetchone()
        terms = d.execute("SELECT array_agg(DISTINCT epoch ORDER BY epoch) FROM changefeed.progress WHERE feed = %s",
                          (dbs.name,)).fetchone()
        rows, ends = d.execute("SELECT count(*), count(DISTINCT end_lsn) FROM changefeed.progress WHERE feed = %s",
                               (dbs.name,)).fetchone()  # type: ignore[misc]
    assert late == (0,) and rows == ends  # nothing of the old term landed after the claim; no batch twice
    assert terms is not None and terms[0][0] == 1 and terms[0][-1] == claimed[0], terms
    assert fingerprint(dbs.source, "public.accounts") == fingerprint(dbs.sink, "public.accounts")
    _money_whole(dbs)


def test_a_request_or_pause_from_any_host_reaches_the_active_runner(dbs: Dbs, tmp_path: Path,
                                                                     spark_server: str) -> None:
    """A third host (the feed's definition, no runner): its `snapshot` request is taken in by the
    active runner; its `pause` stops the active runner and holds the standby; its `resume` runs the
    feed there while the standby keeps waiting."""
    _setup(dbs)
    logs = [tmp_path / "a.log", tmp_path / "b.log", tmp_path / "c.log"]
    written: list[int] = [0]
    with writing(moving_money(ACCOUNTS, 3), dbs.source, written):
        a = start_changefeed("run", "--name", dbs.name, "--state", str(tmp_path / "a"), "--source", dbs.source,
                             "--sink", dbs.sink, "--tables", "public.accounts,public.ledger", "--lease", "3s",
                             "--master", spark_server, log=logs[0])
        runners = [a]
        try:
            wait_for("rows on the replica", lambda: _replicated(dbs) > 50, logs[0])
            runners.append(start_changefeed("run", "--standby", "--name", dbs.name, "--state", str(tmp_path / "b"),
                                            "--source", dbs.source, log=logs[1]))
            wait_for("the standby to wait", lambda: "standing by; active: pid " in logs[1].read_text(), logs[1])
            (tmp_path / "c" / dbs.name).mkdir(parents=True)
            shutil.copy(tmp_path / "a" / dbs.name / "feed.json", tmp_path / "c" / dbs.name / "feed.json")
            done = logs[0].read_text().count("snapshot public.accounts: done")
            asked = changefeed_cli("snapshot", "--name", dbs.name, "--state", str(tmp_path / "c"), "--tables",
                                   "public.accounts")
            assert asked.returncode == 0, asked.stderr
            wait_for("the active runner to read the table again",
                     lambda: logs[0].read_text().count("snapshot public.accounts: done") > done, logs[0])
            paused = changefeed_cli("pause", "--name", dbs.name, "--state", str(tmp_path / "c"))
            assert paused.returncode == 0 and "paused" in paused.stdout and "note:" not in paused.stderr, paused
            assert a.wait(timeout=120) == 0, logs[0].read_text()[-3000:]
            assert re.search(r"paused \(by pid \d+", logs[0].read_text()), logs[0].read_text()[-3000:]
            wait_for("the standby to see the pause", lambda: "the feed is paused" in logs[1].read_text(), logs[1])
            shown = changefeed_cli("status", "--name", dbs.name, "--state", str(tmp_path / "a"))
            assert re.search(r"paused \(by pid \d+", shown.stdout), shown.stdout  # (a's own folder: stopped)
            at_pause = _replicated(dbs)
            time.sleep(6)  # twice the lease: a standby that ignored the pause would have taken over by now
            assert "taking the feed over" not in logs[1].read_text() and _replicated(dbs) == at_pause
            runners.append(start_changefeed("resume", "--name", dbs.name, "--state", str(tmp_path / "c"),
                                            "--master", spark_server, log=logs[2]))
            wait_for("rows after the resume", lambda: _replicated(dbs) > at_pause + 20, logs[2])
        except BaseException:
            _stop_all(*runners)
            raise
    try:
        wait_for("the replica to catch up", lambda: _replicated(dbs) >= written[0], logs[2], timeout=180)
        for p in runners[1:]:  # the standby first: else it takes over from the clean stop
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=120) == 0
    finally:
        _stop_all(*runners)
    assert "taking the feed over" not in logs[1].read_text()
    assert fingerprint(dbs.source, "public.accounts") == fingerprint(dbs.sink, "public.accounts")
    _money_whole(dbs)
    for log in logs:
        assert_no_traceback(log.read_text())


def test_standby_bad_input(dbs: Dbs, tmp_path: Path) -> None:
    """A standby of a feed no runner ever ran, and a second definition under a feed's name: clear
    errors, nothing created."""
    proc = changefeed_cli("run", "--standby", "--name", "nosuchfeed", "--state", str(tmp_path / "s"),
                          "--source", dbs.source)
    assert proc.returncode != 0 and "no feed named nosuchfeed on this source" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "s" / "nosuchfeed").exists()

    _setup(dbs)
    made = changefeed_cli("create", "--name", dbs.name, "--state", str(tmp_path / "one"), "--source", dbs.source,
                          "--sink", dbs.sink, "--tables", "public.accounts")
    assert made.returncode == 0, made.stderr
    other = changefeed_cli("create", "--name", dbs.name, "--state", str(tmp_path / "two"), "--source", dbs.source,
                           "--sink", dbs.sink, "--tables", "public.ledger")
    assert other.returncode == 64 and "different --tables" in other.stderr, other.stderr
    assert not (tmp_path / "two" / dbs.name).exists()
    with dbs.src() as c:
        slots = c.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE %s",
                          (f"%{dbs.name}%",)).fetchone()
    assert slots == (1,)
    with dbs.src() as c:  # PostgreSQL 17+: a failover slot, which a synchronized standby keeps
        failover = c.execute("SELECT failover FROM pg_replication_slots WHERE slot_name LIKE %s",
                             (f"%{dbs.name}%",)).fetchone()
    assert failover == (True,)
    loose = changefeed_cli("run", "--standby", "--name", "loose", "--state", str(tmp_path / "w"), "--source",
                           dbs.source, "--sink", "kafka://127.0.0.1:9?delivery=at_least_once", "--tables",
                           "public.accounts")
    assert loose.returncode == 64 and "a standby cannot take it over yet" in loose.stderr, loose.stderr
    short = changefeed_cli("run", "--name", dbs.name, "--state", str(tmp_path / "one"), "--lease", "1s")
    assert short.returncode == 64 and "--lease must be at least" in short.stderr, short.stderr
