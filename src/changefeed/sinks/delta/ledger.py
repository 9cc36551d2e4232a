"""The Delta sink's ledger: a small Delta table per feed, `ROOT/_changefeed/FEED`.

The driver appends one row per batch, after the batch's tables committed, in a Delta transaction
with the same application transaction as theirs (so a replayed batch adds no second row). Its
`entry` is the line sinks.ledger.FileLedger keeps, read back the same way: status, the metrics and
the runner's checkpoint come from the lake itself, not from the machine that wrote it.
"""
from __future__ import annotations

import json
import shutil
from typing import Any

import pyarrow as pa

from changefeed.core.change import BatchProgress
from changefeed.errors import ConfigError
from changefeed.sinks.delta.options import DeltaOptions
from changefeed.sinks.delta.table import committed, open_table
from changefeed.sinks.ledger import FileLedger, _Entry

COMPACT_EVERY = 100  # ledger versions between compactions (one file per batch otherwise)


class DeltaLedger(FileLedger):
    def __init__(self, opts: DeltaOptions, feed: str) -> None:
        super().__init__(opts.ledger_uri(feed))
        self.opts, self.uri = opts, opts.ledger_uri(feed)
        self._cache: tuple[int, list[_Entry]] | None = None

    def check(self) -> None:
        if self.opts.local:
            root = self.opts.root
            try:
                import os

                os.makedirs(root, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"cannot create the Delta sink's folder {root}: {e.strerror}",
                                  "give the feed's user write access there, or choose another folder") from None

    def prepare(self, tables: list[Any]) -> None:
        """Create the tables of `tables` (postgres.source.SourceTable) that are missing, empty."""
        from changefeed.sinks.delta.shapes import create_tables

        self.check()
        create_tables(self.opts, tables)

    def record_batch(self, app_id: str, batch_id: int, progress: BatchProgress, began: float, done: float) -> None:
        """Append the batch's row unless this application transaction already has it."""
        from deltalake import CommitProperties, Transaction, write_deltalake

        table = open_table(self.uri, self.opts.storage)
        if committed(table, app_id, batch_id):
            return
        line = json.dumps({"batch": batch_id, "progress": progress.__dict__, "began": began, "done": done})
        write_deltalake(self.uri, pa.table({"batch": pa.array([batch_id], pa.int64()), "entry": [line]}),
                        mode="append", storage_options=self.opts.storage or None,
                        commit_properties=CommitProperties(app_transactions=[Transaction(app_id, batch_id)]))
        table = open_table(self.uri, self.opts.storage)
        if table is not None and table.version() % COMPACT_EVERY == 0:
            table.optimize.compact()
            table.create_checkpoint()

    def _entries(self) -> list[_Entry]:
        table = open_table(self.uri, self.opts.storage)
        if table is None:
            return []
        version = table.version()
        if self._cache is None or self._cache[0] != version:
            lines = pa.table(table.to_pyarrow_table(columns=["entry"])).column("entry").to_pylist()
            self._cache = version, self._parse(lines)
        return self._cache[1]

    def forget(self) -> bool:
        """Drop the ledger table (the data tables stay)."""
        if open_table(self.uri, self.opts.storage) is None:
            return False
        if not self.opts.local:
            raise ConfigError(f"remove cannot delete the ledger table {self.uri} on an object store",
                              "delete that folder with the store's own tools")
        shutil.rmtree(self.uri)
        self._cache = None
        return True
