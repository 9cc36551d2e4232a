"""How the runner waits on a `--snapshot only` query: it looks every SNAPSHOT_DONE_POLL_S whether
the snapshot is done (the run ends then, rather than at the next report), and never hands Spark a
wait under a millisecond, which Spark refuses ("Timeout has to be positive")."""
from __future__ import annotations

import time
from typing import Any

from changefeed.control.runner import SNAPSHOT_DONE_POLL_S, _await
from changefeed.core.lsn import Lsn
from changefeed.core.offsets import Offset
from changefeed.core.snapshot import Cursor
from changefeed.spec.definition import DEFAULT_NODE


class Query:
    """A query's waiting side as the runner uses it: its snapshot done after `done_after` waits,
    ended after `ends_after` (None: never). Refuses a wait Spark would refuse."""

    def __init__(self, done_after: int | None, ends_after: int | None = None) -> None:
        self.done_after, self.ends_after = done_after, ends_after
        self.waits: list[float] = []

    def awaitTermination(self, timeout: float) -> bool:
        if int(timeout * 1000) <= 0:
            raise ValueError("Timeout has to be positive")
        self.waits.append(timeout)
        time.sleep(timeout)
        return self.ends_after is not None and len(self.waits) >= self.ends_after

    @property
    def lastProgress(self) -> dict[str, Any]:
        done = self.done_after is not None and len(self.waits) >= self.done_after
        cursor = Cursor() if done else Cursor(pending=("public.t",))
        return {"sources": [{"endOffset": Offset({DEFAULT_NODE: Lsn(100)}, cursor=cursor).to_json()}]}


def test_a_snapshot_done_ends_the_wait_at_the_next_look() -> None:
    q = Query(done_after=3)
    t0 = time.monotonic()
    _await(q, 5.0, snapshot_only=True)
    assert len(q.waits) == 3
    assert time.monotonic() - t0 < 1.0
    assert all(w <= SNAPSHOT_DONE_POLL_S for w in q.waits)


def test_a_snapshot_not_done_waits_the_whole_time_in_steps_spark_takes() -> None:
    q = Query(done_after=None)
    t0 = time.monotonic()
    _await(q, 0.35, snapshot_only=True)
    assert 0.33 <= time.monotonic() - t0 < 1.0
    assert len(q.waits) >= 4 and all(0.001 <= w <= SNAPSHOT_DONE_POLL_S for w in q.waits)


def test_a_query_that_ends_ends_the_wait() -> None:
    q = Query(done_after=None, ends_after=2)
    _await(q, 5.0, snapshot_only=True)
    assert len(q.waits) == 2


def test_without_snapshot_only_one_wait_of_the_whole_time() -> None:
    q = Query(done_after=0)
    _await(q, 0.2, snapshot_only=False)
    assert q.waits == [0.2]
