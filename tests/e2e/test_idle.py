"""An idle feed still closes resolved timestamps, and its slot holds no WAL it does not need.

A running feed (its own process, stopped with SIGTERM) over a table nobody writes: the heartbeat
must keep recording batches with increasing resolved ts. Then 30 MB of WAL from a table the feed
does not capture: the slot must follow it (confirmed position and restart LSN), so WAL does not
pile up behind a filtered feed.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from changefeed.core.hlc import physical_ms
from changefeed.core.lsn import parse_lsn
from support.feeds import start_changefeed, wait_for
from support.servers import Dbs

pytestmark = pytest.mark.timeout(600)


def test_idle_feed_keeps_resolving_and_releasing_wal(dbs: Dbs, tmp_path: Path) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE captured (id int PRIMARY KEY)")
        c.execute("CREATE TABLE other (id int, pad text)")
    log = tmp_path / "run.log"
    p = start_changefeed("run", "--name", dbs.name, "--state", str(tmp_path / "state"), "--source", dbs.source,
                         "--sink", dbs.sink, "--tables", "public.captured", "--resolved", "500ms",
                         # no initial snapshot: its end restarts the query once (docs/how-it-works.md), which
                         # would eat into the idle window measured here
                         "--snapshot", "never", log=log)
    slot = f"changefeed_{dbs.name}"

    def progress() -> list[tuple[int, int]]:
        with dbs.dst() as d:
            if not d.execute("SELECT to_regclass('changefeed.progress')").fetchone()[0]:  # type: ignore[index]
                return []
            return [(int(r[0]), int(r[1])) for r in d.execute(
                "SELECT end_lsn - '0/0'::pg_lsn, resolved_ts FROM changefeed.progress WHERE feed = %s "
                "ORDER BY end_lsn", (dbs.name,))]

    def slot_lsns() -> tuple[int, int, int]:
        with dbs.src() as c:
            row = c.execute("SELECT confirmed_flush_lsn::text, restart_lsn::text, pg_current_wal_lsn()::text "
                            "FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
        assert row is not None
        return parse_lsn(row[0]), parse_lsn(row[1]), parse_lsn(row[2])

    try:
        first = wait_for("the first batch", progress, log, 240)
        confirmed0 = slot_lsns()[0]
        t0 = time.time()

        def four_more() -> list[tuple[int, int]] | None:
            now = progress()
            return now if len(now) >= len(first) + 4 else None

        # Idle, batches still come: with --resolved 500ms the heartbeat gives one per interval plus the
        # batch's own time (background WAL alone would give one every ~15 s or so).
        idle = wait_for("four more batches while idle", four_more, log, 120)
        resolved = [ts for _, ts in idle]
        assert resolved == sorted(set(resolved)), "resolved ts must strictly increase"
        assert physical_ms(resolved[-1]) / 1000 >= t0 - 1  # it follows the clock, not the last write
        assert slot_lsns()[0] > confirmed0  # the slot moves with the heartbeats
        with dbs.dst() as d:
            assert d.execute("SELECT sum(changes) FROM changefeed.progress WHERE feed = %s",
                             (dbs.name,)).fetchone()[0] == 0  # type: ignore[index]

        # 30 MB of WAL the feed does not capture: the slot must not hold it back.
        with dbs.src() as c:
            before = parse_lsn(c.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]
            for _ in range(40):
                c.execute("INSERT INTO other SELECT g, repeat('x', 900) FROM generate_series(1, 1000) g")
            after = parse_lsn(c.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]
            c.execute("SELECT pg_log_standby_snapshot()")  # a running-xacts record: where restart_lsn may move to
        assert after - before > 30_000_000
        wait_for("the slot to pass the filtered writes (confirmed and restart LSN)",
                 lambda: min(slot_lsns()[:2]) >= after, log, 60)
    finally:
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=180)
    assert rc == 0, log.read_text()[-3000:]
