"""A micro-batch's rows as one writer task receives them, decoded once for every sink.

Spark hands a writer task packed rows (core.change.pack). `batches` unpacks them as they come;
`in_order` puts them in the feed's order first where that takes the whole batch (a feed of several
nodes: core.merge). Either way the `P` rows are noted on the way, so that `progress` can tell a
whole batch from one cut short (core.change.BatchProgress.of: IncompleteBatch) before the sink
commits anything of it.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from changefeed.core import change as ch
from changefeed.core import sink_scope


@dataclass(frozen=True)
class Task:
    """Which writer task is writing: Spark's ids, passed by spark.writer (sinks do not import Spark)."""

    batch_id: int  # the micro-batch: the same when Spark replays it after a crash
    query_id: str  # the streaming query: kept in its checkpoint, the same after every restart
    partition: int  # this task's share of the batch (0 when one task writes it)
    attempt: int  # Spark's task attempt id: unique per try



class BatchInput:
    """`sink`: the name of the sink that takes the rows (spec.sinks), which keeps only the snapshot
    rows read for it where a read was for some sinks alone (core.sink_scope)."""

    def __init__(self, packed: Iterator[Any], task: Task, *, multi_node: bool = False, sink: str = "") -> None:
        self._packed, self.task, self.multi_node, self.sink = packed, task, multi_node, sink
        self._progress: list[ch.Progress] = []

    def batches(self) -> Iterator[Any]:
        """The record batches of changes in arrival order, control rows included."""
        import pyarrow.compute as pc

        for packed in self._packed:
            for rb in ch.unpack(packed):
                if self.sink:
                    rb = sink_scope.for_sink(rb, self.sink)
                ops = rb.column("op")
                if pc.any(pc.equal(ops, ch.PROGRESS)).as_py():
                    self._note(rb.filter(pc.equal(ops, ch.PROGRESS)))
                yield rb

    def in_order(self, renumber: bool = False) -> Iterator[Any]:
        """The batch in the feed's order: as it comes on a one-node feed (its rows come in commit
        order); on a feed of several nodes all read first and put in one order (core.merge: a
        distributed transaction's parts in this one batch, with one commit timestamp, `seq`
        renumbered across them with `renumber`), their `P` rows last."""
        if not self.multi_node:
            yield from self.batches()
        else:
            yield from self.merged(renumber)

    def merged(self, renumber: bool = False) -> list[Any]:
        """A multi-node batch read whole and put in one order, `P` rows last (`progress` known after)."""
        from changefeed.core import merge

        parts = merge.split(self.batches())
        merge.refuse_truncate(parts)
        merge.refuse_torn(parts)
        return [*merge.ordered(parts, renumber=renumber).to_batches(max_chunksize=65536),
                *(ch.progress_batch(p.progress) for p in parts)]

    def _note(self, rows: Any) -> None:
        self._progress += [sink_scope.progress_for(ch.Progress.from_meta(m), self.sink)
                           for m in rows.column("meta").to_pylist()]

    @property
    def progress_rows(self) -> list[ch.Progress]:
        """The `P` rows seen so far (a writer task of several sees only those of its share)."""
        return list(self._progress)

    def progress(self) -> ch.BatchProgress:
        """The batch's progress; IncompleteBatch unless every input partition's `P` row came."""
        return ch.BatchProgress.of(self._progress)


WAL_OPS = ["c", "u", "d", "t", "m"]  # rows of committed transactions (or messages), at their commit's LSN


def unsent(rb: Any, done: int) -> Any:
    """`rb` without the rows of WAL changes committed before `done`, the end LSN a one-node feed's
    sink recorded last: a batch read again from an earlier position (a replay, a followed batch's
    retried task) leaves out what the sink has. Snapshot and control rows are kept."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not done or rb.num_rows == 0:
        return rb
    sent = pc.and_(pc.is_in(rb.column("op"), value_set=pa.array(WAL_OPS)), pc.less(rb.column("lsn"), done))
    return rb.filter(pc.invert(sent)) if pc.any(sent).as_py() else rb
