"""Row filters checked on a real server: what PostgreSQL takes as a publication's row filter, on
which columns, and that checking leaves nothing behind; the publication made with the filter, and
the snapshot's chunk bounds counting the filtered rows only."""
from __future__ import annotations

import re

import pytest

from changefeed.errors import ConfigError
from changefeed.postgres import row_filter
from changefeed.postgres import snapshot as snap_pg
from changefeed.postgres import source as src
from changefeed.postgres.decode import pgoutput as po
from support.servers import Dbs


@pytest.fixture
def tables(dbs: Dbs) -> Dbs:
    with dbs.src() as conn:
        conn.execute("CREATE TABLE rf_keyed (id int PRIMARY KEY, region text)")
        conn.execute("CREATE TABLE rf_full (id int PRIMARY KEY, region text)")
        conn.execute("ALTER TABLE rf_full REPLICA IDENTITY FULL")
        conn.execute("INSERT INTO rf_full SELECT g, CASE WHEN g % 4 = 0 THEN 'eu' ELSE 'us' END "
                     "FROM generate_series(1, 100) g")
    return dbs


def _publications(dbs: Dbs) -> list[str]:
    with dbs.src() as conn:
        return [r[0] for r in conn.execute("SELECT pubname FROM pg_publication")]


def test_filters_on_the_replica_identity_pass_and_leave_nothing(tables: Dbs) -> None:
    before = _publications(tables)
    with tables.src() as conn:
        row_filter.check(conn, {"public.rf_keyed": "id > 10 AND id % 2 = 0",
                                "public.rf_full": "region = 'eu'"}, "probe")
    assert _publications(tables) == before


@pytest.mark.parametrize("where, words", [
    ({"public.rf_keyed": "region = 'eu'"}, "outside the table's replica identity (id)"),
    ({"public.rf_keyed": "regio = 'eu'"}, "column \"regio\" does not exist"),
    ({"public.rf_keyed": "id >"}, "syntax error"),
    ({"public.rf_keyed": "id > now()"}, "PostgreSQL refuses"),  # (no volatile or non-immutable functions)
])
def test_a_filter_postgres_would_refuse_is_a_config_error(tables: Dbs, where: dict[str, str], words: str) -> None:
    before = _publications(tables)
    with tables.src() as conn, pytest.raises(ConfigError, match=re.escape(words)) as e:
        row_filter.check(conn, where, "probe")
    assert "public.rf_keyed" in e.value.message and e.value.hint
    assert _publications(tables) == before


def test_the_publication_carries_the_filter_and_chunks_count_filtered_rows(tables: Dbs) -> None:
    with tables.src() as conn:
        described = src.describe_tables(conn, ["public.rf_full", "public.rf_keyed"])
        try:
            src.ensure_publication(conn, "changefeed_rf_probe", described, {"public.rf_full": "region = 'eu'"})
            filters = dict(conn.execute("SELECT tablename, rowfilter FROM pg_publication_tables WHERE pubname = %s",
                                        ("changefeed_rf_probe",)).fetchall())
            assert "'eu'" in str(filters["rf_full"]) and filters["rf_keyed"] is None
        finally:
            conn.execute("DROP PUBLICATION IF EXISTS changefeed_rf_probe")
        full = described[0]
        assert snap_pg.chunk_boundary(conn, full, None, 10, where="region = 'eu'") == ["40"]  # the 10th 'eu' row
        assert snap_pg.chunk_boundary(conn, full, ["96"], 10, where="region = 'eu'") is None


def test_a_partitioned_table_is_published_by_its_root_also_in_an_older_publication(dbs: Dbs) -> None:
    with dbs.src() as conn:
        conn.execute("CREATE TABLE rf_parted (id int PRIMARY KEY, region text) PARTITION BY RANGE (id)")
        conn.execute("CREATE TABLE rf_parted_1 PARTITION OF rf_parted FOR VALUES FROM (0) TO (100)")
        row_filter.check(conn, {"public.rf_parted": "id < 50"}, "probe")  # (refused unless published by the root)
        described = src.describe_tables(conn, ["public.rf_parted"])
        assert src.partitioned(conn, ["public.rf_parted", "public.rf_parted_1"]) == ["public.rf_parted"]
        try:
            conn.execute("CREATE PUBLICATION changefeed_pt_probe FOR TABLE rf_parted")  # as an older changefeed did
            src.ensure_publication(conn, "changefeed_pt_probe", described)
            via_root = conn.execute("SELECT pubviaroot FROM pg_publication WHERE pubname = 'changefeed_pt_probe'")
            assert via_root.fetchone() == (True,)
        finally:
            conn.execute("DROP PUBLICATION IF EXISTS changefeed_pt_probe")


def test_a_filter_replaced_applies_from_its_commit_on(tables: Dbs) -> None:
    with tables.src() as conn:
        conn.execute("CREATE PUBLICATION rf_switch FOR TABLE rf_keyed WHERE (id < 100)")
        conn.execute("SELECT pg_create_logical_replication_slot('rf_switch', 'pgoutput')")
        try:
            conn.execute("INSERT INTO rf_keyed VALUES (1, 'a'), (500, 'b')")  # the old filter: 1 only
            row_filter.replace_filter(conn, "rf_switch", "public.rf_keyed", "id >= 100")
            conn.execute("INSERT INTO rf_keyed VALUES (2, 'c'), (600, 'd')")  # the new one: 600 only
            row_filter.replace_filter(conn, "rf_switch", "public.rf_keyed", None)
            conn.execute("INSERT INTO rf_keyed VALUES (3, 'e')")  # none: every row
            conn.execute("SELECT pg_switch_wal()")  # (flushed: the peek decodes what is)
            messages = [po.decode(bytes(d)) for (d,) in conn.execute(
                "SELECT data FROM pg_logical_slot_peek_binary_changes('rf_switch', NULL, NULL, 'proto_version', "
                "'1', 'publication_names', 'rf_switch')")]
            assert [m.new[0] for m in messages if isinstance(m, po.Insert)] == [b"1", b"600", b"3"]
        finally:
            conn.execute("SELECT pg_drop_replication_slot('rf_switch')")
            conn.execute("DROP PUBLICATION rf_switch")
