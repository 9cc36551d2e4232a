"""One feed over several source nodes: checked first, created on all or none, read in parallel, one replica.

The nodes here are databases of the shared source server (each with its own slot): what differs
between servers (their clocks, their failures) is tested with servers of their own elsewhere.
"""
from __future__ import annotations

import random
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from changefeed.control.runner import run
from changefeed.control.status import status
from changefeed.errors import ConfigError, ConnectionFailed, SourceNotReady
from changefeed.faults import InjectedFault
from changefeed.local.postgres import LocalPostgres
from changefeed.sinks.registry import validated
from changefeed.spec.definition import FeedSpec
from changefeed.spec.state import FeedState
from support.feeds import assert_no_traceback, changefeed_cli, start_changefeed, wait_for
from support.servers import Dbs, drop_slots, fingerprint
from support.writers import WRITE_PAUSE, writing

pytestmark = pytest.mark.timeout(900)
NODES = ("n1", "n2", "n3")
ACCOUNTS, BALANCE = 300, 1_000
SCHEMA = ("CREATE TABLE accounts (id bigint PRIMARY KEY, node text NOT NULL, balance bigint NOT NULL);"
          "CREATE TABLE events (node text, id bigint, note text, PRIMARY KEY (node, id))")
TABLES = ("public.accounts", "public.events")


@pytest.fixture
def nodes(dbs: Dbs, servers: tuple[LocalPostgres, LocalPostgres]) -> Iterator[dict[str, str]]:
    """Node name -> URI: the test's source database is n1, n2 and n3 are two more on the server."""
    source = servers[0]
    uris = {"n1": dbs.source}
    for n in NODES[1:]:
        with psycopg.connect(source.uri(), autocommit=True) as c:
            c.execute(f"CREATE DATABASE {dbs.name}_{n}")
        uris[n] = source.uri(f"{dbs.name}_{n}")
    yield uris
    for n in NODES[1:]:
        drop_slots(source.uri(), f"{dbs.name}_{n}")


def bank(uri: str, node: int) -> None:
    """Accounts with node-disjoint ids (node * 1,000,000 + i), each with BALANCE."""
    with psycopg.connect(uri, autocommit=True) as c:
        c.execute(SCHEMA)
        c.execute("INSERT INTO accounts SELECT %s * 1000000 + i, %s, %s FROM generate_series(1, %s) i",
                  (node, f"n{node}", BALANCE, ACCOUNTS))


def transfers(node: int) -> object:
    """A `writing` worker: transfers between two accounts of node `node`, each logged as an event."""
    def write(uri: str, stop: threading.Event, written: list[int]) -> None:
        rng = random.Random(node)
        with psycopg.connect(uri, autocommit=True) as c:
            while not stop.is_set() or written[0] < 300:
                a, b = (node * 1_000_000 + rng.randrange(1, ACCOUNTS + 1) for _ in range(2))
                amount = rng.randrange(1, 50)
                with c.transaction():
                    c.execute("UPDATE accounts SET balance = balance - %s WHERE id = %s", (amount, a))
                    c.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", (amount, b))
                    c.execute("INSERT INTO events VALUES (%s, %s, 'transfer')", (f"n{node}", written[0]))
                written[0] += 1
                stop.wait(WRITE_PAUSE)
    return write


def union(uris: dict[str, str], table: str) -> list[tuple[object, ...]]:
    rows: list[tuple[object, ...]] = []
    for uri in uris.values():
        with psycopg.connect(uri) as c:
            rows += c.execute(f"SELECT * FROM {table}").fetchall()
    return sorted(rows, key=repr)


def spec_of(dbs: Dbs, uris: dict[str, str], **options: object) -> FeedSpec:
    return FeedSpec(dbs.name, "", dbs.sink, TABLES, nodes=tuple(uris.items()), **options).validate()  # type: ignore[arg-type]


def run_once(spec: FeedSpec, tmp_path: Path) -> None:
    run(spec, FeedState(tmp_path / "state", spec.name), available_now=True, master="local[2]", handle_signals=False,
        report=lambda s: None)


def slots(uri: str) -> list[str]:
    with psycopg.connect(uri) as c:
        return [r[0] for r in c.execute("SELECT slot_name FROM pg_replication_slots "
                                        "WHERE database = current_database() ORDER BY 1")]


def test_three_nodes_make_one_replica_read_by_parallel_tasks(dbs: Dbs, nodes: dict[str, str], tmp_path: Path,
                                                            spark: object) -> None:
    for i, uri in enumerate(nodes.values(), 1):
        bank(uri, i)
    spec = spec_of(dbs, nodes, snapshot_chunk_rows=100)
    run_once(spec, tmp_path)  # the existing rows of every node, by snapshot
    assert union(nodes, "accounts") == sorted(psycopg.connect(dbs.sink).execute("SELECT * FROM accounts"), key=repr)
    for node, uri in nodes.items():
        expected = f"{dbs.name}" + ("" if node == "n1" else f"_{node}")
        assert slots(uri) == [f"cf2pc_{expected}", f"changefeed_{expected}"]  # the prepare slot, the feed's

    written = {n: [0] for n in nodes}
    with writing(transfers(1), nodes["n1"], written["n1"]), writing(transfers(2), nodes["n2"], written["n2"]), \
            writing(transfers(3), nodes["n3"], written["n3"]):
        pass  # each writes at least 300 transfers
    run_once(spec, tmp_path)
    for table in TABLES:
        assert union(nodes, table) == sorted(psycopg.connect(dbs.sink).execute(f"SELECT * FROM {table}"), key=repr)
    with psycopg.connect(dbs.sink) as d:
        total = d.execute("SELECT sum(balance), count(*) FROM accounts").fetchone()
        events = d.execute("SELECT node, count(*), count(DISTINCT id) FROM events GROUP BY 1 ORDER BY 1").fetchall()
        reads = d.execute("SELECT batch_id, reads, positions FROM changefeed.progress WHERE feed = %s "
                          "ORDER BY batch_id", (dbs.name,)).fetchall()
    assert total == (3 * ACCOUNTS * BALANCE, 3 * ACCOUNTS)
    assert events == [(n, written[n][0], written[n][0]) for n in NODES]  # each exactly once
    # every batch moved every node; its windows were read by one task per node, some at the same time
    assert all(set(positions) == set(NODES) for _, _, positions in reads)
    windows = [[r for r in batch_reads if "no" not in r and r.get("node")] for _, batch_reads, _ in reads]
    assert any(sorted(r["node"] for r in w) == list(NODES) and len({r["task"] for r in w}) == 3 for w in windows)
    overlapping = [w for w in windows
                   if any(a["node"] != b["node"] and a["began"] < b["ended"] and b["began"] < a["ended"]
                          for a in w for b in w)]
    assert overlapping, reads
    shown = status(spec, FeedState(tmp_path / "state", spec.name))
    assert set(shown.nodes) == set(NODES) and all(n["lag_bytes"] == 0 for n in shown.nodes.values()), shown
    assert fingerprint(dbs.sink, "accounts")[0] == 3 * ACCOUNTS
    # the stopped feed, verified where it stands: one point on every node, compared with the replica
    verified = changefeed_cli("verify", "--name", dbs.name, "--state", str(tmp_path / "state"))
    assert verified.returncode == 0 and "compared at n1 " in verified.stdout, verified.stdout + verified.stderr


def test_a_node_that_cannot_be_read_is_named_and_nothing_is_created_anywhere(
        dbs: Dbs, nodes: dict[str, str], tmp_path: Path) -> None:
    for i, uri in enumerate(nodes.values(), 1):
        bank(uri, i)
    down = {**nodes, "n2": "postgresql://postgres:x@127.0.0.1:9/nowhere"}
    with pytest.raises(ConnectionFailed, match="source node n2"):
        run_once(spec_of(dbs, down), tmp_path)
    with psycopg.connect(nodes["n3"], autocommit=True) as c:
        c.execute("DROP TABLE events")
    with pytest.raises(SourceNotReady, match="source node n3: table public.events does not exist"):
        run_once(spec_of(dbs, nodes), tmp_path)
    assert all(slots(uri) == [] for uri in nodes.values())


def test_missing_rights_on_one_node_are_found_before_anything_is_created(dbs: Dbs, nodes: dict[str, str],
                                                                         tmp_path: Path) -> None:
    for i, uri in enumerate(nodes.values(), 1):
        bank(uri, i)
    # on n3 the feed's user may read the tables and create slots, but not publish tables it does not own
    with psycopg.connect(nodes["n3"], autocommit=True) as c:
        c.execute(f"CREATE ROLE weak_{dbs.name} LOGIN REPLICATION PASSWORD 'weak'")
        c.execute(f"GRANT SELECT ON accounts, events TO weak_{dbs.name}")
        c.execute(f"GRANT CREATE ON DATABASE {dbs.name}_n3 TO weak_{dbs.name}")
    weak = nodes["n3"].replace("postgres:changefeed@", f"weak_{dbs.name}:weak@")
    with pytest.raises(SourceNotReady, match="source node n3: user weak_.* must be owner of the table"):
        run_once(spec_of(dbs, {**nodes, "n3": weak}), tmp_path)
    assert all(slots(uri) == [] for uri in nodes.values())


def test_creation_failing_on_one_node_removes_what_the_others_got(dbs: Dbs, nodes: dict[str, str], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for i, uri in enumerate(nodes.values(), 1):
        bank(uri, i)
    monkeypatch.setenv("CHANGEFEED_FAIL_AT", "node_created:2")  # after n2's slot, before n3's
    monkeypatch.setenv("CHANGEFEED_FAULT_DIR", str(tmp_path))
    with pytest.raises(InjectedFault):
        run_once(spec_of(dbs, nodes), tmp_path)
    for uri in nodes.values():
        assert slots(uri) == []
        with psycopg.connect(uri) as c:
            assert c.execute("SELECT count(*) FROM pg_publication").fetchone() == (0,)


def test_one_node_with_a_name_of_its_own(dbs: Dbs, tmp_path: Path, spark: object) -> None:
    bank(dbs.source, 1)
    spec = spec_of(dbs, {"main": dbs.source})
    run_once(spec, tmp_path)
    written = [0]
    with writing(transfers(1), dbs.source, written):
        pass
    run_once(spec, tmp_path)
    for table in TABLES:
        assert fingerprint(dbs.source, table) == fingerprint(dbs.sink, table)
    assert slots(dbs.source) == [f"cf2pc_{dbs.name}_main", f"changefeed_{dbs.name}_main"]
    shown = status(spec, FeedState(tmp_path / "state", spec.name))
    assert list(shown.nodes) == ["main"] and shown.nodes["main"]["lag_bytes"] == 0, shown


@pytest.mark.usefixtures("warm_spark")
def test_a_node_added_to_a_running_feed_and_removed_from_a_stopped_one(dbs: Dbs, nodes: dict[str, str],
                                                                       tmp_path: Path) -> None:
    for i, uri in enumerate(nodes.values(), 1):
        bank(uri, i)
    state = str(tmp_path / "state")
    first_two = [a for n in ("n1", "n2") for a in ("--source", f"{n}={nodes[n]}")]
    log = tmp_path / "run.log"
    p = start_changefeed("run", "--name", dbs.name, "--state", state, *first_two, "--sink", dbs.sink,
                         "--tables", ",".join(TABLES), "--master", "local[2]", log=log)
    try:
        def replica(table: str) -> list[tuple[object, ...]]:
            with psycopg.connect(dbs.sink) as c:
                if not c.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()[0]:  # type: ignore[index]
                    return []  # before the feed's first batch
                return sorted(c.execute(f"SELECT * FROM {table}"), key=repr)

        two = {n: nodes[n] for n in ("n1", "n2")}
        wait_for("the first two nodes' rows", lambda: replica("public.accounts") == union(two, "public.accounts"), log)
        added = changefeed_cli("alter", "--name", dbs.name, "--state", state, "--add-node", f"n3={nodes['n3']}")
        assert added.returncode == 0, added.stderr
        assert "now reads nodes n1, n2, n3" in added.stdout
        written = [0]
        with writing(transfers(3), nodes["n3"], written):
            pass
        wait_for("node n3's rows and changes", lambda: all(replica(t) == union(nodes, t) for t in TABLES), log)
        assert "restarting the query to read them" in log.read_text()
        # verify sums each table's chunks over the three nodes (one consistent point on each)
        verified = changefeed_cli("verify", "--name", dbs.name, "--state", state)
        assert verified.returncode == 0 and "compared at n1 " in verified.stdout and " n3 " in verified.stdout, \
            verified.stdout + verified.stderr
        with psycopg.connect(dbs.sink, autocommit=True) as c:
            c.execute("DELETE FROM public.accounts WHERE ctid = (SELECT min(ctid) FROM public.accounts)")
        verified = changefeed_cli("verify", "--name", dbs.name, "--state", state)
        assert verified.returncode == 1 and "1 missing on the sink" in verified.stdout, verified.stdout
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 0, log.read_text()[-3000:]
    assert_no_traceback(log.read_text())
    assert slots(nodes["n3"]) == [f"cf2pc_{dbs.name}_n3", f"changefeed_{dbs.name}_n3"]

    busy = changefeed_cli("alter", "--name", dbs.name, "--state", state, "--remove-node", "n9")
    assert busy.returncode != 0 and "has no node n9" in busy.stderr
    removed = changefeed_cli("alter", "--name", dbs.name, "--state", state, "--remove-node", "n3")
    assert removed.returncode == 0, removed.stderr
    assert slots(nodes["n3"]) == [] and "slot changefeed_" in removed.stdout and "slot cf2pc_" in removed.stdout
    with psycopg.connect(nodes["n3"], autocommit=True) as c:
        c.execute("INSERT INTO events VALUES ('n3', -1, 'after removal')")
    with psycopg.connect(nodes["n1"], autocommit=True) as c:
        c.execute("INSERT INTO events VALUES ('n1', -1, 'after removal')")
    again = changefeed_cli("run", "--name", dbs.name, "--state", state, "--available-now", "--master", "local[2]")
    assert again.returncode == 0, again.stderr[-3000:]
    with psycopg.connect(dbs.sink) as c:
        assert c.execute("SELECT node FROM events WHERE id = -1").fetchall() == [("n1",)]


def test_a_feed_of_three_nodes_writes_two_sinks_alike(dbs: Dbs, nodes: dict[str, str], tmp_path: Path,
                                                      servers: tuple[LocalPostgres, LocalPostgres],
                                                      spark: object) -> None:
    """Several sinks (spec.sinks) from a feed of several nodes: two replicas get the same merged
    batches (the same resolved timestamps), each equal to the nodes' union; a lake, which takes
    no feed of several nodes yet, is refused by name."""
    for i, uri in enumerate(nodes.values(), 1):
        bank(uri, i)
    with psycopg.connect(servers[1].uri(), autocommit=True) as c:
        c.execute(f"CREATE DATABASE {dbs.name}_dr2")
    second = servers[1].uri(f"{dbs.name}_dr2")
    spec = FeedSpec(dbs.name, "", "", TABLES, nodes=tuple(nodes.items()),
                    sinks=(("dr", dbs.sink), ("dr2", second))).validate()
    run_once(spec, tmp_path)
    written = {n: [0] for n in nodes}
    with writing(transfers(1), nodes["n1"], written["n1"]), writing(transfers(2), nodes["n2"], written["n2"]):
        pass
    run_once(spec, tmp_path)
    resolved = []
    for uri in (dbs.sink, second):
        for table in TABLES:
            assert union(nodes, table) == sorted(psycopg.connect(uri).execute(f"SELECT * FROM {table}"), key=repr)
        with psycopg.connect(uri) as c:
            resolved.append([r[0] for r in c.execute("SELECT resolved_ts FROM changefeed.progress WHERE feed = %s "
                                                     "ORDER BY resolved_ts", (f"{dbs.name}.dr" if uri == dbs.sink
                                                                              else f"{dbs.name}.dr2",))])
    assert resolved[0] == resolved[1] and len(resolved[0]) >= 2
    lake = FeedSpec(dbs.name, "", "", TABLES, nodes=tuple(nodes.items()),
                    sinks=(("dr", dbs.sink), ("lake", f"delta://{tmp_path / 'lake'}")))
    with pytest.raises(ConfigError, match="^sink lake: a feed of several source nodes cannot write to the Delta"):
        validated(lake)


def test_a_row_filter_on_a_feed_of_three_nodes(dbs: Dbs, nodes: dict[str, str], tmp_path: Path,
                                               spark: object) -> None:
    """--where on every node alike: the snapshot and the stream of each node filtered, the replica
    equal to the filtered union, verify equal; the unfiltered table whole."""
    for i, uri in enumerate(nodes.values(), 1):
        bank(uri, i)
        with psycopg.connect(uri, autocommit=True) as c:
            c.execute("INSERT INTO events SELECT %s, -g, 'old' FROM generate_series(1, 50) g", (f"n{i}",))
    spec = spec_of(dbs, nodes, snapshot_chunk_rows=20, where=(("public.events", "id % 3 = 0"),))
    run_once(spec, tmp_path)
    written = {n: [0] for n in nodes}
    with writing(transfers(1), nodes["n1"], written["n1"]), writing(transfers(2), nodes["n2"], written["n2"]), \
            writing(transfers(3), nodes["n3"], written["n3"]):
        pass
    run_once(spec, tmp_path)
    kept = [r for r in union(nodes, "events") if int(r[1]) % 3 == 0]  # type: ignore[call-overload]  # (an int)
    with psycopg.connect(dbs.sink) as d:
        assert sorted(d.execute("SELECT * FROM events"), key=repr) == kept
        assert len(kept) < len(union(nodes, "events")) / 2
        assert sorted(d.execute("SELECT * FROM accounts"), key=repr) == union(nodes, "accounts")
    verified = changefeed_cli("verify", "--name", dbs.name, "--state", str(tmp_path / "state"))
    assert verified.returncode == 0, verified.stdout + verified.stderr

    # the filter changed on the stopped feed: on every node, rows that leave go, rows let in come
    altered = changefeed_cli("alter", "--name", dbs.name, "--state", str(tmp_path / "state"),
                             "--where", "public.events=id % 2 = 0")
    assert altered.returncode == 0 and "reach the sinks as deletes" in altered.stdout, altered.stderr
    with writing(transfers(1), nodes["n1"], written["n1"]), writing(transfers(3), nodes["n3"], written["n3"]):
        pass
    stored = FeedState(tmp_path / "state", dbs.name).load()
    assert stored is not None and stored.row_filters == {"public.events": "id % 2 = 0"}
    run_once(stored, tmp_path)
    kept = [r for r in union(nodes, "events") if int(r[1]) % 2 == 0]  # type: ignore[call-overload]  # (an int)
    with psycopg.connect(dbs.sink) as d:
        assert sorted(d.execute("SELECT * FROM events"), key=repr) == kept
    verified = changefeed_cli("verify", "--name", dbs.name, "--state", str(tmp_path / "state"))
    assert verified.returncode == 0, verified.stdout + verified.stderr
