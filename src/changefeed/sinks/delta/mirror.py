"""Mirror mode: a bucket of a Delta table after a batch, from its rows before and its changes. Pure Arrow.

Each key's last change wins, a delete deletes, a truncate empties the table, and the snapshot rows
(`r`, read at or after the window's end) come after the window's changes. A row written before
a column was added with a default holds the default. An unchanged TOASTed value is the one the
row held before: from the key's earlier change in the batch, else the bucket's existing row.

A key change moves a row between buckets, and so maybe between tasks: its new row's unchanged
values are the old row's, which only the old key's bucket knows. So the old bucket reports the
rows that moved out (`departed`: the old key's values just before the move, by the `Move`) and
the new bucket the values it could not fill (`pending`: new key, column, `Move`); the driver
completes them (delta.table.fill_moved) before the commit. A value still pending in a departed
row (a chain of key changes) points on to its own `Move`. A move is named by the old key AND the
key change's place in the stream: a key can move out twice in one batch (0 -> 1, a new 0,
0 -> 2), and each new row must get the values of its own old row.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from changefeed.core import change as ch
from changefeed.sinks.delta.columns import decode
from changefeed.sinks.delta.rows import data_rows, fills, source_schema, typed, unchanged_names, unify
from changefeed.sinks.delta.split import MOVED

Key = tuple[Any, ...]
Position = tuple[int, int, int]  # a change's place in the stream: (commit ts, LSN, seq)


@dataclass(frozen=True)
class Move:
    """A key change that moved key `old_key`'s row away, at `at` (both halves of a key change share
    it). As a value: still to be taken from the row `old_key` held just before this move."""

    old_key: Key
    at: Position


@dataclass
class Bucket:
    rows: pa.Table
    departed: dict[Move, dict[str, Any]] = field(default_factory=dict)  # a row moved out: its values (or Move)
    pending: list[tuple[Key, str, Move]] = field(default_factory=list)  # (new key, column, where it comes from)


def ordered_changes(parts: Sequence[tuple[ch.TableShape, Any]], filled: dict[str, Any],
                     schema: pa.Schema) -> pa.Table:
    """The changes as typed rows, in the order they apply: the window's changes in commit order
    (a key change's delete half first), then the snapshot rows. `_old_key` holds a key change's
    old key (typed, as a struct), `_moved` marks its delete half, `_s2` is the commit ts, `_time`
    the commit time (Unix µs; null for snapshot rows)."""
    tables = []
    for shape, batch in parts:
        rows = data_rows(batch)
        if not len(rows):
            continue
        op = rows.column("op")
        lines = pc.if_else(pc.equal(op, "d"), rows.column("before"), rows.column("after"))
        key_types = [shape.types[shape.columns.index(k)] for k in shape.key]
        old_key = decode(rows.column("old_key"), key_types) if shape.key else []
        arrays = [*typed(lines, shape), op, unchanged_names(rows.column("unchanged").to_pylist(), shape.columns),
                  pa.StructArray.from_arrays(old_key, names=list(shape.key),
                                             mask=rows.column("old_key").is_null().combine_chunks()),
                  pc.fill_null(pc.equal(rows.column("meta"), MOVED), False),
                  pc.cast(pc.equal(op, "r"), pa.int8()), rows.column("commit_ts"), rows.column("lsn"),
                  rows.column("seq"), pc.cast(pc.not_equal(op, "d"), pa.int8()), rows.column("commit_time")]
        names = [*shape.columns, "_op", "_unchanged", "_old_key", "_moved", "_s1", "_s2", "_s3", "_s4", "_s5",
                 "_time"]
        for c, v in filled.items():
            if c not in shape.columns:
                names.append(c)
                arrays.append(pa.array([v] * len(rows), schema.field(c).type))
        tables.append(pa.Table.from_arrays(arrays, names=names))
    if not tables:
        return pa.table({"_op": pa.array([], pa.string())})
    return unify(tables).sort_by([(f"_s{i}", "ascending") for i in range(1, 6)])


def keys_of(table: pa.Table, key: Sequence[str]) -> list[Key]:
    return list(zip(*(table.column(k).to_pylist() for k in key))) if len(table) else []


def positions(changes: pa.Table) -> list[Position]:
    """Each change's place in the stream (see `Move`)."""
    return list(zip(*(changes.column(c).to_pylist() for c in ("_s2", "_s3", "_s4")))) if len(changes) else []


def old_key_of(row_old_key: dict[str, Any], key: Sequence[str]) -> Key:
    """A key change's old key (its `_old_key` struct) as a key tuple."""
    return tuple(row_old_key[k] for k in key)


def apply_mirror(existing: pa.Table | None, parts: Sequence[tuple[ch.TableShape, Any]],
                 shape: ch.TableShape) -> Bucket:
    """The bucket after the batch: `existing` (its rows before, None if it has none) with `parts`
    (its changes: (shape, change rows) pairs) applied; `shape` is the table's latest."""
    schema, filled = source_schema(shape), fills(shape)
    changes = ordered_changes(parts, filled, schema)
    ops = changes.column("_op").to_pylist()
    if "t" in ops:  # a truncate empties the table: what came before it no longer matters
        last = len(ops) - 1 - ops[::-1].index("t")
        changes, ops, existing = changes.slice(last + 1), ops[last + 1:], None
    before = existing if existing is not None else schema.empty_table()
    keys = keys_of(changes, shape.key)
    final = {k: i for i, k in enumerate(keys)}
    kept = before.filter(pa.array([k not in final for k in keys_of(before, shape.key)], pa.bool_())) \
        if final else before
    upserts = sorted(i for i in final.values() if ops[i] != "d")
    new = changes.take(pa.array(upserts, pa.int64()))
    out = Bucket(pa.table({}))
    history = _History(changes, keys, before, shape)
    for i, (op, moved) in enumerate(zip(ops, changes.column("_moved").to_pylist())):
        if op == "d" and moved:
            out.departed[Move(keys[i], history.at[i])] = {c: history.prior(i, c) for c in changes.column_names
                                                          if not c.startswith("_")}
    unchanged = new.column("_unchanged").to_pylist() if len(new) else []
    if any(unchanged):
        new = _fill_unchanged(new, unchanged, upserts, history, out)
    new = new.select([c for c in new.column_names if not c.startswith("_")])
    for c, v in filled.items():  # rows from before the column was added hold its default
        if c not in kept.column_names:
            kept = kept.append_column(schema.field(c), pa.array([v] * len(kept), schema.field(c).type))
    out.rows = unify([kept, new])
    return out


class _History:
    """What a key's columns held around each change of the batch."""

    def __init__(self, changes: pa.Table, keys: list[Key], before: pa.Table, shape: ch.TableShape) -> None:
        self.changes, self.keys, self.before = changes, keys, before
        self.ops = changes.column("_op").to_pylist()
        self.unchanged = changes.column("_unchanged").to_pylist()
        self.old_keys = changes.column("_old_key").to_pylist()
        self.at = positions(changes)
        self.old_rows = {k: i for i, k in enumerate(keys_of(before, shape.key))}
        self.key = shape.key
        self.earlier: list[int | None] = []  # the key's change before each change (None: the first)
        last: dict[Key, int] = {}
        for i, k in enumerate(keys):
            self.earlier.append(last.get(k))
            last[k] = i

    def prior(self, i: int, column: str) -> Any:
        """Column `column` of key `keys[i]` just before change i (a Move where it moved in)."""
        j = self.earlier[i]
        return self.after(j, column) if j is not None else self._existing(self.keys[i], column)

    def after(self, i: int, column: str) -> Any:
        """Column `column` of key `keys[i]` just after change i: an unchanged value is the key's
        previous one, or for a key change the old key's (a Move: it is in another row, maybe in
        another bucket). A loop, not recursion: a batch may update one row many times."""
        while True:
            if self.ops[i] == "d":
                return None
            if column not in (self.unchanged[i] or ()):
                return self.changes.column(column)[i].as_py() if column in self.changes.column_names else None
            if self.old_keys[i] is not None and self.ops[i] == "u":
                return Move(old_key_of(self.old_keys[i], self.key), self.at[i])
            j = self.earlier[i]
            if j is None:
                return self._existing(self.keys[i], column)
            i = j

    def _existing(self, key: Key, column: str) -> Any:
        """Column `column` of key `key`'s row before the batch (None if it had none)."""
        if key in self.old_rows and column in self.before.column_names:
            return self.before.column(column)[self.old_rows[key]].as_py()
        return None


def _fill_unchanged(new: pa.Table, unchanged: list[Any], at: list[int], history: _History, out: Bucket) -> pa.Table:
    columns = {c: new.column(c).to_pylist() for c in {c for names in unchanged if names for c in names}}
    for row, names in enumerate(unchanged):
        i = at[row]
        for c in names or ():
            value = history.after(i, c)
            if isinstance(value, Move):
                out.pending.append((history.keys[i], c, value))
                value = None
            columns[c][row] = value
    for c, values in columns.items():
        new = new.set_column(new.schema.get_field_index(c), c, pa.array(values, new.schema.field(c).type))
    return new
