"""A standby takes over a webhook feed: the active runner SIGKILLed, then the runner that took over
frozen in the middle of a batch past its lease; each time a standby carries on from the ledger on
the source, re-sending the batch in flight cut as before, so a receiver that drops repeated
idempotency keys gets every change exactly once. The frozen runner, woken, sends nothing more
(its requests check the lease first) and stops with LeaseLost."""
from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from support.feeds import assert_no_traceback, changefeed_cli, kill_running, start_changefeed, wait_for
from support.servers import Dbs
from support.webhooks import Receiver
from support.writers import moving_money, writing

pytestmark = pytest.mark.timeout(900)
ACCOUNTS = 20
OPTIONS = "flush_messages=50&retry_backoff=50ms&retry_max_backoff=300ms&timeout=2s&retry_max=inf"


def _ids(rec: Receiver) -> list[int]:
    """The ledger ids the receiver got (repeated keys dropped), in arrival order."""
    return [m["key"][0] for _, m in rec.messages() if m.get("table") == "public.ledger" and m.get("op") == "c"]



def test_a_standby_takes_over_a_webhook_feed_and_the_receiver_sees_each_change_once(
        dbs: Dbs, tmp_path: Path, receiver: tuple[Receiver, str], spark_server: str) -> None:
    rec, url = receiver
    with dbs.src() as c:
        c.execute("CREATE TABLE ledger (id bigint PRIMARY KEY, v text NOT NULL)")
        c.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        c.execute("INSERT INTO accounts SELECT g, 1000 FROM generate_series(0, %s) g", (ACCOUNTS - 1,))
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    states = [tmp_path / "a", tmp_path / "b"]
    first = changefeed_cli("run", "--name", dbs.name, "--state", str(states[0]), "--source", dbs.source, "--sink",
                           f"{url}?{OPTIONS}", "--tables", "public.ledger,public.accounts", "--lease", "3s",
                           "--available-now", "--master", spark_server)  # the snapshot, before changes race it
    assert first.returncode == 0, first.stderr[-3000:]
    written = [0]
    runners: list[subprocess.Popen[bytes]] = []
    try:
        with writing(moving_money(ACCOUNTS), dbs.source, written):
            # killed in the middle of a batch's requests, once a standby waits: the batch in flight
            # stays planned in this host's checkpoint
            runners.append(start_changefeed("run", "--name", dbs.name, "--state", str(states[0]), log=logs[0],
                                            env={"CHANGEFEED_KILL_AT": "webhook_request:5",
                                                 "CHANGEFEED_FAULT_DIR": str(tmp_path / "kill"),
                                                 "CHANGEFEED_FAULT_ARMED": str(tmp_path / "armed")}))
            wait_for("changes at the receiver", lambda: len(_ids(rec)) > 100, logs[0])
            # the standby freezes in the middle of its requests once it runs the feed and sent changes
            # of its own (past the batch in flight it re-sends, however many requests that takes)
            runners.append(start_changefeed("run", "--standby", "--name", dbs.name, "--state", str(states[1]),
                                            "--source", dbs.source, log=logs[1],
                                            env={"CHANGEFEED_STOP_AT": "webhook_request:2",
                                                 "CHANGEFEED_FAULT_DIR": str(tmp_path),
                                                 "CHANGEFEED_FAULT_ARMED": str(tmp_path / "armed-b")}))
            wait_for("the standby to wait", lambda: "standing by; active: pid " in logs[1].read_text(), logs[1])
            (tmp_path / "kill").mkdir()
            (tmp_path / "armed").touch()
            assert runners[0].wait(timeout=120) == -signal.SIGKILL, logs[0].read_text()[-3000:]
            at_kill = max(_ids(rec), default=0)
            wait_for("the standby to take over", lambda: "taking the feed over" in logs[1].read_text(), logs[1],
                     timeout=120)
            wait_for("changes sent by the runner that took over", lambda: max(_ids(rec), default=0) > at_kill,
                     logs[1], timeout=120)
            (tmp_path / "armed-b").touch()
            # The first host comes back as a standby, and takes over from the frozen runner. The batch
            # in flight in its checkpoint was sent further by the runner that froze (whose plan, made
            # later, reached further): it is planned anew, not replayed smaller.
            logs[0].write_text("")
            runners[0] = start_changefeed("run", "--standby", "--name", dbs.name, "--state", str(states[0]),
                                          log=logs[0])
            wait_for("the runner that took over to freeze", lambda: (tmp_path / ".stopped-groups").exists(), logs[1])
            wait_for("the first host to take over", lambda: "taking the feed over" in logs[0].read_text(), logs[0],
                     timeout=120)
            frozen_at = written[0]
            wait_for("changes written after the freeze", lambda: max(_ids(rec), default=0) > frozen_at, logs[0],
                     timeout=180)
            for group in (tmp_path / ".stopped-groups").read_text().split():
                os.killpg(int(group), signal.SIGCONT)
            code = runners[1].wait(timeout=120)
            assert code == 2, f"the woken runner exited {code}:\n{logs[1].read_text()[-3000:]}"
        wait_for("every row at the receiver", lambda: max(_ids(rec), default=0) >= written[0], logs[0], timeout=180)
        runners[0].send_signal(signal.SIGTERM)
        assert runners[0].wait(timeout=120) == 0, logs[0].read_text()[-3000:]
    finally:
        kill_running(runners)
    woken = logs[1].read_text()
    assert re.search(r"lease \(term \d+\)[^\n]*(held by|taken over by)", woken), woken[-3000:]
    assert_no_traceback(woken + logs[0].read_text())
    took = logs[0].read_text()  # its checkpoint's batch in flight planned anew, or the feed moved past it
    assert "last batch was in flight" in took or "older than the sink" in took, took[-3000:]
    ids = sorted(_ids(rec))
    twice = {i for i in ids if ids.count(i) > 1} if len(ids) != len(set(ids)) else set()
    carriers = sorted({k for k, m in rec.messages() if m.get("table") == "public.ledger" and m["key"][0] in twice})
    assert ids == list(range(1, written[0] + 1)), \
        f"{len(ids)} ledger ids for {written[0]} rows, {len(set(ids))} distinct; requests with the ids twice: " \
        f"{carriers}\n{logs[0].read_text()[-2000:]}\n{woken[-2000:]}"
    repeated = len(rec.stored) - len({k for k, _ in rec.stored})
    assert repeated > 0, "no request was sent twice: the takeovers re-sent nothing in flight"
