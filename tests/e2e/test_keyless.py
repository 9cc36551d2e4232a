"""Tables without a key, under REPLICA IDENTITY FULL (pgbench's pgbench_history): refused for the
sinks that apply by key (a replica, a Delta mirror), with nothing created; captured for Kafka, a
webhook and a Delta change log fed from one slot while pgbench runs through the snapshot (the
runner SIGKILLed right after the table was read), then equal rows, updates and deletes. Each sink,
folded as a multiset of whole rows (a delete or update names its row by its old values), equals
the source's rows, duplicates included; `verify` of the Kafka sink agrees."""
from __future__ import annotations

import json
import subprocess
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

from changefeed.local.kafka import LocalKafka, committed, read_partition
from changefeed.local.postgres import bin_dir
from support.feeds import assert_no_traceback, changefeed_cli, kill_running, killed_by_fault, start_changefeed, wait_for
from support.servers import Dbs
from support.webhooks import Receiver

pytestmark = pytest.mark.timeout(600)
TABLES = "public.pgbench_history,public.pgbench_tellers,public.pgbench_branches"
COLUMNS = ("tid", "bid", "aid", "delta", "mtime", "filler")


def _pgbench(uri: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([str(bin_dir() / "pgbench"), *args, uri], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _source(uri: str) -> Counter[tuple[Any, ...]]:
    with psycopg.connect(uri) as c:
        return Counter(c.execute("SELECT tid, bid, aid, delta, to_char(mtime, 'YYYY-MM-DD\"T\"HH24:MI:SS.US') "
                                 "FROM pgbench_history").fetchall())


def _row(row: dict[str, Any]) -> tuple[Any, ...]:
    mtime = row["mtime"] if isinstance(row["mtime"], str) else row["mtime"].isoformat()
    return (row["tid"], row["bid"], row["aid"], row["delta"], mtime.replace(" ", "T")[:26].ljust(26, "0"))


def _folded(events: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None]]) -> Counter[tuple[Any, ...]]:
    """(op, before, after) events as a multiset of rows: each before removes one copy, each after adds one."""
    held: Counter[tuple[Any, ...]] = Counter()
    for op, before, after in events:
        assert op in ("r", "c", "u", "d"), op
        assert (before is not None) == (op in ("u", "d")), (op, before)
        if before is not None:
            assert held[_row(before)] > 0, ("a change names a row the sink does not hold", before)
            held[_row(before)] -= 1
        if after is not None:
            held[_row(after)] += 1
    return +held


def test_a_keyless_table_goes_to_sinks_that_append_and_is_refused_by_the_others(
        dbs: Dbs, kafka: LocalKafka, receiver: tuple[Receiver, str], tmp_path: Path) -> None:
    assert _pgbench(dbs.source, "-i", "-q", "-s", "1").wait(timeout=300) == 0
    with psycopg.connect(dbs.source, autocommit=True) as c:
        c.execute("ALTER TABLE pgbench_history REPLICA IDENTITY FULL")
    assert _pgbench(dbs.source, "-n", "-T", "2", "-c", "2").wait(timeout=60) == 0  # rows for the snapshot

    for sink in (dbs.sink, f"delta://{tmp_path / 'mirror'}?mode=mirror"):
        refused = changefeed_cli("create", "--name", dbs.name, "--state", str(tmp_path / "refused"), "--source",
                                 dbs.source, "--sink", sink, "--tables", TABLES)
        assert refused.returncode == 2, refused.stdout  # (SourceNotReady, as for any table without a key)
        assert "public.pgbench_history has no primary key" in refused.stderr, refused.stderr
        assert "ADD PRIMARY KEY" in refused.stderr and "mode=changelog" in refused.stderr
        assert_no_traceback(refused.stderr)
        assert not (tmp_path / "refused" / dbs.name).exists()
        with psycopg.connect(dbs.source) as c:
            assert not c.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name LIKE %s",
                                 (f"%{dbs.name}",)).fetchall()

    rec, hook = receiver
    prefix, lake, log = f"k{uuid.uuid4().hex[:8]}.", tmp_path / "lake", tmp_path / "run.log"
    state = tmp_path / "state"
    run = ["run", "--name", dbs.name, "--state", str(state), "--source", dbs.source, "--tables", TABLES,
           "--sink", f"events=kafka://{kafka.bootstrap}?topic_prefix={prefix}&progress_topic=p{prefix}"
           "&topic_partitions=1", "--sink", f"lake=delta://{lake}?mode=changelog", "--sink", f"hook={hook}"]
    # pgbench writes all through the history's read (its chunk is the first: after the first
    # batch's window, which already holds many of its rows), and the runner is SIGKILLed right
    # after that read, so that the batch is read again, with another snapshot.
    writer = _pgbench(dbs.source, "-n", "-T", "600", "-c", "2", "-R", "150")
    (tmp_path / "faults").mkdir()
    killed = start_changefeed(*run, log=tmp_path / "killed.log", env={
        "CHANGEFEED_KILL_AT": "snapshot_chunk:1", "CHANGEFEED_FAULT_DIR": str(tmp_path / "faults")})
    killed_by_fault(killed, tmp_path / "killed.log")
    runner = start_changefeed(*run, log=log)
    try:
        wait_for("the snapshot", lambda: "snapshot public.pgbench_history: done" in log.read_text(), log)
        writer.terminate()  # (pgbench takes SIGINT as a cancel request and may run on)
        writer.wait(timeout=60)
        with psycopg.connect(dbs.source, autocommit=True) as c:
            c.execute("INSERT INTO pgbench_history SELECT * FROM pgbench_history WHERE aid % 11 = 0")  # equal rows
            assert c.execute("UPDATE pgbench_history SET delta = delta + 1 WHERE aid % 5 = 0").rowcount > 0
            assert c.execute("DELETE FROM pgbench_history WHERE aid % 7 = 0").rowcount > 0
        verified = wait_for("verify equal", lambda: changefeed_cli(
            "verify", "--name", dbs.name, "--state", str(state), "--sink", "events").returncode == 0, log,
            timeout=180)
        assert verified
        source = _source(dbs.source)
        assert any(n > 1 for n in source.values())  # the duplicates are there
        wait_for("the webhook", lambda: _folded(_hook_events(rec)) == source, log, timeout=120)
    finally:
        writer.kill()
        kill_running([runner])
    messages = [json.loads(r.value) for r in committed(read_partition(
        kafka.bootstrap, f"{prefix}public.pgbench_history", 0, timeout=60)) if r.value]
    assert {m["op"] for m in messages} == {"r", "c", "u", "d"}
    assert _folded([(m["op"], m["before"], m["after"]) for m in messages]) == source
    from deltalake import DeltaTable

    changes = DeltaTable(str(lake / "public.pgbench_history")).to_pyarrow_table().to_pylist()
    assert _folded([(r["_op"], r["_before"] if r["_op"] in ("u", "d") else None,
                     {c: r[c] for c in COLUMNS} if r["_op"] != "d" else None)
                    for r in sorted(changes, key=lambda r: (r["_lsn"], r["_seq"]))]) == source
    assert_no_traceback(log.read_text())


def _hook_events(rec: Receiver) -> list[tuple[str, dict[str, Any] | None, dict[str, Any] | None]]:
    return [(m["op"], m["before"], m["after"]) for _, m in rec.messages()
            if m.get("table") == "public.pgbench_history"]
