"""Snapshot chunk boundaries on a real table: chunks of `rows` rows in key order, no empty tail,
up to the last key when the table's read began."""
from __future__ import annotations

from changefeed.core.snapshot import Cursor
from changefeed.postgres import source as src
from changefeed.postgres.snapshot import chunk_boundary, last_key
from support.servers import Dbs


def plan_all(dbs: Dbs, table: str, rows: int) -> list[tuple[object, object]]:
    """(lo, hi] of every chunk the planner makes for `table`."""
    with dbs.src() as c:
        described = src.describe_tables(c, [table])[0]
        chunks, cursor = Cursor(pending=(table,)).plan(
            lambda _t, after, n, upto: chunk_boundary(c, described, after, n, upto), 1000, rows,
            last=lambda _t: last_key(c, described))
    assert not cursor.pending
    return [(ch.lo, ch.hi) for ch in chunks]


def test_chunks_cover_the_keys_without_an_empty_tail(dbs: Dbs) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE exact (a int, b text, PRIMARY KEY (a, b))")
        c.execute("INSERT INTO exact SELECT g / 2, g::text FROM generate_series(1, 74) g")  # 2 x 37 rows
        c.execute("CREATE TABLE empty (id int PRIMARY KEY)")
    assert plan_all(dbs, "public.exact", 37) == [(None, ["18", "37"]), (["18", "37"], ["37", "74"])]
    assert plan_all(dbs, "public.exact", 74) == [(None, ["37", "74"])]
    assert len(plan_all(dbs, "public.exact", 36)) == 3  # 36 + 36 + 2
    assert plan_all(dbs, "public.empty", 10) == [(None, None)]


def test_rows_written_past_the_last_key_after_the_read_began_are_left_to_the_stream(dbs: Dbs) -> None:
    """A table appended to while it is read: its chunks stop at the last key it had when its read
    began, in its key's order (here text: '91' comes after '9')."""
    with dbs.src() as c:
        c.execute("CREATE TABLE growing (k text PRIMARY KEY)")
        c.execute("INSERT INTO growing SELECT g::text FROM generate_series(1, 9) g")
        described = src.describe_tables(c, ["public.growing"])[0]
        boundary = lambda _t, after, n, upto: chunk_boundary(c, described, after, n, upto)  # noqa: E731 - a query
        first, cursor = Cursor(pending=("public.growing",)).plan(boundary, 1, 4, last=lambda _t: last_key(c, described))
        assert [(ch.lo, ch.hi) for ch in first] == [(None, ["4"])] and cursor.upto == ["9"]
        c.execute("INSERT INTO growing SELECT g::text FROM generate_series(91, 99) g")  # after '9'
        rest, cursor = cursor.plan(boundary, 10, 4, last=lambda _t: last_key(c, described))
        assert [(ch.lo, ch.hi) for ch in rest] == [(["4"], ["8"]), (["8"], ["9"])]
        assert not cursor.pending and cursor.upto is None
