"""A COPY TO STDOUT read in blocks (postgres.copy_out): on a real server, the blocks hold exactly
the rows psycopg's row-at-a-time iteration gives, in order, within their bounds, whatever the
bounds; an error the server meets in the middle of the COPY reaches the caller; and the lines of a
block become an Arrow column of the same lines, as a property."""
from __future__ import annotations

from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.core import change as ch
from changefeed.postgres import copy_out
from changefeed.postgres import snapshot as snap_pg
from support.servers import Dbs

QUERY = "COPY (SELECT * FROM awkward ORDER BY id) TO STDOUT"


def _awkward(conn: psycopg.Connection[Any]) -> None:
    conn.execute("CREATE TABLE awkward (id int PRIMARY KEY, t text, j jsonb, b bytea)")
    conn.execute("INSERT INTO awkward VALUES (1, E'line\\nbreak\\tand tab', '{\"a\": \"\\\\n\"}', '\\x00ff'), "
                 "(2, '', NULL, ''), (3, NULL, '[]', NULL), (4, E'back\\\\slash \\r', '1', '\\x0a0d'), "
                 "(5, 'ünïcødé ✓', '\"x\"', '\\x5c')")
    conn.execute("INSERT INTO awkward SELECT g, repeat(md5(g::text), g % 97), NULL, NULL "
                 "FROM generate_series(6, 3000) g")


def _per_row(conn: psycopg.Connection[Any], query: str) -> list[bytes]:
    with conn.cursor().copy(query) as copy:
        return [bytes(data) for data in copy]


@pytest.mark.parametrize(("rows", "size"), [(1, 1 << 30), (7, 1 << 30), (10 ** 6, 1), (10 ** 6, 5000),
                                            (500, 64 << 10), (10 ** 6, 1 << 30)])
def test_blocks_hold_every_row_in_order_within_their_bounds(dbs: Dbs, rows: int, size: int) -> None:
    with psycopg.connect(dbs.source, autocommit=True) as conn:
        _awkward(conn)
        expected = _per_row(conn, QUERY)
        got = list(copy_out.blocks(conn, QUERY, rows, size))
        assert all(n for _, n in got)  # no empty block
        lines = [line for block, n in got for line in block.splitlines(keepends=True)]
        assert lines == expected
        for block, n in got:
            held = block.splitlines(keepends=True)
            assert len(held) == n <= rows
            assert sum(map(len, held[:-1])) < size  # it ends at the row that reaches `size`
        assert conn.execute("SELECT count(*) FROM awkward").fetchone() == (3000,)  # the connection goes on


def test_a_copy_of_no_rows_gives_no_block_and_an_error_midway_is_raised(dbs: Dbs) -> None:
    with psycopg.connect(dbs.source, autocommit=True) as conn:
        _awkward(conn)
        assert list(copy_out.blocks(conn, "COPY (SELECT * FROM awkward WHERE false) TO STDOUT", 10, 100)) == []
        failing = "COPY (SELECT id, 1 / (id - 2500) FROM awkward ORDER BY id) TO STDOUT"
        seen = 0
        with pytest.raises(psycopg.errors.DivisionByZero):
            for _, n in copy_out.blocks(conn, failing, 100, 1 << 20):
                seen += n
        assert seen < 2500
        assert conn.execute("SELECT 1").fetchone() == (1,)


@settings(deadline=None)  # (the first example pays numpy's and pyarrow's imports)
@given(st.lists(st.binary().map(lambda b: b.replace(b"\n", b"\\n")), max_size=50))
def test_a_blocks_lines_become_an_arrow_column_of_the_same_lines(lines: list[bytes]) -> None:
    block = b"".join(line + b"\n" for line in lines)
    assert copy_out.lines_array(block, len(lines)).to_pylist() == lines
    with pytest.raises(ValueError):
        copy_out.lines_array(block + b"x\n", len(lines))


def test_a_chunk_read_in_blocks_equals_the_rows_copy_gives(dbs: Dbs) -> None:
    """read_chunk: an R row first, then every row once, in pieces of at most rows_per_batch rows
    (also under a rows rate), seq counting on across pieces."""
    with psycopg.connect(dbs.source, autocommit=True) as conn:
        _awkward(conn)
        expected = [line[:-1] for line in _per_row(conn, QUERY)]
        for rate in ((0, 0, 0), (200_000, 0, 0), (0, 5 << 20, 0)):
            found = snap_pg.ChunkRead()
            batches = list(snap_pg.read_chunk(conn, "public.awkward", None, None, 7, 9, found, rows_per_batch=400,
                                              rate=rate))
            assert batches[0].column("op")[0].as_py() == ch.RELATION
            assert all(rb.num_rows <= 401 for rb in batches)
            rows = [r for rb in batches for r in rb.to_pylist()]
            assert [r["after"] for r in rows[1:]] == expected and found.rows == len(expected)
            assert [r["seq"] for r in rows] == list(range(len(rows)))
            assert {(r["op"], r["lsn"], r["commit_ts"], r["table"]) for r in rows[1:]} == {("r", 7, 9, "awkward")}
            assert batches[0].schema == ch.arrow_schema()
        conn.execute("CREATE TABLE nothing (id int PRIMARY KEY)")
        empty = list(snap_pg.read_chunk(conn, "public.nothing", None, None, 7, 9, snap_pg.ChunkRead(), 100))
        assert [rb.column("op").to_pylist() for rb in empty] == [[ch.RELATION]]


def test_row_bytes_come_from_the_tables_statistics(dbs: Dbs) -> None:
    """What --snapshot-chunks-per-batch auto sizes a batch by: bytes on disk per row, a partitioned
    table's over its partitions, None before the table was ever analysed or when it is empty."""
    with psycopg.connect(dbs.source, autocommit=True) as c:
        c.execute("CREATE TABLE plain (id int PRIMARY KEY, v text)")
        c.execute("INSERT INTO plain SELECT g, repeat('x', 200) FROM generate_series(1, 20000) g")
        c.execute('CREATE TABLE "Parted" (id int PRIMARY KEY, v text) PARTITION BY RANGE (id)')
        c.execute('CREATE TABLE p1 PARTITION OF "Parted" FOR VALUES FROM (0) TO (10000)')
        c.execute('CREATE TABLE p2 PARTITION OF "Parted" FOR VALUES FROM (10000) TO (30000)')
        c.execute('INSERT INTO "Parted" SELECT g, repeat(\'y\', 50) FROM generate_series(1, 20000) g')
        c.execute("CREATE TABLE empty (id int PRIMARY KEY)")
        assert snap_pg.row_bytes(c, "public.plain") is None  # never analysed
        c.execute('ANALYZE plain, "Parted", empty')
        plain, parted = snap_pg.row_bytes(c, "public.plain"), snap_pg.row_bytes(c, "public.Parted")
        assert snap_pg.row_bytes(c, "public.empty") is None
    assert plain is not None and 200 < plain < 400, plain  # 200 bytes of text and a tuple's overhead
    assert parted is not None and 50 < parted < plain, parted
