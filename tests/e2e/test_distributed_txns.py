"""Distributed transactions (two-phase commit over several source nodes) reach the replica whole.

Node n1 is the test's database on the shared source server, n2 one on a server of this module's
own: a gid names one prepared transaction per server, so the parts of one distributed
transaction must be on different servers, as they are in production.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from changefeed.control.runner import run
from changefeed.errors import SourceNotReady, TransactionInDoubt
from changefeed.local.kafka import LocalKafka, committed, read_partition
from changefeed.local.postgres import LocalPostgres
from changefeed.spec.definition import FeedSpec
from changefeed.spec.state import FeedState
from support.feeds import assert_no_traceback, changefeed_cli, killed_by_fault, start_changefeed, wait_for
from support.servers import Dbs, drop_slots

pytestmark = pytest.mark.timeout(900)
ACCOUNTS, BALANCE = 50, 1_000
TOTAL = 2 * ACCOUNTS * BALANCE


@pytest.fixture(scope="module")
def second(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    server = LocalPostgres.start(tmp_path_factory.mktemp("pg") / "second", settings={"max_prepared_transactions": "16"})
    yield server
    server.stop("immediate")


@pytest.fixture
def nodes(dbs: Dbs, second: LocalPostgres) -> Iterator[dict[str, str]]:
    """Two nodes on two servers, each with accounts of its own (ids node * 1000 + i)."""
    yield from bank(dbs, second, 2)


@pytest.fixture
def three(dbs: Dbs, second: LocalPostgres) -> Iterator[dict[str, str]]:
    """Three nodes: n1 on the shared server, n2 and n3 on the module's (so a distributed
    transaction here always has a part on n1: two parts on one server cannot share a gid)."""
    yield from bank(dbs, second, 3)


def bank(dbs: Dbs, second: LocalPostgres, count: int) -> Iterator[dict[str, str]]:
    uris = {"n1": dbs.source}
    for n in range(2, count + 1):
        with psycopg.connect(second.uri(), autocommit=True) as c:
            c.execute(f"CREATE DATABASE {dbs.name}_n{n}")
        uris[f"n{n}"] = second.uri(f"{dbs.name}_n{n}")
    for i, uri in enumerate(uris.values(), 1):
        with psycopg.connect(uri, autocommit=True) as c:
            c.execute("CREATE TABLE accounts (id bigint PRIMARY KEY, balance bigint NOT NULL)")
            c.execute("INSERT INTO accounts SELECT %s * 1000 + g, %s FROM generate_series(1, %s) g",
                      (i, BALANCE, ACCOUNTS))
    yield uris
    for uri in uris.values():
        with psycopg.connect(uri, autocommit=True) as c:
            for (gid,) in c.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"):
                c.execute(f"ROLLBACK PREPARED '{gid}'")
    for n in range(2, count + 1):
        drop_slots(second.uri(), f"{dbs.name}_n{n}")


def prepare(uri: str, gid: str, account: int, amount: int) -> None:
    with psycopg.connect(uri, autocommit=True) as c:
        c.execute("BEGIN")
        c.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", (amount, account))
        c.execute(f"PREPARE TRANSACTION '{gid}'")


def decide(uri: str, gid: str, how: str = "COMMIT") -> None:
    with psycopg.connect(uri, autocommit=True) as c:
        c.execute(f"{how} PREPARED '{gid}'")


def balances(uri: str) -> dict[int, int]:
    with psycopg.connect(uri) as c:
        return dict(c.execute("SELECT id, balance FROM accounts").fetchall())  # type: ignore[arg-type]


def union(nodes: dict[str, str]) -> dict[int, int]:
    return {k: v for uri in nodes.values() for k, v in balances(uri).items()}


def run_once(dbs: Dbs, nodes: dict[str, str], tmp_path: Path, sink: str | None = None, in_doubt: bool = False,
             **options: object) -> None:
    """An --available-now run; with `in_doubt`, one that must end (after a few seconds of retries)
    with TransactionInDoubt: changes committed before it wait for a transaction in doubt."""
    spec = FeedSpec(dbs.name, "", sink or dbs.sink, ("public.accounts",), nodes=tuple(nodes.items()),
                    **options).validate()  # type: ignore[arg-type]
    state = FeedState(tmp_path / "state", spec.name)
    if not in_doubt:
        run(spec, state, available_now=True, master="local[2]", handle_signals=False, report=lambda s: None)
        return
    said: list[str] = []
    with pytest.raises(TransactionInDoubt) as e:
        run(spec, state, available_now=True, master="local[2]", handle_signals=False, report=said.append,
            retry_max_backoff_s=0.5, give_up_after_s=3)
    assert "'t1' committed on node n1, still prepared on node n2" in e.value.message or "'k1'" in e.value.message, \
        e.value.message
    assert any("retrying" in line or "next attempt" in line for line in said), said


def test_parts_wait_for_each_other_and_a_rollback_delivers_nothing(dbs: Dbs, nodes: dict[str, str], tmp_path: Path,
                                                                   spark: object) -> None:
    run_once(dbs, nodes, tmp_path)
    with psycopg.connect(nodes["n1"]) as c:  # the feed's slot, and the prepare slot with two-phase decoding
        assert c.execute("SELECT slot_name LIKE 'cf2pc%', two_phase FROM pg_replication_slots "
                         "WHERE database = current_database() ORDER BY 1").fetchall() == [(False, False), (True, True)]
    # t1 moves 10 from n1 to n2; it is committed on n1 only, and n1 goes on with a local change after it
    prepare(nodes["n1"], "t1", 1001, -10)
    prepare(nodes["n2"], "t1", 2001, 10)
    prepare(nodes["n1"], "t2", 1002, -7)  # t2 is rolled back on both
    prepare(nodes["n2"], "t2", 2002, 7)
    decide(nodes["n1"], "t2", "ROLLBACK")
    decide(nodes["n2"], "t2", "ROLLBACK")
    decide(nodes["n1"], "t1")
    with psycopg.connect(nodes["n1"], autocommit=True) as c:
        c.execute("UPDATE accounts SET balance = balance - 1 WHERE id = 1003")
        c.execute("UPDATE accounts SET balance = balance + 1 WHERE id = 1004")
    with psycopg.connect(nodes["n2"], autocommit=True) as c:  # later on n2: it waits too (one cut in time)
        c.execute("UPDATE accounts SET balance = balance + 0 WHERE id = 2003")
    run_once(dbs, nodes, tmp_path, in_doubt=True)  # never exits 0 with t1's node behind
    replica = balances(dbs.sink)
    assert sum(replica.values()) == TOTAL
    # n1 waits before t1's commit: neither t1's part nor what n1 committed after it is applied
    assert (replica[1001], replica[2001], replica[1003]) == (BALANCE, BALANCE, BALANCE)
    assert (replica[1002], replica[2002]) == (BALANCE, BALANCE)

    decide(nodes["n2"], "t1")
    run_once(dbs, nodes, tmp_path)
    replica = balances(dbs.sink)
    assert replica == union(nodes) and sum(replica.values()) == TOTAL
    assert (replica[1001], replica[2001], replica[1003]) == (BALANCE - 10, BALANCE + 10, BALANCE - 1)
    with psycopg.connect(dbs.sink) as d:
        reads = [r for (batch,) in d.execute("SELECT reads FROM changefeed.progress WHERE feed = %s ORDER BY batch_id",
                                             (dbs.name,)) for r in batch]
    assert reads  # every batch recorded who read it


def test_kafka_gets_a_distributed_transaction_in_one_batch_with_one_commit_ts(
        dbs: Dbs, nodes: dict[str, str], tmp_path: Path, kafka: LocalKafka, spark: object) -> None:
    prefix = f"k{uuid.uuid4().hex[:8]}."
    sink = f"kafka://{kafka.bootstrap}?topic_prefix={prefix}&progress_topic=progress-{prefix}&topic_partitions=1"
    run_once(dbs, nodes, tmp_path, sink)  # the snapshot

    def changes() -> list[dict[str, Any]]:
        return [json.loads(r.value) for r in committed(read_partition(kafka.bootstrap, f"{prefix}public.accounts",
                                                                      timeout=60))
                if r.value and json.loads(r.value).get("op") != "r"]

    prepare(nodes["n1"], "k1", 1001, -5)
    prepare(nodes["n2"], "k1", 2001, 5)
    prepare(nodes["n1"], "k2", 1002, -5)
    prepare(nodes["n2"], "k2", 2002, 5)
    decide(nodes["n1"], "k2", "ROLLBACK")
    decide(nodes["n2"], "k2", "ROLLBACK")
    decide(nodes["n1"], "k1")
    run_once(dbs, nodes, tmp_path, sink, in_doubt=True)
    assert changes() == []  # k1 waits for its part on n2; k2 sends nothing
    decide(nodes["n2"], "k1")
    run_once(dbs, nodes, tmp_path, sink)
    got = changes()
    assert sorted((c["after"]["id"], c["after"]["balance"]) for c in got) == [(1001, BALANCE - 5), (2001, BALANCE + 5)]
    assert len({c["updated"] for c in got}) == 1  # one commit timestamp for the whole transaction


def test_a_pending_prepared_transaction_is_named_before_anything_is_created(dbs: Dbs, nodes: dict[str, str],
                                                                           tmp_path: Path) -> None:
    prepare(nodes["n2"], "stuck", 2001, 1)
    with pytest.raises(SourceNotReady, match="source node n2: 1 prepared transaction.*'stuck'"):
        run_once(dbs, nodes, tmp_path)
    for uri in nodes.values():
        with psycopg.connect(uri) as c:
            assert c.execute("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()"
                             ).fetchone() == (0,)


def transfers(nodes: dict[str, str], stop: threading.Event, done: list[int]) -> None:
    """Money moves between the nodes by two-phase commit (some rolled back, some decided slowly),
    and within each node by local transactions, until `stop`."""
    rng = random.Random(7)
    conns = {n: psycopg.connect(uri, autocommit=True) for n, uri in nodes.items()}
    try:
        while not stop.is_set() or done[0] < 200:
            done[0] += 1
            if rng.random() < 0.5:
                n = rng.choice(list(nodes))
                a, b = rng.sample(range(1, ACCOUNTS + 1), 2)
                base = 1000 * int(n[1:])
                with conns[n].transaction():
                    conns[n].execute("UPDATE accounts SET balance = balance - 3 WHERE id = %s", (base + a,))
                    conns[n].execute("UPDATE accounts SET balance = balance + 3 WHERE id = %s", (base + b,))
                continue
            gid, amount = f"x{done[0]}", rng.randrange(1, 20)
            pair = rng.sample(["n1", rng.choice([n for n in nodes if n != "n1"])], 2)
            for n, delta in zip(pair, (-amount, amount)):
                c = conns[n]
                c.execute("BEGIN")
                account = 1000 * int(n[1:]) + rng.randrange(1, ACCOUNTS + 1)
                c.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", (delta, account))
                c.execute(f"PREPARE TRANSACTION '{gid}'")
            how = "ROLLBACK" if rng.random() < 0.1 else "COMMIT"
            for n in rng.sample(pair, 2):
                conns[n].execute(f"{how} PREPARED '{gid}'")
                time.sleep(rng.choice((0, 0, 0.01, 0.3)))  # sometimes a part waits across batches
    finally:
        for c in conns.values():
            c.close()


def sampling(uri: str, stop: threading.Event, samples: list[int], accounts: int) -> None:
    """Read the replica's total again and again (once it has all `accounts`)."""
    with psycopg.connect(uri, autocommit=True) as c:
        while not stop.is_set():
            try:
                row = c.execute("SELECT count(*), sum(balance) FROM accounts").fetchone()
            except psycopg.errors.UndefinedTable:  # before the feed's first batch
                row = None
            if row and row[0] == accounts:
                samples.append(int(row[1]))
            time.sleep(0.02)


@pytest.mark.slow
def test_sigkill_at_awkward_moments_keeps_every_sample_whole(dbs: Dbs, three: dict[str, str], tmp_path: Path,
                                                             spark_server: str) -> None:
    """Three nodes; killed while a node's window is read (others' maybe not yet), while a part is
    held, after the replica's commit (before the slots move); then run on until caught up."""
    nodes = three
    state = str(tmp_path / "state")
    sources = [a for n, uri in nodes.items() for a in ("--source", f"{n}={uri}")]
    base = ["run", "--name", dbs.name, "--state", state, *sources, "--sink", dbs.sink, "--tables", "public.accounts",
            "--max-changes-per-batch", "40", "--master", "local[2]"]
    # the feed exists (and has its snapshot) before the load
    first = changefeed_cli(*base, "--available-now", "--master", spark_server)
    assert first.returncode == 0, first.stderr[-3000:]
    stop, sampler_stop = threading.Event(), threading.Event()
    done, samples = [0], []
    writer = threading.Thread(target=transfers, args=(nodes, stop, done))
    sampler = threading.Thread(target=sampling, args=(dbs.sink, sampler_stop, samples, 3 * ACCOUNTS))
    writer.start()
    sampler.start()
    try:
        kills = ({"CHANGEFEED_KILL_AT": "read:3"}, {"CHANGEFEED_KILL_AT": "pending:2"},
                 {"CHANGEFEED_KILL_AT": "after_sink_commit:3"}, {})
        for i, env in enumerate(kills):
            fault_dir = tmp_path / f"faults{i}"
            fault_dir.mkdir()
            log = tmp_path / f"run{i}.log"
            p = start_changefeed(*base, log=log, env={**env, "CHANGEFEED_FAULT_DIR": str(fault_dir)})
            if env:
                killed_by_fault(p, log)
                assert (fault_dir / f".fault-{env['CHANGEFEED_KILL_AT'].split(':')[0]}").exists()
            else:
                ran = done[0]
                wait_for("transfers made while this run goes on", lambda: done[0] >= ran + 40, log)
                stop.set()
                writer.join()
                expected = union(nodes)
                wait_for("the replica to catch up", lambda: balances(dbs.sink) == expected, log, timeout=240)
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    finally:
        stop.set()
        writer.join()
        sampler_stop.set()
        sampler.join()
    assert balances(dbs.sink) == union(nodes)
    with psycopg.connect(dbs.sink) as d:
        batches = d.execute("SELECT batch_id, positions, reads FROM changefeed.progress WHERE feed = %s "
                            "ORDER BY batch_id", (dbs.name,)).fetchall()
    batches_of: dict[str, set[int]] = {}  # gid -> the batches that delivered a part of it
    for batch_id, _, reads in batches:
        for r in reads:
            for gid, _ in r.get("gids") or ():
                batches_of.setdefault(gid, set()).add(batch_id)
    assert len(batches_of) > 50 and all(len(b) == 1 for b in batches_of.values()), batches_of
    assert any(r.get("pending") for _, _, reads in batches for r in reads)  # parts did wait for their partners
    assert len(samples) > 20 and set(samples) == {3 * ACCOUNTS * BALANCE}, sorted(set(samples))  # never half a transfer


def local_transfers(nodes: dict[str, str], stop: threading.Event, done: list[int]) -> None:
    """Transfers within each node, riding out a node that is down (its transfers wait)."""
    rng = random.Random(11)
    while not stop.is_set():
        n = rng.choice(list(nodes))
        base = 1000 if n == "n1" else 2000
        a, b = rng.sample(range(1, ACCOUNTS + 1), 2)
        try:
            with psycopg.connect(nodes[n], autocommit=True, connect_timeout=2) as c, c.transaction():
                c.execute("UPDATE accounts SET balance = balance - 2 WHERE id = %s", (base + a,))
                c.execute("UPDATE accounts SET balance = balance + 2 WHERE id = %s", (base + b,))
            done[0] += 1
        except psycopg.OperationalError:
            time.sleep(0.2)


@pytest.mark.usefixtures("warm_spark")
@pytest.mark.slow
def test_a_node_down_for_20_s_stalls_the_feed_which_then_catches_up(dbs: Dbs, nodes: dict[str, str],
                                                                    second: LocalPostgres, tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    base = ["--name", dbs.name, "--state", state]
    log = tmp_path / "run.log"
    p = start_changefeed("run", *base, "--source", f"n1={nodes['n1']}", "--source", f"n2={nodes['n2']}",
                         "--sink", dbs.sink, "--tables", "public.accounts", "--master", "local[2]",
                         "--retry-max-backoff", "2s", log=log)
    stop, done = threading.Event(), [0]
    writer = threading.Thread(target=local_transfers, args=(nodes, stop, done))
    try:
        wait_for("the snapshot", lambda: _has_accounts(dbs.sink) and len(balances(dbs.sink)) == 2 * ACCOUNTS, log)
        writer.start()
        wait_for("transfers on both nodes", lambda: done[0] >= 20, log)
        second.stop("immediate")

        def failures_of_n2() -> int:
            shown = changefeed_cli("status", *base)
            found = re.search(r"after (\d+) failure\(s\) of the source node n2", shown.stdout)
            return int(found.group(1)) if found else 0

        wait_for("status to name n2's repeated failures", lambda: failures_of_n2() >= 4, log)
        assert p.poll() is None, log.read_text()[-3000:]  # it waits, it does not give up or skip the node
        LocalPostgres.start(second.datadir, port=second.port, settings={"max_prepared_transactions": "16"})
        back = done[0]
        wait_for("transfers after n2 is back", lambda: done[0] >= back + 20, log)
        stop.set()
        writer.join()
        expected = union(nodes)
        wait_for("the replica to catch up", lambda: balances(dbs.sink) == expected, log, timeout=240)
        # (said at the runner's next look after a batch landed: the catch-up may have been that batch)
        wait_for("the runner to say n2 is back", lambda: "carrying on" in log.read_text(), log, timeout=60)
    finally:
        stop.set()
        if writer.is_alive():
            writer.join()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=120)
    text = log.read_text()
    assert "source node n2" in text and "carrying on" in text, text[-3000:]
    assert_no_traceback(text)
    assert sum(balances(dbs.sink).values()) == TOTAL and done[0] > 50


def _has_accounts(uri: str) -> bool:
    with psycopg.connect(uri) as c:
        return c.execute("SELECT to_regclass('public.accounts') IS NOT NULL").fetchone()[0]  # type: ignore[index]
