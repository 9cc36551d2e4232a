"""A standby takes over a feed into Delta Lake, five times: it carries on from the lake's own ledger
(no Spark checkpoint of the feed on its host, or a stale one), also when the active runner died
between two tables' commits of a batch, and every change lands once; a runner frozen past its
lease, about to commit, lands nothing once woken (the lease term in each table's commits proves
it) and stops with LeaseLost."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from support.feeds import assert_no_traceback, changefeed_cli, kill_running, start_changefeed, wait_for
from support.servers import Dbs
from support.standby import kill_turns, standby_starter, stop_both, turn_env
from support.writers import moving_money, writing

pytestmark = pytest.mark.timeout(900)
ACCOUNTS, BALANCE = 20, 1000
# The active runner ends five times: first between two of a batch's commits (a table's and the next,
# or the feed's ledger row), so the standby's first batch, planned anew from the lake's ledger, reaches
# back over rows a table holds already; then at random and between the batch's commit and the slot's advance.
KILLS = ["delta_table_committed:7", "random", "after_sink_commit:4", "before_sink_commit:4", "random"]


def _setup(dbs: Dbs) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE ledger (id bigint PRIMARY KEY, v text NOT NULL)")
        c.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        c.execute("INSERT INTO accounts SELECT g, %s FROM generate_series(0, %s) g", (BALANCE, ACCOUNTS - 1))


def _rows(lake: Path, table: str) -> list[dict[str, Any]]:
    from deltalake import DeltaTable

    if not DeltaTable.is_deltatable(str(lake / table)):
        return []
    rows: list[dict[str, Any]] = pa.table(DeltaTable(str(lake / table)).to_pyarrow_table()).to_pylist()
    return rows


def _top(lake: Path) -> int:
    return max((r["id"] for r in _rows(lake, "public.ledger")), default=0)



def _feed_ledger(lake: Path, feed: str) -> list[dict[str, Any]]:
    """The feed's ledger rows in the lake, as recorded (not de-duplicated)."""
    return [json.loads(r["entry"]) for r in _rows(lake, f"_changefeed/{feed}")]


def test_a_standby_takes_over_a_delta_feed_exactly_once(dbs: Dbs, tmp_path: Path, spark_server: str) -> None:
    _setup(dbs)
    lake = tmp_path / "lake"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    states = [tmp_path / "a", tmp_path / "b"]
    faults, takeovers = tmp_path / "faults", []
    written = [0]
    runners: list[subprocess.Popen[bytes]] = []
    first = changefeed_cli("run", "--name", dbs.name, "--state", str(states[0]), "--source", dbs.source, "--sink",
                           f"delta://{lake}?mode=changelog", "--tables", "public.ledger,public.accounts",
                           "--lease", "3s", "--available-now", "--master",
                           spark_server)  # the snapshot, before changes race it (rows of both would arrive)
    assert first.returncode == 0, first.stderr[-3000:]
    try:
        with writing(moving_money(ACCOUNTS), dbs.source, written):
            runners.append(start_changefeed("run", "--name", dbs.name, "--state", str(states[0]), log=logs[0],
                                            env=turn_env(KILLS, 0, faults)))
            wait_for("the first runner's batches", lambda: "batches since start" in logs[0].read_text(), logs[0])

            standby = standby_starter(dbs.name, dbs.source, states, logs)
            runners.append(standby(1, turn_env(KILLS, 1, faults)))
            active = kill_turns(KILLS, runners, logs, faults, standby, lambda: _top(lake), written,
                                lambda turn, text: takeovers.append(text))
        wait_for("every row in the lake", lambda: _top(lake) >= written[0], logs[active], timeout=180)
        stop_both(runners, logs, active)
    finally:
        kill_running(runners)
    # the first takeover on a host without a checkpoint, later ones on a host whose checkpoint is stale
    assert "no checkpoint" in takeovers[0], takeovers[0][-3000:]
    assert any("older than the sink" in text for text in takeovers[1:]), takeovers[-1][-3000:]
    n = written[0]
    ledger = [r for r in _rows(lake, "public.ledger") if r["_op"] == "c"]
    assert sorted(r["id"] for r in ledger) == list(range(1, n + 1)), f"{len(ledger)} ledger rows for {n}"
    accounts = _rows(lake, "public.accounts")
    assert sum(1 for r in accounts if r["_op"] == "u") == 2 * n, "an account change missing or twice"
    last: dict[int, tuple[Any, ...]] = {}
    for r in sorted(accounts, key=lambda r: (r["_commit_ts"], r["_seq"])):
        last[r["id"]] = (r["id"], r["balance"])
    with psycopg.connect(dbs.source) as c:
        assert sorted(last.values()) == sorted(c.execute("SELECT id, balance FROM accounts").fetchall())
    entries = _feed_ledger(lake, dbs.name)
    ends = [e["progress"]["end_lsn"] for e in entries]
    assert len(ends) == len(set(ends)), "a batch recorded twice in the feed's ledger"
    assert sum(len(e["progress"]["chunks"]) for e in entries) == 2, "the snapshot was read again"
    for log in logs:
        assert_no_traceback(log.read_text())


def test_a_frozen_delta_runner_lands_nothing_when_woken(dbs: Dbs, tmp_path: Path, spark_server: str) -> None:
    from deltalake import DeltaTable

    _setup(dbs)
    lake = tmp_path / "lake"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    written = [0]
    b: subprocess.Popen[bytes] | None = None
    with writing(moving_money(ACCOUNTS), dbs.source, written):
        # frozen in the driver after it checked a table's term and before it commits there
        a = start_changefeed("run", "--name", dbs.name, "--state", str(tmp_path / "a"), "--source", dbs.source,
                             "--sink", f"delta://{lake}?mode=mirror&buckets=4", "--tables",
                             "public.ledger,public.accounts", "--lease", "3s", log=logs[0],
                             env={"CHANGEFEED_STOP_AT": "delta_term_checked:3", "CHANGEFEED_FAULT_DIR": str(tmp_path),
                                  "CHANGEFEED_FAULT_ARMED": str(tmp_path / "armed")})
        try:
            wait_for("rows in the lake", lambda: _top(lake) > 0, logs[0])
            b = start_changefeed("run", "--standby", "--name", dbs.name, "--state", str(tmp_path / "b"), "--source",
                                 dbs.source, "--master", spark_server, log=logs[1])
            wait_for("the standby to wait", lambda: "standing by; active: pid " in logs[1].read_text(), logs[1])
            (tmp_path / "armed").touch()  # it freezes from now on, a standby waiting
            wait_for("the runner to freeze", lambda: (tmp_path / ".stopped-groups").exists(), logs[0])
            frozen_at = _top(lake)
            wait_for("the standby to take over", lambda: "taking the feed over" in logs[1].read_text(), logs[1],
                     timeout=60)
            wait_for("new rows from the standby", lambda: _top(lake) > frozen_at + 20, logs[1], timeout=180)
            for group in (tmp_path / ".stopped-groups").read_text().split():
                os.killpg(int(group), signal.SIGCONT)
            code = a.wait(timeout=120)
            assert code == 2, f"the woken runner exited {code}:\n{logs[0].read_text()[-3000:]}"
        except BaseException:
            kill_running([a, *([b] if b else [])])
            raise
    assert b is not None
    try:
        wait_for("every row in the lake", lambda: _top(lake) >= written[0], logs[1], timeout=180)
        b.send_signal(signal.SIGTERM)
        assert b.wait(timeout=120) == 0, logs[1].read_text()[-3000:]
    finally:
        kill_running([a, b])
    text = logs[0].read_text()
    assert re.search(r"lease \(term 1\)[^\n]*(held by|taken over by)", text), text[-3000:]
    assert_no_traceback(text)
    # In every table (and the feed's ledger), once a later term claimed it, no commit of term 1 followed.
    for table in ("public.ledger", "public.accounts", f"_changefeed/{dbs.name}"):
        history = sorted(DeltaTable(str(lake / table)).history(), key=lambda h: h["version"])
        terms = [int(h["changefeed.term"]) for h in history if "changefeed.term" in h]
        claimed = next(i for i, t in enumerate(terms) if t > 1)
        assert all(t > 1 for t in terms[claimed:]), (table, terms)
    n = written[0]
    assert sorted(r["id"] for r in _rows(lake, "public.ledger")) == list(range(1, n + 1))
    accounts = _rows(lake, "public.accounts")
    assert sum(r["balance"] for r in accounts) == ACCOUNTS * BALANCE and len(accounts) == ACCOUNTS
    with psycopg.connect(dbs.source) as c:
        assert sorted((r["id"], r["balance"]) for r in accounts) == sorted(
            c.execute("SELECT id, balance FROM accounts").fetchall())
