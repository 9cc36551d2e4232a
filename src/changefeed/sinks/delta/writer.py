"""The Delta sink's batch writer: tasks write data files in parallel, the driver commits them.

Each writer task takes the groups the split stage (delta.split) sent it: a table's rows of one
bucket, its `R` row first (carrying the bucket in `seq`). In `changelog` mode it appends them as
new files; in `mirror` mode it reads the bucket's current files, applies the changes (delta.rows)
and writes the bucket anew, replacing them. It returns what it wrote and the `P` rows it saw.
The driver (`commit`) checks the batch is whole (every input partition's `P` row), then commits
each table once (delta.table.commit), then the ledger row (delta.ledger). Nothing of a batch
that fails before is visible; a replay skips every table the batch reached before, and rows
before the position a table holds (a batch planned anew by a runner that took the feed over
from the ledger may reach back before it) are left out by the tasks, as a replica does.
"""
from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from changefeed import faults
from changefeed.core import change as ch
from changefeed.core.lsn import format_lsn
from changefeed.sinks.batch_input import BatchInput
from changefeed.sinks.delta import rows as delta_rows
from changefeed.sinks.delta.history import apply_history
from changefeed.sinks.delta.ledger import DeltaLedger
from changefeed.sinks.delta.mirror import apply_mirror
from changefeed.sinks.delta.options import DeltaOptions
from changefeed.sinks.delta.shapes import follow
from changefeed.sinks.delta.table import Files, Stamp, applied_upto, bucket_rows, commit, open_table, write_file


@dataclass
class Wrote:
    """One writer task's result."""

    task: dict[str, Any]  # who wrote, and when: {"partition", "attempt", "pid", "began", "ended"} (Unix s)
    files: list[Files] = field(default_factory=list)
    progress: list[ch.Progress] = field(default_factory=list)


class DeltaWriter:
    """Options: uri, feed, app (the feed's application transaction, delta.ledger), floor (no table
    of the feed held a position past it when the query started: rows from there on are new to
    all), epoch (the runner's lease term)."""

    def __init__(self, options: dict[str, str]) -> None:
        self.feed = options["key"]
        self.opts = DeltaOptions.parse(options["uri"])
        self.resync = frozenset(t for t in (options.get("resync") or "").split(",") if t)
        self.app, self.floor = options["app"], int(options.get("floor") or 0)
        self.epoch = int(options["epoch"]) if options.get("epoch") else None

    def write(self, batch: BatchInput) -> Wrote:
        began = time.time()
        groups: dict[tuple[str, str], dict[int, list[Any]]] = defaultdict(lambda: defaultdict(list))
        shapes: dict[tuple[str, str], set[tuple[tuple[int, int], ch.TableShape]]] = defaultdict(set)
        for rb in batch.batches():
            if not len(rb) or rb.column("op")[0].as_py() != ch.RELATION:
                continue  # the P rows: BatchInput noted them
            r = rb.slice(0, 1).to_pylist()[0]
            shape = ch.TableShape.from_meta(r["schema"], r["table"], r["meta"])
            groups[(shape.schema, shape.table)][int(r["xid"])].append((shape, rb.slice(1)))
            shapes[(shape.schema, shape.table)].add(((r["lsn"], r["seq"]), shape))
        out = Wrote({"partition": batch.task.partition, "attempt": batch.task.attempt, "pid": os.getpid(),
                     "began": began}, progress=batch.progress_rows)
        for (schema, table), buckets in sorted(groups.items()):
            uri = self.opts.table_uri(schema, table)
            existing = open_table(uri, self.opts.storage) if self.opts.mode != "changelog" or \
                self._reaches_back(buckets) else None
            buckets = _after(buckets, applied_upto(existing, self.app))
            if not buckets:
                continue  # all there already: the driver finds the batch in the table and skips it
            if self.opts.mode == "changelog":
                files = self._changelog(uri, buckets, batch.task.batch_id)
            else:
                files = self._rewrite(uri, existing, buckets, batch.task.batch_id)
            files.shapes = sorted(shapes[(schema, table)], key=lambda p: p[0])
            out.files.append(files)
        out.task["ended"] = time.time()
        faults.reach("delta_files_written")
        return out

    def _reaches_back(self, buckets: dict[int, list[Any]]) -> bool:
        """Whether a row is from before `floor` (so the table may hold it already)."""
        return any(_first(rows) < self.floor for parts in buckets.values() for _, rows in parts)

    def _changelog(self, uri: str, buckets: dict[int, list[Any]], batch_id: int) -> Files:
        parts = [p for b in sorted(buckets) for p in buckets[b]]
        rows = delta_rows.changelog(parts, batch_id, self.opts.diff)
        files = Files(uri, rows.schema, partitioned=False)
        for start in range(0, len(rows), self.opts.target_file_rows):
            files.adds.append(write_file(uri, rows.slice(start, self.opts.target_file_rows), batch_id, None))
        return files

    def _rewrite(self, uri: str, existing: Any, buckets: dict[int, list[Any]], batch_id: int) -> Files:
        """Mirror and history mode: each bucket the batch touches read, changed and written anew."""
        apply = apply_mirror if self.opts.mode == "mirror" else apply_history
        fills = {c: v for parts in buckets.values() for shape, _ in parts for c, v in delta_rows.fills(shape).items()}
        files = Files(uri, pa.schema([]), partitioned=True, fills=fills,
                      read_version=existing.version() if existing is not None else None)
        for bucket, parts in sorted(buckets.items()):
            before, replaced = bucket_rows(existing, bucket, fills) if existing is not None else (None, [])
            shape = parts[-1][0]
            out = apply(before, parts, shape)
            files.removes += replaced
            files.key = shape.key if self.opts.mode == "mirror" else (*shape.key, "_commit_ts")
            files.schema = pa.unify_schemas([files.schema, out.rows.schema])
            files.departed.update(out.departed)
            for start in range(0, len(out.rows), self.opts.target_file_rows):
                rows = out.rows.slice(start, self.opts.target_file_rows)
                files.adds.append(write_file(uri, rows, batch_id, bucket))
                if out.pending:
                    files.pending.append((files.adds[-1]["path"], out.pending))
        return files

    def commit(self, results: list[Wrote], batch_id: int) -> None:
        progress = ch.BatchProgress.of([p for r in results for p in r.progress])  # IncompleteBatch if cut short
        stamp = Stamp(self.feed, self.app, progress.end_lsn, self.epoch)
        info = {"changefeed.feed": self.feed, "changefeed.batch": str(batch_id),
                "changefeed.resolved_ts": str(progress.resolved_ts),
                "changefeed.end": ",".join(f"{n}:{format_lsn(lsn)}" for n, lsn in sorted(progress.nodes.items()))}
        by_table: dict[str, list[tuple[Files, dict[str, Any]]]] = defaultdict(list)
        for r in results:
            for f in r.files:
                by_table[f.uri].append((f, r.task))
        faults.reach("before_sink_commit")
        for uri, wrote in sorted(by_table.items()):
            tasks = json.dumps([{**task, "files": len(f.adds)} for f, task in wrote])
            files = [f for f, _ in wrote]
            shape = follow(self.feed, uri, [s for f in files for s in f.shapes], self.opts, self.resync)
            commit(files, stamp, {**info, "changefeed.tasks": tasks,
                                          **({"changefeed.shape": shape} if shape else {})}, self.opts.storage)
            faults.reach("delta_table_committed")
        began = min((r.task["began"] for r in results), default=time.time())
        DeltaLedger(self.opts, self.feed).record_batch(stamp, batch_id, progress, began, time.time())
        faults.reach("after_sink_commit")

    def abort(self, results: list[Any], batch_id: int) -> None:
        """Nothing to undo: uncommitted files are unreferenced (vacuum removes them)."""


def _after(buckets: dict[int, list[Any]], done: int) -> dict[int, list[Any]]:
    """The buckets' (shape, rows) parts without the rows before position `done` (0: none), as a
    replica skips them (sinks.replica.apply); a bucket whose rows all were is dropped (one that
    had none, a shape alone, stays)."""
    if not done:
        return buckets
    kept: dict[int, list[Any]] = {}
    for bucket, parts in buckets.items():
        rest = [(shape, rows.filter(pc.greater_equal(rows.column("lsn"), done)) if _first(rows) < done else rows)
                for shape, rows in parts]
        if any(len(rows) for _, rows in rest) or not any(len(rows) for _, rows in parts):
            kept[bucket] = rest
    return kept


def _first(rows: Any) -> int:
    """The lowest position among `rows` (none: past every position)."""
    low = pc.min(rows.column("lsn")).as_py() if len(rows) else None
    return int(low) if low is not None else 1 << 63
