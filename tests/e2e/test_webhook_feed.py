"""Webhook sink end to end: a feed process POSTs to a real HTTP server on loopback that fails on
purpose (500, 429, a hang past the client's timeout, "store then fail", a dropped connection), and
is killed (SIGKILL) once in the middle; every change arrives, in per-key order, and a message
arrives twice only under the same idempotency key. A 400 stops the feed with the status shown."""
from __future__ import annotations

import json
import signal
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from support.feeds import changefeed_cli, start_changefeed, wait_for
from support.servers import Dbs
from support.webhooks import Receiver

pytestmark = pytest.mark.timeout(600)


OPTIONS = "flush_messages=40&retry_backoff=50ms&retry_max_backoff=300ms&timeout=1s&retry_max=inf&resolved=true"


def replay(messages: list[tuple[str, dict[str, Any]]]) -> dict[int, int]:
    """Apply json-envelope messages in order, as a consumer would: key id -> v."""
    rows: dict[int, int] = {}
    for _, m in messages:
        if "resolved" in m:
            continue
        if m["after"] is None:
            rows.pop(m["key"][0], None)
        else:
            rows[m["key"][0]] = m["after"]["v"]
    return rows


def source_rows(dbs: Dbs) -> dict[int, int]:
    with dbs.src() as c:
        return {r[0]: r[1] for r in c.execute("SELECT id, v FROM t")}


def test_every_change_arrives_in_key_order_through_faults_and_a_kill(dbs: Dbs, tmp_path: Path,
                                                                      receiver: tuple[Receiver, str],
                                                                      spark_server: str) -> None:
    rec, url = receiver
    rec.plan = {2: "500", 4: "429", 6: "hang", 8: "store_then_500", 10: "close", 13: "500", 14: "500", 16: "hold"}
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL)")
        c.execute("INSERT INTO t SELECT g, 0 FROM generate_series(1, 200) g")  # the snapshot
    state, log = str(tmp_path / "state"), tmp_path / "run.log"
    args = ("run", "--name", dbs.name, "--state", state, "--source", dbs.source, "--sink", f"{url}?{OPTIONS}",
            "--tables", "public.t", "--resolved", "500ms")
    # v counts each key's versions: 0 from the snapshot, then 1, 2, ... in commit order
    written: dict[int, list[int]] = defaultdict(lambda: [0])

    def workload(rounds: range) -> None:
        with dbs.src() as c:
            for r in rounds:
                with c.transaction():
                    c.execute("UPDATE t SET v = v + 1 WHERE id %% 7 = %s", (r % 7,))
                    c.execute("INSERT INTO t VALUES (%s, 1)", (1000 + r,))
                    if r % 5 == 4:
                        c.execute("DELETE FROM t WHERE id = %s", (1000 + r - 2,))
        with dbs.src() as c:
            for key, v in c.execute("SELECT id, v FROM t"):
                written[key] = list(range(1 if key >= 1000 else 0, v + 1))

    p = start_changefeed(*args, log=log)
    try:
        # the snapshot first: its rows and the changes racing it may arrive in either order (docs/sinks.md)
        wait_for("the snapshot at the endpoint", lambda: len(replay(rec.messages())) == 200, log)
        workload(range(0, 30))
        wait_for("a request to hold", lambda: rec.held.wait(0.1), log)
        p.send_signal(signal.SIGKILL)  # in the middle of a request, mid-batch
        p.wait(30)
        p = start_changefeed(*args, "--master", spark_server, log=log)  # stopped, not killed: on the shared server
        workload(range(30, 60))
        expected = source_rows(dbs)
        wait_for("the endpoint to hold the source's rows", lambda: replay(rec.messages()) == expected, log)
        p.send_signal(signal.SIGTERM)
        assert p.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    assert {"500", "429", "hang", "store_then_500", "close", "hold"} <= set(rec.faults)  # every fault was met

    messages = rec.messages()
    changes = [(k, m) for k, m in messages if "resolved" not in m]
    # per-key order: each key's versions arrive in commit order (a replayed batch may repeat a run of them)
    versions: dict[int, list[int]] = defaultdict(list)
    for _, m in changes:
        if m["after"] is not None:
            versions[m["key"][0]].append(m["after"]["v"])
    for key, vs in versions.items():
        distinct = sorted(set(vs))
        if key in expected:
            assert distinct == written[key], (key, vs)  # every version arrived
        firsts = [v for i, v in enumerate(vs) if v not in vs[:i]]
        assert firsts == distinct, f"key {key} out of order: {vs}"
    # a message seen twice came under one idempotency key (a retry or a replay of the same request)
    keys_of: dict[str, set[str]] = defaultdict(set)
    for k, m in messages:
        keys_of[json.dumps(m, sort_keys=True)].add(k)
    assert all(len(ks) == 1 for ks in keys_of.values()), [ks for ks in keys_of.values() if len(ks) > 1][:3]
    # resolved messages never go back, and each covers every change delivered before it
    resolved = [int(m["resolved"]) for _, m in messages if "resolved" in m]
    assert resolved and resolved == sorted(resolved)
    last = 0
    for _, m in messages:
        if "resolved" in m:
            last = int(m["resolved"])
        else:
            assert int(m["updated"]) > last or m["op"] == "r", (m, last)

    status = json.loads(changefeed_cli("status", "--name", dbs.name, "--state", state, "--json").stdout)
    # (the batch the kill left in flight is planned anew after it: one batch may hold all that came after)
    assert status["batches"] >= 1 and status["checkpoint_lsn"] and status["snapshot"]["public.t"]["rows"] == 200


@pytest.mark.usefixtures("warm_spark")
def test_a_400_stops_the_feed_with_the_status_shown(dbs: Dbs, tmp_path: Path,
                                                     receiver: tuple[Receiver, str]) -> None:
    rec, url = receiver
    rec.always = "400"
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL)")
        c.execute("INSERT INTO t VALUES (1, 0)")
    state = str(tmp_path / "state")
    r = changefeed_cli("run", "--name", dbs.name, "--state", state, "--source", dbs.source,
                       "--sink", f"{url}?{OPTIONS}", "--tables", "public.t", "--available-now")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "400" in r.stderr and "bad payload: field x" in r.stderr, r.stderr[-2000:]
    assert r.stderr.startswith("changefeed: error:") and "hint:" in r.stderr, r.stderr[-2000:]
    assert not [line for line in (r.stdout + r.stderr).splitlines()  # the one error, Spark's log elsewhere
                if any(w in line for w in ("Traceback", "at org.apache", "ERROR", "WARN", "PythonException"))], r.stderr
    assert rec.seen == 1  # not retried
    status = json.loads(changefeed_cli("status", "--name", dbs.name, "--state", state, "--json").stdout)
    assert status["state"].startswith("failed") and "400" in status["state"], status
    assert status["batches"] == 0


@pytest.mark.usefixtures("warm_spark")
def test_an_endpoint_down_for_a_while_is_waited_out(dbs: Dbs, tmp_path: Path,
                                                     receiver: tuple[Receiver, str]) -> None:
    """The endpoint answers 500 longer than the client's own retries last (retry_max=2): the batch
    fails with a transient error, and the runner waits and sends it again, in the same process,
    until the endpoint is back; status says retrying meanwhile and names the sink."""
    rec, url = receiver
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL)")
        c.execute("INSERT INTO t SELECT g, 0 FROM generate_series(1, 50) g")
    state, log = str(tmp_path / "state"), tmp_path / "run.log"
    sink = f"{url}?flush_messages=40&retry_backoff=50ms&retry_max_backoff=200ms&timeout=1s&retry_max=2"
    feed = start_changefeed("run", "--name", dbs.name, "--state", state, "--source", dbs.source, "--sink", sink,
                            "--tables", "public.t", "--retry-max-backoff", "1s", log=log)
    try:
        wait_for("the snapshot delivered", lambda: len(replay(rec.messages())) == 50, log)
        rec.always = "500"
        with dbs.src() as c:
            c.execute("UPDATE t SET v = v + 1 WHERE id <= 25")
            c.execute("DELETE FROM t WHERE id > 45")

        def retrying() -> str | None:
            out = changefeed_cli("status", "--name", dbs.name, "--state", state, "--json")
            st = json.loads(out.stdout) if out.returncode == 0 else {}
            return st["state"] if "retrying" in st.get("state", "") else None

        assert "the sink" in wait_for("status to say retrying", retrying, log, timeout=120)
        time.sleep(2)
        rec.always = ""
        wait_for("every change delivered", lambda: replay(rec.messages()) == source_rows(dbs), log, timeout=120)
        wait_for("the feed to say it carries on", lambda: "is back; carrying on" in log.read_text(), log)
        assert feed.poll() is None, log.read_text()[-3000:]
        assert "Traceback" not in log.read_text()
    finally:
        feed.send_signal(signal.SIGTERM)
        rc = feed.wait(timeout=120)
    assert rc == 0, log.read_text()[-3000:]


def test_capture_ddl_sends_the_schema_change_between_the_rows_around_it(dbs: Dbs, tmp_path: Path,
                                                                      receiver: tuple[Receiver, str]) -> None:
    import base64

    rec, url = receiver
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY, v int, a text)")
    log = tmp_path / "run.log"
    p = start_changefeed("run", "--name", dbs.name, "--state", str(tmp_path / "state"), "--source", dbs.source,
                         "--sink", f"{url}?flush_messages=10", "--tables", "public.t", "--capture-ddl", log=log)
    try:
        wait_for("the (empty) snapshot read", lambda: "snapshot public.t: done" in log.read_text(), log)
        with dbs.src() as c:  # (rows a snapshot read sees come as `r`, their inserts left out)
            c.execute("INSERT INTO t VALUES (1, 1, 'x')")
            with c.transaction():  # the change and the rows around it, in one transaction
                c.execute("INSERT INTO t VALUES (2, 2, 'y')")
                c.execute("ALTER TABLE t RENAME COLUMN a TO b")
                c.execute("INSERT INTO t VALUES (3, 3, 'z')")
            c.execute("INSERT INTO t VALUES (4, 4, 'w')")
        wait_for("four rows", lambda: sum(1 for _, m in rec.messages() if m.get("op") == "c") == 4, log)
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 0, log.read_text()[-3000:]
    events = [m for _, m in rec.messages() if m.get("op") in ("c", "m")]
    assert [m["op"] for m in events] == ["c", "c", "m", "c", "c"], events
    ddl = events[2]["message"]
    assert ddl["prefix"] == "changefeed.ddl"
    content = json.loads(base64.b64decode(ddl["content"]))
    assert content["tag"] == "ALTER TABLE" and content["renamed_columns"] == [["a", "b"]]
    assert (content["schema"], content["table"], content["rewrite"]) == ("public", "t", False)
    assert "RENAME COLUMN a TO b" in content["statement"]
    assert "a" in events[1]["after"] and "b" in events[3]["after"]
