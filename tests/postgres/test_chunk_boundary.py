"""Snapshot chunk boundaries on a real table: chunks of `rows` rows in key order, no empty tail."""
from __future__ import annotations

from changefeed.core.snapshot import Cursor
from changefeed.postgres import source as src
from changefeed.postgres.snapshot import chunk_boundary
from conftest import Dbs


def plan_all(dbs: Dbs, table: str, rows: int) -> list[tuple[object, object]]:
    """(lo, hi] of every chunk the planner makes for `table`."""
    with dbs.src() as c:
        described = src.describe_tables(c, [table])[0]
        chunks, cursor = Cursor(pending=(table,)).plan(lambda _t, after, n: chunk_boundary(c, described, after, n),
                                                        1000, rows)
    assert not cursor.pending
    return [(ch.lo, ch.hi) for ch in chunks]


def test_chunks_cover_the_keys_without_an_empty_tail(dbs: Dbs) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE exact (a int, b text, PRIMARY KEY (a, b))")
        c.execute("INSERT INTO exact SELECT g / 2, g::text FROM generate_series(1, 74) g")  # 2 x 37 rows
        c.execute("CREATE TABLE empty (id int PRIMARY KEY)")
    assert plan_all(dbs, "public.exact", 37) == [(None, ["18", "37"]), (["18", "37"], None)]
    assert plan_all(dbs, "public.exact", 74) == [(None, None)]
    assert len(plan_all(dbs, "public.exact", 36)) == 3  # 36 + 36 + 2
    assert plan_all(dbs, "public.empty", 10) == [(None, None)]
