"""Slots are made as failover slots on PostgreSQL 17+ unless the feed says not to."""
from __future__ import annotations

import psycopg

from changefeed.postgres import slots
from support.servers import Dbs


def test_failover_slots_on_request(dbs: Dbs) -> None:
    with psycopg.connect(dbs.source, autocommit=True) as c:
        assert c.info.server_version >= 170000  # the embedded server
        for name, failover, two_phase in (("fo_on", True, False), ("fo_off", False, False), ("fo_2pc", True, True)):
            slots.create_slot(c, f"{name}_{dbs.name}", two_phase=two_phase, failover=failover)
            row = c.execute("SELECT failover, two_phase, plugin FROM pg_replication_slots WHERE slot_name = %s",
                            (f"{name}_{dbs.name}",)).fetchone()
            slots.drop(c, f"{name}_{dbs.name}")
            assert row == (failover, two_phase, "pgoutput"), (name, row)
