"""Judging window changes against snapshot reads on a real server: keys placed in ranges by the
key's own order and collation, and chunk reads in the planner's exported snapshot."""
from __future__ import annotations

from typing import Any

import psycopg
import pyarrow as pa

from changefeed.core.judge import Judge
from changefeed.core.visibility import Snap
from changefeed.postgres import snapshot as snap_pg
from changefeed.postgres import source as src
from changefeed.postgres.key_ranges import Judging, KeyOrder
from support.servers import Dbs


def test_keys_fall_in_ranges_by_their_types_order_not_their_text(dbs: Dbs) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE nums (a int, b text COLLATE \"C\", PRIMARY KEY (a, b))")
        order = KeyOrder(c, src.describe_tables(c, ["public.nums"])[0])
        keys = [["9", "x"], ["10", "a"], ["10", "b"], ["100", "Z"], ["2", "a"]]
        assert order.inside(c, keys, [(["9", "x"], ["10", "a"])]) == [False, True, False, False, False]
        assert order.inside(c, keys, [(["10", "a"], None)]) == [False, False, True, True, False]
        assert order.inside(c, keys, [(None, ["9", "x"]), (["99", "a"], ["100", "a"])]) == \
            [True, False, False, True, True]  # ("100", "Z") < ("100", "a") in "C"
        assert order.inside(c, keys, [(None, None)]) == [True] * 5
        assert order.inside(c, [], [(None, ["1", "a"])]) == []


def test_a_text_key_is_ordered_by_its_columns_collation(dbs: Dbs) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE names (n text COLLATE \"C\" PRIMARY KEY)")
        order = KeyOrder(c, src.describe_tables(c, ["public.names"])[0])
        assert order.inside(c, [["B"], ["a"]], [(None, ["Z"])]) == [True, False]  # in "C", 'a' > 'Z'


def test_chunks_read_in_the_exported_snapshot_see_what_it_saw_and_a_gone_one_reads_anew(dbs: Dbs) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
        c.execute("INSERT INTO t SELECT g, 0 FROM generate_series(1, 10) g")
    with dbs.src() as planner, dbs.src() as reader, dbs.src() as writer:
        exported = snap_pg.export(planner)
        writer.execute("UPDATE t SET v = 1")  # after the export: the chunk must not see it
        found = snap_pg.ChunkRead()
        rows = list(snap_pg.read_chunk(reader, "public.t", None, None, 0, 0, found, 100, exported=exported.id))
        assert found.imported and found.snap == exported.snap and found.rows == 10
        assert sum(r.num_rows for r in rows) == 11  # the R row, and ten rows
        lines = [line for r in rows for line in r.column("after").to_pylist() if line]
        assert {line.split(b"\t")[1] for line in lines} == {b"0"}
        planner.execute("ROLLBACK")  # the planner's transaction ends (as a restarted feed's did)
        again = snap_pg.ChunkRead()
        rows = list(snap_pg.read_chunk(reader, "public.t", None, None, 0, 0, again, 100, exported=exported.id))
        assert not again.imported and again.snap != exported.snap and again.rows == 10
        assert {line.split(b"\t")[1] for r in rows for line in r.column("after").to_pylist() if line} == {b"1"}
        assert reader.info.transaction_status == psycopg.pq.TransactionStatus.IDLE



def _rows(*changes: tuple[str, int, bytes | None, bytes | None, bytes | None]) -> Any:
    """A window's record batch of table public.m (id int key, v int): its `R` row, then
    (op, xid, after, before, old_key) in commit order."""
    from changefeed.core import change as ch

    shape = ch.TableShape("public", "m", ("id", "v"), ("integer", "integer"), ("id",), "d")
    rows = [{"op": ch.RELATION, "schema": "public", "table": "m", "meta": shape.to_meta()}]
    rows += [{"op": op, "schema": "public", "table": "m", "lsn": 100 + n, "seq": 0, "xid": xid, "after": after,
              "before": before, "old_key": old} for n, (op, xid, after, before, old) in enumerate(changes)]
    return pa.RecordBatch.from_pylist(rows, schema=ch.arrow_schema())


def test_a_key_change_with_one_half_seen_becomes_the_other_and_a_truncate_ends_what_reads_leave_out(
        dbs: Dbs) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE m (id int PRIMARY KEY, v int)")
    judge = Judge({"public.m": ((None, ["10"], Snap.parse("50:50:")),)}, {})  # keys up to 10, read seeing xid < 50
    judging = Judging(judge, lambda: psycopg.connect(dbs.source, autocommit=True))
    try:
        out = judging.apply(_rows(("c", 7, b"3\t0", None, None),  # seen, in the range: left out
                                  ("c", 60, b"4\t0", None, None),  # not seen: kept
                                  ("u", 8, b"20\t1", b"5\t0", b"5"),  # 5 (seen) -> 20 (past the range)
                                  ("u", 9, b"2\t2", b"30\t1", b"30"),  # 30 -> 2 (seen)
                                  ("u", 9, b"6\t1", b"1\t0", b"1"),  # both halves seen: left out
                                  ("c", 12, b"40\t0", None, None),  # past the range: kept
                                  ("t", 13, None, None, None),
                                  ("c", 14, b"8\t0", None, None)))  # after the truncate: kept
    finally:
        judging.close()
    got = [(r["op"], r["after"], r["before"], r["old_key"]) for r in out.to_pylist()[1:]]
    assert got == [("c", b"4\t0", None, None), ("c", b"20\t1", None, None), ("d", None, b"30\t1", None),
                   ("c", b"40\t0", None, None), ("t", None, None, None), ("c", b"8\t0", None, None)]
    assert judging.dropped == 2


def test_a_tables_storage_is_new_after_a_truncate_a_partitioned_ones_too(dbs: Dbs) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE plain (id int PRIMARY KEY)")
        c.execute("CREATE TABLE parts (id int PRIMARY KEY) PARTITION BY RANGE (id)")
        c.execute("CREATE TABLE parts_a PARTITION OF parts FOR VALUES FROM (0) TO (10)")
        c.execute("VACUUM plain")  # (storage is not a row count: a vacuum keeps it)
        before = {t: snap_pg.storage(c, "public", t) for t in ("plain", "parts")}
        assert all(before.values()) and snap_pg.storage(c, "public", "plain") == before["plain"]
        c.execute("TRUNCATE plain, parts")
        after = {t: snap_pg.storage(c, "public", t) for t in ("plain", "parts")}
        assert all(after[t] != before[t] for t in after), (before, after)
