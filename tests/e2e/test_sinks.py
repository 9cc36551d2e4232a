"""One feed, three sinks (a replica, Kafka exactly once, a Delta change log) from one slot, under a
writer moving money, the runner SIGKILLed at random and at the points between the sinks' commits;
then its checkpoint lost between two sinks' commits. Every sink gets every change once, each
transaction carries the same commit timestamp in Kafka and in the lake, the sinks record the same
resolved timestamps, and money is never half-moved."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from changefeed.local.kafka import LocalKafka, committed, read_partition
from support.feeds import assert_no_traceback, changefeed_cli, kill_running, start_changefeed, status_of, wait_for
from support.servers import Dbs, free_port
from support.standby import kill_turns, standby_starter, stop_both, turn_env
from support.writers import moving_money, writing

pytestmark = pytest.mark.timeout(900)
ACCOUNTS, BALANCE = 20, 1000
# random, then inside the sinks' commits: a replica or Kafka committed and the other not (the two
# write side by side), both committed and the lake not, the lake's tables committed and its ledger not
KILLS = ["random", "after_sink_commit:7", "before_sink_commit:8", "delta_table_committed:3"]


class Sinks:
    def __init__(self, dbs: Dbs, kafka: LocalKafka, lake: Path) -> None:
        self.dbs, self.kafka, self.lake = dbs, kafka, lake
        tag = uuid.uuid4().hex[:8]
        self.prefix, self.progress = f"m{tag}.", f"progress-{tag}"
        self.args = ["--sink", f"dr={dbs.sink}",
                     "--sink", f"events=kafka://{kafka.bootstrap}?topic_prefix={self.prefix}&progress_topic="
                               f"{self.progress}&topic_partitions=1",
                     "--sink", f"lake=delta://{lake}?mode=changelog"]

    def kafka_ledger(self) -> dict[int, int]:
        """Ledger id -> commit ts of each insert a read_committed reader gets (a repeat fails)."""
        out: dict[int, int] = {}
        records = committed(read_partition(self.kafka.bootstrap, f"{self.prefix}public.ledger", 0, timeout=60))
        for r in records:
            if r.key is None or r.value is None:
                continue
            value = json.loads(r.value)
            if value["op"] == "c":
                n = json.loads(r.key)[0]
                assert n not in out, f"ledger row {n} twice in Kafka"
                out[n] = int(value["updated"])
        return out

    def lake_rows(self, table: str) -> list[dict[str, Any]]:
        from deltalake import DeltaTable

        path = str(self.lake / table)
        if not DeltaTable.is_deltatable(path):
            return []
        rows: list[dict[str, Any]] = pa.table(DeltaTable(path).to_pyarrow_table()).to_pylist()
        return rows

    def lake_ledger(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for r in self.lake_rows("public.ledger"):
            if r["_op"] == "c":
                assert r["id"] not in out, f"ledger row {r['id']} twice in the lake"
                out[r["id"]] = r["_commit_ts"]
        return out

    def replica_top(self) -> int:
        with psycopg.connect(self.dbs.sink) as c:
            return int(c.execute("SELECT coalesce(max(id), 0) FROM ledger").fetchone()[0])

    def least(self) -> int:
        """The highest ledger row every sink has."""
        return min(self.replica_top(), max(self.kafka_ledger(), default=0), max(self.lake_ledger(), default=0))

    def resolved(self) -> dict[str, set[int]]:
        """Per sink, the resolved timestamps of the batches it recorded."""
        with psycopg.connect(self.dbs.sink) as c:
            dr = {int(r[0]) for r in c.execute("SELECT resolved_ts FROM changefeed.progress WHERE feed = %s",
                                               (f"{self.dbs.name}.dr",))}
        events = {json.loads(r.value or b"")["progress"]["resolved_ts"]
                  for r in committed(read_partition(self.kafka.bootstrap, self.progress, 0, timeout=60))
                  if json.loads(r.value or b"")["batch"] >= 0}
        lake = {int(json.loads(r["entry"])["progress"]["resolved_ts"])
                for r in self.lake_rows(f"_changefeed/{self.dbs.name}.lake")}
        return {"dr": dr, "events": events, "lake": lake}


def _setup(dbs: Dbs) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE ledger (id bigint PRIMARY KEY, v text NOT NULL)")
        c.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        c.execute("INSERT INTO accounts SELECT g, %s FROM generate_series(0, %s) g", (BALANCE, ACCOUNTS - 1))


def _killed(run: list[str], point: str, log: Path, faults: Path) -> None:
    """Run the feed until it dies at `point` ("random": SIGKILLed after a while in its batches)."""
    env = {} if point == "random" else {"CHANGEFEED_KILL_AT": point, "CHANGEFEED_FAULT_DIR": str(faults)}
    faults.mkdir(parents=True, exist_ok=True)
    p = start_changefeed(*run, log=log, env=env)
    try:
        if point == "random":
            wait_for("a batch", lambda: "batches since start" in log.read_text(), log)
            time.sleep(random.uniform(0.3, 2.0))
            os.killpg(p.pid, signal.SIGKILL)
        assert p.wait(timeout=300) == -signal.SIGKILL, (point, log.read_text()[-3000:])
    finally:
        kill_running([p])
    time.sleep(0.5)


def test_three_sinks_from_one_slot_each_exactly_once(dbs: Dbs, tmp_path: Path, kafka: LocalKafka) -> None:
    _setup(dbs)
    sinks = Sinks(dbs, kafka, tmp_path / "lake")
    state = tmp_path / "state"
    run = ["run", "--name", dbs.name, "--state", str(state)]
    first = changefeed_cli(*run, "--source", dbs.source, *sinks.args, "--tables", "public.ledger,public.accounts",
                           "--available-now")  # the snapshot, before changes race it
    assert first.returncode == 0, first.stderr[-3000:]
    written = [0]
    runner: subprocess.Popen[bytes] | None = None
    try:
        with writing(moving_money(ACCOUNTS), dbs.source, written):
            for i, point in enumerate(KILLS):
                _killed(run, point, tmp_path / f"run{i}.log", tmp_path / f"faults{i}")
            # The checkpoint lost while the sinks disagree: a kill after the replica and Kafka
            # committed a batch and the lake's tables took it, its ledger not; then the state
            # folder's checkpoint gone (a new host): the feed resumes from the least far sink (the
            # lake), its first batch exactly what the lake lacks.
            _killed(run, "delta_table_committed:2", tmp_path / "run-lost.log", tmp_path / "faults-lost")
            shutil.rmtree(state / dbs.name / "checkpoint")
            log = tmp_path / "final.log"
            runner = start_changefeed(*run, log=log)
            time.sleep(2)
        wait_for("every row in every sink", lambda: sinks.least() >= written[0], log, timeout=300)
        st = status_of(dbs.name, state)
        assert set(st["sinks"]) == {"dr", "events", "lake"}, st
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        kill_running([runner] if runner else [])
    assert "resuming from the sink's last batch" in log.read_text(), log.read_text()[-3000:]
    assert "lack the last batch the others recorded" in log.read_text(), log.read_text()[-3000:]

    n = written[0]
    in_kafka, in_lake = sinks.kafka_ledger(), sinks.lake_ledger()
    assert sorted(in_kafka) == list(range(1, n + 1)), f"Kafka: {len(in_kafka)} ledger rows for {n}"
    assert sorted(in_lake) == list(range(1, n + 1)), f"lake: {len(in_lake)} ledger rows for {n}"
    differ = [i for i in in_kafka if in_kafka[i] != in_lake[i]]
    assert not differ, f"{len(differ)} transactions with other timestamps in Kafka and the lake, e.g. {differ[:3]}"
    with psycopg.connect(dbs.sink) as c:
        ids = [r[0] for r in c.execute("SELECT id FROM ledger ORDER BY id")]
        assert ids == list(range(1, n + 1)), f"replica: {len(ids)} ledger rows for {n}"
        assert c.execute("SELECT sum(balance) FROM accounts").fetchone()[0] == ACCOUNTS * BALANCE
        replica_accounts = sorted(c.execute("SELECT id, balance FROM accounts").fetchall())
    with psycopg.connect(dbs.source) as c:
        assert replica_accounts == sorted(c.execute("SELECT id, balance FROM accounts").fetchall())
    moved = [r for r in sinks.lake_rows("public.accounts") if r["_op"] == "u"]
    per_txn: dict[int, int] = {}
    for r in moved:
        per_txn[r["_commit_ts"]] = per_txn.get(r["_commit_ts"], 0) + 1
    assert set(per_txn) == set(in_lake.values()) and set(per_txn.values()) == {2}, "money half-moved in the lake"

    # Every sink recorded the same batches (the same resolved timestamps), but for the lake's
    # first batch after the checkpoint was lost, which spans what the others had, and the batch
    # the stop may have cut between the sinks' commits (the replica and Kafka commit in the task,
    # the lake on the driver after it: the next run gives it to the lake alone).
    got = sinks.resolved()
    assert got["dr"] == got["events"] and got["lake"] <= got["dr"], {k: len(v) for k, v in got.items()}
    assert len(got["dr"] - got["lake"]) <= 2, {k: len(v) for k, v in got.items()}
    for log_file in tmp_path.glob("*.log"):
        assert_no_traceback(log_file.read_text())


def _kafka_ops_at(bootstrap: str, topic: str) -> dict[str, list[int]]:
    """Per op, the keys (first key column) a read_committed reader gets from `topic`, in order."""
    out: dict[str, list[int]] = {}
    for r in committed(read_partition(bootstrap, topic, 0, timeout=60)):
        if r.key is not None and r.value is not None:
            out.setdefault(json.loads(r.value)["op"], []).append(json.loads(r.key)[0])
    return out


def test_a_sink_added_to_a_running_feed_gets_its_own_snapshot_then_goes(dbs: Dbs, tmp_path: Path,
                                                                       kafka: LocalKafka) -> None:
    _setup(dbs)
    state, log = tmp_path / "state", tmp_path / "run.log"
    tag = uuid.uuid4().hex[:8]
    events = (f"events=kafka://{kafka.bootstrap}?topic_prefix=a{tag}.&progress_topic=progress-{tag}"
              "&topic_partitions=1")
    feed = ["--name", dbs.name, "--state", str(state)]
    first = changefeed_cli("run", *feed, "--source", dbs.source, "--sink", dbs.sink, "--tables",
                           "public.ledger,public.accounts", "--available-now")
    assert first.returncode == 0, first.stderr[-3000:]
    with psycopg.connect(dbs.sink) as c:
        chunks_before = c.execute("SELECT count(*) FROM changefeed.snapshot_chunks WHERE feed = %s",
                                  (dbs.name,)).fetchone()[0]
    written = [0]
    port = free_port()
    runner = start_changefeed("run", *feed, "--metrics-port", str(port), log=log)
    try:
        with writing(moving_money(ACCOUNTS), dbs.source, written):
            wait_for("a batch", lambda: "batches since start" in log.read_text(), log)
            added = changefeed_cli("alter", *feed, "--add-sink", events)
            assert added.returncode == 0, added.stderr[-3000:]
            assert "now writes to sinks replica, events" in added.stdout
            wait_for("the query restarted with the new sink",
                     lambda: "its sinks are now replica, events" in log.read_text(), log)
            time.sleep(3)
        n = written[0]

        def in_kafka() -> dict[str, list[int]]:
            return _kafka_ops_at(kafka.bootstrap, f"a{tag}.public.ledger")

        wait_for("every ledger row in Kafka", lambda: set(in_kafka().get("c", []) + in_kafka().get("r", []))
                 >= set(range(1, n + 1)), log)
        got = in_kafka()
        for op in ("c", "r"):
            ids = got.get(op, [])
            assert len(ids) == len(set(ids)), f"a ledger row twice in Kafka as {op!r}"
        assert got.get("r") and got.get("c"), "the new sink got its snapshot and the stream"
        accounts = _kafka_ops_at(kafka.bootstrap, f"a{tag}.public.accounts")
        assert sorted(set(accounts["r"])) == list(range(ACCOUNTS)), "the accounts' existing rows, for Kafka"
        with psycopg.connect(dbs.sink) as c:
            chunks_after = c.execute("SELECT count(*) FROM changefeed.snapshot_chunks WHERE feed = %s",
                                     (dbs.name,)).fetchone()[0]
            assert chunks_after == chunks_before, "the replica was given the new sink's snapshot"
        # the ledger file the status reads is appended after the batch commits: it may trail Kafka
        wait_for("a batch in each sink's ledger", lambda: all(
            s["batches"] > 0 for s in status_of(dbs.name, state)["sinks"].values()), log)
        st = status_of(dbs.name, state)
        assert set(st["sinks"]) == {"replica", "events"}, st
        wait_for("/metrics per sink", lambda: scrape_sinks(port).get("events", 0) > 0, log)
        assert scrape_sinks(port)["replica"] > 0

        both = changefeed_cli("verify", *feed)
        assert both.returncode == 2 and "--sink NAME" in both.stderr, both.stderr[-2000:]
        for sink in ("replica", "events"):
            verified = changefeed_cli("verify", *feed, "--sink", sink)
            assert verified.returncode == 0, (sink, verified.stdout[-2000:], verified.stderr[-2000:])

        # bad input: nothing changes
        definition = (state / dbs.name / "feed.json").read_text()
        for args, words in ((["--add-sink", f"replica={dbs.sink}x"], "two sinks are named replica"),
                            (["--add-sink", f"events2={events.split('=', 1)[1]}"], "have the same URI"),
                            (["--remove-sink", "lake"], "has no sink named 'lake'"),
                            (["--add-sink", "kafka://nameless:9092"], "--add-sink takes NAME=URI")):
            refused = changefeed_cli("alter", *feed, *args)
            assert refused.returncode != 0 and words in refused.stderr, (args, refused.stderr[-2000:])
            assert (state / dbs.name / "feed.json").read_text() == definition

        removed = changefeed_cli("alter", *feed, "--remove-sink", "events")
        assert removed.returncode == 0, removed.stderr[-3000:]
        wait_for("the query restarted without it", lambda: "its sinks are now replica:" in log.read_text(), log)
        last = len(in_kafka().get("c", []))
        at_removal = _applied(dbs)
        with psycopg.connect(dbs.source, autocommit=True) as c:
            for i in range(n + 1, n + 201):
                c.execute("INSERT INTO ledger (id, v) VALUES (%s, 'after')", (i,))
        wait_for("the replica caught up", lambda: _replica_top(dbs) >= n + 200, log)
        assert len(in_kafka().get("c", [])) == last, "a removed sink got more"
        last_only = changefeed_cli("alter", *feed, "--remove-sink", "replica")
        assert last_only.returncode != 0 and "the only sink" in last_only.stderr
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        kill_running([runner])
    assert not (state / dbs.name / "delivered.events.jsonl").exists(), "the removed sink's ledger stayed"
    with psycopg.connect(dbs.source) as c:
        slot = c.execute("SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s",
                         (f"changefeed_{dbs.name}",)).fetchone()[0]
    assert _lsn(slot) > _lsn(at_removal), "the slot waits for a removed sink"
    assert_no_traceback(log.read_text())


def _applied(dbs: Dbs) -> str:
    with psycopg.connect(dbs.sink) as c:
        return str(c.execute("SELECT max(end_lsn) FROM changefeed.progress WHERE feed = %s",
                             (dbs.name,)).fetchone()[0])


def _lsn(text: str) -> int:
    hi, lo = str(text).split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def scrape_sinks(port: int) -> dict[str, float]:
    """Per sink, the batches its ledger holds, as /metrics says."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {s.labels["sink"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "changefeed_sink_batches"}


def _replica_top(dbs: Dbs) -> int:
    with psycopg.connect(dbs.sink) as c:
        if c.execute("SELECT to_regclass('public.ledger') IS NULL").fetchone()[0]:
            return 0  # (made as the feed starts)
        return int(c.execute("SELECT coalesce(max(id), 0) FROM ledger").fetchone()[0])


def test_bad_sinks_on_the_command_line_create_nothing(dbs: Dbs, tmp_path: Path) -> None:
    _setup(dbs)
    state = tmp_path / "state"
    for sinks, words in (([f"dr={dbs.sink}", f"dr={dbs.sink}x"], "two sinks are named dr"),
                         ([dbs.sink, f"{dbs.sink}x"], "several times without a name"),
                         ([f"dr={dbs.sink}", "lake=delta://relative"], "absolute")):
        args = [a for s in sinks for a in ("--sink", s)]
        refused = changefeed_cli("run", "--name", dbs.name, "--state", str(state), "--source", dbs.source, *args,
                                 "--tables", "public.ledger", "--available-now")
        assert refused.returncode != 0 and words in refused.stderr, (sinks, refused.stderr[-2000:])
        assert not (state / dbs.name).exists()
    with psycopg.connect(dbs.source) as c:
        assert c.execute("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()"
                         ).fetchone()[0] == 0


def test_a_sink_out_of_reach_holds_the_others_and_is_named(dbs: Dbs, tmp_path: Path) -> None:
    """Kafka's broker (reached through a TCP proxy) is down for 30 s under a writer: by default the
    feed waits it out, the replica taking nothing meanwhile, `status` naming the sink; then both
    sinks get every row exactly once."""
    from tcp_proxy import TcpProxy

    _setup(dbs)
    broker_port = free_port()
    with TcpProxy(broker_port) as proxy, LocalKafka.start(tmp_path / "kafka", broker_port,
                                                          advertised_port=proxy.port):
        bootstrap = f"127.0.0.1:{proxy.port}"
        state, log = tmp_path / "state", tmp_path / "run.log"
        runner = start_changefeed("run", "--name", dbs.name, "--state", str(state), "--source", dbs.source,
                                  "--sink", f"dr={dbs.sink}", "--sink", f"events=kafka://{bootstrap}?timeout=10s"
                                  "&topic_partitions=1", "--tables", "public.ledger,public.accounts",
                                  "--retry-max-backoff", "2s", log=log)
        written = [0]
        try:
            with writing(moving_money(ACCOUNTS), dbs.source, written):
                wait_for("changes in both sinks", lambda: min(_replica_top(dbs), _kafka_top(bootstrap)) > 100, log)
                proxy.down()
                began = time.monotonic()
                wait_for("status to name the sink", lambda: _retrying(dbs.name, state) != "no", log, timeout=90)
                held = _replica_top(dbs)
                time.sleep(max(0.0, 30 - (time.monotonic() - began)))
                assert _replica_top(dbs) == held, "the replica went on while Kafka was out of reach"
                st = status_of(dbs.name, state)
                assert st["sinks"]["dr"]["retrying"] == "no" and "retrying" in st["state"], st
                proxy.up()
                time.sleep(3)
            wait_for("every row in both sinks", lambda: min(_replica_top(dbs), _kafka_top(bootstrap)) >= written[0],
                     log, timeout=240)
            assert "failure(s) of the sink events" in log.read_text() and "the sink events is back" in log.read_text()
            runner.send_signal(signal.SIGTERM)
            assert runner.wait(timeout=120) == 0, log.read_text()[-3000:]
        finally:
            kill_running([runner])
        ops = _kafka_ops_at(bootstrap, "public.ledger")  # (rows the snapshot read late come as reads)
        assert len(ops["c"]) == len(set(ops["c"])) and len(ops.get("r", [])) == len(set(ops.get("r", [])))
        ids = set(ops["c"]) | set(ops.get("r", []))
        assert sorted(ids) == list(range(1, written[0] + 1)), f"{len(ids)} ids in Kafka for {written[0]} rows"
    with psycopg.connect(dbs.sink) as c:
        assert [r[0] for r in c.execute("SELECT id FROM ledger ORDER BY id")] == list(range(1, written[0] + 1))
    assert_no_traceback(log.read_text())


def _kafka_top(bootstrap: str) -> int:
    from confluent_kafka.admin import AdminClient

    if "public.ledger" not in AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics:
        return 0  # (made with the first batch)
    records = committed(read_partition(bootstrap, "public.ledger", 0, timeout=60))
    return max((json.loads(r.key)[0] for r in records if r.key is not None and r.value is not None), default=0)


def _retrying(feed: str, state: Path) -> str:
    sinks = status_of(feed, state).get("sinks", {})
    return str(sinks.get("events", {}).get("retrying", "no"))


STANDBY_KILLS = ["delta_table_committed:3", "after_sink_commit:7", "random"]


def test_a_standby_takes_over_a_feed_of_three_sinks(dbs: Dbs, tmp_path: Path, kafka: LocalKafka) -> None:
    """The active runner ends between its sinks' commits (the lake's tables committed, its ledger
    not; a replica or Kafka committed, the other not) and at random; a standby with a state folder
    of its own takes over from the sinks' ledgers each time: every sink gets every change once."""
    _setup(dbs)
    sinks = Sinks(dbs, kafka, tmp_path / "lake")
    logs, states = [tmp_path / "a.log", tmp_path / "b.log"], [tmp_path / "a", tmp_path / "b"]
    faults, takeovers = tmp_path / "faults", []
    first = changefeed_cli("run", "--name", dbs.name, "--state", str(states[0]), "--source", dbs.source,
                           *sinks.args, "--tables", "public.ledger,public.accounts", "--lease", "3s", "--available-now")
    assert first.returncode == 0, first.stderr[-3000:]
    written = [0]
    runners: list[subprocess.Popen[bytes]] = []
    try:
        with writing(moving_money(ACCOUNTS), dbs.source, written):
            runners.append(start_changefeed("run", "--name", dbs.name, "--state", str(states[0]), log=logs[0],
                                            env=turn_env(STANDBY_KILLS, 0, faults)))
            wait_for("the first runner's batches", lambda: "batches since start" in logs[0].read_text(), logs[0])

            standby = standby_starter(dbs.name, dbs.source, states, logs)
            runners.append(standby(1, turn_env(STANDBY_KILLS, 1, faults)))
            active = kill_turns(STANDBY_KILLS, runners, logs, faults, standby, sinks.least, written,
                                lambda turn, text: takeovers.append(text))
        wait_for("every row in every sink", lambda: sinks.least() >= written[0], logs[active], timeout=240)
        stop_both(runners, logs, active)
    finally:
        kill_running(runners)
    assert "lack the last batch the others recorded" in takeovers[0], takeovers[0][-3000:]
    n = written[0]
    assert sorted(sinks.kafka_ledger()) == list(range(1, n + 1))
    assert sorted(sinks.lake_ledger()) == list(range(1, n + 1))
    assert _replica_top(dbs) == n
    with psycopg.connect(dbs.sink) as c:
        assert c.execute("SELECT count(*), sum(balance) FROM accounts").fetchone() == (ACCOUNTS, ACCOUNTS * BALANCE)
        assert c.execute("SELECT count(*) FROM ledger").fetchone()[0] == n
    for log in logs:
        assert_no_traceback(log.read_text())
