"""Rows changed while the snapshot reads them reach an appending sink once (issue 62): a key's
change log is its snapshot row, then exactly the changes its read did not see, in commit order.

Each update adds one to a row's `v`, so a key's history in the lake must count up by one from
its snapshot row: a change the read saw and that came again shows as a step back, a lost one as
a step of two. A killed snapshot batch is read again in a snapshot of its own, which saw more
than the one the batch was planned with: changes may then come twice (never lost)."""
from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from support.feeds import changefeed_cli, killed_by_fault, start_changefeed
from support.servers import Dbs
from support.writers import WRITE_PAUSE, writing

pytestmark = pytest.mark.timeout(900)
ROWS, CHUNK = 20_000, 2_000


def _updating(uri: str, stop: threading.Event, written: list[int]) -> None:
    """Each transaction adds one to `v` of three rows and inserts a row past the table's end; one in
    twenty rolls back."""
    rng = random.Random(62)
    with psycopg.connect(uri, autocommit=True) as c:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                with c.transaction():
                    for k in rng.sample(range(1, ROWS + 1), 3):
                        c.execute("UPDATE items SET v = v + 1 WHERE id = %s", (k,))
                    c.execute("INSERT INTO items VALUES (%s, 0)", (ROWS + n,))
                    if n % 20 == 0:
                        raise _RolledBack
            except _RolledBack:
                pass
            else:
                written[0] += 1
            time.sleep(WRITE_PAUSE)


class _RolledBack(Exception):
    pass


def _history(lake: Path) -> dict[int, list[tuple[str, int]]]:
    from deltalake import DeltaTable

    rows: list[dict[str, Any]] = pa.table(DeltaTable(str(lake / "public.items")).to_pyarrow_table()).to_pylist()
    out: dict[int, list[tuple[str, int]]] = {}
    for r in sorted(rows, key=lambda r: (r["_lsn"], r["_seq"])):
        out.setdefault(r["id"], []).append((r["_op"], r["v"]))
    return out


def _steps(history: dict[int, list[tuple[str, int]]], source: dict[int, int]) -> tuple[list[Any], list[Any]]:
    """(keys whose history repeats a change, keys whose history skips one or ends apart from the source)."""
    again, lost = [], []
    for k, want in source.items():
        events = history.get(k, [])
        ops = [op for op, _ in events]
        if not events or ops[0] not in "rc" or any(op not in "u" for op in ops[1:]):
            lost.append((k, events))
            continue
        steps = [b[1] - a[1] for a, b in zip(events, events[1:])]
        if any(s <= 0 for s in steps):
            again.append((k, events))
        if any(s > 1 for s in steps) or events[-1][1] != want:
            lost.append((k, events, want))
    return again, lost


def _source(dbs: Dbs) -> dict[int, int]:
    with dbs.src() as c:
        return dict(c.execute("SELECT id, v FROM items").fetchall())  # type: ignore[arg-type]


def _setup(dbs: Dbs) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE items (id bigint PRIMARY KEY, v int NOT NULL)")
        c.execute("INSERT INTO items SELECT g, 0 FROM generate_series(1, %s) g", (ROWS,))
        c.execute("ANALYZE items")


@pytest.mark.parametrize("reads", ["parallel", "sequential"])
def test_a_row_changed_while_the_snapshot_reads_it_is_in_the_change_log_once(dbs: Dbs, tmp_path: Path, reads: str,
                                                                            spark_server: str) -> None:
    _setup(dbs)
    lake = tmp_path / "lake"
    base = ["run", "--name", dbs.name, "--state", str(tmp_path / "state"), "--master", spark_server]
    first = [*base, "--source", dbs.source, "--sink", f"delta://{lake}?mode=changelog", "--tables", "public.items",
             "--snapshot-chunk-rows", str(CHUNK), "--snapshot-chunks-per-batch", "2", "--snapshot-reads", reads,
             "--available-now"]
    written = [0]
    with writing(_updating, dbs.source, written):
        time.sleep(0.5)  # (the writer runs before the feed starts, as an application would)
        done = changefeed_cli(*first)
        assert done.returncode == 0, done.stderr[-3000:]
    assert written[0] > 50, written  # the writer really ran during the snapshot
    done = changefeed_cli(*base, "--available-now")
    assert done.returncode == 0, done.stderr[-3000:]
    again, lost = _steps(_history(lake), _source(dbs))
    assert not lost, f"{len(lost)} keys lost a change, e.g. {lost[:3]}"
    assert not again, f"{len(again)} keys got a change twice, e.g. {again[:3]}"


def test_a_killed_snapshot_batch_read_again_loses_no_change(dbs: Dbs, tmp_path: Path, spark_server: str) -> None:
    _setup(dbs)
    lake = tmp_path / "lake"
    base = ["run", "--name", dbs.name, "--state", str(tmp_path / "state")]
    first = [*base, "--source", dbs.source, "--sink", f"delta://{lake}?mode=changelog", "--tables", "public.items",
             "--snapshot-chunk-rows", str(CHUNK), "--snapshot-chunks-per-batch", "2"]
    written = [0]
    with writing(_updating, dbs.source, written):
        for i, nth in enumerate((3, 4)):  # mid-batch: chunks read, their batch not yet committed
            faults, log = tmp_path / f"faults{i}", tmp_path / f"run{i}.log"
            faults.mkdir()
            env = {"CHANGEFEED_KILL_AT": f"snapshot_chunk:{nth}", "CHANGEFEED_FAULT_DIR": str(faults)}
            p = start_changefeed(*(first if i == 0 else base), log=log, env=env)
            killed_by_fault(p, log)
    done = changefeed_cli(*base, "--available-now", "--master", spark_server)
    assert done.returncode == 0, done.stderr[-3000:]
    again, lost = _steps(_history(lake), _source(dbs))
    assert not lost, f"{len(lost)} keys lost a change, e.g. {lost[:3]}"
    print(f"{len(again)} keys got a change twice after the kills")
