"""spark.checkpoint.resume against ledgers, without Spark: where a query without a usable checkpoint starts."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from changefeed.core.change import BatchProgress
from changefeed.core.offsets import Offset
from changefeed.core.snapshot import Cursor
from changefeed.errors import CheckpointLost
from changefeed.sinks.ledger import FileLedger
from changefeed.spark.checkpoint import resume
from changefeed.spec.state import FeedState
from support.feeds import planned


class Recorded(FileLedger):
    """A file ledger that says it records its batches' end offsets (as the replica does)."""

    def resume_offset(self) -> dict[str, Any] | None:
        entries = self._entries()
        return entries[-1].progress.offset if entries else None


def _plan(state: FeedState, batch: int, end: Offset, committed: bool = True) -> None:
    planned(state.checkpoint, batch, end.to_json(), committed)


def _record(ledger: FileLedger, batch: int, end: Offset) -> None:
    ledger.record(batch, BatchProgress(end.lsn, end.ts, None, 1, (), None, (), end.to_json()), 0.0, 1.0)


def _offset(lsn: int) -> Offset:
    return Offset({"n1": lsn}, lsn * 10, Cursor(pending=("public.t",), after=["7"], next_no=3, requests=1))


def test_missing_and_stale_checkpoints_resume_from_the_ledger(tmp_path: Path) -> None:
    state, said = FeedState(tmp_path, "f"), []
    ledger = Recorded(tmp_path / "ledger.jsonl")
    assert resume(state, ledger, said.append) is None  # a new feed: its slot and snapshot
    _record(ledger, 0, _offset(100))
    got = resume(state, ledger, said.append)
    assert got == _offset(100) and got.cursor.after == ["7"] and "no checkpoint" in said[-1]
    _plan(state, 4, _offset(100))
    assert resume(state, ledger, said.append) is None  # current: Spark goes on from it
    _plan(state, 5, _offset(150), committed=False)
    assert resume(state, ledger, said.append) is None  # planned past the ledger: Spark replays batch 5
    _record(ledger, 9, _offset(300))  # another runner moved the feed on
    assert resume(state, ledger, said.append) == _offset(300)
    assert not state.checkpoint.exists() and (state.dir / "checkpoint.replaced" / "offsets" / "5").exists()
    assert "older than the sink" in said[-1]


def test_a_ledger_without_offsets_refuses_a_missing_or_stale_checkpoint(tmp_path: Path) -> None:
    state = FeedState(tmp_path, "f")
    ledger = FileLedger(tmp_path / "ledger.jsonl")  # records after the sink committed: no offsets
    assert resume(state, ledger, print) is None
    _record(ledger, 0, _offset(100))
    with pytest.raises(CheckpointLost, match="has no checkpoint"):
        resume(state, ledger, print)
    _plan(state, 0, _offset(100))
    assert resume(state, ledger, print) is None
    _record(ledger, 1, _offset(200))
    with pytest.raises(CheckpointLost, match="older than the sink"):
        resume(state, ledger, print)
    assert (state.checkpoint / "offsets" / "0").exists()  # nothing changed


def test_a_batch_in_flight_is_planned_anew_for_a_sink_that_shows_batches_in_parts(tmp_path: Path) -> None:
    """A webhook's batch in flight may have been sent further by a runner that took over (its plan
    reaching further): the checkpoint's smaller plan is not replayed; a sink whose batches show
    whole or not at all replays it."""
    state, said = FeedState(tmp_path, "f"), []
    ledger = Recorded(tmp_path / "ledger.jsonl")
    _record(ledger, 0, _offset(100))
    _plan(state, 4, _offset(100))
    assert resume(state, ledger, said.append, in_parts=True) is None  # nothing in flight: Spark goes on
    _plan(state, 5, _offset(150), committed=False)
    assert resume(state, ledger, said.append) is None  # whole or nothing: Spark replays batch 5
    assert resume(state, ledger, said.append, in_parts=True) == _offset(100)
    assert not state.checkpoint.exists() and (state.dir / "checkpoint.replaced" / "offsets" / "5").exists()
    assert "in flight" in said[-1]
    _plan(state, 0, _offset(100), committed=False)  # recorded by the sink, not committed by Spark: replayed
    assert resume(state, ledger, said.append, in_parts=True) is None


@pytest.mark.parametrize("committed", [False, True])
def test_a_followed_batch_the_sink_recorded_more_of_is_told_apart_from_another_runner(tmp_path: Path,
                                                                                     committed: bool) -> None:
    """Low-latency mode: Spark logs a followed batch with where it starts, and its sink records
    sub-windows past that as it goes. The query starts again from the sink either way, and the
    report says which it was: the batch's own work, or a later batch of another runner."""
    from dataclasses import replace

    state, said = FeedState(tmp_path, "f"), []
    ledger = Recorded(tmp_path / "ledger.jsonl")
    _record(ledger, 3, _offset(100))
    _plan(state, 3, _offset(100))
    _plan(state, 4, replace(_offset(100), follow=7), committed)  # follows the slot from 100
    for lsn in (120, 140):  # its sub-windows
        _record(ledger, 4, replace(_offset(lsn), follow=7))
    assert resume(state, ledger, said.append) == replace(_offset(140), follow=7)
    assert "its last batch followed the slot" in said[-1] and "another runner" not in said[-1]
    _plan(state, 5, replace(_offset(140), follow=7))  # the new query's first batch
    _record(ledger, 6, replace(_offset(300), follow=8))  # a standby's next followed batch
    assert resume(state, ledger, said.append) == replace(_offset(300), follow=8)
    assert "another runner moved the feed on" in said[-1]


def test_a_batch_in_flight_with_judged_reads_no_sink_recorded_is_planned_anew(tmp_path: Path) -> None:
    """Its reads' export is gone with the planner: replayed, each read would take a later snapshot
    than its offset records (core.judge) and repeat what only it saw; planned anew it is read in a
    fresh export. Recorded by the sink, or without judged reads, it is replayed as planned."""
    from dataclasses import replace

    state, said = FeedState(tmp_path, "f"), []
    ledger = Recorded(tmp_path / "ledger.jsonl")
    judged = replace(_offset(150), exports={"n1": "00000003-0000002A-1"})
    _plan(state, 0, judged, committed=False)  # the first batch, nothing recorded anywhere
    assert resume(state, ledger, said.append) is None
    assert not state.checkpoint.exists() and (state.dir / "checkpoint.replaced" / "offsets" / "0").exists()
    assert "first batch was in flight with snapshot reads no sink recorded" in said[-1]
    _record(ledger, 0, _offset(100))
    _plan(state, 0, _offset(100))
    _plan(state, 1, judged, committed=False)
    (state.checkpoint / "offsets" / ".1.crc").write_bytes(b"crc")
    assert resume(state, ledger, said.append) is None  # Spark plans batch 1 again from batch 0's end
    assert sorted(p.name for p in (state.checkpoint / "offsets").iterdir()) == ["0"]
    assert "last batch was in flight with snapshot reads no sink recorded" in said[-1]
    shutil.rmtree(state.checkpoint)
    _plan(state, 0, judged, committed=False)  # a query's first batch (it started from the sink)
    assert resume(state, ledger, said.append) == _offset(100)
    assert not state.checkpoint.exists() and "in flight with snapshot reads no sink recorded" in said[-1]
    _plan(state, 0, _offset(100))
    _plan(state, 1, _offset(150), committed=False)  # no judged reads: replayed
    assert resume(state, ledger, said.append) is None and state.checkpoint.exists()
    _plan(state, 1, judged, committed=False)
    _record(ledger, 1, judged)  # the sink holds the earlier read's rows: replayed as planned
    assert resume(state, ledger, said.append) is None and (state.checkpoint / "offsets" / "1").exists()
