"""End to end: PostgreSQL -> real Spark -> Delta tables, read back with the Delta library and DuckDB.

The mixed workload of the replica test (every column type, TOAST, composite keys, key changes,
deletes, truncate, an added column) goes to Delta in each mode. The mirror must equal the source
row for row; the change log, replayed in its own order, must give the source's rows, and hold
each change once.
"""
from __future__ import annotations

import json
import uuid
from datetime import datetime, time, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from test_replica import SCHEMA, TABLES, workload

from changefeed.control.runner import run
from changefeed.spec.definition import FeedSpec
from changefeed.spec.state import FeedState
from support.servers import Dbs

pytestmark = pytest.mark.timeout(600)


def feed_once(dbs: Dbs, tmp_path: Path, lake: Path, mode: str, **limits: Any) -> None:
    spec = FeedSpec(dbs.name, dbs.source, f"delta://{lake}?mode={mode}&buckets=4", TABLES,
                    **limits).validate()  # type: ignore[arg-type]
    run(spec, FeedState(tmp_path / "state", dbs.name), available_now=True, master="local[2]",
        handle_signals=False, report=lambda s: None)


def _norm(v: Any) -> Any:
    """A value as both sides can be compared: psycopg's Python value or the Delta (Arrow) one."""
    if isinstance(v, datetime):
        return v.astimezone(timezone.utc) if v.tzinfo else v
    if isinstance(v, (dict, list)) and not isinstance(v, list):
        return json.dumps(v, sort_keys=True)
    if isinstance(v, list):
        return [_norm(x) for x in v]
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, memoryview):
        return bytes(v)
    if isinstance(v, Decimal):
        return v.normalize()
    if isinstance(v, time):
        return v.isoformat()
    return v


ADDED = ("added", "added_null")


def delta_table(lake: Path, table: str) -> list[dict[str, Any]]:
    from deltalake import DeltaTable

    return pa.table(DeltaTable(str(lake / table)).to_pyarrow_table()).to_pylist()


def source_rows(dbs: Dbs, table: str, cols: list[str]) -> list[tuple[Any, ...]]:
    with psycopg.connect(dbs.source) as c:
        cur = c.execute(f"SELECT {', '.join(cols)} FROM {table}")
        names = [d.name for d in cur.description]  # type: ignore[union-attr]
        types = {n: t for n, t in c.execute("SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
                                            "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped",
                                            (table,)).fetchall()}
        rows = cur.fetchall()
    out = []
    for r in rows:
        out.append(tuple(_norm(json.dumps(v, sort_keys=True) if types[n] in ("json", "jsonb") and v is not None
                               else v) for n, v in zip(names, r)))
    return sorted(out, key=repr)


def delta_rows(lake: Path, table: str, columns: list[str]) -> list[tuple[Any, ...]]:
    from deltalake import DeltaTable

    t = pa.table(DeltaTable(str(lake / table)).to_pyarrow_table())
    return sorted((tuple(_norm(_json(n, r[n])) for n in columns) for r in t.to_pylist()), key=repr)


def _json(name: str, v: Any) -> Any:
    if name == "j" and isinstance(v, str):
        return json.dumps(json.loads(v), sort_keys=True)
    return v


def columns(dbs: Dbs, table: str) -> list[str]:
    with psycopg.connect(dbs.source) as c:
        return [r[0] for r in c.execute("SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
                                        "AND NOT attisdropped ORDER BY attnum", (table,)).fetchall()]


def replayed(lake: Path, table: str, key: list[str], cols: list[str]) -> list[tuple[Any, ...]]:
    """The change log applied in its order, as a consumer would: the table it describes."""
    from deltalake import DeltaTable

    log = pa.table(DeltaTable(str(lake / table)).to_pyarrow_table())
    rows = sorted(log.to_pylist(), key=lambda r: (r["_commit_ts"], r["_lsn"], r["_seq"], r["_op"] != "r"))
    snap = [r for r in log.to_pylist() if r["_op"] == "r"]
    state: dict[tuple[Any, ...], dict[str, Any]] = {}
    moved: dict[str, Any] = {}  # the row a key change's delete half took away: its update half's before
    for r in [r for r in rows if r["_op"] != "r"] + snap:
        k = tuple(r[c] for c in key)
        if r["_op"] == "t":
            state.clear()
        elif r["_op"] == "d":
            moved = state.pop(k, {})
        else:
            old = moved if r["_op"] == "u" and r["_seq"] % 2 else state.get(k, {})
            state[k] = {c: (old.get(c) if c in (r["_unchanged"] or ()) else r.get(c)) for c in cols}
    return sorted((tuple(_norm(_json(c, v[c])) for c in cols) for v in state.values()), key=repr)


KEYS = {"public.kinds": ["id"], "public.regions": ["region", "id"], "public.audit": ["id"], "public.ledger": ["id"]}


def current_versions(lake: Path, table: str, key: list[str], cols: list[str]) -> list[tuple[Any, ...]]:
    """A history table's current versions, after checking its versions never overlap: per key,
    in commit order, each ends no later than the next starts, and only the last may be current."""
    versions: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in delta_table(lake, table):
        versions.setdefault(tuple(r[c] for c in key), []).append(r)
    for k, vs in versions.items():
        vs.sort(key=lambda v: v["_commit_ts"])
        assert all(a["_valid_to"] is not None and a["_valid_to"] <= b["_valid_from"] and not a["_current"]
                   for a, b in zip(vs, vs[1:])), (table, k, vs)
        assert vs[-1]["_current"] == (vs[-1]["_valid_to"] is None), (table, k, vs[-1])
    return sorted((tuple(_norm(_json(c, vs[-1][c])) for c in cols) for vs in versions.values()
                   if vs[-1]["_current"]), key=repr)


@pytest.mark.parametrize("mode", ["mirror", "changelog", "history"])
def test_mixed_workload_reaches_delta(dbs: Dbs, tmp_path: Path, spark: object, mode: str) -> None:
    lake = tmp_path / "lake"
    with dbs.src() as c:
        c.execute(SCHEMA)
    feed_once(dbs, tmp_path, lake, mode)
    with dbs.src() as c:
        workload(c)
    feed_once(dbs, tmp_path, lake, mode, max_changes_per_batch=500, max_bytes_per_batch=0)
    for table in TABLES:
        cols = columns(dbs, table)
        if mode == "changelog":  # a change from before ADD COLUMN has no value for it (the mirror has the default)
            cols = [c for c in cols if c not in ADDED]
        got = (delta_rows(lake, table, cols) if mode == "mirror" else replayed(lake, table, KEYS[table], cols)
               if mode == "changelog" else current_versions(lake, table, KEYS[table], cols))
        want = source_rows(dbs, table, cols)
        assert got == want, (table, _diff(got, want))
    if mode == "history":  # the truncated rows stay, as ended versions
        ended = [r for r in delta_table(lake, "public.ledger") if not r["_current"]]
        assert sum(r["v"].startswith("before truncate") for r in ended) == 100
    if mode == "changelog":
        log = delta_table(lake, "public.kinds")
        assert (7, "set") in {(r["added"], r["added_null"]) for r in log if r["_op"] == "u" and r["id"] == 20}
        changes = [(r["_lsn"], r["_seq"]) for r in log]
        assert len(changes) == len(set(changes)), "a change appears twice in the change log"


def _diff(a: list[Any], b: list[Any]) -> str:
    """The first rows that differ, by key (the first column), shown side by side."""
    da, db = {r[0]: r for r in a}, {r[0]: r for r in b}
    keys = sorted((k for k in {*da, *db} if da.get(k) != db.get(k)), key=repr)[:3]
    return "\n".join(f"{k!r}: delta {da.get(k)!r}\n   source {db.get(k)!r}" for k in keys)


def test_several_tasks_write_one_batch_and_the_driver_commits_it_once(dbs: Dbs, tmp_path: Path, spark: object) -> None:
    """The batch's files come from two Spark tasks (two partitions, two Python workers) that ran at
    the same time, and the table has one commit for the batch, holding all of them."""
    from deltalake import DeltaTable

    lake, tables = tmp_path / "lake", ("public.wide",)
    with dbs.src() as c:
        c.execute("CREATE TABLE wide (id int PRIMARY KEY, v text, n numeric(12,2))")
    spec = FeedSpec(dbs.name, dbs.source, f"delta://{lake}?mode=mirror&buckets=8&tasks=2", tables).validate()
    state = FeedState(tmp_path / "state", dbs.name)
    run(spec, state, available_now=True, master="local[2]", handle_signals=False, report=lambda s: None)
    with dbs.src() as c:
        c.execute("INSERT INTO wide SELECT g, md5(g::text), g / 3.0 FROM generate_series(1, 200000) g")
    run(spec, state, available_now=True, master="local[2]", handle_signals=False, report=lambda s: None)
    history = [h for h in DeltaTable(str(lake / "public.wide")).history() if "changefeed.tasks" in h]
    assert len({h["changefeed.batch"] for h in history}) == len(history), "a batch committed twice"
    by_batch = [json.loads(h["changefeed.tasks"]) for h in history]
    both = [ts for ts in by_batch if len({t["partition"] for t in ts if t["files"]}) == 2
            and len({t["pid"] for t in ts}) == 2]
    assert both, f"no batch was written by two tasks: {by_batch}"
    assert any(max(t["began"] for t in ts) < min(t["ended"] for t in ts) for ts in both), \
        f"the two tasks of a batch did not run at the same time: {both}"
    assert delta_rows(lake, "public.wide", ["id", "v", "n"]) == source_rows(dbs, "public.wide", ["id", "v", "n"])


@pytest.mark.usefixtures("warm_spark")
def test_compact_merges_files_keeps_rows_and_vacuum_deletes_orphans(dbs: Dbs, tmp_path: Path, spark: object) -> None:
    import os
    import shutil

    from deltalake import DeltaTable

    from support.feeds import changefeed_cli

    lake = tmp_path / "lake"
    with dbs.src() as c:
        c.execute("CREATE TABLE small (id int PRIMARY KEY, v text)")
    spec = FeedSpec(dbs.name, dbs.source, f"delta://{lake}?mode=changelog", ("public.small",)).validate()
    state = FeedState(tmp_path / "state", dbs.name)
    run(spec, state, available_now=True, master="local[2]", handle_signals=False, report=lambda s: None)
    for i in range(3):  # three runs: at least three batches, each with its own files
        with dbs.src() as c:
            c.execute("INSERT INTO small SELECT g, 'v' || g FROM generate_series(%s::int, %s::int) g",
                      (i * 100 + 1, i * 100 + 100))
        run(spec, state, available_now=True, master="local[2]", handle_signals=False, report=lambda s: None)
    table = lake / "public.small"
    before = DeltaTable(str(table))
    files_before, rows_before = len(before.file_uris()), sorted(r["id"] for r in delta_table(lake, "public.small"))
    orphan = table / "part-orphan-of-a-crashed-batch.parquet"  # written, never committed
    shutil.copy(table / pa.table(before.get_add_actions(flatten=True)).column("path")[0].as_py(), orphan)
    os.utime(orphan, (os.path.getmtime(orphan) - 7200,) * 2)
    done = changefeed_cli("compact", "--name", dbs.name, "--state", str(tmp_path / "state"), "--vacuum", "1h")
    assert done.returncode == 0, done.stderr
    assert "public.small:" in done.stdout and "unreferenced files deleted" in done.stdout, done.stdout
    after = DeltaTable(str(table))
    assert files_before >= 3 and len(after.file_uris()) == 1
    assert sorted(r["id"] for r in delta_table(lake, "public.small")) == rows_before == list(range(1, 301))
    assert not orphan.exists()
    bad = changefeed_cli("compact", "--name", dbs.name, "--state", str(tmp_path / "state"), "--vacuum", "5m")
    assert bad.returncode == 64 and "at least 1h" in bad.stderr


def test_a_renamed_column_stops_the_feed_until_the_table_is_read_again(dbs: Dbs, tmp_path: Path,
                                                                       spark: object) -> None:
    """What the WAL cannot tell (RENAME COLUMN or DROP + ADD) stops a Delta feed before the change,
    as it stops a replica's; `changefeed snapshot --tables` is the way on."""
    from changefeed.control.lifecycle import request_snapshot
    from changefeed.errors import UnfollowableChange

    lake, tables = tmp_path / "lake", ("public.named",)
    with dbs.src() as c:
        c.execute("CREATE TABLE named (id int PRIMARY KEY, v text)")
        c.execute("INSERT INTO named SELECT g, 'v' || g FROM generate_series(1, 5) g")
    spec = FeedSpec(dbs.name, dbs.source, f"delta://{lake}?mode=mirror&buckets=2", tables).validate()
    state = FeedState(tmp_path / "state", dbs.name)
    run(spec, state, available_now=True, master="local[2]", handle_signals=False, report=lambda s: None)
    with dbs.src() as c:
        c.execute("ALTER TABLE named RENAME COLUMN v TO w")
        c.execute("INSERT INTO named VALUES (6, 'after rename')")
    with pytest.raises(UnfollowableChange, match="RENAME COLUMN"):
        run(spec, state, available_now=True, master="local[2]", handle_signals=False, report=lambda s: None)
    assert sorted(r["id"] for r in delta_table(lake, "public.named")) == [1, 2, 3, 4, 5]  # nothing past it
    request_snapshot(spec, state, tables)
    run(spec, state, available_now=True, master="local[2]", handle_signals=False, report=lambda s: None)
    assert delta_rows(lake, "public.named", ["id", "w"]) == source_rows(dbs, "public.named", ["id", "w"])
