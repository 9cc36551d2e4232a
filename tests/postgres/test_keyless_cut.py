"""A snapshot chunk of a table without a key turned back to its batch's window end
(postgres.keyless_cut): on a real server, with duplicate rows, a TOASTed value left unchanged, a
transaction committed after the snapshot and a truncate; and, as a property, for any changes."""
from __future__ import annotations

import time
from collections import Counter
from typing import Any

import psycopg
from hypothesis import given
from hypothesis import strategies as st

from changefeed.core.lsn import format_lsn, parse_lsn
from changefeed.postgres import keyless_cut
from changefeed.postgres import snapshot as snap_pg
from support.servers import Dbs

BIG = "".join(f"{i:05d}" for i in range(3000))  # stored out of line (TOAST), so left out of an update


def _lsn(conn: psycopg.Connection[Any], what: str = "pg_current_wal_flush_lsn") -> int:
    time.sleep(0.7)  # (synchronous_commit off: let the WAL writer flush what went before)
    return parse_lsn(conn.execute(f"SELECT {what}()::text").fetchone()[0])


def _read_in_order(conn: psycopg.Connection[Any], table: str, cut: snap_pg.Cut) -> list[bytes]:
    found = snap_pg.ChunkRead()
    out: list[bytes] = []
    for rb in snap_pg.read_chunk(conn, table, None, None, 0, 1, found, rows_per_batch=100, cut=cut):
        out.extend(a for op, a in zip(rb.column("op").to_pylist(), rb.column("after").to_pylist()) if op == "r")
    assert found.rows == len(out)
    return out


def _read(conn: psycopg.Connection[Any], table: str, cut: snap_pg.Cut) -> Counter[bytes]:
    return Counter(_read_in_order(conn, table, cut))


def _rows(conn: psycopg.Connection[Any], table: str) -> Counter[bytes]:
    with conn.cursor().copy(f"COPY (SELECT * FROM {table}) TO STDOUT") as copy:
        return Counter(bytes(data[:-1]) for data in copy)


def test_a_keyless_chunk_reads_the_rows_at_its_window_end_while_changes_go_on(dbs: Dbs) -> None:
    with psycopg.connect(dbs.source, autocommit=True) as conn, psycopg.connect(dbs.source, autocommit=True) as other:
        conn.execute("CREATE TABLE kl (tag text, n int, doc text)")
        conn.execute("ALTER TABLE kl REPLICA IDENTITY FULL")
        conn.execute("ALTER TABLE kl ALTER COLUMN doc SET STORAGE EXTERNAL")
        conn.execute("INSERT INTO kl VALUES ('dup', 1, NULL), ('dup', 1, NULL), ('u', 3, 'x'), ('t', 4, %s), "
                     "('tab\tand\\back', 5, E'line\\nbreak')", (BIG,))
        conn.execute("CREATE PUBLICATION kl_pub FOR TABLE kl")
        conn.execute("SELECT pg_create_logical_replication_slot('kl_slot', 'pgoutput')")
        at_window_end = _rows(conn, "kl")
        window_end = _lsn(conn)
        conn.execute("INSERT INTO kl VALUES ('dup', 1, NULL), ('new', 6, NULL)")
        conn.execute("DELETE FROM kl WHERE ctid = (SELECT min(ctid) FROM kl WHERE tag = 'dup')")
        conn.execute("UPDATE kl SET n = 30 WHERE tag = 'u'")
        conn.execute("UPDATE kl SET n = 40 WHERE tag = 't'")  # doc unchanged: not sent in the new row
        conn.execute("DELETE FROM kl WHERE tag LIKE 'tab%'")
        other.execute("BEGIN")
        other.execute("INSERT INTO kl VALUES ('late', 7, NULL)")  # open while the chunk is read
        assert _rows(conn, "kl") != at_window_end
        cut = snap_pg.Cut(("kl_slot",), "kl_pub", window_end)
        first = _read_in_order(conn, "public.kl", cut)
        assert Counter(first) == at_window_end
        other.execute("COMMIT")
        assert _read_in_order(conn, "public.kl", cut) == first  # the late commit undone too, now seen; same order
        assert _read(conn, "public.kl", snap_pg.Cut(("kl_slot",), "kl_pub", _lsn(conn))) == _rows(conn, "kl")

        # A commit the snapshot does not see is left as read, even though it is in the WAL.
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        seen = keyless_cut.seen(conn)
        other.execute("INSERT INTO kl VALUES ('unseen', 8, NULL)")
        upto = _lsn(other, "pg_current_wal_insert_lsn")
        conn.execute("ROLLBACK")
        conn.execute("SELECT pg_copy_logical_replication_slot('kl_slot', 'kl_copy', true)")
        undo = keyless_cut.undo(conn, "kl_copy", "kl_pub", "public.kl", 3, window_end, upto, seen)
        assert not any(b"unseen" in line for line in (*undo.drop, *undo.add))
        # (the dup inserted and the dup deleted cancel out)
        assert sorted(line.split(b"\t")[0] for line in undo.drop.elements()) == [b"late", b"new", b"t", b"u"]
        assert sorted(line.split(b"\t")[0] for line in undo.add.elements()) == [b"t", b"tab\\tand\\\\back", b"u"]

        # After a truncate nothing before it can be put back: the rows right after it are read.
        conn.execute("SELECT pg_drop_replication_slot('kl_copy')")
        conn.execute("SELECT pg_replication_slot_advance('kl_slot', %s::pg_lsn)", (format_lsn(_lsn(conn)),))
        window_end = _lsn(conn)
        conn.execute("INSERT INTO kl VALUES ('before', 9, NULL)")
        conn.execute("TRUNCATE kl")
        conn.execute("INSERT INTO kl VALUES ('after', 10, NULL)")
        assert _read(conn, "public.kl", snap_pg.Cut(("kl_slot",), "kl_pub", window_end)) == Counter()
        conn.execute("SELECT pg_drop_replication_slot('kl_slot')")
        conn.execute("DROP PUBLICATION kl_pub")
        conn.execute("DROP TABLE kl")


rows = st.sampled_from([b"a\t1", b"a\t1", b"b\t2", b"c\t\\N", b"d\t4"])


@given(st.lists(rows, max_size=6), st.lists(st.tuples(st.sampled_from("idu"), rows, st.integers(0, 5)),
                                            max_size=20), st.integers(1, 4))
def test_undoing_what_transactions_did_gives_back_the_rows_before_them(
        start: list[bytes], ops: list[tuple[str, bytes, int]], per_txn: int) -> None:
    held: Counter[bytes] = Counter(start)
    changes: list[tuple[int, bytes]] = []
    for op, row, pick in ops:
        present = sorted(held.elements())
        if op == "i" or not present:
            held[row] += 1
            changes.append((1, row))
            continue
        old = present[pick % len(present)]
        held[old] -= 1
        changes.append((-1, old))
        if op == "u":
            held[row] += 1
            changes.append((1, row))
    undo = keyless_cut.Undo()
    for i in range(0, len(changes), per_txn):
        keyless_cut._count(undo, changes[i:i + per_txn])
    after = +held
    kept = Counter(line for line in sorted(after.elements()) if undo.keeps(line))
    undo.check_done("t")
    assert kept + Counter(undo.put_back()) == Counter(start)


def test_a_snapshot_sees_by_xid_across_wraparound() -> None:
    seen = keyless_cut.Seen(xmin=0xFFFFFFF0, xmax=5, xip=frozenset({0xFFFFFFF8, 2}))
    assert seen.sees(0xFFFFFFE0) and seen.sees(0xFFFFFFF5) and seen.sees(1)
    assert not seen.sees(0xFFFFFFF8) and not seen.sees(2) and not seen.sees(5) and not seen.sees(100)
