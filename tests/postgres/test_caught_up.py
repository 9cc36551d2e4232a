"""`captured_change_after`: what `status` asks a stopped feed's slot to tell caught up from behind,
on a real server: WAL of other tables and PostgreSQL's own records do not count, a change of a
captured table past the checkpoint does, one before it does not, and a slot in use is "unknown"."""
from __future__ import annotations

import subprocess
import time

import psycopg

from changefeed.core.lsn import parse_lsn
from changefeed.local.postgres import bin_dir
from changefeed.postgres import slots
from changefeed.postgres import source as src
from support.servers import Dbs

SLOT, PUB = "caught_up_slot", "caught_up_pub"


def lsn(c: psycopg.Connection) -> int:
    return parse_lsn(c.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]


def test_only_changes_of_captured_tables_past_the_checkpoint_count(dbs: Dbs) -> None:
    with dbs.src() as c:
        c.execute("SET synchronous_commit = on")  # decoding reads flushed WAL; the test servers commit async
        c.execute("CREATE TABLE captured (id int PRIMARY KEY, v int)")
        c.execute("CREATE TABLE other (id int PRIMARY KEY, v int)")
        c.execute(f"CREATE PUBLICATION {PUB} FOR TABLE captured")
        slots.create_slot(c, SLOT)
        try:
            checkpoint = lsn(c)
            assert src.captured_change_after(c, SLOT, PUB, checkpoint) is False  # nothing at all
            c.execute("INSERT INTO other SELECT g, g FROM generate_series(1, 100) g")
            c.execute("SELECT pg_logical_emit_message(true, 'changefeed.heartbeat', 'x')")
            c.execute("CHECKPOINT")
            assert src.captured_change_after(c, SLOT, PUB, checkpoint) is False  # other WAL only
            c.execute("INSERT INTO captured VALUES (1, 1)")
            assert src.captured_change_after(c, SLOT, PUB, checkpoint) is True
            assert src.captured_change_after(c, SLOT, PUB, lsn(c)) is False  # applied: before the checkpoint
            reader = subprocess.Popen([str(bin_dir() / "pg_recvlogical"), "-d", dbs.source, "--slot", SLOT, "--start",
                                       "-o", "proto_version=1", "-o", f"publication_names={PUB}", "-f", "/dev/null"])
            try:  # the slot streamed by another session: not known, and the reader is left alone
                while slots.slot_state(c, SLOT).active_pid is None:  # type: ignore[union-attr]
                    assert reader.poll() is None, "pg_recvlogical exited"
                    time.sleep(0.05)
                assert src.captured_change_after(c, SLOT, PUB, checkpoint) is None
                assert reader.poll() is None
            finally:
                reader.terminate()
                reader.wait(timeout=30)
        finally:
            c.execute("SELECT pg_drop_replication_slot(%s)", (SLOT,))
