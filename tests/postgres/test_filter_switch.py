"""A row filter switched on a real server (postgres.filter_switch): the rows that leave arrive as
deletes in the switch's own transaction, decoded as production decodes a window, for the feed's
publication only; later changes are filtered by the new filter; a writer holding the table
makes the switch give up with nothing changed."""
from __future__ import annotations

from typing import Any

import psycopg
import pytest

from changefeed.errors import ConfigError
from changefeed.postgres import filter_switch, row_filter
from changefeed.postgres import source as src
from changefeed.postgres.decode.builder import HEARTBEAT_PREFIX, ChangeBuilder
from support.servers import Dbs

pytestmark = pytest.mark.timeout(300)


def _decoded(conn: Any, slot: str, publication: str, as_for: str | None) -> list[tuple[str, str | None, Any]]:
    """(op, table, key id) of the window up to now, decoded for the feed reading `as_for`."""
    end, _ = src.heartbeat(conn, HEARTBEAT_PREFIX)
    builder = ChangeBuilder(0, end, 0, 1 << 62, lambda rel: src.column_catalog(conn, rel), publication=as_for)
    rows = [r for rb in builder.batches(src.peek(conn, slot, publication, end)) for r in rb.to_pylist()]
    out = []
    for r in rows:
        if r["op"] in "cud":
            line = r["after"] if r["op"] != "d" else r["before"]
            out.append((r["op"], r["table"], line.split(b"\t")))
    return out


def test_rows_leaving_the_filter_are_deletes_where_it_changed(dbs: Dbs) -> None:
    with dbs.src() as conn:
        conn.execute("CREATE TABLE fs (id int, part text, region text, note text, PRIMARY KEY (id, part))")
        conn.execute("INSERT INTO fs SELECT g, 'p' || g % 2, CASE WHEN g % 3 = 0 THEN 'eu' ELSE 'us' END, "
                     "'n' || g FROM generate_series(1, 30) g")
        conn.execute("CREATE PUBLICATION fs_pub FOR TABLE fs (id, part, region) WHERE (region = 'eu')")
        conn.execute("SELECT pg_create_logical_replication_slot('fs_slot', 'pgoutput')")
        try:
            conn.execute("INSERT INTO fs VALUES (31, 'p1', 'eu', 'x'), (32, 'p0', 'us', 'y')")  # old filter: 31
            table = src.describe_tables(conn, ["public.fs"], {"public.fs": ("id", "part", "region")})[0]
            left, after = filter_switch.switch(conn, "fs_pub", table, "id % 2 = 0", listed=True)
            eu = {g for g in range(1, 31) if g % 3 == 0} | {31}
            assert left == len({g for g in eu if g % 2})  # the eu rows with an odd id
            assert row_filter.published(conn, "fs_pub", "public.fs") == (True, "((id % 2) = 0)")
            assert after > 0
            conn.execute("INSERT INTO fs VALUES (33, 'p1', 'eu', 'z'), (34, 'p0', 'us', 'w')")  # new filter: 34
            mine = _decoded(conn, "fs_slot", "fs_pub", "fs_pub")
            deletes = [d for op, _, d in mine if op == "d"]
            assert sorted(int(d[0]) for d in deletes) == sorted(g for g in eu if g % 2)
            # the old key tuple: key columns, the rest NULL (as a DELETE under the default identity)
            assert all(d[1] == f"p{int(d[0]) % 2}".encode() and d[2] == b"\\N" for d in deletes)
            assert [(op, int(v[0])) for op, _, v in mine if op == "c"] == [("c", 31), ("c", 34)]
            order = [op for op, _, _ in mine]
            assert order.index("d") > order.index("c") and order[-1] == "c", "deletes between the inserts"
            other = _decoded(conn, "fs_slot", "fs_pub", "another_feeds")
            assert [op for op, _, _ in other] == ["c", "c"], "another feed's publication: no deletes"
            again, _ = filter_switch.switch(conn, "fs_pub", table, "id % 2 = 0", listed=True)
            assert again == 0, "run again: nothing left to leave"
        finally:
            conn.execute("SELECT pg_drop_replication_slot('fs_slot')")
            conn.execute("DROP PUBLICATION fs_pub")


def test_a_writer_that_holds_the_table_fails_the_switch_clearly_and_changes_nothing(dbs: Dbs, monkeypatch: Any) -> None:
    with dbs.src() as conn:
        conn.execute("CREATE TABLE fw (id int PRIMARY KEY, v int)")
        conn.execute("INSERT INTO fw SELECT g, g FROM generate_series(1, 10) g")
        conn.execute("CREATE PUBLICATION fw_pub FOR TABLE fw WHERE (id < 5)")
        table = src.describe_tables(conn, ["public.fw"])[0]
        try:
            with psycopg.connect(dbs.source) as writer:  # an open transaction that wrote the table
                writer.execute("UPDATE fw SET v = 100 WHERE id = 1")
                monkeypatch.setattr(filter_switch, "LOCK_TIMEOUT", "1s")
                with pytest.raises(Exception) as failed:
                    filter_switch.switch(conn, "fw_pub", table, "id < 3", listed=False)
                assert "stayed locked by writers" in str(failed.value)
                writer.rollback()
            assert row_filter.published(conn, "fw_pub", "public.fw") == (True, "(id < 5)"), "nothing changed"

        finally:
            conn.execute("DROP PUBLICATION fw_pub")


def test_a_publication_left_with_another_filter_than_the_feeds_is_named_at_attach(dbs: Dbs) -> None:
    with dbs.src() as conn:
        conn.execute("CREATE TABLE fp (id int PRIMARY KEY, v int)")
        conn.execute("CREATE TABLE fq (id int PRIMARY KEY)")
        conn.execute("CREATE PUBLICATION fp_pub FOR TABLE fp WHERE (id  <  5), fq")
        try:
            where = {"public.fp": "id<5"}
            printed = row_filter.check(conn, where, "probe")
            row_filter.check_published(conn, "fp_pub", ["public.fp", "public.fq"], where, printed, "probe")  # as said
            table = src.describe_tables(conn, ["public.fp"])[0]
            filter_switch.switch(conn, "fp_pub", table, "id < 9", listed=False)  # an alter that stopped there
            with pytest.raises(ConfigError) as refused:
                row_filter.check_published(conn, "fp_pub", ["public.fp", "public.fq"], where, printed, "probe")
            assert "did not finish" in refused.value.message and "--where \"public.fp=id<5\"" in refused.value.hint
            with pytest.raises(ConfigError, match="filters public.fq by"):
                row_filter.check_published(conn, "fp_pub", ["public.fq"], {"public.fq": "id > 0"},
                                           row_filter.check(conn, {"public.fq": "id > 0"}, "probe"), "probe")
        finally:
            conn.execute("DROP PUBLICATION fp_pub")


def test_a_leaving_rows_key_is_spelled_as_a_delete_of_it_would_be(dbs: Dbs) -> None:
    """Keys whose cast to text differs from their output (bool, char(n), with a tab and a
    backslash): the delete a switch makes equals the delete PostgreSQL publishes for the row."""
    with dbs.src() as conn:
        conn.execute("CREATE TABLE fk (flag bool, code char(6), n int, PRIMARY KEY (flag, code))")
        conn.execute("INSERT INTO fk VALUES (true, E'a\\tb', 1), (false, E'c\\\\', 2), (true, 'keep', 3)")
        conn.execute("CREATE PUBLICATION fk_pub FOR TABLE fk")
        conn.execute("SELECT pg_create_logical_replication_slot('fk_slot', 'pgoutput')")
        try:
            table = src.describe_tables(conn, ["public.fk"])[0]
            left, _ = filter_switch.switch(conn, "fk_pub", table, "code = 'keep'", listed=False)
            assert left == 2
            filter_switch.switch(conn, "fk_pub", table, None, listed=False)  # every row again
            conn.execute("DELETE FROM fk WHERE NOT (code = 'keep')")  # what PostgreSQL publishes for them
            got = _decoded(conn, "fk_slot", "fk_pub", "fk_pub")
            switched, deleted = [v for op, _, v in got if op == "d"][:2], [v for op, _, v in got if op == "d"][2:]
            assert sorted(switched) == sorted(deleted) and len(deleted) == 2, got
        finally:
            conn.execute("SELECT pg_drop_replication_slot('fk_slot')")
            conn.execute("DROP PUBLICATION fk_pub")
