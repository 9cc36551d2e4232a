"""changefeed's own CREATE ... IF NOT EXISTS, run by runners that start together on one database
(feeds splitting a table by key ranges, each creating its lease, requests and record tables):
each waits its turn and then finds what the others created, never a unique violation in the catalog."""
from __future__ import annotations

import random
import threading

import psycopg

from changefeed.postgres.connect import connect, missing, shared_ddl
from support.servers import Dbs

RUNNERS, ROUNDS = 3, 15
DDLS = [f"CREATE SCHEMA IF NOT EXISTS ddl_turn; CREATE TABLE IF NOT EXISTS ddl_turn.t{i} (id int PRIMARY KEY)"
        for i in range(4)]


def test_runners_starting_together_create_the_same_schema_without_a_catalog_conflict(dbs: Dbs) -> None:
    failed: list[str] = []
    together = threading.Barrier(RUNNERS)

    def runner(me: int) -> None:
        rng = random.Random(me)
        with connect(dbs.source, "source") as conn:
            for _ in range(ROUNDS):
                together.wait()
                try:
                    for ddl in rng.sample(DDLS, len(DDLS)):  # each runner in its own order, as attach's steps
                        missing(conn, "ddl_turn.t0")  # (looking first, as ensure does)
                        shared_ddl(conn, ddl)
                except psycopg.Error as e:
                    failed.append(f"runner {me}: {e}")
                together.wait()
                if me == 0:
                    conn.execute("DROP SCHEMA ddl_turn CASCADE")  # the next round creates it again
                together.wait()

    threads = [threading.Thread(target=runner, args=(i,)) for i in range(RUNNERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not failed, failed[:3]
    with psycopg.connect(dbs.source, autocommit=True) as c:
        assert c.execute("SELECT to_regnamespace('ddl_turn')").fetchone() == (None,)


def test_a_turn_inside_a_callers_transaction_lasts_to_its_end(dbs: Dbs) -> None:
    """(ddl_capture.install runs its DDL in a transaction of its own): the turn is held until that
    transaction ends, so no other runner creates meanwhile what it has not committed yet."""
    with connect(dbs.source, "source") as conn, connect(dbs.source, "source") as other:
        with conn.transaction():
            shared_ddl(conn, DDLS[0])
            held = other.execute("SELECT pg_try_advisory_lock(hashtext('changefeed:ddl'))").fetchone()
            assert held == (False,)  # still this runner's turn
        assert other.execute("SELECT pg_try_advisory_lock(hashtext('changefeed:ddl'))").fetchone() == (True,)
        other.execute("SELECT pg_advisory_unlock(hashtext('changefeed:ddl'))")
        conn.execute("DROP SCHEMA ddl_turn CASCADE")
