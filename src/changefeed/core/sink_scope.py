"""Snapshot rows read for some of a feed's sinks alone (a sink added to a running feed gets the
captured tables' existing rows; the others, which have them, get nothing of that read).

A chunk read for sinks `only` (core.snapshot.Chunk) marks its `r` rows in their `meta` (which
plain `r` rows leave empty) and names them in its `P` row's chunk. Each sink's writer input
(sinks.batch_input) keeps the rows marked for it, unmarked, drops those marked for others, and
keeps the `P` row but without the chunk (that sink's ledger records no chunk it did not get).
Pure Arrow: no I/O.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from changefeed.core import change as ch

MARK = "only:"  # meta of a `r` row read for the sinks that follow, joined by ","


def mark(rows: Any, only: tuple[str, ...]) -> Any:
    """`rows` (a record batch of a chunk read) with its `r` rows marked as read for `only`."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not only:
        return rows
    i = rows.schema.get_field_index("meta")
    meta = pc.if_else(pc.equal(rows.column("op"), "r"), pa.scalar(MARK + ",".join(only)), rows.column(i))
    return rows.set_column(i, rows.schema.field(i), meta)


def for_sink(rows: Any, sink: str) -> Any:
    """`rows` as sink `sink` takes them: marked `r` rows kept (unmarked) if read for it, else left
    out; `P` rows without a chunk read for others alone (progress_for); the rest as they are."""
    import pyarrow as pa
    import pyarrow.compute as pc

    rows = _progress_for(rows, sink)
    meta = rows.column("meta")
    marked = pc.fill_null(pc.and_(pc.equal(rows.column("op"), "r"), pc.starts_with(meta, MARK)), False)
    if not pc.any(marked).as_py():
        return rows
    mine = pc.fill_null(pc.match_substring_regex(meta, f"^{MARK}(.*,)?{sink}(,.*)?$"), False)  # (names: [a-z0-9_])
    kept = rows.filter(pc.or_(pc.invert(marked), mine))
    i = kept.schema.get_field_index("meta")
    still = pc.fill_null(pc.and_(pc.equal(kept.column("op"), "r"), pc.starts_with(kept.column(i), MARK)), False)
    return kept.set_column(i, kept.schema.field(i), pc.if_else(still, pa.scalar(None, pa.string()), kept.column(i)))


def _progress_for(rows: Any, sink: str) -> Any:
    """`rows` with each `P` row's meta as progress_for gives it."""
    import pyarrow as pa
    import pyarrow.compute as pc

    ops = rows.column("op")
    if not pc.any(pc.equal(ops, ch.PROGRESS)).as_py() or not pc.any(pc.match_substring(rows.column("meta"),
                                                                                       '"only":')).as_py():
        return rows
    metas = rows.column("meta").to_pylist()
    for i, op in enumerate(ops.to_pylist()):
        if op == ch.PROGRESS:
            metas[i] = progress_for(ch.Progress.from_meta(metas[i]), sink).to_meta()
    i = rows.schema.get_field_index("meta")
    return rows.set_column(i, rows.schema.field(i), pa.array(metas, pa.string()))


def progress_for(progress: ch.Progress, sink: str) -> ch.Progress:
    """A `P` row as sink `sink` records it: a chunk read for other sinks alone is not its own."""
    chunk = progress.chunk
    if chunk is None or not chunk.get("only") or sink in chunk["only"]:
        return progress
    return replace(progress, chunk=None, changes=0)
