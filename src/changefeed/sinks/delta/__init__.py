"""The Delta Lake sink: a Delta table per captured table, as a change log, a mirror or a history.

`options` parses the URI, `columns` types the values, `rows` builds a change log's rows, `mirror`
and `history` a bucket's rows after a batch, `split` cuts a batch for the parallel writer tasks,
`table` writes files and commits them, `ledger` keeps the feed's progress in the lake, `writer`
is the batch writer, `duck` reads the lake with DuckDB.
"""
from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

from changefeed.errors import ConfigError
from changefeed.sinks.base import BatchWriter, Sink, task_slots

if TYPE_CHECKING:
    from changefeed.sinks.ledger import Ledger
    from changefeed.spec.definition import FeedSpec
    from changefeed.spec.state import FeedState


class DeltaSink(Sink):
    name = "delta"
    parallel_reads = True  # each task orders its rows itself (by commit position)

    def validate(self, uri: str) -> None:
        from changefeed.sinks.delta.options import DeltaOptions

        opts = DeltaOptions.parse(uri)
        if not opts.local:
            raise ConfigError(f"the Delta sink writes to local or mounted folders only so far, got {opts.root}",
                              "mount the store (e.g. s3fs) and use delta:///MOUNTED/PATH")

    def resumable(self, uri: str) -> bool:
        return True  # the ledger row holds the batch's end offset; the stamp fences earlier terms

    def check_feed(self, spec: "FeedSpec") -> None:
        if spec.multi_node:
            raise ConfigError("a feed of several source nodes cannot write to the Delta sink yet",
                              "use a replica, Kafka or webhook sink for it")

    def needs_key(self, uri: str) -> bool:
        from changefeed.sinks.delta.options import DeltaOptions

        return DeltaOptions.parse(uri).mode != "changelog"  # a mirror and a history place rows by key

    def open_ledger(self, spec: "FeedSpec", state: "FeedState") -> "Ledger":
        from changefeed.sinks.delta.ledger import DeltaLedger
        from changefeed.sinks.delta.options import DeltaOptions

        return DeltaLedger(DeltaOptions.parse(spec.sink), spec.key)

    def writer_options(self, spec: "FeedSpec", state: "FeedState") -> dict[str, str]:
        """The feed's application transaction, and the furthest position a table of the feed holds
        (a batch replayed, or planned anew from the ledger, may reach back before it)."""
        from changefeed.postgres.source import split_table
        from changefeed.sinks.delta.ledger import DeltaLedger
        from changefeed.sinks.delta.options import DeltaOptions
        from changefeed.sinks.delta.table import applied_upto, open_table

        opts = DeltaOptions.parse(spec.sink)
        app = DeltaLedger(opts, spec.key).app()
        floor = max((applied_upto(open_table(opts.table_uri(*split_table(t)), opts.storage), app)
                     for t in spec.tables), default=0)
        return {"app": app, "floor": str(floor)}

    def writer(self, options: dict[str, str]) -> BatchWriter:
        from changefeed.sinks.delta.writer import DeltaWriter

        return DeltaWriter(options)

    def plan(self, changes: Any, spec: "FeedSpec", parallel_reads: bool) -> Any:
        """Each input partition is split by table and bucket (delta.split), then shuffled to the
        writer tasks by that key: a bucket's changes all reach one task, tasks write at once."""
        from changefeed.sinks.delta.options import DeltaOptions
        from changefeed.sinks.delta.split import SPLIT_DDL, split

        opts = DeltaOptions.parse(spec.sink)
        tasks = opts.tasks or task_slots(changes.sparkSession)
        return (changes.mapInArrow(partial(split, mode=opts.mode, buckets=opts.buckets), SPLIT_DDL)
                .repartition(tasks, "part"))

    def beside(self, packed: Iterator[Any], options: dict[str, str]) -> Iterator[Any]:
        """Split as `plan` does, all in this one task (the buckets of a table then written one
        after the other)."""
        from changefeed.sinks.delta.options import DeltaOptions
        from changefeed.sinks.delta.split import split

        opts = DeltaOptions.parse(options["uri"])
        return split(packed, mode=opts.mode, buckets=opts.buckets)


SINK = DeltaSink()
