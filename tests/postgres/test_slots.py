"""The slot mover on a real server: positions come back as `Lsn`, move only forward, and an
`Lsn` goes into SQL as the number it is."""
from __future__ import annotations

import psycopg

from changefeed.core.lsn import Lsn
from changefeed.postgres import slots
from changefeed.postgres import source as src
from changefeed.postgres.connect import insert_lsn
from support.servers import Dbs


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


def _restart(conn: psycopg.Connection, slot: str) -> Lsn:
    state = slots.slot_state(conn, slot)
    assert state is not None and state.restart_lsn is not None
    return state.restart_lsn


def test_a_restart_mark_lets_the_slot_restart_where_it_was_confirmed(dbs: Dbs) -> None:
    """A slot moved on restarts at the last running-transactions record it passed: with a mark
    just before its new position, there (without, where the server last wrote one by itself)."""
    slot = f"{dbs.name}_restart"
    with dbs.src() as conn:
        conn.execute("CREATE TABLE probe (v int)")
        slots.create_slot(conn, slot)
        mark = slots.RestartMark(every=60)
        conn.execute("INSERT INTO probe SELECT g FROM generate_series(1, 1000) g")
        before = insert_lsn(conn)
        mark.maybe(conn)
        slots.advance(conn, slot, src.heartbeat(conn, "probe")[0])  # (decoding reads flushed WAL)
        assert _restart(conn, slot) >= before  # (the server's own record comes only every 15 s or so)
        assert not mark.refused


def test_a_restart_mark_the_role_may_not_write_stops_trying(dbs: Dbs) -> None:
    role = f"weak_{dbs.name}"
    with dbs.src() as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN REPLICATION PASSWORD 'weak'")
    weak = psycopg.conninfo.make_conninfo(dbs.source, user=role, password="weak")
    try:
        with psycopg.connect(weak, autocommit=True) as conn:
            mark = slots.RestartMark(every=0)
            mark.maybe(conn)
            assert mark.refused
            assert conn.execute("SELECT 1").fetchone() == (1,)  # the connection goes on
    finally:
        with dbs.src() as conn:
            conn.execute(f"DROP ROLE {role}")
