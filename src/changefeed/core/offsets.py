"""A batch's position in the feed's sources: what Spark's offset log holds for each batch.

An `Offset` holds, per node (a PostgreSQL server the feed reads), the WAL position up to which a
batch reads; the batch's resolved commit timestamp (no change in a later batch gets a smaller
one); the snapshot cursor after it; and the snapshot chunks it carries. Spark stores offsets as
JSON and tells "new data" from "none" by comparing them, so a one-node feed's JSON keeps the
shape every checkpoint written before nodes existed holds (version 1: `lsn`, `ts`, `snap`,
`chunks`), and reading and writing it again gives the same JSON. A feed of several nodes writes
version 2: `v`, `nodes` (name -> LSN) in place of `lsn`, and `holds` for nodes read with
two-phase decoding: where that node's slot stays while the batch is read (at or before its
start, see core.distributed), which is also as far as the slot may move once the batch is
committed (a later PREPARE may still wait for its outcome).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import DefiniteError
from .nodes import DEFAULT_NODE
from .snapshot import Chunk, Cursor

VERSION = 2  # the newest shape this code writes (a one-node offset is still written as version 1)


class OffsetError(DefiniteError, ValueError):
    """An offset this version cannot read (written by a newer changefeed, or damaged)."""

    def __init__(self, message: str, hint: str = "run the feed with the changefeed version that wrote its "
                 "checkpoint, or newer", *, component: str = "feed") -> None:
        super().__init__(message, hint, component=component)


@dataclass(frozen=True)
class Offset:
    lsns: Mapping[str, int]  # node name -> WAL position
    ts: int = 0  # resolved commit timestamp (HLC)
    cursor: Cursor = field(default_factory=Cursor)
    chunks: tuple[Chunk, ...] = ()
    holds: Mapping[str, int] = field(default_factory=dict)  # node -> where its slot stays (two-phase nodes)

    def release(self, node: str) -> int:
        """How far node `node`'s slot may move once the batch up to here is committed downstream."""
        return self.holds.get(node, self.lsns.get(node, 0))

    @property
    def lsn(self) -> int:
        """The WAL position of a one-node feed."""
        if len(self.lsns) != 1:
            raise OffsetError(f"an offset of {len(self.lsns)} nodes has no single LSN")
        return next(iter(self.lsns.values()))

    def at(self, lsn: int) -> Offset:
        """The same offset with a one-node feed's position moved to `lsn`."""
        (node,) = self.lsns
        return replace(self, lsns={node: lsn})

    def to_json(self) -> dict[str, Any]:
        if set(self.lsns) == {DEFAULT_NODE}:
            out: dict[str, Any] = {"lsn": self.lsns[DEFAULT_NODE], "ts": self.ts, "snap": self.cursor.to_json()}
        else:
            out = {"v": VERSION, "nodes": dict(sorted(self.lsns.items())), "ts": self.ts,
                   "snap": self.cursor.to_json()}
        if self.chunks:
            out["chunks"] = [c.to_json() for c in self.chunks]
        if self.holds:
            out["holds"] = dict(sorted(self.holds.items()))
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str) -> Offset:
        """An offset from Spark's offset log (a dict, or its JSON text)."""
        d = json.loads(data) if isinstance(data, str) else data
        try:
            version = int(d.get("v", 1))
            if version > VERSION:
                raise OffsetError(f"offset version {version} was written by a newer changefeed (this one reads up to "
                                  f"{VERSION})")
            lsns = {DEFAULT_NODE: int(d["lsn"])} if version == 1 else {str(k): int(v) for k, v in d["nodes"].items()}
            return cls(lsns, int(d.get("ts", 0)), Cursor.from_offset(d),
                       tuple(Chunk.from_json(c) for c in d.get("chunks", ())),
                       {str(k): int(v) for k, v in (d.get("holds") or {}).items()})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, OffsetError):
                raise
            raise OffsetError(f"unreadable offset {str(d)[:200]!r}: {type(e).__name__}: {e}") from None
