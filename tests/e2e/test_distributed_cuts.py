"""Distributed transactions whole under small windows, slow coordinators, retried gids, kills and a
node added under load (three servers: a gid names one prepared transaction per server, so three
parts need three servers).

The workload is the one that lost rows before (issue 35): transfers by two-phase commit whose
coordinators stall between the parts and commit them in either order, gids retried after a
ROLLBACK PREPARED, a writer of rows large enough to straddle WAL pages, windows of 256kB; the
feed killed at awkward moments, a node added while it runs, and a final --available-now run.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from changefeed.local.postgres import LocalPostgres
from support.feeds import assert_no_traceback, changefeed_cli, killed_by_fault, start_changefeed, wait_for
from support.servers import Dbs, drop_slots

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
ACCOUNTS, BALANCE = 100, 1_000


@pytest.fixture(scope="module")
def extra_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalPostgres]]:
    root = tmp_path_factory.mktemp("pg")
    started = [LocalPostgres.start(root / name, settings={"max_prepared_transactions": "32"})
               for name in ("second", "third")]
    yield started
    for server in started:
        server.stop("immediate")


@pytest.fixture
def nodes(dbs: Dbs, extra_servers: list[LocalPostgres]) -> Iterator[dict[str, str]]:
    uris = {"n1": dbs.source}
    for i, server in enumerate(extra_servers, 2):
        with psycopg.connect(server.uri(), autocommit=True) as c:
            c.execute(f"CREATE DATABASE {dbs.name}")
        uris[f"n{i}"] = server.uri(dbs.name)
    for i, uri in enumerate(uris.values(), 1):
        with psycopg.connect(uri, autocommit=True) as c:
            c.execute("CREATE TABLE accounts (id bigint PRIMARY KEY, balance bigint NOT NULL)")
            c.execute("INSERT INTO accounts SELECT %s * 1000 + g, %s FROM generate_series(1, %s) g",
                      (i, BALANCE, ACCOUNTS))
            c.execute("CREATE TABLE events (node text, id bigint, gid text, payload text, PRIMARY KEY (node, id))")
    yield uris
    for uri in uris.values():
        with psycopg.connect(uri, autocommit=True) as c:
            for (gid,) in c.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"):
                c.execute(f"ROLLBACK PREPARED '{gid}'")
    for server in extra_servers:
        drop_slots(server.uri(), dbs.name)


class Workload:
    """Two coordinators moving money by two-phase commit over the joined nodes, and a writer of
    local transfers and large event rows on every node, until `stop`."""

    def __init__(self, nodes: dict[str, str]) -> None:
        self.nodes, self.joined = nodes, ["n1", "n2"]
        self.stop, self.errors = threading.Event(), []
        self.counter = iter(range(1, 10**9))
        self.lock = threading.Lock()
        self.committed: set[str] = set()
        self.retried: set[str] = set()
        self.threads = [threading.Thread(target=self._guard, args=(self._coordinator, seed)) for seed in (1, 2)]
        self.threads.append(threading.Thread(target=self._guard, args=(self._local, 3)))

    def __enter__(self) -> Workload:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        assert not self.errors, self.errors

    def _guard(self, work: Any, seed: int) -> None:
        try:
            work(random.Random(seed))
        except Exception as e:  # noqa: BLE001 - the test fails with it
            self.errors.append(repr(e))

    def _next(self) -> int:
        with self.lock:
            return next(self.counter)

    def _event(self, c: psycopg.Connection[Any], node: str, gid: str, rng: random.Random, size: int) -> None:
        c.execute("INSERT INTO events VALUES (%s, %s, %s, %s)", (node, self._next(), gid, os.urandom(size).hex()))

    def _coordinator(self, rng: random.Random) -> None:
        conns = {n: psycopg.connect(uri, autocommit=True) for n, uri in self.nodes.items()}
        while not self.stop.is_set():
            gid = f"x{self._next()}"
            parts = rng.sample(list(self.joined), rng.choice((2, 2, 3)) if len(self.joined) > 2 else 2)
            amounts = [rng.randrange(1, 20) for _ in parts[1:]]
            deltas = dict(zip(parts, [-sum(amounts), *amounts]))
            rollback_first = rng.random() < 0.15
            for attempt in range(2 if rollback_first else 1):
                for n in parts:
                    c = conns[n]
                    c.execute("BEGIN")
                    account = 1000 * int(n[1:]) + rng.randrange(1, ACCOUNTS + 1)
                    c.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", (deltas[n], account))
                    self._event(c, n, gid, rng, rng.randrange(500, 3000))
                    c.execute(f"PREPARE TRANSACTION '{gid}'")
                how = "ROLLBACK" if rollback_first and attempt == 0 else "COMMIT"
                for n in rng.sample(parts, len(parts)):  # either order, stalling between the parts
                    conns[n].execute(f"{how} PREPARED '{gid}'")
                    time.sleep(rng.choice((0, 0, 0, 0.01, 0.2, 0.8)))
                if how == "ROLLBACK":
                    self.retried.add(gid)  # the same gid again, as a transaction manager retries
            self.committed.add(gid)
        for c in conns.values():
            c.close()

    def _local(self, rng: random.Random) -> None:
        conns = {n: psycopg.connect(uri, autocommit=True) for n, uri in self.nodes.items()}
        while not self.stop.is_set():
            n = rng.choice(list(self.nodes))  # n3 too, before it joins the feed: its snapshot has that
            c, base = conns[n], 1000 * int(n[1:])
            a, b = rng.sample(range(1, ACCOUNTS + 1), 2)
            with c.transaction():
                c.execute("UPDATE accounts SET balance = balance - 3 WHERE id = %s", (base + a,))
                c.execute("UPDATE accounts SET balance = balance + 3 WHERE id = %s", (base + b,))
                for _ in range(rng.randrange(1, 4)):
                    self._event(c, n, "", rng, rng.randrange(1000, 6000))  # records straddling WAL pages
            time.sleep(0.05)  # (less WAL than the feed's 256kB windows follow on a busy machine)
        for c in conns.values():
            c.close()


def sampling(uri: str, stop: threading.Event, paused: threading.Event, samples: list[tuple[int, int]]) -> None:
    """The replica's (count, total) of accounts, again and again (but while `paused`)."""
    with psycopg.connect(uri, autocommit=True) as c:
        while not stop.is_set():
            if paused.is_set():
                time.sleep(0.02)
                continue
            try:
                row = c.execute("SELECT count(*), coalesce(sum(balance), 0) FROM accounts").fetchone()
            except psycopg.errors.UndefinedTable:
                row = None
            if row and row[0]:
                samples.append((int(row[0]), int(row[1])))
            time.sleep(0.02)


def past_snapshot(sink: str, feed: str, node: str) -> bool:
    """Whether the feed's stream has passed where `node`'s snapshot chunks were read (until then
    a chunk may hold a transaction whose other parts come later: postgres/snapshot.py)."""
    with psycopg.connect(sink) as c:
        read = c.execute("SELECT max(read_lsn - '0/0') FROM changefeed.snapshot_chunks WHERE feed = %s "
                         "AND table_name LIKE %s", (feed, f"{node}:%")).fetchone()[0]
        at = c.execute("SELECT (positions ->> %s)::numeric FROM changefeed.progress WHERE feed = %s "
                       "ORDER BY batch_id DESC LIMIT 1", (node, feed)).fetchone()
    return read is not None and at is not None and at[0] is not None and at[0] > read


def resolved_s(sink: str, feed: str) -> float:
    with psycopg.connect(sink) as c:
        row = c.execute("SELECT max(resolved_ts) FROM changefeed.progress WHERE feed = %s", (feed,)).fetchone()
    return (int(row[0]) >> 18) / 1000 if row and row[0] else 0.0


def rows(uri: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(uri) as c:
        return sorted(c.execute(query).fetchall(), key=repr)


def union(nodes: dict[str, str], query: str) -> list[tuple[Any, ...]]:
    return sorted((r for uri in nodes.values() for r in rows(uri, query)), key=repr)


BALANCES = "SELECT id, balance FROM accounts"
EVENTS = "SELECT node, id, gid, md5(payload) FROM events"


def test_transactions_stay_whole_through_small_windows_stalls_retries_kills_and_a_new_node(
        dbs: Dbs, nodes: dict[str, str], tmp_path: Path, spark_server: str) -> None:
    state = str(tmp_path / "state")
    two = [a for n in ("n1", "n2") for a in ("--source", f"{n}={nodes[n]}")]
    base = ["run", "--name", dbs.name, "--state", state, "--master", "local[2]"]
    first = changefeed_cli(*base, *two, "--sink", dbs.sink, "--tables", "public.accounts,public.events",
                           "--max-bytes-per-batch", "256kB", "--available-now", "--master", spark_server)
    assert first.returncode == 0, first.stderr[-3000:]
    samples: list[tuple[int, int]] = []
    sampler_stop, paused = threading.Event(), threading.Event()
    sampler = threading.Thread(target=sampling, args=(dbs.sink, sampler_stop, paused, samples))
    sampler.start()
    try:
        with Workload(nodes) as work:
            kills = ("read:6", "pending:2", "after_sink_commit:5", "add-node")
            for i, kill in enumerate(kills):
                fault_dir = tmp_path / f"faults{i}"
                fault_dir.mkdir()
                log = tmp_path / f"run{i}.log"
                env = {"CHANGEFEED_FAULT_DIR": str(fault_dir)}
                if ":" in kill:
                    env["CHANGEFEED_KILL_AT"] = kill
                p = start_changefeed(*base, log=log, env=env)
                if ":" in kill:
                    killed_by_fault(p, log)
                    continue
                time.sleep(6)  # then n3 added while the feed runs and the coordinators write
                # (a node's snapshot is read after its window: the replica is a consistent cut
                # again once the stream has passed the snapshot's read position)
                paused.set()
                added = changefeed_cli("alter", "--name", dbs.name, "--state", state,
                                       "--add-node", f"n3={nodes['n3']}")
                assert added.returncode == 0, added.stderr
                work.joined.append("n3")  # distributed transactions span n3 from now on
                wait_for("node n3's rows", lambda: len(rows(dbs.sink, BALANCES)) == 3 * ACCOUNTS, log)
                wait_for("the stream past n3's snapshot", lambda: past_snapshot(dbs.sink, dbs.name, "n3"), log)
                # and past the other parts of transactions that n3's chunks caught half-decided
                later = time.time() + 3
                wait_for("the stream 3 s further", lambda: resolved_s(dbs.sink, dbs.name) > later, log)
                paused.clear()
                time.sleep(random.Random(len(samples)).uniform(1, 4))  # SIGKILLed at a random moment
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        assert work.retried & work.committed and len(work.committed) > 40, (len(work.retried), len(work.committed))
        log = tmp_path / "final.log"
        final = changefeed_cli(*base, "--available-now", "--master", spark_server, timeout=600)
        log.write_text(final.stdout + final.stderr)
        assert final.returncode == 0, final.stderr[-3000:]
        assert_no_traceback(final.stdout + final.stderr)
    finally:
        sampler_stop.set()
        sampler.join()
    assert rows(dbs.sink, BALANCES) == union(nodes, BALANCES)
    assert rows(dbs.sink, EVENTS) == union(nodes, EVENTS)
    with psycopg.connect(dbs.sink) as d:
        batches = d.execute("SELECT batch_id, reads FROM changefeed.progress WHERE feed = %s ORDER BY batch_id",
                            (dbs.name,)).fetchall()
    batches_of: dict[str, set[int]] = {}  # gid -> the batches that delivered a part of it
    parts_of: dict[str, int] = {}
    for batch_id, reads in batches:
        for r in reads:
            for gid, _ in r.get("gids") or ():
                batches_of.setdefault(gid, set()).add(batch_id)
                parts_of[gid] = parts_of.get(gid, 0) + 1
    assert len(batches) > 40, len(batches)  # windows of 256kB: cut again and again (~100 on a quiet machine)
    assert set(batches_of) == {g for (g,) in union(nodes, "SELECT DISTINCT gid FROM events WHERE gid <> ''")}
    assert all(len(b) == 1 for b in batches_of.values()), {g: b for g, b in batches_of.items() if len(b) > 1}
    assert any(n == 3 for n in parts_of.values())  # three-part transactions, over the node added under load
    assert any(r.get("pending") for _, reads in batches for r in reads)  # parts did wait for their partners
    valid = {(2 * ACCOUNTS, 2 * ACCOUNTS * BALANCE), (3 * ACCOUNTS, 3 * ACCOUNTS * BALANCE)}
    assert len(samples) > 100 and set(samples) <= valid, sorted(set(samples) - valid)[:5]  # never half a transfer
