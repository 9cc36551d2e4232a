"""The PostgreSQL replica sink: tables kept equal to the source's, one transaction per batch.

`apply` merges a batch into the replica and keeps the ledger in its `changefeed.*` tables, `shape`
follows the source's schema changes, `writer` is the batch writer.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from changefeed.sinks.base import BatchWriter, Recorded, Sink

if TYPE_CHECKING:
    from changefeed.sinks.ledger import Ledger
    from changefeed.spec.definition import FeedSpec
    from changefeed.spec.state import FeedState


class ReplicaSink(Sink):
    name = "replica"
    parallel_reads = True
    snapshot_budget = 4  # a chunk streams into one COPY in pieces (replica.insert_run); see bench/README.md

    def resumable(self, uri: str) -> bool:
        return True  # its ledger commits with each batch, and it has a fence

    def needs_key(self, uri: str) -> bool:
        return True  # an update or delete is applied to the row of its key

    def open_ledger(self, spec: "FeedSpec", state: "FeedState") -> "Ledger":
        from changefeed.postgres.connect import connect
        from changefeed.sinks.replica.ledger import ReplicaLedger

        return ReplicaLedger(connect(spec.sink, "sink"), spec.key)

    def writer_options(self, spec: "FeedSpec", state: "FeedState") -> dict[str, str]:
        return {"renamed": json.dumps(spec.renamed), "row_filters": json.dumps(spec.row_filters)}

    def writer(self, options: dict[str, str]) -> BatchWriter:
        from changefeed.sinks.replica.writer import ReplicaWriter

        return ReplicaWriter(options)

    def recorded(self, options: dict[str, str]) -> "Recorded":
        from changefeed.sinks.replica.ledger import AppliedUpto

        return AppliedUpto(options["uri"], options["key"])


SINK = ReplicaSink()
