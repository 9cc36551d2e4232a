"""The demos' catch-up target: past every commit, on a server that commits asynchronously."""
from __future__ import annotations

import psycopg

from changefeed.demo.workload import committed_end
from support.servers import Dbs


def _decoded_commits(c: psycopg.Connection, slot: str, upto: int) -> int:
    c.execute("SELECT pg_logical_emit_message(false, 'flush', '', true)")  # (a peek reads flushed WAL only)
    row = c.execute("SELECT count(*) FROM pg_logical_slot_peek_changes(%s, '0/0'::pg_lsn + %s::numeric, NULL) "
                    "WHERE data LIKE 'COMMIT%%'", (slot, upto)).fetchone()
    assert row is not None
    return int(row[0])


def test_the_target_is_past_each_asynchronous_commit(dbs: Dbs) -> None:
    """The demo once stopped its feed with the last transfers missing: its target was the WAL
    write position, which an asynchronous commit's record is still past."""
    slot = f"{dbs.name}_target"
    with dbs.src() as c:
        assert c.execute("SHOW synchronous_commit").fetchone() == ("off",)
        c.execute("CREATE TABLE t (id int PRIMARY KEY)")
        c.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding')", (slot,))
        behind = 0
        for i in range(1, 21):
            c.execute("INSERT INTO t VALUES (%s)", (i,))
            target = committed_end(c)
            written = int(c.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()[0])  # type: ignore[index]
            behind += written < target
            assert _decoded_commits(c, slot, target) == i
        assert behind, "the write position was never behind: the test no longer shows the race"
