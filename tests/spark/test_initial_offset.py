"""Where a query's first batch starts, asked again (real PostgreSQL slot, the source's reader
without Spark).

Spark logs each batch's end, never the first batch's start: a query run again before its first
batch was logged as committed asks the source's initialOffset anew. A query that started from a
sink's ledger (a runner without the checkpoint) or behind the others (a sink being caught up) is
then given no resume offset, so the answer must come from the checkpoint, not from the slot: at
the slot with no timestamp, the batch's commit timestamps would differ from those the other sinks
got (the first transaction after the start, committed in the millisecond of its plan).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import psycopg

from changefeed.core.hlc import ceiling_of_ms
from changefeed.core.offsets import Offset
from changefeed.core.snapshot import Cursor
from changefeed.spark.source import ChangeStreamReader
from support.servers import Dbs


def test_a_query_run_again_before_its_first_batch_committed_starts_where_it_did(dbs: Dbs, tmp_path: Path) -> None:
    slot = f"cf_{dbs.name}"
    with psycopg.connect(dbs.source, autocommit=True) as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY)")
        c.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        c.execute("INSERT INTO t SELECT generate_series(1, 100)")
        c.execute("SELECT pg_switch_wal()")  # (flushed past the inserts)
        confirmed, at, clock = c.execute(
            "SELECT confirmed_flush_lsn - '0/0'::pg_lsn, pg_current_wal_flush_lsn() - '0/0'::pg_lsn, "
            "(extract(epoch FROM clock_timestamp()) * 1000)::bigint FROM pg_replication_slots WHERE slot_name = %s",
            (slot,)).fetchone()  # type: ignore[misc]
    assert at > confirmed  # the sink is past the slot
    resume = Offset({"n1": int(at)}, ceiling_of_ms(int(clock)), Cursor())
    until = Offset({"n1": int(at) + 10}, ceiling_of_ms(int(clock) + 5), Cursor())
    options = {"nodes": json.dumps([["n1", dbs.source, slot, f"pub_{dbs.name}"]]), "feed": dbs.name,
               "snapshot_tables": "public.t", "checkpoint": str(tmp_path / "checkpoint")}

    first = ChangeStreamReader({**options, "resume_offset": json.dumps(resume.to_json())})
    assert first.initialOffset() == resume.to_json()
    # killed before Spark logged its first batch: the next run plans it anew, from where it says
    resume = replace(resume, lsns={"n1": int(at) + 1})
    second = ChangeStreamReader({**options, "resume_offset": json.dumps(resume.to_json()),
                                 "resume_until": json.dumps(until.to_json())})
    assert second.initialOffset() == resume.to_json()
    assert second._replay == [until]
    (tmp_path / "checkpoint" / "offsets").mkdir(parents=True, exist_ok=True)
    (tmp_path / "checkpoint" / "offsets" / "0").write_text("v1\n{}\n{}\n")  # (Spark's offset log: batch 0 planned)
    # killed again, after: the next run has the checkpoint, so no resume offset is given
    again = ChangeStreamReader(options)
    assert again.initialOffset() == resume.to_json(), "started at the slot, not where the first batch did"
    assert again._replay == [until], "the first batch's end (the furthest sink) forgotten"
    assert again.initialOffset() == resume.to_json() and again._replay == [until]  # (asked twice: the same)

    # a new checkpoint of a new feed: at the slot, its snapshot ahead
    fresh = Offset.from_json(ChangeStreamReader({**options, "checkpoint": str(tmp_path / "new")}).initialOffset())
    assert fresh.ts == 0 and fresh.lsns["n1"] == confirmed and fresh.cursor.pending
