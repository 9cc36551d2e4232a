"""Low-latency mode (`run --low-latency`, core.followed): each batch's one task follows the slot and
commits a replica transaction per sub-window. Under writes, with SIGKILLs at its fault points and
at random, the replica still gets every committed change once, in sub-windows whose resolved
timestamps never go back; a run in micro-batches carries on where it stopped. A runner frozen in a
followed batch is taken over by a standby, which follows the slot in turn. What the mode cannot do
yet is refused with nothing created."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from support.feeds import assert_no_traceback, changefeed_cli, kill_group, kill_runs, start_changefeed, wait_for
from support.kafka import kafka_partitions, kafka_sink
from support.servers import Dbs, fingerprint
from support.standby import taken_over_while_frozen
from support.webhooks import Receiver
from support.writers import money_tables, most_sub_windows, moving_money, replicated, writing

ACCOUNTS = 40
SNAPSHOT_ROWS = 3000  # rows the snapshot delivers (in micro-batches) before the feed follows the slot


@pytest.mark.slow
def test_a_low_latency_feed_is_exactly_once_through_kills(dbs: Dbs, tmp_path: Path) -> None:
    money_tables(dbs, ACCOUNTS)
    with dbs.src() as c:
        c.execute("INSERT INTO ledger SELECT -g, 'old' FROM generate_series(1, %s) g", (SNAPSHOT_ROWS,))
    state = str(tmp_path / "state")
    base = ["run", "--name", dbs.name, "--state", state]
    written = [0]
    # batches of 3 s: the kills and the runs between them cross several batch boundaries; the
    # first run is killed as it reads the snapshot (in micro-batches), before it follows the slot
    kills = ["snapshot_chunk", "after_sink_commit:25", "startup", "read:60", "before_sink_commit:40", "random"]
    (tmp_path / "first").mkdir()
    with writing(moving_money(ACCOUNTS), dbs.source, written):
        kill_runs([*base, "--source", dbs.source, "--sink", dbs.sink, "--tables", "public.ledger,public.accounts",
                   "--low-latency", "3s", "--snapshot-chunk-rows", "1000"], kills[:1], tmp_path / "first",
                  random_after=(15, 25))
        kill_runs(base, kills[1:], tmp_path, random_after=(15, 25))
    final = changefeed_cli(*base, "--available-now")  # the rest in micro-batches, from where the last run was
    assert final.returncode == 0, final.stderr[-3000:]

    for table in ("public.ledger", "public.accounts"):
        assert fingerprint(dbs.source, table) == fingerprint(dbs.sink, table), table
    with dbs.dst() as d:
        ids = [r[0] for r in d.execute("SELECT id FROM ledger WHERE id > 0 ORDER BY id")]
        assert ids == list(range(1, written[0] + 1))  # every committed row, once, none missing
        assert d.execute("SELECT sum(balance) FROM accounts").fetchone() == (ACCOUNTS * 1000,)
        rows = d.execute("SELECT batch_id, end_lsn - '0/0'::pg_lsn, resolved_ts FROM changefeed.progress "
                         "WHERE feed = %s ORDER BY end_lsn", (dbs.name,)).fetchall()
    resolved = [r[2] for r in rows]
    assert resolved == sorted(resolved)  # the resolved ts never went back
    per_batch: dict[int, int] = {}
    for batch, _, _ in rows:
        per_batch[batch] = per_batch.get(batch, 0) + 1
    assert max(per_batch.values()) >= 10, per_batch  # followed batches committed many sub-windows each


@pytest.mark.slow
def test_a_low_latency_feed_into_kafka_is_exactly_once_through_kills(dbs: Dbs, tmp_path: Path, kafka: Any) -> None:
    """The same into Kafka: each sub-window a transaction with its progress record. A read_committed
    consumer gets every ledger row once and each account's balance moves in commit order; the
    progress topic shows followed batches of many transactions each."""
    from changefeed.local.kafka import committed
    from changefeed.sinks.kafka.batch import ProgressRecord

    money_tables(dbs, ACCOUNTS)
    sink, prefix, progress_topic = kafka_sink(kafka.bootstrap, 2)
    state = str(tmp_path / "state")
    base = ["run", "--name", dbs.name, "--state", state]
    written = [0]
    # the snapshot first, before any change (a row inserted while it is read comes as read and as
    # inserted: two messages, as in micro-batches)
    first = changefeed_cli(*base, "--source", dbs.source, "--sink", sink, "--tables", "public.ledger,public.accounts",
                           "--low-latency", "3s", "--available-now")
    assert first.returncode == 0, first.stderr[-3000:]
    kills = ["sink_write:1", "after_sink_commit:25", "before_sink_commit:40", "read:60", "random"]
    with writing(moving_money(ACCOUNTS), dbs.source, written):
        kill_runs(base, kills, tmp_path, random_after=(15, 25))
    final = changefeed_cli(*base, "--available-now")  # the rest in micro-batches, from where the last run was
    assert final.returncode == 0, final.stderr[-3000:]

    ids = sorted(json.loads(r.key)[0] for part in kafka_partitions(kafka.bootstrap, f"{prefix}public.ledger")
                 for r in committed(part))
    assert ids == list(range(1, written[0] + 1)), f"{len(ids)} ids for {written[0]} rows, {len(set(ids))} distinct"
    balances: dict[int, list[int]] = {}
    for part in kafka_partitions(kafka.bootstrap, f"{prefix}public.accounts"):
        for r in committed(part):
            value = json.loads(r.value)
            balances.setdefault(json.loads(r.key)[0], []).append(value["after"]["balance"])
    with dbs.src() as c:
        source = dict(c.execute("SELECT id, balance FROM accounts").fetchall())
    assert {k: v[-1] for k, v in balances.items()} == source  # each account ends where the source's is
    per_batch: dict[tuple[str, int], int] = {}
    resolved = []
    for r in committed(kafka_partitions(kafka.bootstrap, progress_topic)[0]):
        record = ProgressRecord.decode(r.value)
        if r.key == dbs.name.encode() and not record.claimed:
            per_batch[(record.query, record.batch)] = per_batch.get((record.query, record.batch), 0) + 1
            resolved.append(record.progress.resolved_ts)
    assert resolved == sorted(resolved)  # the resolved ts never went back
    assert max(per_batch.values()) >= 10, per_batch  # followed batches committed many sub-windows each


@pytest.mark.slow
def test_a_low_latency_feed_into_a_webhook_is_at_least_once_through_kills(dbs: Dbs, tmp_path: Path,
                                                                          receiver: tuple[Receiver, str]) -> None:
    """The same into a webhook, at least once: each sub-window posted as it ends. The endpoint gets
    every ledger row, their first arrivals in commit order, each account's last message its
    balance on the source, resolved messages that never go back, and followed batches of many
    requests each."""
    rec, url = receiver
    money_tables(dbs, ACCOUNTS)
    sink = f"{url}?retry_backoff=50ms&retry_max_backoff=300ms&timeout=2s&retry_max=inf&resolved=true"
    state = str(tmp_path / "state")
    base = ["run", "--name", dbs.name, "--state", state]
    written = [0]
    first = changefeed_cli(*base, "--source", dbs.source, "--sink", sink, "--tables", "public.ledger,public.accounts",
                           "--low-latency", "3s", "--available-now")  # the snapshot, before any change
    assert first.returncode == 0, first.stderr[-3000:]
    kills = ["webhook_request:30", "read:60", "webhook_request:90", "random"]
    with writing(moving_money(ACCOUNTS), dbs.source, written):
        kill_runs(base, kills, tmp_path, random_after=(15, 25))
    final = changefeed_cli(*base, "--available-now")  # the rest in micro-batches, from where the last run was
    assert final.returncode == 0, final.stderr[-3000:]

    messages = rec.messages()  # (idempotency key, message), repeated keys dropped as a receiver would
    changes = [m for _, m in messages if "resolved" not in m]
    ledger = [m["key"][0] for m in changes if m["table"] == "public.ledger" and m["after"] is not None]
    firsts = list(dict.fromkeys(ledger))  # each row's first arrival, in arrival order
    assert sorted(firsts) == list(range(1, written[0] + 1))  # every committed row, none missing
    assert firsts == sorted(firsts)  # first arrivals in commit order (a replay repeats a run of them)
    last: dict[int, int] = {}
    for m in changes:
        if m["table"] == "public.accounts":
            last[m["key"][0]] = m["after"]["balance"]
    with dbs.src() as c:
        assert last == dict(c.execute("SELECT id, balance FROM accounts").fetchall())
    resolved = [int(m["resolved"]) for _, m in messages if "resolved" in m]
    assert resolved and resolved == sorted(resolved)  # the resolved ts never went back
    per_batch: dict[str, int] = {}
    for key, _ in messages:
        if not key.endswith("-resolved"):
            batch = key.split("-")[1]  # {feed}-{batch}-{first}-{last}-{hash}
            per_batch[batch] = per_batch.get(batch, 0) + 1
    assert max(per_batch.values()) >= 10, per_batch  # followed batches posted many sub-windows each


def test_a_frozen_low_latency_runner_is_taken_over_and_lands_nothing_when_woken(dbs: Dbs, tmp_path: Path) -> None:
    """Frozen (SIGSTOP) with a sub-window's transaction open on the replica and its replication
    connection reading the slot: a standby ends its sessions once its lease lapses, follows the slot
    itself, and the woken runner lands nothing (its lease is gone) and stops."""
    money_tables(dbs, ACCOUNTS)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    armed = tmp_path / "armed"
    written = [0]
    with writing(moving_money(ACCOUNTS, 3), dbs.source, written):
        a = start_changefeed("run", "--name", dbs.name, "--state", str(tmp_path / "a"), "--source", dbs.source,
                             "--sink", dbs.sink, "--tables", "public.ledger,public.accounts", "--lease", "3s",
                             "--low-latency", "30s", log=logs[0],
                             env={"CHANGEFEED_STOP_AT": "before_sink_commit:5", "CHANGEFEED_FAULT_DIR": str(tmp_path),
                                  "CHANGEFEED_FAULT_ARMED": str(armed)})
        b = None
        try:
            wait_for("followed rows on the replica", lambda: replicated(dbs.sink) > 50, logs[0])
            b = start_changefeed("run", "--standby", "--name", dbs.name, "--state", str(tmp_path / "b"),
                                 "--source", dbs.source, log=logs[1])
            wait_for("the standby to wait", lambda: "standing by; active: pid " in logs[1].read_text(), logs[1])
            armed.touch()
            claimed = taken_over_while_frozen(dbs, a, logs, tmp_path, lambda: replicated(dbs.sink))
            wait_for("the standby to follow the slot", lambda: most_sub_windows(dbs.sink, dbs.name, claimed[0]) > 3,
                     logs[1])
        except BaseException:
            kill_group(a)
            raise
    assert b is not None
    try:
        wait_for("the replica to catch up", lambda: fingerprint(dbs.source, "public.ledger")
                 == fingerprint(dbs.sink, "public.ledger"), logs[1], timeout=180)
    finally:
        kill_group(b)
    assert fingerprint(dbs.source, "public.accounts") == fingerprint(dbs.sink, "public.accounts")
    assert_no_traceback(logs[0].read_text())
    with dbs.dst() as d:
        late = d.execute("SELECT count(*) FROM changefeed.progress WHERE feed = %s AND applied_at > %s "
                         "AND epoch < %s", (dbs.name, claimed[1], claimed[0])).fetchone()
    assert late == (0,), "the woken runner landed a sub-window after the standby's claim"


def test_a_frozen_low_latency_runner_into_kafka_is_fenced_by_the_standby(dbs: Dbs, tmp_path: Path,
                                                                          kafka: Any) -> None:
    """The same into Kafka: frozen with a sub-window's transaction open, the runner is fenced by the
    standby's claim (its producer's transactional id taken over); the standby follows the slot, and
    no progress record of the old term is committed after the claim."""
    from changefeed.local.kafka import committed, read_partition
    from changefeed.sinks.kafka.batch import ProgressRecord

    money_tables(dbs, ACCOUNTS)
    sink, prefix, progress_topic = kafka_sink(kafka.bootstrap, 1)
    topic = f"{prefix}public.ledger"

    def ids() -> list[int]:
        return [json.loads(r.key)[0] for r in committed(read_partition(kafka.bootstrap, topic, 0, timeout=60))]

    def records() -> list[tuple[int, ProgressRecord]]:
        return [(r.offset, ProgressRecord.decode(r.value)) for r in
                committed(read_partition(kafka.bootstrap, progress_topic, 0, timeout=60))
                if r.key == dbs.name.encode()]

    def claim() -> tuple[int, int]:
        return max((p.epoch, offset) for offset, p in records() if p.claimed)

    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    armed = tmp_path / "armed"
    written = [0]
    first = changefeed_cli("run", "--name", dbs.name, "--state", str(tmp_path / "a"), "--source", dbs.source,
                           "--sink", sink, "--tables", "public.ledger,public.accounts", "--available-now")
    assert first.returncode == 0, first.stderr[-3000:]  # (the snapshot, before changes race it)
    with writing(moving_money(ACCOUNTS, 3), dbs.source, written):
        a = start_changefeed("run", "--name", dbs.name, "--state", str(tmp_path / "a"), "--lease", "3s",
                             "--low-latency", "30s", log=logs[0],
                             env={"CHANGEFEED_STOP_AT": "before_sink_commit:5", "CHANGEFEED_FAULT_DIR": str(tmp_path),
                                  "CHANGEFEED_FAULT_ARMED": str(armed)})
        b = None
        try:
            wait_for("followed rows in Kafka", lambda: len(ids()) > 50, logs[0])
            b = start_changefeed("run", "--standby", "--name", dbs.name, "--state", str(tmp_path / "b"),
                                 "--source", dbs.source, log=logs[1])
            wait_for("the standby to wait", lambda: "standing by; active: pid " in logs[1].read_text(), logs[1])
            armed.touch()
            epoch, at = taken_over_while_frozen(dbs, a, logs, tmp_path, lambda: max(ids(), default=0), claim)
            wait_for("the standby to follow the slot", lambda: sum(
                1 for _, p in records() if p.epoch == epoch and not p.claimed and
                (p.progress.offset or {}).get("follow")) > 3, logs[1])
        except BaseException:
            kill_group(a)
            raise
    assert b is not None
    try:
        wait_for("every row in Kafka", lambda: max(ids(), default=0) >= written[0], logs[1], timeout=180)
    finally:
        kill_group(b)
    assert sorted(ids()) == list(range(1, written[0] + 1))
    assert_no_traceback(logs[0].read_text())
    late = [(offset, p.epoch) for offset, p in records() if offset > at and p.epoch < epoch]
    assert late == [], "the woken runner committed a sub-window after the standby's claim"


def test_a_snapshot_request_ends_a_followed_batch_before_its_time(dbs: Dbs, tmp_path: Path) -> None:
    """A batch that would follow the slot for ten minutes ends when `snapshot --tables` asks, so
    the re-snapshot comes within a minute or two rather than after the batch."""
    with dbs.src() as c:
        c.execute("CREATE TABLE items (id int PRIMARY KEY, v text)")
        c.execute("INSERT INTO items SELECT g, 'v' FROM generate_series(1, 2000) g")
    state, log = str(tmp_path / "state"), tmp_path / "feed.log"
    feed = start_changefeed("run", "--name", dbs.name, "--state", state, "--source", dbs.source, "--sink", dbs.sink,
                            "--tables", "public.items", "--low-latency", "10m", log=log)
    try:
        wait_for("the snapshot", lambda: "snapshot public.items: done" in log.read_text(), log)
        with dbs.src() as c:
            c.execute("INSERT INTO items VALUES (5000, 'new')")  # followed: on the replica at once
        wait_for("a followed change", lambda: _count(dbs.sink, "id = 5000") == 1, log, timeout=60)
        with dbs.dst() as d:
            d.execute("DELETE FROM items WHERE id <= 1000")  # the replica damaged: a re-snapshot mends it
        asked = changefeed_cli("snapshot", "--name", dbs.name, "--state", state, "--tables", "public.items")
        assert asked.returncode == 0, asked.stderr
        wait_for("the re-snapshot", lambda: _count(dbs.sink, "true") == 2001, log, timeout=120)
        assert fingerprint(dbs.source, "public.items") == fingerprint(dbs.sink, "public.items")
    finally:
        kill_group(feed)


def _count(uri: str, where: str) -> int:
    import psycopg

    with psycopg.connect(uri) as c:
        return int(c.execute(f"SELECT count(*) FROM items WHERE {where}").fetchone()[0])  # type: ignore[index]


@pytest.mark.parametrize(("extra", "says"), [
    (["--sink", "delta:///tmp/never"], "not a PostgreSQL replica, Kafka or a webhook"),
    (["--sink", "kafka://127.0.0.1:9?delivery=at_least_once"], "needs delivery=exactly_once"),
    (["--max-rate", "100"], "--max-rate"),
    (["--low-latency", "0.5s"], "at least 1s"),
])
def test_what_low_latency_cannot_do_is_refused_with_nothing_created(dbs: Dbs, tmp_path: Path, extra: list[str],
                                                                     says: str) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY)")
    sink = [] if "--sink" in extra else ["--sink", dbs.sink]
    got = changefeed_cli("run", "--name", dbs.name, "--state", str(tmp_path / "state"), "--source", dbs.source,
                         *sink, "--tables", "public.t", "--low-latency", *extra)
    assert got.returncode == 64 and says in got.stderr and "Traceback" not in got.stderr, got.stderr
    with dbs.src() as c:
        assert c.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE %s",
                         (f"%{dbs.name}%",)).fetchone() == (0,)
