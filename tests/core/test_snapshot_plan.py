"""Snapshot planning: chunks tile each table's key range exactly, across batches and requests."""
from __future__ import annotations

import bisect
from fractions import Fraction
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from changefeed.core.requests import Request, SnapshotRequests
from changefeed.core.snapshot import (
    MAX_AUTO_CHUNKS,
    PACED_BATCH_S,
    PARALLEL_CHUNKS,
    Chunk,
    Cursor,
    auto_chunks,
)


def boundary_over(tables: dict[str, list[int]]):  # type: ignore[no-untyped-def]
    """What the source's boundary query answers, over sorted integer keys (read when asked)."""
    def boundary(table: str, after: list[str] | None, rows: int, upto: list[str] | None) -> list[str] | None:
        keys = tables[table]
        end = len(keys) if upto is None else bisect.bisect_right(keys, int(upto[0]))
        i = 0 if after is None else bisect.bisect_right(keys, int(after[0]))
        return [str(keys[i + rows - 1])] if i + rows - 1 < end else None
    return boundary


def last_over(tables: dict[str, list[int]]):  # type: ignore[no-untyped-def]
    return lambda table: [str(tables[table][-1])] if tables[table] else None


def rows_of(chunk: Chunk, keys: list[int]) -> list[int]:
    lo = 0 if chunk.lo is None else bisect.bisect_right(keys, int(chunk.lo[0]))
    return keys[lo:len(keys) if chunk.hi is None else bisect.bisect_right(keys, int(chunk.hi[0]))]


@given(st.dictionaries(st.sampled_from(["s.a", "s.b", "s.c"]), st.sets(st.integers(0, 500)), min_size=1),
       st.integers(1, 40), st.integers(1, 5), st.sets(st.sampled_from(["s.a", "s.b", "s.c"])),
       st.integers(0, 5))
def test_chunks_cover_every_key_once_in_order(data: dict[str, set[int]], rows: int, per_batch: int,
                                              alone: set[str], appended: int) -> None:
    """Each key a table had when its read began is read once, in key order; keys appended after
    that (`appended` a batch, past the last) are not, and every table's read ends."""
    tables = {t: sorted(k) for t, k in data.items()}
    began: dict[str, list[int]] = {}
    cursor = Cursor(pending=tuple(tables))
    chunks: list[Chunk] = []
    while cursor.pending:
        if cursor.after is None and cursor.upto is None:
            began[cursor.pending[0]] = list(tables[cursor.pending[0]])
        planned, after = cursor.plan(boundary_over(tables), per_batch, rows, alone.__contains__, last_over(tables))
        assert 1 <= len(planned) <= per_batch
        assert len(planned) == 1 or not alone & {c.table for c in planned}  # (a table alone: one chunk a batch)
        for c in planned[1:]:  # (a table begun in this plan: its keys then)
            if c.lo is None:
                began[c.table] = list(tables[c.table])
        chunks += planned
        cursor = Cursor.from_offset({"snap": after.to_json()})  # through the offset JSON, as Spark keeps it
        for keys in tables.values():  # written between batches, past the last key
            keys += range(max(keys, default=0) + 1, max(keys, default=0) + 1 + appended)
        assert len(chunks) <= sum(len(k) for k in began.values()) + len(tables) + 1, "a read that never ends"
    assert [c.no for c in chunks] == list(range(len(chunks)))
    for table, keys in began.items():
        mine = [c for c in chunks if c.table == table]
        assert [k for c in mine for k in rows_of(c, keys)] == keys  # each key once, in key order
        assert all(len(rows_of(c, tables[table])) <= max(rows, 1) for c in mine[:-1])
        assert mine[-1].hi == ([str(keys[-1])] if keys else None)  # up to the last key then
    assert cursor.plan(boundary_over(tables), per_batch, rows) == ([], cursor)


@given(st.dictionaries(st.sampled_from(["s.a", "s.b", "s.c"]), st.sets(st.integers(0, 300)), min_size=1),
       st.integers(1, 40), st.fixed_dictionaries({t: st.integers(1, 6) for t in ["s.a", "s.b", "s.c"]}))
def test_a_batch_takes_each_tables_share_of_it(data: dict[str, set[int]], rows: int, per: dict[str, int]) -> None:
    """Chunks per batch by table (--snapshot-chunks-per-batch auto): a chunk of table t takes 1/per[t]
    of its batch; a batch holds at least one chunk, never more than fills it, and stops only
    where the next chunk would not fit; every key is still read once, in order."""
    tables = {t: sorted(k) for t, k in data.items()}
    cursor, chunks = Cursor(pending=tuple(tables)), []
    while cursor.pending:
        planned, cursor = cursor.plan(boundary_over(tables), per.__getitem__, rows, last=last_over(tables))
        used = sum(Fraction(1, per[c.table]) for c in planned)
        assert planned and (used <= 1 or len(planned) == 1)
        assert not cursor.pending or used + Fraction(1, per[cursor.pending[0]]) > 1
        chunks += planned
    for table, keys in tables.items():
        assert [k for c in chunks if c.table == table for k in rows_of(c, keys)] == keys


def test_a_request_reads_a_table_again_after_what_is_pending() -> None:
    c = Cursor(pending=("s.a", "s.b"), after=["5"], next_no=3)
    c = c.request(["s.a", "s.c", "s.b"], 2)
    assert c.pending == ("s.a", "s.b", "s.a", "s.c") and c.after == ["5"] and c.requests == 2
    assert c.request(["s.c"], 1).pending == c.pending  # already queued; the count never goes back
    assert c.request(["s.c"], 1).requests == 2


def test_requests_are_numbered_and_read_in_order(tmp_path) -> None:  # type: ignore[no-untyped-def]
    reqs = SnapshotRequests(tmp_path / "requests")
    assert reqs.after(0) == []
    assert reqs.add(["s.a"]) == 1 and reqs.add(["s.b", "s.c"]) == 2
    assert reqs.after(0) == [Request(1, ["s.a"]), Request(2, ["s.b", "s.c"])]
    assert reqs.after(1) == [Request(2, ["s.b", "s.c"])]
    assert reqs.add(["s.d"], first=True) == 3 and reqs.after(2) == [Request(3, ["s.d"], first=True)]
    assert not [p for p in (tmp_path / "requests").iterdir() if p.suffix == ".tmp"]


def test_a_request_for_some_sinks_alone_plans_chunks_for_them() -> None:
    """A sink added to a feed (spec.sinks) gets the tables' rows read for itself alone; a read for
    all sinks pending already covers it, and the cursor's JSON keeps who each table is read for."""
    def boundary(entry: str, after: list[str] | None, rows: int, upto: list[str] | None) -> list[str] | None:
        return None  # one chunk per table

    cursor = Cursor(pending=("s.a",)).request(["s.a", "s.b"], 1, ["lake"])
    assert cursor.pending == ("s.a", "s.a", "s.b") and cursor.only == ("", "lake", "lake")
    assert Cursor.from_offset({"snap": cursor.to_json()}) == cursor
    again = cursor.request(["s.b"], 2, ["lake"])
    assert again.pending == cursor.pending and again.requests == 2  # pending for lake already
    chunks, after = cursor.plan(boundary, 2, 10)
    assert [(c.table, c.only) for c in chunks] == [("s.a", ()), ("s.a", ("lake",))]
    assert after.pending == ("s.b",) and after.only == ("lake",)
    assert [Chunk.from_json(c.to_json()) for c in chunks] == chunks
    chunks, done = after.plan(boundary, 4, 10)
    assert [(c.table, c.only) for c in chunks] == [("s.b", ("lake",))]
    assert done.to_json() == Cursor(next_no=3).to_json() | {"req": 1}


def test_held_back_leaves_out_the_changes_of_tables_whose_snapshot_is_to_come() -> None:
    from changefeed.core import change as ch
    from changefeed.core.snapshot import held_back

    ops = ["R", "c", "u", "d", "t", "c", "R", "P"]
    tables = ["h", "h", "h", "h", "h", "k", "k", None]
    n = len(ops)
    rows = ch.record_batch({"op": ops, "schema": [None if t is None else "s" for t in tables], "table": tables,
                            "lsn": [1] * n, "seq": list(range(n)), "xid": [0] * n, "commit_time": [None] * n,
                            "commit_ts": [0] * n, "after": [None] * n, "before": [None] * n, "old_key": [None] * n,
                            "unchanged": [None] * n, "meta": [None] * n})
    kept = held_back(rows, frozenset({"s.h"}))
    assert kept.column("op").to_pylist() == ["R", "c", "R", "P"]
    assert kept.column("table").to_pylist() == ["h", "k", "k", None]
    assert held_back(rows, frozenset()) is rows


def test_a_request_file_keeps_the_positions_it_waits_for(tmp_path: Path) -> None:
    reqs = SnapshotRequests(tmp_path / "requests")
    reqs.add(["s.a"], after={"source": 1234})
    (got,) = reqs.after(0)
    assert got.after == (("source", 1234),) and not got.due({"source": 1233}) and got.due({"source": 1234})


@given(st.booleans(), st.integers(0, 1 << 32), st.integers(1, 10**6), st.one_of(st.none(), st.floats(-1, 1e6)),
       st.integers(1, 4), st.sampled_from([0, 1, 1000, 10**5, 10**7]), st.sampled_from([0, 1, 10**6, 10**9]))
def test_auto_chunks_fill_a_batch_by_bytes_when_one_task_reads(parallel: bool, max_bytes: int, rows: int,
                                                               row_bytes: float | None, budget: int, rate_rows: int,
                                                               rate_bytes: int) -> None:
    """--snapshot-chunks-per-batch 0: the read's parallelism with parallel reads or an unknown row
    size; else as many chunks as the sink's budget of bytes holds, at least one, at most
    MAX_AUTO_CHUNKS per unit of budget; under a --snapshot-rate, no more than it reads in
    PACED_BATCH_S (still at least one)."""
    got = auto_chunks(parallel, max_bytes, rows, row_bytes, budget, rate_rows, rate_bytes)
    sized = bool(row_bytes and row_bytes > 0)
    paced = [c for c in (rate_rows * PACED_BATCH_S / rows if rate_rows else None,
                         rate_bytes * PACED_BATCH_S / (rows * row_bytes) if rate_bytes and sized else None)
             if c is not None]  # (chunks each rate allows a batch)
    assert 1 <= got
    assert got == 1 or all(got <= c * (1 + 1e-9) for c in paced)
    if parallel or not max_bytes or not sized:
        assert got == PARALLEL_CHUNKS or paced and got == max(1, int(min(paced)))
        return
    assert got <= MAX_AUTO_CHUNKS * budget
    assert got == 1 or got * rows * row_bytes <= budget * max_bytes * (1 + 1e-9)  # (as floating point divides)
    full = got + 1 > MAX_AUTO_CHUNKS * budget or budget * max_bytes < (got + 1) * rows * row_bytes * (1 + 1e-9)
    assert full or any(got + 1 > c * (1 - 1e-9) for c in paced)  # what it leaves out, a rate left out


def test_auto_chunks_of_the_benchmark_table() -> None:
    """snap_t of bench/snapshot_throughput.py: ~136 bytes per row on disk, 50,000-row chunks, 64 MB."""
    assert auto_chunks(False, 64 << 20, 50_000, 136.0) == 9
    assert auto_chunks(False, 64 << 20, 50_000, 136.0, budget=4) == 39  # a replica's
    assert auto_chunks(False, 64 << 20, 50_000, 5_000.0) == 1  # wide rows: one chunk (250 MB) a batch
    assert auto_chunks(False, 64 << 20, 100, 50.0) == MAX_AUTO_CHUNKS
    assert auto_chunks(False, 64 << 20, 100, 50.0, budget=4) == 4 * MAX_AUTO_CHUNKS
    assert auto_chunks(False, 64 << 20, 50_000, 136.0, budget=4, rate_rows=100_000) == 4  # 2 s of the rate
    assert auto_chunks(True, 64 << 20, 50_000, None, rate_rows=5_000) == 1  # (a chunk takes 10 s: one a batch)
    assert auto_chunks(False, 64 << 20, 50_000, 136.0, budget=4, rate_bytes=20 << 20) == 6
