"""What the message sinks' batch writers (webhook, Kafka) share.

The batch's one writer task delivers it and returns `Delivered`; the driver's `commit` then
appends the batch to the feed's ledger file (sinks.ledger.FileLedger) for status and metrics,
and only after that does Spark record the batch as done and the source release its WAL.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from changefeed.core import change as ch
from changefeed.core import followed
from changefeed.core.envelope import Formatter, formatter
from changefeed.core.offsets import Offset
from changefeed.sinks.base import ledger_path
from changefeed.sinks.ledger import FileLedger

if TYPE_CHECKING:
    from changefeed.spec.definition import FeedSpec
    from changefeed.spec.state import FeedState


@dataclass(frozen=True)
class Delivered:
    progress: ch.BatchProgress | None  # None: a followed batch that delivered nothing new
    began: float
    done: float


def message_options(spec: "FeedSpec", state: "FeedState") -> dict[str, str]:
    """The options every message sink's writer takes: format, diff, database (for Debezium's
    source.db), ledger (path), outbox (core.outbox.OutboxSpec as JSON, or "")."""
    from psycopg.conninfo import conninfo_to_dict

    outbox = spec.outbox_spec
    return {"format": spec.format, "diff": str(spec.diff).lower(),
            "database": str(conninfo_to_dict(spec.sources[0].uri).get("dbname") or ""),
            "ledger": ledger_path(spec, state), "outbox": json.dumps(outbox.to_json()) if outbox else ""}


class MessageWriter:
    """The options of `message_options`, and uri, feed."""

    def __init__(self, options: dict[str, str]) -> None:
        self.options = options

    def formatter(self) -> Formatter:
        o = self.options
        return formatter(o["format"], o["feed"], o["diff"] == "true", o.get("database", ""))

    def ledger(self) -> FileLedger:
        """Where the driver records a delivered batch."""
        return FileLedger(self.options["ledger"])

    def commit(self, results: list[Delivered], batch_id: int) -> None:
        """The batch was delivered: record it in the ledger (while the runner's lease term holds).
        In low-latency mode, keep where it ended, for the next batch to start there (core.followed)."""
        epoch = int(self.options["epoch"]) if self.options.get("epoch") else None
        follow_end = self.options.get("follow_end")
        for m in results:  # one writer task: one result
            if m.progress is None:
                continue
            self.ledger().record(batch_id, m.progress, m.began, m.done, epoch)
            if follow_end and m.progress.offset:
                followed.note_end(Path(follow_end), Offset.from_json(m.progress.offset))

    def abort(self, results: list[Any], batch_id: int) -> None:
        """Nothing to undo here; see the sink's own notes on what a replay does."""
