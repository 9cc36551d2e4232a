"""The slot mover on a real server: positions come back as `Lsn`, move only forward, and an
`Lsn` goes into SQL as the number it is."""
from __future__ import annotations

from changefeed.core.lsn import Lsn
from changefeed.postgres import slots
from conftest import Dbs


def test_a_slot_moves_forward_only_and_its_positions_are_lsns(dbs: Dbs) -> None:
    with dbs.src() as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS slot_probe (v int)")
        start = slots.create_slot(conn, "changefeed_slot_probe")
        try:
            assert type(start) is Lsn
            assert conn.execute("SELECT %s::bigint, %s::pg_lsn::text", (start, start.text)).fetchone() == (
                int(start), start.text)
            conn.execute("INSERT INTO slot_probe VALUES (1)")
            end = Lsn.parse(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
            slots.advance(conn, "changefeed_slot_probe", end)
            state = slots.slot_state(conn, "changefeed_slot_probe")
            assert state is not None and type(state.confirmed_flush) is Lsn and state.confirmed_flush == end
            slots.advance(conn, "changefeed_slot_probe", start)  # backwards: the slot stays
            again = slots.slot_state(conn, "changefeed_slot_probe")
            assert again is not None and again.confirmed_flush == end
        finally:
            slots.drop(conn, "changefeed_slot_probe")
        assert slots.slot_state(conn, "changefeed_slot_probe") is None
