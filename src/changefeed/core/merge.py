"""One ordered stream from the partitions of a batch read from several nodes.

Each node's partitions (its WAL window, its snapshot chunks) are read by Spark tasks of their
own and reach the batch's writer one after the other, each whole and closed by its `P` row (a
shuffle hands a reducer each map task's output as one block). The writer splits its input back
into partitions (`split`), then `ordered` puts the rows of all nodes in one order:

* a node's snapshot rows first (they hold the rows as of the window's start, and the window's
  changes go on top of them, as on a one-node feed, see postgres/snapshot.py);
* then the transactions of all nodes by commit time, ties broken by node name, then LSN; a
  transaction's rows (and the `R` rows describing its tables) keep their order.

A transaction's place is the latest commit time among it and every transaction before it on its
node: that keeps each node's commit order (a commit's time is taken just before its record is
written, so two concurrent commits may land in the other order by a few microseconds), and it
still puts a transaction after every one it read on another node (that one was visible before
it committed, so it and all before it on its node have earlier times). core.distributed makes
every batch a cut in commit time, so this order continues from batch to batch.

The parts of one distributed transaction (core.distributed: always all in one batch) keep their
places in their nodes' orders, which is what each key's order needs (a key lives on one node),
but carry one commit timestamp and commit time: the latest of their parts', when the last part
committed. Commit timestamps then never go back along a node's order: a transaction after a
part takes at least the part's timestamp. Pure: Arrow only.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from changefeed.core import change as ch
from changefeed.errors import IncompleteBatch, TornTransaction, UnfollowableChange


@dataclass(frozen=True)
class Part:
    """One input partition of a batch: its progress and its rows (without the `P` row)."""

    progress: ch.Progress
    rows: list[Any]  # record batches


def split(batches: Iterable[Any]) -> list[Part]:
    """The batch's partitions from its record batches as they arrived (each partition's rows
    consecutive, its `P` row last). Rows after the last `P` row mean the input was cut short."""
    parts: list[Part] = []
    pending: list[Any] = []
    for rb in batches:
        ops = rb.column("op")
        progress = pc.indices_nonzero(pc.equal(ops, ch.PROGRESS)).to_pylist()
        start = 0
        for i in progress:
            if i > start:
                pending.append(rb.slice(start, i - start))
            parts.append(Part(ch.Progress.from_meta(rb.column("meta")[i].as_py()), pending))
            pending, start = [], i + 1
        if start < rb.num_rows:
            pending.append(rb.slice(start))
    if any(rb.num_rows for rb in pending):
        raise IncompleteBatch("the batch's input ended inside a partition: it was cut short, so nothing of it is "
                              "committed", "none: the batch is read again when the query runs next")
    return parts


def ordered(parts: list[Part], renumber: bool = True) -> Any:
    """All data and `R` rows of `parts` as one table in the feed's order (see the module doc).

    With `renumber`, its `lsn` column holds each row's position in that order and `seq` is 0: a
    sink that orders rows by (lsn, seq), as the replica's merge does, orders them so. Without it,
    rows keep their nodes' LSNs (what a message sink shows its consumers)."""
    tables, keys, nodes = [], [], []
    labels = _latest(parts)
    for part in parts:
        rows = [rb for rb in part.rows if rb.num_rows]
        if not rows:
            continue
        t = pa.Table.from_batches(rows)
        if part.progress.chunk is not None:  # snapshot rows sort before every transaction
            keys.append(np.full(t.num_rows, -1, np.int64))
        else:
            times = pc.fill_null(t.column("commit_time"), 0).to_numpy(zero_copy_only=False).astype(np.int64)
            keys.append(np.maximum.accumulate(times))
            t = _label(t, part.progress.gids or [], labels)
        tables.append(t)
        nodes.append(np.full(t.num_rows, part.progress.node, dtype=object))
    if not tables:
        return pa.Table.from_batches([], schema=ch.arrow_schema())
    table = pa.concat_tables(tables)
    n = table.num_rows
    sort = pa.table({"ts": np.concatenate(keys), "node": pa.array(np.concatenate(nodes), pa.string()),
                     "lsn": table.column("lsn"), "pos": np.arange(n, dtype=np.int64)})
    order = pc.sort_indices(sort, sort_keys=[("ts", "ascending"), ("node", "ascending"), ("lsn", "ascending"),
                                             ("pos", "ascending")])
    out = table.take(order)
    if not renumber:
        return out
    out = out.set_column(out.schema.get_field_index("lsn"), "lsn", pa.array(np.arange(n, dtype=np.int64)))
    return out.set_column(out.schema.get_field_index("seq"), "seq", pa.array(np.zeros(n, np.int32)))


def _latest(parts: list[Part]) -> dict[str, tuple[int, int]]:
    """gid -> (latest commit ts, latest commit time) over its parts in `parts`."""
    out: dict[str, tuple[int, int]] = {}
    for part in parts:
        gid_of = {int(x): str(g) for g, x in part.progress.gids or ()}
        for rb in part.rows if gid_of else ():
            xids, inverse = np.unique(rb.column("xid").to_numpy(zero_copy_only=False), return_inverse=True)
            latest = []
            for name in ("commit_ts", "commit_time"):
                most = np.zeros(len(xids), np.int64)
                np.maximum.at(most, inverse, pc.fill_null(rb.column(name), 0).to_numpy(zero_copy_only=False))
                latest.append(most)
            for i, x in enumerate(xids.tolist()):
                if x in gid_of:
                    old = out.get(gid_of[x], (0, 0))
                    out[gid_of[x]] = (max(int(latest[0][i]), old[0]), max(int(latest[1][i]), old[1]))
    return out


def _label(t: Any, gids: list[list[Any]], labels: dict[str, tuple[int, int]]) -> Any:
    """`t` (one window's rows, in its node's order) with its distributed transactions' commit ts
    and time set to theirs, and every commit ts at least the one before it."""
    if not gids:
        return t
    xid = t.column("xid").to_numpy(zero_copy_only=False)
    mask = np.zeros(t.num_rows, bool)
    ts = t.column("commit_ts").to_numpy(zero_copy_only=False).astype(np.int64)
    at = np.zeros(t.num_rows, np.int64)
    for g, x in gids:
        m = xid == int(x)
        mask |= m
        ts[m], at[m] = labels[str(g)]
    t = t.set_column(t.schema.get_field_index("commit_ts"), "commit_ts", pa.array(np.maximum.accumulate(ts)))
    return t.set_column(t.schema.get_field_index("commit_time"), "commit_time",
                        pc.if_else(pa.array(mask), pa.array(at), t.column("commit_time").combine_chunks()))


def refuse_torn(parts: list[Part]) -> None:
    """The safety net under core.distributed: a batch that delivers a part of a gid while a part
    of that gid is pending (prepared, or committed past its window) on a node stops the feed
    before anything of it is delivered."""
    pending = {g: p.progress.node for p in parts for g in p.progress.pending or ()}
    for part in parts:
        for g, _ in part.progress.gids or ():
            if g in pending:
                raise TornTransaction(
                    f"distributed transaction {g!r}: this batch holds its part on source node {part.progress.node} "
                    f"while its part on source node {pending[g]} is not decided within the batch",
                    "nothing of the batch was delivered; this is a bug in changefeed: report it with "
                    "`changefeed status --name NAME --json`")


def refuse_truncate(parts: list[Part]) -> None:
    """A TRUNCATE on one node empties only that node's share of the table, which one target table
    (or one topic) cannot tell from the others' rows: stop before delivering anything of the batch."""
    for part in parts:
        for rb in part.rows:
            hit = pc.index(rb.column("op"), "t").as_py()
            if hit >= 0:
                table = f"{rb.column('schema')[hit].as_py()}.{rb.column('table')[hit].as_py()}"
                raise UnfollowableChange(
                    f"TRUNCATE of {table} on source node {part.progress.node}: the sink holds the rows of every "
                    "node of the table together and cannot tell which were that node's, so nothing of this batch "
                    "is delivered", f"truncate {table} on every node and on the sink, then changefeed snapshot "
                    f"--tables {table}; or delete the rows instead of TRUNCATE")
