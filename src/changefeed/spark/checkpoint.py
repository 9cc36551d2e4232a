"""What Spark's checkpoint says about the feed: the last batch it planned (its offset log) and
whether it was committed downstream (its commit log), read as files by the driver. Spark writes
these; changefeed only reads them (to tell whether snapshot chunks are still to be read).
"""
from __future__ import annotations

from changefeed.core import snapshot
from changefeed.core.offsets import Offset
from changefeed.core.requests import SnapshotRequests
from changefeed.spec.definition import FeedSpec
from changefeed.spec.state import FeedState


def logged_end(state: FeedState) -> tuple[Offset | None, bool]:
    """(The end offset of the last batch in the checkpoint's offset log, None before the first;
    whether Spark logged that batch as committed downstream too)."""
    logged = [p for p in (state.checkpoint / "offsets").glob("*") if p.name.isdigit()]
    if not logged:
        return None, False
    path = max(logged, key=lambda p: int(p.name))
    last = path.read_text().splitlines()
    end = Offset.from_json(last[-1]) if len(last) > 2 else None
    return end, (state.checkpoint / "commits" / path.name).exists()


def chunks_to_read(spec: FeedSpec, state: FeedState) -> bool:
    """Whether the last batch Spark planned carries snapshot chunks and may still run (it is not
    logged as committed), or chunks are pending after it, or requested; a fresh checkpoint has its
    initial snapshot ahead."""
    end, committed = logged_end(state)
    tables = () if spec.snapshot == "never" else spec.tables
    cursor = end.cursor if end else snapshot.Cursor(pending=snapshot.entries(tables, [n.name for n in spec.sources]))
    running_chunks = end is not None and bool(end.chunks) and not committed
    return running_chunks or bool(cursor.pending or SnapshotRequests(state.requests).after(cursor.requests))


def resyncing(state: FeedState) -> tuple[str, ...]:
    """Tables of snapshot requests the feed has not taken in yet: until then a replica table
    follows any schema change, as its rows are read again next (see core.schema_change)."""
    end, _ = logged_end(state)
    taken = end.cursor.requests if end else 0
    return tuple(sorted({t for _, tables in SnapshotRequests(state.requests).after(taken) for t in tables}))
