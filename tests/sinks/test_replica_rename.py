"""A captured table rename on a replica that has a table of the new name already (made by a
runner started after the source's rename): empty, it gives way; with rows, the feed stops."""
from __future__ import annotations

import pytest

from changefeed.errors import UnfollowableChange
from changefeed.sinks.replica.shape import rename
from support.servers import Dbs


def _tables(dbs: Dbs, new_rows: int) -> None:
    with dbs.dst() as d:
        d.execute("CREATE TABLE old_t (id int PRIMARY KEY, a int)")
        d.execute("INSERT INTO old_t SELECT g, g FROM generate_series(1, 5) g")
        d.execute("CREATE TABLE new_t (id int PRIMARY KEY, b int)")
        d.execute("INSERT INTO new_t SELECT g, g FROM generate_series(1, %s) g", (new_rows,))


def test_an_empty_table_of_the_new_name_gives_way(dbs: Dbs) -> None:
    _tables(dbs, 0)
    with dbs.dst() as d:
        rename(d, ("public", "old_t"), ("public", "new_t"), [("a", "b")])
        assert d.execute("SELECT count(*), sum(b) FROM new_t").fetchone() == (5, 15)
        assert d.execute("SELECT to_regclass('public.old_t')").fetchone() == (None,)
        rename(d, ("public", "old_t"), ("public", "new_t"), [("a", "b")])  # (a replayed batch: done already)
        assert d.execute("SELECT count(*) FROM new_t").fetchone() == (5,)


def test_a_table_of_the_new_name_with_rows_stops_the_feed(dbs: Dbs) -> None:
    _tables(dbs, 2)
    with dbs.dst() as d, pytest.raises(UnfollowableChange, match="has both, with rows in each"):
        rename(d, ("public", "old_t"), ("public", "new_t"), [])
    with dbs.dst() as d:  # nothing changed
        assert d.execute("SELECT (SELECT count(*) FROM old_t), (SELECT count(*) FROM new_t)").fetchone() == (5, 2)
