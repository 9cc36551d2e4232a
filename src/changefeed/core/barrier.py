"""A barrier: WAL positions a running feed's batches stop at, and wait at, for a while.

`changefeed verify` needs the sink at exactly the position of a source snapshot it took (see
postgres/consistent_point.py). It writes a barrier, one position per node, into the feed's state
folder; the planner (spark/source.py) then ends no window past a node's barrier position, and plans
no new batch once every node has reached its position, until the barrier is taken away or expires
(so a verify that dies never leaves a feed waiting). A window planned before the barrier was seen
may end past it: verify sees that from the sink's checkpoint and tries again with a new snapshot.

Pure but for the file: written atomically, read on every poll of the planner.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Barrier:
    lsns: Mapping[str, int]  # node -> where its windows stop
    expires: float  # Unix time after which the planner ignores the barrier

    def live(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) < self.expires

    def cap(self, start: Mapping[str, int], ends: Mapping[str, int]) -> dict[str, int]:
        """Window ends `ends` (from `start`) cut at the barrier: a node before its position goes no
        further than it, a node at it stays there; a node past it (planned before the barrier was
        seen) goes on, as its verify starts again anyway."""
        out = dict(ends)
        for node, at in self.lsns.items():
            if node in out and start.get(node, 0) <= at:
                out[node] = min(out[node], at)
        return out

    def reached(self, start: Mapping[str, int]) -> bool:
        """Whether every node of the barrier is at its position: no batch until it goes."""
        return all(start.get(node, 0) == at for node, at in self.lsns.items())


def write(path: Path, barrier: Barrier) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"lsns": dict(barrier.lsns), "expires": barrier.expires}))
    tmp.replace(path)


def read(path: Path) -> Barrier | None:
    """The barrier in `path`, None if there is none, it expired, or it is unreadable (a reader
    must never stop a feed: an unreadable barrier only makes its verify try again)."""
    try:
        data = json.loads(path.read_text())
        barrier = Barrier({str(k): int(v) for k, v in data["lsns"].items()}, float(data["expires"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return barrier if barrier.live() else None


def remove(path: Path) -> None:
    path.unlink(missing_ok=True)
