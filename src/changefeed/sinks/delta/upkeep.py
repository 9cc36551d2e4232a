"""`changefeed compact`: a Delta feed's tables kept fast to read.

Every batch adds files (a change log a few per table; a mirror or history rewrites each touched
bucket), and every commit a log entry. `compact` merges each table's small files into files of
about `target_size` (Delta's OPTIMIZE: a commit that replaces files, changing no row), writes a
Delta checkpoint so readers need not replay the whole log, and with `vacuum` deletes files no
version within the retention references: those replaced by compaction or rewrites, and those of
batches that never committed (a crash between writing and committing leaves them unreferenced).

It may run while the feed runs: a mirror or history batch that meets a compaction in between
writes again (TransientError), a change log's append commits alongside it. Vacuum's retention
must exceed the longest batch (it must not delete the files a batch is about to commit), so
less than MIN_RETAIN_H is refused.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from changefeed.errors import ConfigError
from changefeed.sinks.delta.ledger import DeltaLedger
from changefeed.sinks.delta.options import DeltaOptions
from changefeed.sinks.delta.table import open_table

MIN_RETAIN_H = 1.0
DEFAULT_TARGET_SIZE = 128 * 1024 * 1024


@dataclass(frozen=True)
class Compacted:
    table: str
    files_removed: int
    files_added: int
    vacuumed: int  # files deleted


def compact(opts: DeltaOptions, feed: str, tables: list[tuple[str, str]], *, target_size: int = DEFAULT_TARGET_SIZE,
            vacuum_retain_h: float | None = None, report: Callable[[str], None] = print) -> list[Compacted]:
    """Compact the tables of `tables` ((schema, table) pairs) and the feed's ledger table."""
    if vacuum_retain_h is not None and vacuum_retain_h < MIN_RETAIN_H:
        raise ConfigError(f"--vacuum keeps files for at least {MIN_RETAIN_H:g}h, got {vacuum_retain_h:g}h",
                          "a shorter retention could delete the files of a batch about to commit")
    uris = [(f"{s}.{t}", opts.table_uri(s, t)) for s, t in tables] + [("(ledger)", DeltaLedger(opts, feed).uri)]
    done = []
    for name, uri in uris:
        table = open_table(uri, opts.storage)
        if table is None:
            report(f"{name}: no Delta table yet")
            continue
        metrics: dict[str, Any] = table.optimize.compact(target_size=target_size)
        table.create_checkpoint()
        vacuumed = []
        if vacuum_retain_h is not None:
            vacuumed = table.vacuum(retention_hours=int(vacuum_retain_h), dry_run=False,
                                    enforce_retention_duration=False, full=True)
        c = Compacted(name, int(metrics.get("numFilesRemoved", 0)), int(metrics.get("numFilesAdded", 0)),
                      len(vacuumed))
        report(f"{name}: {c.files_removed} files merged into {c.files_added}, checkpoint at version "
               f"{table.version()}" + (f", {c.vacuumed} unreferenced files deleted" if vacuum_retain_h else ""))
        done.append(c)
    return done
