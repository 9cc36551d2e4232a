"""The Delta sink's batch writer: tasks write data files in parallel, the driver commits them.

Each writer task takes the groups the split stage (delta.split) sent it: a table's rows of one
bucket, its `R` row first (carrying the bucket in `seq`). In `changelog` mode it appends them as
new files; in `mirror` mode it reads the bucket's current files, applies the changes (delta.rows)
and writes the bucket anew, replacing them. It returns what it wrote and the `P` rows it saw.
The driver (`commit`) checks the batch is whole (every input partition's `P` row), then commits
each table once (delta.table.commit), then the ledger row (delta.ledger). Nothing of a batch
that fails before is visible; a replay skips every table the batch reached before.
"""
from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

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
from changefeed.sinks.delta.table import Files, bucket_rows, commit, committed, open_table, write_file


@dataclass
class Wrote:
    """One writer task's result."""

    query_id: str
    task: dict[str, Any]  # who wrote, and when: {"partition", "attempt", "pid", "began", "ended"} (Unix s)
    files: list[Files] = field(default_factory=list)
    progress: list[ch.Progress] = field(default_factory=list)


def app_id(feed: str, query_id: str) -> str:
    """The Delta application transaction of a feed's query: the query id (kept in Spark's checkpoint)
    tells a feed created anew under an old name from the one before it."""
    return f"changefeed-{feed}-{query_id}"


class DeltaWriter:
    """Options: uri, feed."""

    def __init__(self, options: dict[str, str]) -> None:
        self.feed = options["feed"]
        self.opts = DeltaOptions.parse(options["uri"])
        self.resync = frozenset(t for t in (options.get("resync") or "").split(",") if t)

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
        app = app_id(self.feed, batch.task.query_id)
        out = Wrote(batch.task.query_id, {"partition": batch.task.partition, "attempt": batch.task.attempt,
                                          "pid": os.getpid(), "began": began}, progress=batch.progress_rows)
        for (schema, table), buckets in sorted(groups.items()):
            uri = self.opts.table_uri(schema, table)
            if self.opts.mode == "changelog":
                files = self._changelog(uri, buckets, batch.task.batch_id)
            else:
                existing = open_table(uri, self.opts.storage)
                if committed(existing, app, batch.task.batch_id):
                    continue  # a replay: the driver will find the batch there and skip the table
                files = self._rewrite(uri, existing, buckets, batch.task.batch_id)
            files.shapes = sorted(shapes[(schema, table)], key=lambda p: p[0])
            out.files.append(files)
        out.task["ended"] = time.time()
        faults.reach("delta_files_written")
        return out

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
        query = next((r.query_id for r in results if r.query_id), "")
        app = app_id(self.feed, query)
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
            commit(files, app, batch_id, {**info, "changefeed.tasks": tasks,
                                          **({"changefeed.shape": shape} if shape else {})}, self.opts.storage)
        began = min((r.task["began"] for r in results), default=time.time())
        DeltaLedger(self.opts, self.feed).record_batch(app, batch_id, progress, began, time.time())
        faults.reach("after_sink_commit")

    def abort(self, results: list[Any], batch_id: int) -> None:
        """Nothing to undo: uncommitted files are unreferenced (vacuum removes them)."""
