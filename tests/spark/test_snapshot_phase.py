"""checkpoint.chunks_to_read: whether the runner reads snapshot chunks (in parallel tasks), decided from
the Spark checkpoint's offset and commit logs as they lie on disk."""
from __future__ import annotations

import json
from pathlib import Path

from changefeed.core import snapshot
from changefeed.core.requests import SnapshotRequests
from changefeed.spark import checkpoint
from changefeed.spec.definition import FeedSpec
from changefeed.spec.state import FeedState

NONE = SnapshotRequests("/nonexistent")  # no requests
SPEC = FeedSpec(name="f", source="postgresql://s/db", sink="postgresql://r/db", tables=["public.t"])


def _log(state: FeedState, batch: int, end: dict[str, object], committed: bool) -> None:
    """Write batch `batch`'s entries as Spark does: offsets/N (version, metadata, the offset), commits/N."""
    for d in ("offsets", "commits"):
        (state.checkpoint / d).mkdir(parents=True, exist_ok=True)
    (state.checkpoint / "offsets" / str(batch)).write_text(f'v1\n{{"batchWatermarkMs":0}}\n{json.dumps(end)}')
    if committed:
        (state.checkpoint / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}')


def _end(pending: tuple[str, ...], chunks: bool) -> dict[str, object]:
    end: dict[str, object] = {"lsn": 100, "ts": 1, "snap": snapshot.Cursor(pending=pending).to_json()}
    if chunks:
        end["chunks"] = [[0, "public.t", None, None]]
    return end


def test_fresh_checkpoint_has_its_snapshot_ahead(tmp_path: Path) -> None:
    state = FeedState(tmp_path, "f")
    assert checkpoint.chunks_to_read(SPEC, state, NONE)
    assert not checkpoint.chunks_to_read(FeedSpec(**{**SPEC.__dict__, "snapshot": "never"}), state, NONE)


def test_a_batch_of_chunks_counts_until_it_is_committed(tmp_path: Path) -> None:
    """The last chunks planned keep the parallel reads while their batch may still run; once it is
    committed, a restarted feed (or the running one) drops the shuffle instead of restarting for nothing."""
    state = FeedState(tmp_path, "f")
    _log(state, 0, _end((), chunks=True), committed=False)
    assert checkpoint.chunks_to_read(SPEC, state, NONE)
    _log(state, 0, _end((), chunks=True), committed=True)
    assert not checkpoint.chunks_to_read(SPEC, state, NONE)
    _log(state, 1, _end(("public.t",), chunks=True), committed=True)  # more tables pending after it
    assert checkpoint.chunks_to_read(SPEC, state, NONE)
    _log(state, 2, _end((), chunks=False), committed=False)
    assert not checkpoint.chunks_to_read(SPEC, state, NONE)


def test_a_request_not_taken_in_has_chunks_ahead(tmp_path: Path) -> None:
    state = FeedState(tmp_path, "f")
    requests = SnapshotRequests(tmp_path / "requests")
    _log(state, 0, _end((), chunks=False), committed=True)
    assert not checkpoint.chunks_to_read(SPEC, state, requests) and checkpoint.resyncing(state, requests) == ()
    requests.add(["public.t"])
    assert checkpoint.chunks_to_read(SPEC, state, requests)
    assert checkpoint.resyncing(state, requests) == ("public.t",)
