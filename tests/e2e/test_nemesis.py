"""A seeded nemesis: the feed SIGKILLed, its source and replica crash-restarted, its connections
terminated, and the feed started again while a server is down: each kind of fault once (and
CHANGEFEED_NEMESIS_STEPS more drawn at random), one after another under a concurrent writer, in an
order drawn from a seed.

Every fault is waited out: after each one the replica catches up with what the source had when the
fault ended, before the next one hits. Afterwards the replica equals the source, every
acknowledged ledger row is there once, money moved between accounts is never half-moved, and every
batch was recorded once, in order. The source commits synchronously here, so an acknowledged row
survives its crash; the replica keeps the test servers' asynchronous commits (the feed makes its
own batch commits durable).

CHANGEFEED_NEMESIS_SEED draws another schedule; the schedule drawn is printed, so a failure can be
replayed with its seed.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import psycopg
import pytest

from changefeed.local.postgres import LocalPostgres
from support.feeds import assert_no_traceback, changefeed_cli, killed_by_fault, start_changefeed, wait_for
from support.servers import Dbs, fingerprint
from support.writers import terminating, writing

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]

SEED = int(os.environ.get("CHANGEFEED_NEMESIS_SEED", "19"))
EXTRA_STEPS = int(os.environ.get("CHANGEFEED_NEMESIS_STEPS", "0"))
ACCOUNTS = 20
KILL_POINTS = ("startup", "read:2", "before_sink_commit:2", "after_sink_commit:2")
FAULTS = ("feed killed", "feed killed at a fault point", "source crash-restart", "replica crash-restart",
          "backends terminated", "feed restarted while the source is down",
          "feed restarted while the replica is down")


def writer(uri: str, stop: threading.Event, acked: list[int]) -> None:
    """Each transaction appends ledger row n and moves 1 between two accounts; `acked` collects the
    rows whose commit was acknowledged. Through an outage it reconnects and goes on with the next n
    (a row whose commit was cut off may or may not be there)."""
    n = 0
    while not stop.is_set():
        try:
            with psycopg.connect(uri, autocommit=True, connect_timeout=2,
                                 options="-c synchronous_commit=on") as c:
                while not stop.is_set():
                    n += 1
                    with c.transaction():
                        c.execute("INSERT INTO ledger (id, v) VALUES (%s, %s)", (n, f"entry {n}"))
                        c.execute("UPDATE accounts SET balance = balance - 1 WHERE id = %s", (n % ACCOUNTS,))
                        c.execute("UPDATE accounts SET balance = balance + 1 WHERE id = %s",
                                  ((n * 7 + 3) % ACCOUNTS,))
                    acked.append(n)
                    time.sleep(0.02)
        except psycopg.OperationalError:
            time.sleep(0.2)



def last_row(uri: str) -> int:
    """The highest ledger id on a server; 0 while it cannot be asked."""
    try:
        with psycopg.connect(uri, connect_timeout=2) as c:
            return int(c.execute("SELECT coalesce(max(id), 0) FROM ledger").fetchone()[0])  # type: ignore[index]
    except (psycopg.OperationalError, psycopg.errors.UndefinedTable):
        return 0


class Nemesis:
    """The feed's runs, its two servers and the faults between them."""

    def __init__(self, tmp_path: Path, name: str, source: LocalPostgres, replica: LocalPostgres) -> None:
        self.tmp_path, self.name, self.source, self.replica = tmp_path, name, source, replica
        self.state = tmp_path / "state"
        self.base = ["run", "--name", name, "--state", str(self.state)]
        self.logs: list[Path] = []
        self.feed: subprocess.Popen[bytes] | None = None
        self.rng = random.Random(SEED)

    @property
    def log(self) -> Path:
        return self.logs[-1]

    def start_feed(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        self.logs.append(self.tmp_path / f"run{len(self.logs)}.log")
        self.feed = start_changefeed(*self.base, *args, "--retry-max-backoff", "2s", log=self.log, env=env)
        return self.feed

    def kill_feed(self) -> None:
        assert self.feed is not None and self.feed.poll() is None, f"the feed ended:\n{self.log.read_text()[-3000:]}"
        os.killpg(self.feed.pid, signal.SIGKILL)
        assert self.feed.wait(timeout=60) == -signal.SIGKILL
        time.sleep(0.5)  # let the killed group's sockets close

    def crash(self, server: LocalPostgres, down_s: float) -> LocalPostgres:
        server.stop("immediate")
        time.sleep(down_s)
        return LocalPostgres.start(server.datadir, port=server.port)

    def retrying(self, component: str) -> str | None:
        out = changefeed_cli("status", "--name", self.name, "--state", str(self.state), "--json")
        state = json.loads(out.stdout).get("state", "") if out.returncode == 0 else ""
        return state if "retrying" in state and f"the {component}" in state else None

    def restart_while_down(self, role: str) -> None:
        """The feed killed, then started again while its source or replica is down: it waits."""
        self.kill_feed()
        server = self.source if role == "source" else self.replica
        server.stop("immediate")
        try:
            self.start_feed()
            component = "source" if role == "source" else "sink"
            wait_for(f"status to say the {role} is retried", lambda: self.retrying(component), self.log, timeout=120)
        finally:
            restarted = LocalPostgres.start(server.datadir, port=server.port)
        if role == "source":
            self.source = restarted
        else:
            self.replica = restarted

    def hit(self, fault: str) -> None:
        rng = self.rng
        if fault == "feed killed":
            time.sleep(rng.uniform(0, 3))
            self.kill_feed()
            self.start_feed()
        elif fault == "feed killed at a fault point":
            self.kill_feed()
            point = rng.choice(KILL_POINTS)
            faults = self.tmp_path / f"faults{len(self.logs)}"
            faults.mkdir()
            print(f"  killed at {point}")
            run = self.start_feed(env={"CHANGEFEED_KILL_AT": point, "CHANGEFEED_FAULT_DIR": str(faults)})
            killed_by_fault(run, self.log)
            time.sleep(0.5)
            self.start_feed()
        elif fault == "source crash-restart":
            self.source = self.crash(self.source, rng.uniform(1, 5))
        elif fault == "replica crash-restart":
            self.replica = self.crash(self.replica, rng.uniform(2, 8))
        elif fault == "backends terminated":
            with writing(terminating, self.source.uri(), [0]):
                time.sleep(rng.uniform(2, 5))
        else:
            self.restart_while_down("source" if "source" in fault else "replica")

    def caught_up(self, what: str) -> None:
        """Wait until the replica has every row the source had when the fault ended."""
        target = last_row(self.source.uri())
        wait_for(f"the replica to catch up after {what} (ledger row {target})",
                 lambda: last_row(self.replica.uri()) >= target, self.log, timeout=300)


def test_a_seeded_nemesis_loses_and_doubles_nothing(dbs: Dbs, tmp_path: Path) -> None:
    source = LocalPostgres.start(tmp_path / "source")
    replica = LocalPostgres.start(tmp_path / "replica")
    nemesis = Nemesis(tmp_path, dbs.name, source, replica)
    try:
        with psycopg.connect(source.uri(), autocommit=True) as c:
            c.execute("CREATE TABLE ledger (id bigint PRIMARY KEY, v text NOT NULL)")
            c.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
            c.execute("INSERT INTO accounts SELECT g, 1000 FROM generate_series(0, %s) g", (ACCOUNTS - 1,))
        schedule = nemesis.rng.sample(FAULTS, len(FAULTS)) + [nemesis.rng.choice(FAULTS) for _ in range(EXTRA_STEPS)]
        print(f"nemesis seed {SEED}: {schedule}")
        acked: list[int] = []
        with writing(writer, source.uri(), acked):
            nemesis.start_feed("--source", source.uri(), "--sink", replica.uri(),
                               "--tables", "public.ledger,public.accounts", "--max-changes-per-batch", "1000",
                               "--snapshot-reads", "parallel")
            # first, a fault inside the query's restart after the initial snapshot (read in parallel)
            wait_for("the snapshot phase to end", lambda: "without the shuffle" in nemesis.log.read_text(),
                     nemesis.log)
            nemesis.replica = nemesis.crash(nemesis.replica, 3)
            nemesis.caught_up("the replica crashed as the query restarted")
            began = time.monotonic()
            for i, fault in enumerate(schedule):
                print(f"{time.monotonic() - began:.0f}s: step {i}: {fault}")
                nemesis.hit(fault)
                nemesis.caught_up(fault)
            time.sleep(2)
        source, replica = nemesis.source.uri(), nemesis.replica.uri()
        wait_for("the replica to equal the source",
                 lambda: all(fingerprint(replica, t) == fingerprint(source, t) for t in ("ledger", "accounts")),
                 nemesis.log, timeout=300)
        feed = nemesis.feed
        assert feed is not None and feed.poll() is None, f"the feed ended:\n{nemesis.log.read_text()[-3000:]}"
        feed.send_signal(signal.SIGTERM)
        assert feed.wait(timeout=120) == 0, nemesis.log.read_text()[-3000:]
        for log in nemesis.logs:
            assert_no_traceback(log.read_text())

        with psycopg.connect(replica) as d:
            ids = {r[0] for r in d.execute("SELECT id FROM ledger")}
            total = d.execute("SELECT sum(balance) FROM accounts").fetchone()[0]  # type: ignore[index]
            batches = d.execute("SELECT batch_id, resolved_ts FROM changefeed.progress WHERE feed = %s "
                                "ORDER BY end_lsn", (dbs.name,)).fetchall()
        missing = set(acked) - ids
        assert not missing, f"acknowledged rows missing on the replica: {sorted(missing)[:20]}"
        assert total == 1000 * ACCOUNTS  # a consistent cut: money is never half-moved
        batch_ids = [b[0] for b in batches]
        assert len(batch_ids) == len(set(batch_ids)), "a batch was applied twice"
        assert batch_ids == sorted(batch_ids)
        assert [b[1] for b in batches] == sorted(b[1] for b in batches), "resolved timestamps went backwards"
    finally:
        if nemesis.feed is not None and nemesis.feed.poll() is None:
            os.killpg(nemesis.feed.pid, signal.SIGKILL)
        nemesis.source.stop("immediate")
        nemesis.replica.stop("immediate")
