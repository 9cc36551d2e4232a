"""Followed batches: the low-latency mode's micro-batches (`run --low-latency`, issue 42).

Spark plans a batch from its end offset before the batch is read. A followed batch's end is not
known then: its one task follows the slot for a while (postgres.follow) and its sink commits a
transaction per sub-window, each recorded in the sink's ledger as any batch is. So its offset
(core.offsets, `follow` > 0) holds where the batch *starts*: the end of the last sub-window its
sink recorded before it, which the driver learns from the sink's commit (the *end file*, in the
checkpoint folder) when the batch is over. Whatever reads from an offset of a followed batch
starts at `started`: the recorded end, if later than the offset's own position.

Exactly once holds as in any batch: a sub-window's rows and its progress row commit in one sink
transaction, and a batch read again (Spark replays one whose commit it did not log) reads from
the offset's position, its rows before the sink's recorded position skipped as applied before
(sinks.replica.apply). The slot moves only to a position the end file or the ledger holds.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from changefeed.core.change import BatchProgress, Progress
from changefeed.core.offsets import Offset, OffsetError

END_FILE = "changefeed-follow-end.json"  # in the checkpoint folder: moved aside or deleted with it
RESOLVED_S = 1.0  # a followed batch's resolved messages (message sinks): at most this often


def note_end(path: Path, end: Offset) -> None:
    """Keep `end` (a sub-window's end, recorded by the sink) as where the next batch starts,
    unless the file holds a later one already. Written whole or not at all."""
    known = recorded_end(path)
    if known is not None and known.order >= end.order:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(end.to_json()))
    os.replace(tmp, path)


def recorded_end(path: Path) -> Offset | None:
    """The latest end `note_end` kept; None before the first (or when the file is unreadable,
    which costs only a read again from an earlier position)."""
    try:
        return Offset.from_json(path.read_text())
    except (OSError, ValueError, OffsetError):
        return None


def started(offset: Offset, path: Path | None, until: Offset | None = None) -> Offset:
    """Where reading from `offset` starts: for a followed batch's offset, the end its sink
    recorded last (the file at `path`), if that is later; never past `until` (the end of the batch
    read from it, when one is planned: a batch read again starts where it did the first time)."""
    if not offset.follow or path is None:
        return offset
    end = recorded_end(path)
    if end is None or end.lsns.keys() != offset.lsns.keys() or end.order <= offset.order:
        return offset
    if until is not None and not until.follow and end.order > until.order:
        return offset
    return replace(offset, lsns=end.lsns, ts=max(offset.ts, end.ts))


def folded(parts: list[Progress]) -> list[Progress]:
    """The `P` rows of sub-windows committed in one transaction (a sink's group commit) as one,
    ending at the last: when every one is a whole batch's own (`parts` 1), which a batch's several
    input partitions never are (those are left as they are)."""
    if len(parts) < 2 or any(p.parts != 1 for p in parts):
        return parts
    times = [p.last_commit_time for p in parts if p.last_commit_time is not None]
    return [replace(parts[-1], changes=sum(p.changes for p in parts), last_commit_time=max(times) if times else None)]


def together(parts: list[BatchProgress]) -> BatchProgress | None:
    """What a followed batch's sub-windows delivered, as a sink's ledger records one batch: the
    last one's end, every one's changes (None: no sub-window came)."""
    if not parts:
        return None
    times = [p.last_commit_time for p in parts if p.last_commit_time is not None]
    return replace(parts[-1], last_commit_time=max(times) if times else None, changes=sum(p.changes for p in parts))
