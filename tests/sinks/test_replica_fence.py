"""The replica's fence against a real server: once a later lease term claims the replica, a batch of
an earlier term lands nothing, and a claim made while a batch is being applied waits for it."""
from __future__ import annotations

import threading
from pathlib import Path

import psycopg
import pytest

from changefeed.core import change as ch
from changefeed.errors import LeaseLost
from changefeed.sinks.replica import apply as replica
from changefeed.sinks.replica import ledger
from support.feeds import wait_for
from support.servers import Dbs


def _progress(end_lsn: int) -> ch.Progress:
    return ch.Progress(end_lsn=end_lsn, resolved_ts=end_lsn << 18, last_commit_time=None, changes=0)


def _batch(dbs: Dbs, batch_id: int, epoch: int | None, *, hold: threading.Event | None = None,
           began: threading.Event | None = None) -> replica.Applied:
    """A batch of nothing but its progress, applied by lease term `epoch`; with `hold`, it waits
    inside its transaction (after its fence check) until `hold` is set."""
    with psycopg.connect(dbs.sink, autocommit=True) as conn:
        applier = replica.BatchApplier(conn, dbs.name, batch_id, epoch=epoch)
        applier.begin()
        if began is not None:
            began.set()
        if hold is not None:
            hold.wait(30)
        applier.add(ch.progress_batch(_progress(1000 * (batch_id + 1))))
        return applier.commit()


def _waiting_on_a_lock(dbs: Dbs) -> bool:
    with dbs.dst() as d:
        return bool(d.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                              "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                              ).fetchone()[0])  # type: ignore[index]


def _batches(dbs: Dbs) -> list[int]:
    with dbs.dst() as d:
        return [r[0] for r in d.execute("SELECT batch_id FROM changefeed.progress WHERE feed = %s "
                                        "ORDER BY batch_id", (dbs.name,))]


def test_a_batch_of_an_earlier_term_lands_nothing(dbs: Dbs) -> None:
    with dbs.dst() as d:
        ledger.ensure_meta(d)
        ledger.raise_fence(d, dbs.name, 1, "first")
    _batch(dbs, 0, 1)
    with dbs.dst() as d:
        ledger.raise_fence(d, dbs.name, 2, "second")
        ledger.raise_fence(d, dbs.name, 1, "late")  # a claim of an earlier term changes nothing
        assert d.execute("SELECT epoch, holder FROM changefeed.fences WHERE feed = %s",
                         (dbs.name,)).fetchone() == (2, "second")
    with pytest.raises(LeaseLost) as lost:
        _batch(dbs, 1, 1)
    assert "term 1" in lost.value.message and "second" in lost.value.message
    assert _batches(dbs) == [0]  # nothing of the refused batch
    _batch(dbs, 1, 2)
    _batch(dbs, 2, None)  # a run without a lease term (an older runner) is not fenced
    assert _batches(dbs) == [0, 1, 2]


def test_a_claim_waits_for_the_batch_in_flight_which_lands_before_it(dbs: Dbs, tmp_path: Path) -> None:
    with dbs.dst() as d:
        ledger.ensure_meta(d)
    hold, began = threading.Event(), threading.Event()
    results: list[object] = []
    t = threading.Thread(target=lambda: results.append(_batch(dbs, 0, 1, hold=hold, began=began)))
    t.start()
    assert began.wait(30)
    claimed = threading.Event()

    def claim() -> None:
        with dbs.dst() as d:
            ledger.raise_fence(d, dbs.name, 2, "taker")
        claimed.set()

    c = threading.Thread(target=claim)
    c.start()
    log = tmp_path / "no-feed.log"
    log.touch()
    wait_for("the claim to wait for the batch's lock", lambda: _waiting_on_a_lock(dbs), log, timeout=30)
    assert not claimed.is_set()
    hold.set()
    t.join(30)
    c.join(30)
    assert claimed.is_set() and len(results) == 1 and _batches(dbs) == [0]
    with pytest.raises(LeaseLost):
        _batch(dbs, 1, 1)
