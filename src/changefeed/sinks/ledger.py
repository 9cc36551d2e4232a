"""A sink's ledger: what it has durably recorded for a feed, whatever the sink.

The control plane (run, status, the metrics, the retention check, remove) asks the ledger how far
the sink is: the checkpoint a restart resumes after, what was delivered, the snapshot chunks done.
The replica keeps its ledger in its own `changefeed.*` tables, written in the batch's transaction
(`sinks.replica.ledger.ReplicaLedger`). A sink with no place of its own to write to (a webhook) keeps
it in the feed's state folder as `FileLedger`: one JSON line per batch, appended by the Spark
driver once every message of the batch was acknowledged, before Spark records the batch as done.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from changefeed.core.change import BatchProgress
from changefeed.core.offsets import Offset

RATE_WINDOW_S = 60


@dataclass(frozen=True)
class LastBatch:
    """The last batch a sink recorded."""

    end_lsn: int
    commit_time: str | None  # of the last commit applied (by this batch or an earlier one), as text
    resolved_ts: int
    batches: int  # recorded in all
    seconds: float | None  # its delivery time, None where unknown


class Ledger(Protocol):
    def check(self) -> None:
        """Fail with a typed error if the sink cannot be used; creates nothing."""

    def prepare(self, tables: list[Any]) -> None:
        """Create the bookkeeping and the targets of `tables` (postgres.source.SourceTable) if missing."""

    def notes(self) -> list[str]:
        """What `prepare` found out about the sink that is worth a line at start (none for most)."""

    def checkpoint(self) -> dict[str, int] | None:
        """Per source node: the end of the last batch recorded; None before the first."""

    def last_resolved_ts(self) -> int | None: ...

    def last_batch(self) -> LastBatch | None: ...

    def recent_rate(self) -> float:
        """Changes per second delivered over the last RATE_WINDOW_S (or since the first batch in it began)."""

    def totals(self) -> tuple[int, int]:
        """(batches, changes) recorded."""

    def snapshot_totals(self) -> dict[str, tuple[int, int]]:
        """Per table: (chunks, rows) of snapshot delivered."""

    def forget(self) -> bool:
        """Drop the feed's bookkeeping (not the delivered data); True if there was any."""

    def resume_offset(self) -> dict[str, Any] | None:
        """The end offset (core.offsets) of the last batch recorded, where the sink records it in
        the batch's own transaction (then it is exactly where the feed stands, and a lost Spark
        checkpoint is rebuilt from it: spark.checkpoint.resume); None where it does not, or before
        the first batch."""

    def batch_ends(self, after: Offset) -> list[Offset]:
        """The end offsets of the batches recorded past `after`, in order, of those it knows (the
        bounds a sink behind is caught up by: control.lag_budget)."""

    def fence(self, epoch: int, holder: str) -> bool:
        """Claim the sink for lease term `epoch` (postgres.lease), before the term's first batch:
        True if the sink then refuses batches of earlier terms, False where it has no fence yet."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class _Entry:
    batch_id: int
    progress: BatchProgress
    began: float  # Unix s
    done: float

    def line(self) -> str:
        """The entry as every ledger keeps it (one JSON line), read back by FileLedger._parse."""
        return json.dumps({"batch": self.batch_id, "progress": self.progress.__dict__, "began": self.began,
                           "done": self.done})


class FileLedger:
    """The ledger of a sink without a place of its own: `delivered.jsonl` in the feed's state folder.

    A line is appended (and fsynced) after the batch's messages were all acknowledged. A replayed
    batch (the process died before Spark recorded it) appends its line again: entries are keyed by
    their end LSN. A line torn by a crash while being written is ignored: its batch is replayed.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._parsed: tuple[tuple[int, int], list[_Entry]] | None = None  # (size, mtime) -> entries


    def record(self, batch_id: int, progress: BatchProgress, began: float, done: float,
               epoch: int | None = None) -> None:
        """Append the batch's line (`epoch`, the runner's lease term, is not checked: the file is
        the runner's own)."""
        line = _Entry(batch_id, progress, began, done).line()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+b") as f:  # writes go to the end
            end = f.seek(0, os.SEEK_END)
            torn = end > 0 and f.seek(end - 1) >= 0 and f.read(1) != b"\n"  # a crash cut the last line
            f.write((b"\n" if torn else b"") + line.encode() + b"\n")  # ... which stays on its own
            f.flush()
            os.fsync(f.fileno())

    def _entries(self) -> list[_Entry]:
        """The recorded batches; parsed again only when the file changed (a report asks several times)."""
        try:
            st = self.path.stat()
            version = (st.st_size, st.st_mtime_ns)
            if self._parsed is None or self._parsed[0] != version:
                self._parsed = version, self._parse(self.path.read_text(encoding="utf-8").splitlines())
        except FileNotFoundError:
            return []
        return self._parsed[1]

    @staticmethod
    def _parse(lines: list[str]) -> list[_Entry]:
        seen: dict[int, _Entry] = {}
        for line in lines:
            try:
                d = json.loads(line)
                entry = _Entry(d["batch"], BatchProgress.from_json(d["progress"]), d["began"], d["done"])
            except (ValueError, KeyError, TypeError):
                continue  # torn by a crash: that batch is delivered again
            seen.setdefault(entry.progress.end_lsn, entry)
        return sorted(seen.values(), key=lambda e: e.progress.end_lsn)

    def check(self) -> None:
        """Nothing to check: the state directory is ours."""

    def prepare(self, tables: list[Any]) -> None:
        """Nothing to create: the file appears with the first batch."""

    def notes(self) -> list[str]:
        return []

    def checkpoint(self) -> dict[str, int] | None:
        entries = self._entries()
        return entries[-1].progress.nodes if entries else None

    def last_resolved_ts(self) -> int | None:
        entries = self._entries()
        return max(e.progress.resolved_ts for e in entries) if entries else None

    def last_batch(self) -> LastBatch | None:
        entries = self._entries()
        if not entries:
            return None
        last = entries[-1]
        when = next((e.progress.last_commit_time for e in reversed(entries) if e.progress.last_commit_time), None)
        commit_time = None if when is None else time.strftime(
            "%Y-%m-%d %H:%M:%S", time.gmtime(when / 1e6)) + f".{when % 1_000_000:06d}+00"
        return LastBatch(last.progress.end_lsn, commit_time, last.progress.resolved_ts, len(entries),
                         round(last.done - last.began, 3))

    def recent_rate(self) -> float:
        now = time.time()
        recent = [e for e in self._entries() if e.done > now - RATE_WINDOW_S]
        if not recent:
            return 0.0
        since = max(now - RATE_WINDOW_S, min(min(e.began, e.done) for e in recent))
        return round(sum(e.progress.changes for e in recent) / max(now - since, 1.0), 1)

    def totals(self) -> tuple[int, int]:
        entries = self._entries()
        return len(entries), sum(e.progress.changes for e in entries)

    def snapshot_totals(self) -> dict[str, tuple[int, int]]:
        chunks: dict[int, dict[str, Any]] = {}
        for e in self._entries():
            for c in e.progress.chunks:
                chunks.setdefault(int(c["no"]), c)  # a chunk counts once
        out: dict[str, tuple[int, int]] = {}
        for c in chunks.values():
            n, rows = out.get(c["table"], (0, 0))
            out[c["table"]] = (n + 1, rows + int(c["rows"]))
        return out

    def forget(self) -> bool:
        existed = self.path.exists()
        self.path.unlink(missing_ok=True)
        return existed

    def resume_offset(self) -> dict[str, Any] | None:
        """None: a file written after the sink committed may lag it (see resume_offset above)."""
        return None

    def batch_ends(self, after: Offset) -> list[Offset]:
        return ends_after(self._entries(), after)

    def fence(self, epoch: int, holder: str) -> bool:
        """No fence: the file is the runner's own (Kafka and Delta fence on their own terms)."""
        return False

    def close(self) -> None:
        """Nothing held open."""


def ends_after(entries: list[_Entry], after: Offset) -> list[Offset]:
    """The end offsets of `entries` (those that record one) past `after`, in order."""
    ends = (Offset.from_json(e.progress.offset) for e in entries if e.progress.offset)
    return sorted((o for o in ends if o.order > after.order), key=lambda o: o.order)
