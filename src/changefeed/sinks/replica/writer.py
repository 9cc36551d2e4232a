"""The replica's batch writer: the batch's one writer task applies it atomically.

The query has one writer task per micro-batch, so the task itself can apply the whole batch in
one target transaction and commit it: the progress row in that transaction makes a retried task
or a replayed batch a no-op, and the source advances its slot only after Spark has seen the task
succeed. Applying while reading needs the task to keep taking input while the database merges:
a thread applies chunks from a short queue (sinks.handoff).

A feed in low-latency mode (`follow_end`, core.followed) commits each time the rows taken in
make a whole batch: a followed batch's task commits a transaction per sub-window, each with its
progress row, and the driver keeps the last one's end as where the next batch starts.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from changefeed.core import change as ch
from changefeed.core import followed
from changefeed.core.offsets import Offset
from changefeed.postgres.connect import connect, lost_connection
from changefeed.sinks import handoff
from changefeed.sinks.batch_input import BatchInput
from changefeed.sinks.replica import apply as replica

FOLD_S = 0.05  # low-latency mode: the longest a transaction takes in sub-windows that wait (group commit)


class ReplicaWriter:
    """Options: uri, feed, multi_node, resync (tables that follow any schema change, see
    core.schema_change), renamed (JSON [[old, new], ...]: tables renamed on the source), epoch
    (the runner's lease term: a batch is refused once a later term claimed the replica),
    follow_end (low-latency mode: the driver's end file, core.followed)."""

    def __init__(self, options: dict[str, str]) -> None:
        self.uri = options["uri"]
        self.feed = options["key"]
        self.resync = frozenset(t for t in (options.get("resync") or "").split(",") if t)
        self.renamed = dict(json.loads(options.get("renamed") or "[]"))
        self.row_filters: dict[str, str] = json.loads(options.get("row_filters") or "{}")
        self.epoch = int(options["epoch"]) if options.get("epoch") else None
        self.follow_end = Path(options["follow_end"]) if options.get("follow_end") else None

    def _applier(self, conn: Any, batch: BatchInput, in_stream_order: bool = False) -> replica.BatchApplier:
        applier = replica.BatchApplier(conn, self.feed, batch.task.batch_id, in_stream_order=in_stream_order,
                                       resync=self.resync, renamed=self.renamed, epoch=self.epoch,
                                       row_filters=self.row_filters)
        applier.begin()
        return applier

    def write(self, batch: BatchInput) -> replica.Applied:
        return self._write_merged(batch) if batch.multi_node else self._write_streaming(batch)

    def commit(self, results: list[Any], batch_id: int) -> None:
        """Nothing left to do: the writer task committed the batch on the replica. In low-latency
        mode, keep where it ended, for the next batch to start there."""
        ends = [Offset.from_json(r.offset) for r in results if r.offset]
        if self.follow_end is not None and ends:
            followed.note_end(self.follow_end, max(ends, key=lambda e: e.order))

    def abort(self, results: list[Any], batch_id: int) -> None:
        """Nothing to undo: a failed task rolled back; a committed one is skipped when replayed."""

    def _write_merged(self, batch: BatchInput) -> replica.Applied:
        """A batch of several nodes: read all its partitions, put their rows in one order (see
        core.merge), then apply them. The batch is held in memory meanwhile: at most about
        --max-bytes-per-batch of WAL per node, decoded."""
        rows = batch.merged(renumber=True)
        progress = batch.progress()
        with connect(self.uri, "sink", autocommit=True) as conn, lost_connection("sink"):
            applier = self._applier(conn, batch, in_stream_order=True)
            try:
                if applier.covers(progress):  # a batch applied before adds nothing but its progress
                    rows = [ch.progress_batch(p) for p in batch.progress_rows]
                for rb in rows:
                    applier.add(rb)
            except BaseException:
                applier.rollback()
                raise
            return applier.commit()

    def _write_streaming(self, batch: BatchInput) -> replica.Applied:
        """A one-node batch: applied while it is read (its rows come in commit order); in
        low-latency mode committed at each whole batch or sub-window it holds."""
        committed: list[replica.Applied] = []
        open_: list[replica.BatchApplier] = []  # the applier of what is not committed yet (none or one)

        def apply(chunks: handoff.Handoff) -> None:
            began = 0.0  # when the open transaction began (monotonic)
            for rb in chunks:
                if not open_:
                    open_.append(self._applier(conn, batch))
                    began = time.monotonic()
                open_[0].add(rb)
                if self.follow_end is not None and handoff.ends_with_progress(rb) and open_[0].whole():
                    # Group commit: a whole sub-window waiting already goes in the same
                    # transaction, for up to FOLD_S (never rows no `P` row closed yet).
                    if time.monotonic() - began < FOLD_S and chunks.progress_waits():
                        continue
                    committed.append(open_.pop().commit())

        with connect(self.uri, "sink", autocommit=True) as conn, lost_connection("sink"):
            if self.follow_end is None:
                open_.append(self._applier(conn, batch))  # (a batch's one transaction, begun before its rows)
            try:
                handoff.run(batch.batches(), apply)
            except BaseException:
                for applier in open_:
                    applier.rollback()
                raise
            if open_:  # (in low-latency mode, rows no whole sub-window closed: IncompleteBatch)
                committed.append(open_[0].commit())
            return replica.Applied.of(batch.task.batch_id, committed)
