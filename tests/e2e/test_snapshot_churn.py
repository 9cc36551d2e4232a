"""A first snapshot read while the application deletes, inserts again and moves keys (issue 62):
a replica, Kafka (exactly once, read back through the transactions' outcome) and a Delta change
log of one feed all end equal to the source, and Kafka and the change log hold each change once.

The writer's transactions add one to `v` whatever they do to a row: an update, a delete and an
insert again of the same key, a key moved into a gap (ranges read already, still to be read, or
past the table's end), a delete, an insert of a new key. The change log is replayed strictly: a
snapshot row or an insert lands on a key that is not there, an update or delete on one that is, a
key change's update on the key its delete freed, and each update's `v` is one more than the row
it replaces. A change the read saw and that came again breaks one of these, and so does a lost
one; the end must equal the source. Kafka is replayed key by key (a key change's halves are messages
of two keys). Killed in the middle of snapshot batches, the sinks still end equal to the source
(a batch read again after a restart may repeat changes its new read saw: never a loss). A table
`alter --add-tables` brings into the running feed while it is churned replays strictly too."""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from changefeed.local.postgres import LocalPostgres
from changefeed.sinks.kafka.log import committed
from support.feeds import changefeed_cli, kill_running, killed_by_fault, start_changefeed, wait_for
from support.kafka import kafka_partitions, kafka_sink
from support.servers import Dbs, drop_slots
from support.writers import WRITE_PAUSE, writing

pytestmark = pytest.mark.timeout(900)
ROWS, CHUNK = 6_000, 500  # even ids 2..2*ROWS: the odd ones are gaps a key can move into


class _RolledBack(Exception):
    pass


def _churning(uri: str, stop: threading.Event, written: list[int]) -> None:
    """One to three changes per transaction, one transaction in twenty rolled back."""
    rng = random.Random(6201)
    free = list(range(1, 2 * ROWS + 4000, 2)) + list(range(2 * ROWS + 2, 2 * ROWS + 4000, 2))
    rng.shuffle(free)
    with psycopg.connect(uri, autocommit=True) as c:
        n = 0
        while not stop.is_set() and free:
            n += 1
            try:
                with c.transaction():
                    for _ in range(rng.randint(1, 3)):
                        _change(c, rng, free)
                    if n % 20 == 0:
                        raise _RolledBack
            except _RolledBack:
                pass
            else:
                written[0] += 1
            time.sleep(WRITE_PAUSE)


def _change(c: psycopg.Connection, rng: random.Random, free: list[int]) -> None:
    k = c.execute("SELECT id FROM churn TABLESAMPLE SYSTEM (5) LIMIT 1").fetchone()
    what = rng.random()
    if k is None or what < 0.15:
        c.execute("INSERT INTO churn VALUES (%s, 0)", (free.pop(),))
    elif what < 0.45:
        c.execute("UPDATE churn SET v = v + 1 WHERE id = %s", k)
    elif what < 0.65:
        gone = c.execute("DELETE FROM churn WHERE id = %s RETURNING v", k).fetchone()
        if gone is not None:
            c.execute("INSERT INTO churn VALUES (%s, %s)", (k[0], gone[0] + 1))
    elif what < 0.9:
        c.execute("UPDATE churn SET id = %s, v = v + 1 WHERE id = %s", (free.pop(), k[0]))
    else:
        c.execute("DELETE FROM churn WHERE id = %s", k)


def _replayed(lake: Path) -> tuple[dict[int, int], list[str]]:
    """The change log applied in order, and what broke the strict rules."""
    from deltalake import DeltaTable

    rows: list[dict[str, Any]] = pa.table(DeltaTable(str(lake / "public.churn")).to_pyarrow_table()).to_pylist()
    state: dict[int, int] = {}
    broken: list[str] = []
    freed: dict[tuple[int, int], int] = {}  # (lsn, seq of the update) -> v of the row a key change's delete removed
    for r in sorted(rows, key=lambda r: (r["_lsn"], r["_seq"])):
        op, k, v, at = r["_op"], r["id"], r["v"], (r["_lsn"], r["_seq"])
        if op == "d":
            freed[(r["_lsn"], r["_seq"] + 1)] = state.get(k, -1)
        before = freed.pop(at, None) if op == "u" and k not in state else state.get(k)
        _step(state, broken, op, k, v, before, at)
    return state, broken


def _step(state: dict[int, int], broken: list[str], op: str, k: int, v: int | None, before: int | None,
          at: object) -> None:
    """Apply one change to `state`, noting in `broken` where it breaks the strict rules (`before`:
    the row's `v` it replaces, None if there is none)."""
    if op == "t":
        state.clear()
    elif op in "rc":
        if k in state:
            broken.append(f"{op} of {k} (v {v}) over a row with v {state[k]} at {at}")
        state[k] = v  # type: ignore[assignment]  # (an insert has a row)
    elif op == "d":
        if k not in state:
            broken.append(f"delete of {k}, not there, at {at}")
        state.pop(k, None)
    elif op == "u":
        if before is None:
            broken.append(f"update of {k}, not there, at {at}")
        elif v != before + 1:
            broken.append(f"update of {k} to v {v} after v {before} at {at}")
        state[k] = v  # type: ignore[assignment]


def _kafka(bootstrap: str, prefix: str) -> tuple[dict[int, int], list[str]]:
    """Kafka's committed messages applied key by key in partition order (a key change's new key
    arrives as an update of a key that is not there: its old key's delete is another key's)."""
    state: dict[int, int] = {}
    broken: list[str] = []
    for part in kafka_partitions(bootstrap, f"{prefix}public.churn"):
        for r in committed(part):
            if r.value is None:
                continue
            m = json.loads(r.value)
            if m["op"] == "t":
                state.clear()
                continue
            k, op = m["key"][0], m["op"]
            v = (m["after"] or {}).get("v")
            moved_in = op == "u" and k not in state and v is not None
            _step(state, broken, op, k, v, v - 1 if moved_in else state.get(k), r.offset)
    return state, broken


def _setup(dbs: Dbs) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE churn (id bigint PRIMARY KEY, v int NOT NULL)")
        c.execute("INSERT INTO churn SELECT 2 * g, 0 FROM generate_series(1, %s) g", (ROWS,))
        c.execute("ANALYZE churn")


def _sinks(dbs: Dbs) -> tuple[dict[int, int], dict[int, int]]:
    """(source, replica): id -> v."""
    with dbs.src() as c:
        source = dict(c.execute("SELECT id, v FROM churn").fetchall())
    with dbs.dst() as c:
        replica = dict(c.execute("SELECT id, v FROM churn").fetchall())
    return source, replica


def _differ(a: dict[int, int], b: dict[int, int]) -> int:
    return len(set(a.items()) ^ set(b.items()))


def _three_sinks(dbs: Dbs, tmp_path: Path, kafka: Any, tables: str = "public.churn"
                 ) -> tuple[Path, str, list[str], list[str]]:
    """The churn table set up, and a feed of `tables` into a replica, a Delta change log and Kafka:
    (the lake, Kafka's topic prefix, the run command of a feed that exists, the first run's)."""
    _setup(dbs)
    lake = tmp_path / "lake"
    topics, prefix, _ = kafka_sink(kafka.bootstrap, 2)
    base = ["run", "--name", dbs.name, "--state", str(tmp_path / "state")]
    first = [*base, "--source", dbs.source, "--sink", f"dr={dbs.sink}", "--sink", f"lake=delta://{lake}?mode=changelog",
             "--sink", f"events={topics}", "--tables", tables, "--snapshot-chunk-rows", str(CHUNK),
             "--snapshot-chunks-per-batch", "2"]
    return lake, prefix, base, first


def _killed_runs(dbs: Dbs, tmp_path: Path, base: list[str], first: list[str], kills: tuple[str, ...]) -> list[Path]:
    """Under the churning writer, a run killed at each of `kills` (fault points) in turn: their logs."""
    written, logs = [0], []
    with writing(_churning, dbs.source, written):
        for i, at in enumerate(kills):
            faults, log = tmp_path / f"faults{i}", tmp_path / f"run{i}.log"
            faults.mkdir()
            p = start_changefeed(*(first if i == 0 else base), log=log,
                                 env={"CHANGEFEED_KILL_AT": at, "CHANGEFEED_FAULT_DIR": str(faults)})
            killed_by_fault(p, log)
            logs.append(log)
    return logs


def _check_sinks(dbs: Dbs, lake: Path | None, bootstrap: str, prefix: str, strict: bool = True) -> None:
    """Every sink equals the source; with `strict`, Kafka and the change log (if `lake`) replay
    strictly too."""
    source, replica = _sinks(dbs)
    assert replica == source, f"replica: {_differ(replica, source)} rows differ"
    logs = [("the change log", _replayed(lake))] if lake else []
    for sink, (state, broken) in [*logs, ("Kafka", _kafka(bootstrap, prefix))]:
        assert not strict or not broken, f"{sink}: {len(broken)} changes break the rules, e.g. {broken[:5]}"
        assert state == source, f"{sink}: {_differ(state, source)} rows differ"


def test_deletes_inserts_again_and_key_moves_during_the_first_snapshot_reach_each_sink_once(
        dbs: Dbs, tmp_path: Path, kafka: Any) -> None:
    lake, prefix, base, first = _three_sinks(dbs, tmp_path, kafka)
    written = [0]
    with writing(_churning, dbs.source, written):
        time.sleep(0.5)  # (the writer runs before the feed starts, as an application would)
        done = changefeed_cli(*first, "--available-now")
        assert done.returncode == 0, done.stderr[-3000:]
    assert written[0] > 50, written  # the writer really ran during the snapshot
    done = changefeed_cli(*base, "--available-now")
    assert done.returncode == 0, done.stderr[-3000:]
    _check_sinks(dbs, lake, kafka.bootstrap, prefix)


def test_killed_in_the_middle_of_snapshot_batches_every_sink_ends_equal_to_the_source(
        dbs: Dbs, tmp_path: Path, kafka: Any) -> None:
    lake, prefix, base, first = _three_sinks(dbs, tmp_path, kafka)
    # chunks read; one sink committed
    _killed_runs(dbs, tmp_path, base, first, ("snapshot_chunk:3", "before_sink_commit:4"))
    done = changefeed_cli(*base, "--available-now")
    assert done.returncode == 0, done.stderr[-3000:]
    _check_sinks(dbs, lake, kafka.bootstrap, prefix, strict=False)


def test_killed_while_its_chunks_are_read_each_change_still_reaches_each_sink_once(
        dbs: Dbs, tmp_path: Path, kafka: Any) -> None:
    """SIGKILLed while a snapshot batch's chunks are read (before any sink recorded it), the batch
    is planned anew at the restart, its reads in a fresh export: a read in a snapshot of its own,
    later than the one the offset recorded, would repeat the changes only it saw."""
    lake, prefix, base, first = _three_sinks(dbs, tmp_path, kafka)
    logs = _killed_runs(dbs, tmp_path, base, first, ("snapshot_chunk:1", "snapshot_chunk:3", "snapshot_chunk:2"))
    done = changefeed_cli(*base, "--available-now")
    assert done.returncode == 0, done.stderr[-3000:]
    _check_sinks(dbs, lake, kafka.bootstrap, prefix)
    for said in [log.read_text() for log in logs[1:]] + [done.stdout + done.stderr]:
        assert "snapshot reads no sink recorded" in said, "each restart plans the batch in flight anew"


def test_a_table_added_to_a_running_feed_while_it_is_written_reaches_each_sink_once(
        dbs: Dbs, tmp_path: Path, kafka: Any) -> None:
    """alter --add-tables on a running feed while the application churns the table: the request is
    made with the table's publication, so the batch whose window first brings its changes has
    taken it in, and its read is a first read: no change before it or seen by it comes again."""
    lake, prefix, base, first = _three_sinks(dbs, tmp_path, kafka, tables="public.other")
    with dbs.src() as c:
        c.execute("CREATE TABLE other (id int PRIMARY KEY)")
    _added_while_churned(dbs, tmp_path, base, first)
    _check_sinks(dbs, lake, kafka.bootstrap, prefix)


def test_a_table_added_to_a_running_feed_of_two_nodes_while_it_is_written_reaches_each_sink_once(
        dbs: Dbs, tmp_path: Path, kafka: Any, servers: tuple[LocalPostgres, LocalPostgres]) -> None:
    """The same on a feed of two nodes (the table churned on one, empty on the other): the
    publications on both and the request are made under the lock a runner fixes a window's end
    under (postgres.requests.publishing). `alter` is frozen for a while between the publications
    and the request: the runner plans no window meanwhile that would bring the table's changes."""
    with psycopg.connect(servers[0].uri(), autocommit=True) as c:
        c.execute(f"CREATE DATABASE {dbs.name}_n2")
    n2 = servers[0].uri(f"{dbs.name}_n2")
    try:
        _setup(dbs)
        with psycopg.connect(n2, autocommit=True) as c:
            c.execute("CREATE TABLE churn (id bigint PRIMARY KEY, v int NOT NULL)")
        for uri in (dbs.source, n2):
            with psycopg.connect(uri, autocommit=True) as c:
                c.execute("CREATE TABLE other (id int PRIMARY KEY)")
        topics, prefix, _ = kafka_sink(kafka.bootstrap, 2)
        base = ["run", "--name", dbs.name, "--state", str(tmp_path / "state")]
        first = [*base, "--source", f"n1={dbs.source}", "--source", f"n2={n2}", "--sink", f"dr={dbs.sink}",
                 "--sink", f"events={topics}", "--tables", "public.other", "--snapshot-chunk-rows", str(CHUNK),
                 "--snapshot-chunks-per-batch", "2"]
        _added_while_churned(dbs, tmp_path, base, first, frozen=True)
        _check_sinks(dbs, None, kafka.bootstrap, prefix)
    finally:
        drop_slots(servers[0].uri(), f"{dbs.name}_n2")


def _added_while_churned(dbs: Dbs, tmp_path: Path, base: list[str], first: list[str], frozen: bool = False) -> None:
    """A feed of `other` run (`first`) while the churn table is written, the churn table added to
    it (`frozen`: `alter` stopped for a while once it published the table), read and written on;
    then stopped and run once more to the end (`base`)."""
    log, written = tmp_path / "run.log", [0]
    p = start_changefeed(*first, log=log)
    try:
        with writing(_churning, dbs.source, written):
            with dbs.src() as c:
                c.execute("INSERT INTO other VALUES (1)")
            wait_for("the feed to run", lambda: _replica_count(dbs, "other") == 1, log)
            _alter(tmp_path, dbs.name, frozen)
            wait_for("the added table's read", lambda: _replica_count(dbs, "churn") >= ROWS * 0.8, log, 300)
            time.sleep(1)  # (changes after the read, too)
        assert written[0] > 50, written
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 0, log.read_text()[-3000:]
    done = changefeed_cli(*base, "--available-now")
    assert done.returncode == 0, done.stderr[-3000:]


def _alter(tmp_path: Path, name: str, frozen: bool) -> None:
    """alter --add-tables public.churn; `frozen`: stopped (SIGSTOP) at tables_published for 3 s."""
    args = ("alter", "--name", name, "--state", str(tmp_path / "state"), "--add-tables", "public.churn")
    if not frozen:
        altered = changefeed_cli(*args)
        assert altered.returncode == 0, altered.stderr
        return
    faults, log = tmp_path / "alter-faults", tmp_path / "alter.log"
    faults.mkdir()
    p = start_changefeed(*args, log=log, env={"CHANGEFEED_STOP_AT": "tables_published",
                                              "CHANGEFEED_FAULT_DIR": str(faults)})
    groups = wait_for("alter to freeze", lambda: (faults / ".stopped-groups").is_file()
                      and (faults / ".stopped-groups").read_text().split(), log, 60)
    time.sleep(3)  # (the writer goes on, and the feed would plan windows)
    for g in groups:
        os.killpg(int(g), signal.SIGCONT)
    assert p.wait(timeout=120) == 0, log.read_text()[-3000:]


def _replica_count(dbs: Dbs, table: str) -> int:
    with dbs.dst() as c:
        try:
            return int(c.execute(f"SELECT count(*) FROM {table}").fetchone()[0])  # type: ignore[index]
        except psycopg.errors.UndefinedTable:
            return 0


def test_a_truncate_between_a_window_end_and_its_read_leaves_no_row_out(dbs: Dbs, tmp_path: Path) -> None:
    """Frozen where a snapshot batch's window end is fixed and its read not begun: a TRUNCATE and
    inserts then commit after the window's end, and the read sees them; the truncate reaches the
    sinks a window later and empties what the read gave them, so the inserts it saw, in the
    windows after the truncate's, must come again."""
    _setup(dbs)
    lake, faults = tmp_path / "lake", tmp_path / "faults"
    faults.mkdir()
    base = ["run", "--name", dbs.name, "--state", str(tmp_path / "state")]
    first = [*base, "--source", dbs.source, "--sink", f"dr={dbs.sink}", "--sink", f"lake=delta://{lake}?mode=changelog",
             "--tables", "public.churn", "--snapshot-chunk-rows", str(CHUNK), "--snapshot-chunks-per-batch", "2",
             "--max-bytes-per-batch", "8KB", "--available-now"]  # (the truncate and the inserts in windows apart)
    log = tmp_path / "run.log"
    p = start_changefeed(*first, log=log, env={"CHANGEFEED_STOP_AT": "snapshot_export:2",
                                                "CHANGEFEED_FAULT_DIR": str(faults)})
    try:
        wait_for("the planner to freeze", lambda: (faults / ".stopped-groups").exists(), log)
        with dbs.src() as c:
            c.execute("TRUNCATE churn")
            c.execute("INSERT INTO churn SELECT 2 * g + 1, 7 FROM generate_series(1, %s, 10) g", (ROWS,))
        for group in (faults / ".stopped-groups").read_text().split():
            os.killpg(int(group), signal.SIGCONT)
        assert p.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        kill_running([p])
    done = changefeed_cli(*base, "--available-now")
    assert done.returncode == 0, done.stderr[-3000:]
    source, replica = _sinks(dbs)
    assert len(source) == ROWS // 10
    assert replica == source, f"replica: {_differ(replica, source)} rows differ"
    state, _ = _replayed(lake)
    assert state == source, f"change log: {_differ(state, source)} rows differ"
