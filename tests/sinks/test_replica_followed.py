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
from changefeed.core.lsn import format_lsn
from changefeed.core.offsets import Offset
from changefeed.errors import IncompleteBatch
from changefeed.postgres import source as src
from changefeed.postgres.connect import connect
from changefeed.postgres.decode.builder import ChangeBuilder
from changefeed.postgres.follow import FOLLOWED
from changefeed.sinks.batch_input import BatchInput, Task
from changefeed.sinks.replica import ledger, merge
from changefeed.sinks.replica.ledger import ReplicaLedger
from changefeed.sinks.replica.writer import ReplicaWriter
from support.servers import Dbs, fingerprint
from support.windows import followed_batches, sub_window_ends

pytestmark = pytest.mark.timeout(300)


def _write(dbs: Dbs, batches: list[Any], batch_id: int, end_file: Path) -> Any:
    writer = ReplicaWriter({"uri": dbs.sink, "key": dbs.name, "follow_end": str(end_file)})
    result = writer.write(BatchInput(iter([ch.pack(rb) for rb in batches]), Task(batch_id, "q", 0, batch_id)))
    writer.commit([result], batch_id)
    return result


def _sub_windows(batches: list[Any]) -> list[list[Any]]:
    """The record batches split after each `P` row."""
    out: list[list[Any]] = [[]]
    for rb in batches:
        ps = [i for i, op in enumerate(rb.column("op").to_pylist()) if op == ch.PROGRESS]
        start = 0
        for i in ps:
            out[-1].append(rb.slice(start, i + 1 - start))
            out.append([])
            start = i + 1
        if start < rb.num_rows:
            out[-1].append(rb.slice(start))
    return [part for part in out if part]


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


def test_old_sub_windows_progress_rows_fold_and_every_reader_answers_as_before(dbs: Dbs, tmp_path: Path) -> None:
    """Low-latency mode writes a progress row per sub-window: those applied more than a while ago
    are folded into the feed's totals, each followed batch's last row kept, and the ledger's
    readers (totals, last batch, resume offset, how far applied) answer the same; a replay still
    adds nothing; a recent row, and a batch that did not follow the slot, are never folded."""
    batches, _ = followed_batches(dbs, every=0.0)
    ends = sub_window_ends(batches)
    _prepare(dbs)
    for part in _sub_windows(batches):  # a transaction each (not grouped, as a writer behind would)
        _write(dbs, part, 7, tmp_path / followed.END_FILE)
    with dbs.dst() as d:  # two followed batches: the sub-windows after the middle one are batch 8's
        d.execute("UPDATE changefeed.progress SET batch_id = 8, end_offset = jsonb_set(end_offset, '{follow}', '2') "
                  "WHERE feed = %s AND end_lsn > %s::pg_lsn", (dbs.name, format_lsn(ends[len(ends) // 2])))
        d.execute("INSERT INTO changefeed.progress (feed, batch_id, end_lsn, resolved_ts, changes, end_offset) "
                  "VALUES (%s, 6, '0/10', 1, 5, '{\"lsn\": 16, \"ts\": 1}')", (dbs.name,))  # not followed
    book = ReplicaLedger(connect(dbs.sink, "sink", autocommit=True), dbs.name)

    def answers() -> tuple[Any, ...]:
        with dbs.dst() as d:
            return (book.totals(), book.last_batch(), book.resume_offset(), book.last_resolved_ts(),
                    book.checkpoint(), ledger.applied_upto(d, dbs.name))

    before = answers()
    with dbs.dst() as d:
        assert ledger.fold_sub_windows(d, dbs.name, keep_s=3600) == 0  # all recent
        gone = ledger.fold_sub_windows(d, dbs.name, keep_s=0)
        left = d.execute("SELECT batch_id, end_lsn - '0/0'::pg_lsn FROM changefeed.progress WHERE feed = %s "
                         "ORDER BY end_lsn", (dbs.name,)).fetchall()
    assert gone == len(ends) - 2 and left == [(6, 16), (7, ends[len(ends) // 2]), (8, ends[-1])]
    assert answers() == before
    assert not _write(dbs, batches, 9, tmp_path / followed.END_FILE).applied  # all recorded before
    with dbs.dst() as d:
        assert ledger.fold_sub_windows(d, dbs.name, keep_s=0) == 0
    assert answers() == before
    book.forget()
    with dbs.dst() as d:
        assert d.execute("SELECT count(*) FROM changefeed.folded WHERE feed = %s", (dbs.name,)).fetchone() == (0,)
