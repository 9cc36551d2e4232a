"""A batch's resolved timestamp from its nodes' frontiers.

A node's frontier is where its share of a batch ends: a flushed WAL position and the node's clock
once it was flushed (a heartbeat's answer). Every commit before that position on that node has a
commit time at or below that clock. The batch's resolved timestamp is the least of those clocks,
so it never claims more of any node than that node has shown; it is at least a millisecond past
the previous batch's (core.hlc.window_end_ts), so it strictly grows whatever the clocks do. A
node with nothing to send still answers a heartbeat with its clock: an idle node moves with the
others and never holds the resolved timestamp back.

Commits on a node whose clock runs ahead of the least one get timestamps capped at the resolved
timestamp (postgres.decode.builder.ChangeBuilder keeps them inside their window, in order): no change in
a later batch ever gets a smaller timestamp than one already delivered.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from changefeed.core.hlc import window_end_ts
from changefeed.core.lsn import Lsn


@dataclass(frozen=True)
class Frontier:
    lsn: Lsn  # the node's window ends here (a flushed record or page boundary)
    clock_ms: int  # the node's clock (Unix ms) once `lsn` was flushed


def resolved_ts(start_ts: int, frontiers: Mapping[str, Frontier]) -> int:
    """The resolved timestamp of a batch after one resolved at `start_ts`."""
    if not frontiers:
        raise ValueError("a batch has at least one node")
    return window_end_ts(start_ts, min(f.clock_ms for f in frontiers.values()))

