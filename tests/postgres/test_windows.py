"""Batch windows cut by bytes, read as production reads them: a real slot, peeks, advances.

A window [start, end) ends at a WAL page boundary found without decoding (`page_cut`). Large
non-transactional messages and transactions straddle those boundaries; reading window after
window (peek up to the cut from the slot, then advance the slot to it) must deliver exactly what
one window over everything delivers: nothing lost, nothing twice.
"""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.postgres import slots
from changefeed.postgres import source as src
from changefeed.postgres.decode.builder import HEARTBEAT_PREFIX, ChangeBuilder
from support.servers import Dbs

pytestmark = pytest.mark.timeout(300)


@given(st.integers(0, 1 << 40), st.integers(1, 1 << 30), st.sampled_from([1024, 8192, 32768]))
def test_page_cut_is_a_page_boundary_past_start(start: int, max_bytes: int, block: int) -> None:
    cut = src.page_cut(start, max_bytes, block)
    assert cut % block == 0 and cut > start
    assert cut <= start + max_bytes or cut - start <= block  # within the limit unless under a page


def _read(conn: Any, slot: str, start: int, end: int) -> list[dict[str, Any]]:
    """One window as the Spark source's `read` does it."""
    slots.advance(conn, slot, start)
    conn.commit()
    builder = ChangeBuilder(start, end, 0, 1 << 62, lambda rel: src.column_catalog(conn, rel))
    blocks = src.peek(conn, slot, "p", end, fetch=50)  # small blocks: many end inside a transaction
    rows = [r for rb in builder.batches(blocks, 64) for r in rb.to_pylist()]
    return [r for r in rows if r["op"] not in "RP"]


@pytest.mark.parametrize("max_bytes", [1, 8192, 50_000])
def test_windows_cut_at_pages_deliver_everything_once(dbs: Dbs, max_bytes: int) -> None:
    with dbs.src() as c:
        c.execute("SET synchronous_commit = on")
        c.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        c.execute("CREATE PUBLICATION p FOR TABLE t")
        c.execute("SELECT pg_create_logical_replication_slot('w', 'pgoutput')")
        c.execute("SELECT pg_create_logical_replication_slot('whole', 'pgoutput')")
        for i in range(40):
            # Messages of 3-13 KB cross page boundaries (8 KB pages) as often as not.
            c.execute("SELECT pg_logical_emit_message(false, 'note', %s)", (f"{i}:" + "x" * (3000 + 250 * i),))
            c.execute("INSERT INTO t SELECT g, repeat('v', %s) FROM generate_series(%s::int, %s::int) g",
                      (i * 7 % 300, i * 100, i * 100 + i % 5 * 20))
            if i % 3 == 0:
                c.execute("UPDATE t SET v = 'u' WHERE id %% 3 = %s", (i % 3,))
        end, _ = src.heartbeat(c, HEARTBEAT_PREFIX)
        block, _ = src.wal_layout(c)

    with dbs.src() as a:
        a.autocommit = False
        whole = _read(a, "whole", 0, end)
        bounds, start = [], slots.slot_state(a, "w").confirmed_flush  # type: ignore[union-attr]
        split: list[dict[str, Any]] = []
        while start < end:
            cut = min(end, src.page_cut(start, max_bytes, block))
            split.extend(_read(a, "w", start, cut))
            bounds.append(cut)
            start = cut
        slots.advance(a, "w", end)
        a.commit()
        for slot in ("w", "whole"):
            a.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        a.commit()

    assert len(bounds) > 20 and all(b % block == 0 for b in bounds[:-1])
    notes = [r["after"] for r in split if r["op"] == "m"]
    assert sorted(int(n.split(b":")[0]) for n in notes) == list(range(40))  # every message once
    strip = lambda rows: [(r["op"], r["lsn"], r["xid"], r["after"], r["before"]) for r in rows]  # noqa: E731
    assert strip(split) == strip(whole)
    assert sum(r["op"] == "c" for r in whole) == sum(1 + i % 5 * 20 for i in range(40))


def test_a_window_past_the_servers_wal_is_read_once_the_wal_reaches_it(dbs: Dbs,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """After a failover, a window planned on the old primary may end past the new primary's WAL:
    `reach` writes heartbeats up to its end first, so rows committed before hold positions below
    the end (this window) and rows committed after hold positions past it (the next one)."""
    monkeypatch.setattr(src, "MAX_PAD", 8000)  # several padding messages
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        c.execute("CREATE PUBLICATION p FOR TABLE t")
        start = slots.create_slot(c, "ahead")
        end = src.flush_lsn(c)[0] + 50_000  # not written yet
        c.execute("INSERT INTO t SELECT g, 'before' FROM generate_series(1, 20) g")
        src.reach(c, end, HEARTBEAT_PREFIX)
        assert src.flush_lsn(c)[0] >= end
        c.execute("INSERT INTO t SELECT g, 'after' FROM generate_series(21, 30) g")
        end2, _ = src.heartbeat(c, HEARTBEAT_PREFIX)

    with dbs.src() as a:
        a.autocommit = False
        first, second = _read(a, "ahead", start, end), _read(a, "ahead", end, end2)
        a.rollback()
        a.execute("SELECT pg_drop_replication_slot('ahead')")
        a.commit()
    assert [r["after"] for r in first] == [f"{i}\tbefore".encode() for i in range(1, 21)]
    assert [r["after"] for r in second] == [f"{i}\tafter".encode() for i in range(21, 31)]
