"""Snapshot requests: tables to (re-)read, handed from `changefeed alter/snapshot` to a feed.

`Requests` is what a feed reads them through: the feed's table on its first source node
(postgres.requests, where every runner of the feed reaches them), or a folder of files.

In a folder, each request is a numbered JSON file (`000001.json`: {"tables": [...]}) in the feed's
`requests` folder, written atomically. The running feed takes in those numbered above what its
checkpoint says it has taken (see core.snapshot.Cursor.requests), so a request is acted on once,
also across restarts, and one made while the feed is stopped waits for its next run.
"""
from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

from changefeed.core.nodes import DEFAULT_NODE
from changefeed.core.snapshot import node_of


class Request(NamedTuple):
    no: int
    tables: list[str]
    only: tuple[str, ...] = ()  # the sinks it is for (a sink added to the feed: spec.sinks); () = all
    # per node, a WAL position its batch must start at or after (a row filter changed there: its
    # snapshot must not land before the change, see postgres.filter_switch); () = any batch
    after: tuple[tuple[str, int], ...] = ()
    # the sinks hold nothing of its tables yet: tables brought into the feed, whose request was
    # made with their publication (control.lifecycle.add_tables), so their reads are first reads
    # (core.judge) when the request is taken in before any of their changes was sent
    first: bool = False

    def fits(self, nodes: Collection[str], sinks: Collection[str]) -> bool:
        """Whether a query over `nodes` feeding `sinks` can take the request in (a node or sink
        added since the query started is its next query's)."""
        return all(node_of(t, DEFAULT_NODE)[0] in nodes for t in self.tables) and set(self.only) <= set(sinks)

    def due(self, start: Mapping[str, int]) -> bool:
        """Whether a batch starting at `start` (per node) may take the request in."""
        return all(start.get(node, 0) >= lsn for node, lsn in self.after)


class Requests(Protocol):
    def add(self, tables: Sequence[str], only: Sequence[str] = (), after: Mapping[str, int] | None = None,
            first: bool = False) -> int:
        """Queue a request of `tables` (for the sinks `only`, or all; for a batch from `after` on;
        `first`: see Request.first); its number (one above the last)."""
        ...

    def after(self, taken: int) -> list[Request]:
        """Requests numbered above `taken`, in order."""
        ...


class SnapshotRequests:
    """Requests as files in a folder: a feed of an older changefeed, and tests without a source."""

    def __init__(self, folder: Path | str) -> None:
        self.folder = Path(folder)

    def _numbers(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        return sorted(int(p.stem) for p in self.folder.glob("*.json") if p.stem.isdigit())

    def add(self, tables: Sequence[str], only: Sequence[str] = (), after: Mapping[str, int] | None = None,
            first: bool = False) -> int:
        """Queue a request; returns its number."""
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            no = (self._numbers() or [0])[-1] + 1
            tmp = self.folder / f".{no:06d}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps({"tables": list(tables), **({"only": list(only)} if only else {}),
                                       **({"after": dict(after)} if after else {}),
                                       **({"first": True} if first else {})}))
            try:
                os.link(tmp, self.folder / f"{no:06d}.json")  # fails if another request took `no`
                return no
            except FileExistsError:
                continue
            finally:
                tmp.unlink()

    def after(self, taken: int) -> list[Request]:
        """Requests numbered above `taken`, in order."""
        found = [(no, json.loads((self.folder / f"{no:06d}.json").read_text())) for no in self._numbers() if no > taken]
        return [Request(no, d["tables"], tuple(d.get("only", ())), tuple(d.get("after", {}).items()),
                        bool(d.get("first"))) for no, d in found]
