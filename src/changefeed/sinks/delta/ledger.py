"""The Delta sink's ledger: a small Delta table per feed, `ROOT/_changefeed/FEED`.

The driver appends one row per batch, after the batch's tables committed, in a Delta transaction
with the same stamp as theirs (delta.table.Stamp: a replayed batch adds no second row, a runner
whose lease was taken over adds none). Its `entry` is the line sinks.ledger.FileLedger keeps, read
back the same way: status, the metrics and the runner's checkpoint come from the lake itself, not
from the machine that wrote it, and so does the end offset of the last batch, from which a runner
without the feed's Spark checkpoint (a standby taking over) carries on.

The table's own id (Delta metadata, made when the feed is created) names the feed's application
transaction: a feed created anew under an old name, whose ledger was dropped, never finds the
batches of the one before it in the data tables.
"""
from __future__ import annotations

import shutil
from typing import Any

import pyarrow as pa

from changefeed.core.change import BatchProgress
from changefeed.errors import ConfigError
from changefeed.sinks.delta.options import DeltaOptions
from changefeed.sinks.delta.table import Stamp, checked, claim, open_table
from changefeed.sinks.ledger import FileLedger, _Entry

COMPACT_EVERY = 100  # ledger versions between compactions (one file per batch otherwise)
SCHEMA = pa.schema([("batch", pa.int64()), ("entry", pa.string())])


class DeltaLedger(FileLedger):
    def __init__(self, opts: DeltaOptions, feed: str) -> None:
        super().__init__(opts.ledger_uri(feed))
        self.opts, self.uri, self.feed = opts, opts.ledger_uri(feed), feed
        self._tables: list[str] = []  # the data tables' folders (prepare)
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
        """Create the ledger table and those of `tables` (postgres.source.SourceTable) that are
        missing, empty."""
        from changefeed.sinks.delta.shapes import create_tables

        self.check()
        self.app()
        create_tables(self.opts, tables)
        self._tables = [self.opts.table_uri(t.schema, t.name) for t in tables]

    def app(self) -> str:
        """The feed's application transaction (the ledger table made if missing)."""
        from deltalake import DeltaTable

        table = open_table(self.uri, self.opts.storage) or DeltaTable.create(
            self.uri, SCHEMA, mode="ignore", storage_options=self.opts.storage or None)
        return f"changefeed-{self.feed}-{table.metadata().id}"

    def resume_offset(self) -> dict[str, Any] | None:
        entries = self._entries()
        return entries[-1].progress.offset if entries else None

    def fence(self, epoch: int, holder: str) -> bool:
        """Claim the ledger and every table of the feed (those `prepare` made) for lease term `epoch`."""
        stamp = Stamp(self.feed, self.app(), 0, epoch)
        for uri in [self.uri, *self._tables]:
            claim(uri, stamp, {"changefeed.feed": self.feed, "changefeed.claim": holder}, self.opts.storage)
        return True

    def record_batch(self, stamp: Stamp, batch_id: int, progress: BatchProgress, began: float, done: float) -> None:
        """Append the batch's row unless the ledger has it (or a later one)."""
        from deltalake.transaction import AddAction

        from changefeed.sinks.delta.table import write_file

        line = _Entry(batch_id, progress, began, done).line()
        rows = pa.table({"batch": pa.array([batch_id], pa.int64()), "entry": pa.array([line], pa.string())})

        def once() -> None:
            table = open_table(self.uri, self.opts.storage)
            if stamp.done(table):
                return
            stamp.check(table)
            a = write_file(self.uri, rows, batch_id, None)
            add = AddAction(a["path"], a["size"], {}, a["modification_time"], True, f'{{"numRecords":{a["rows"]}}}')
            table.create_write_transaction([add], "append", table.schema(), commit_properties=stamp.properties({}))

        checked(self.uri, once)
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
