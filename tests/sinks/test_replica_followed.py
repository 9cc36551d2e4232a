"""The replica's writer in low-latency mode (core.followed), fed a followed batch of a real slot
(no Spark): it commits at sub-window ends with their progress row (sub-windows that wait already
go in one transaction: group commit), the driver keeps the last end, a batch read again from its
start (cut elsewhere, or as one window) doubles nothing, and rows that no sub-window closed are
refused, with the sub-windows before them kept."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pyarrow.compute as pc
import pytest

from changefeed.core import change as ch
from changefeed.core import followed
from changefeed.core.offsets import Offset
from changefeed.errors import IncompleteBatch
from changefeed.postgres import source as src
from changefeed.postgres.decode.builder import ChangeBuilder
from changefeed.postgres.follow import FOLLOWED
from changefeed.sinks.batch_input import BatchInput, Task
from changefeed.sinks.replica import ledger, merge
from changefeed.sinks.replica.writer import ReplicaWriter
from conftest import Dbs, fingerprint, followed_batches, sub_window_ends

pytestmark = pytest.mark.timeout(300)


def _write(dbs: Dbs, batches: list[Any], batch_id: int, end_file: Path) -> Any:
    writer = ReplicaWriter({"uri": dbs.sink, "key": dbs.name, "follow_end": str(end_file)})
    result = writer.write(BatchInput(iter([ch.pack(rb) for rb in batches]), Task(batch_id, "q", 0, batch_id)))
    writer.commit([result], batch_id)
    return result


def _progress(dbs: Dbs) -> list[tuple[int, int]]:
    with dbs.dst() as d:
        return d.execute("SELECT batch_id, end_lsn - '0/0'::pg_lsn FROM changefeed.progress WHERE feed = %s "
                         "ORDER BY end_lsn", (dbs.name,)).fetchall()


def _prepare(dbs: Dbs) -> None:
    with dbs.src() as c:
        tables = src.describe_tables(c, ["public.t"])
    with dbs.dst() as d:
        ledger.ensure_meta(d)
        merge.ensure_tables(d, tables)


def test_each_sub_window_commits_and_a_batch_read_again_doubles_nothing(dbs: Dbs, tmp_path: Path) -> None:
    end_file = tmp_path / followed.END_FILE
    batches, start = followed_batches(dbs, every=0.0)
    ends = sub_window_ends(batches)
    assert len(ends) > 5
    _prepare(dbs)
    half = next(i for i in range(len(batches)) if sub_window_ends(batches[:i + 1]) == ends[:len(ends) // 2])
    first = _write(dbs, batches[:half + 1], 7, end_file)  # a task that ended halfway (cut short by a kill)
    recorded = [e for _, e in _progress(dbs)]
    assert first.applied and set(recorded) <= set(ends) and recorded[-1] == ends[len(ends) // 2 - 1]
    assert followed.recorded_end(end_file).lsn == ends[len(ends) // 2 - 1]  # type: ignore[union-attr]
    # the batch read again from its start as one window, cut elsewhere: what the replica has is skipped
    with dbs.src() as c, psycopg.connect(dbs.source) as r:
        whole = ChangeBuilder(start, ends[-1], 0, FOLLOWED, lambda rel: src.column_catalog(c, rel),
                              offset=Offset({"n1": ends[-1]}, 0).to_json())
        one = list(whole.batches(src.peek(r, "s", "p", ends[-1])))
    again = _write(dbs, one, 7, end_file)
    assert again.applied and [e for _, e in _progress(dbs)] == [*recorded, ends[-1]]
    assert fingerprint(dbs.source, "t") == fingerprint(dbs.sink, "t")  # (an update applied twice would show)
    assert followed.recorded_end(end_file).lsn == ends[-1]  # type: ignore[union-attr]
    replay = _write(dbs, batches, 8, end_file)  # and the sub-windows once more: all recorded before
    assert not replay.applied and len(_progress(dbs)) == len(recorded) + 1
    assert fingerprint(dbs.source, "t") == fingerprint(dbs.sink, "t")


def test_rows_no_sub_window_closed_are_refused_and_the_ones_before_kept(dbs: Dbs, tmp_path: Path) -> None:
    batches, _ = followed_batches(dbs, every=0.0, seconds=2.0)
    ends = sub_window_ends(batches)
    _prepare(dbs)
    last_p = max(i for i, rb in enumerate(batches) if sub_window_ends([rb]))
    tail = batches[:last_p] + [batches[last_p].filter(pc.not_equal(batches[last_p].column("op"), ch.PROGRESS))]
    assert tail[-1].num_rows and len(ends) > 1  # the last sub-window's rows, without its P row
    with pytest.raises(IncompleteBatch):
        _write(dbs, tail, 3, tmp_path / followed.END_FILE)
    recorded = [e for _, e in _progress(dbs)]  # up to the sub-window before the cut-short one
    assert set(recorded) <= set(ends[:-1]) and recorded[-1] == ends[-2]
