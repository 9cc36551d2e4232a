"""A batch's position in the feed's sources: what Spark's offset log holds for each batch.

An `Offset` holds, per node (a PostgreSQL server the feed reads), the WAL position up to which a
batch reads; the batch's resolved commit timestamp (no change in a later batch gets a smaller
one); the snapshot cursor after it; and the snapshot chunks it carries. Spark stores offsets as
JSON and tells "new data" from "none" by comparing them, so a one-node feed's JSON keeps the
shape every checkpoint written before nodes existed holds (version 1: `lsn`, `ts`, `snap`,
`chunks`), and reading and writing it again gives the same JSON. A feed of several nodes writes
version 3: `v`, `nodes` (name -> LSN) in place of `lsn`, the batch's cut time `theta` (Unix µs,
see core.distributed), per node the prepared parts its windows deliver (`parts`: gid, xid and the
start of their COMMIT PREPARED) and those still open at its end (`open`, which the next plan
starts from). Version 2 (two-phase slots read from a hold) is refused: its feed must be created
again. A followed batch (`run --low-latency`, core.followed) adds `follow`, its number among them:
its LSN and ts are where it starts, its end is only known once its sink recorded it. While a
snapshot is read, `reads` (the snapshot reads its windows are judged against, core.judge) and
`exports` (per node, the exported snapshot its chunks are read in) are added.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from changefeed.core.distributed import Part
from changefeed.core.judge import Read
from changefeed.core.lsn import Lsn
from changefeed.core.nodes import DEFAULT_NODE
from changefeed.core.snapshot import Chunk, Cursor
from changefeed.errors import DefiniteError

VERSION = 3  # the newest shape this code writes (a one-node offset is still written as version 1)


class OffsetError(DefiniteError, ValueError):
    """An offset this version cannot read (written by a newer changefeed, or damaged)."""

    def __init__(self, message: str, hint: str = "run the feed with the changefeed version that wrote its "
                 "checkpoint, or newer", *, component: str = "feed") -> None:
        super().__init__(message, hint, component=component)


@dataclass(frozen=True)
class Offset:
    lsns: Mapping[str, Lsn]  # node name -> WAL position
    ts: int = 0  # resolved commit timestamp (HLC)
    cursor: Cursor = field(default_factory=Cursor)
    chunks: tuple[Chunk, ...] = ()
    theta: int = 0  # a feed of several nodes: the batch's cut time (Unix µs)
    parts: Mapping[str, tuple[tuple[str, int, int], ...]] = field(default_factory=dict)  # node -> (gid, xid, lsn)
    open: Mapping[str, tuple[Part, ...]] = field(default_factory=dict)  # node -> parts prepared, undecided at its end
    follow: int = 0  # a followed batch's number (core.followed): `lsns` and `ts` are where it starts
    reads: tuple[Read, ...] = ()  # the snapshot reads its windows are judged against (core.judge)
    exports: Mapping[str, str] = field(default_factory=dict)  # node -> the snapshot its chunks import

    @property
    def lsn(self) -> Lsn:
        """The WAL position of a one-node feed."""
        if len(self.lsns) != 1:
            raise OffsetError(f"an offset of {len(self.lsns)} nodes has no single LSN")
        return next(iter(self.lsns.values()))

    @property
    def order(self) -> int:
        """What orders a feed's batches: a one-node feed's end LSN, else the resolved ts (as
        core.change.BatchProgress.end_lsn)."""
        return self.lsn if len(self.lsns) == 1 else self.ts

    def at(self, lsn: Lsn) -> Offset:
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
        if self.theta:
            out["theta"] = self.theta
        if any(self.parts.values()):
            out["parts"] = {n: [list(p) for p in v] for n, v in sorted(self.parts.items()) if v}
        if any(self.open.values()):
            out["open"] = {n: [p.to_json() for p in v] for n, v in sorted(self.open.items()) if v}
        if self.follow:
            out["follow"] = self.follow
        if self.reads:
            out["reads"] = [r.to_json() for r in self.reads]
        if self.exports:
            out["exports"] = dict(sorted(self.exports.items()))
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
            if version == 2:
                raise OffsetError("the feed's checkpoint was written by an older changefeed that read its nodes' "
                                  "prepared transactions from two-phase slots",
                                  "remove the feed (changefeed remove --name NAME) and create it again")
            lsns = ({DEFAULT_NODE: Lsn(int(d["lsn"]))} if version == 1
                    else {str(k): Lsn(int(v)) for k, v in d["nodes"].items()})
            parts = {str(n): tuple((str(g), int(x), int(at)) for g, x, at in v)
                     for n, v in (d.get("parts") or {}).items()}
            opened = {str(n): tuple(Part.from_json(p) for p in v) for n, v in (d.get("open") or {}).items()}
            return cls(lsns, int(d.get("ts", 0)), Cursor.from_offset(d),
                       tuple(Chunk.from_json(c) for c in d.get("chunks", ())), int(d.get("theta", 0)), parts, opened,
                       int(d.get("follow", 0)), tuple(Read.from_json(r) for r in d.get("reads", ())),
                       {str(n): str(i) for n, i in (d.get("exports") or {}).items()})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, OffsetError):
                raise
            raise OffsetError(f"unreadable offset {str(d)[:200]!r}: {type(e).__name__}: {e}") from None
