"""History mode (SCD type 2): every version of each row, with its validity. Pure Arrow/Python.

A version is a key's state after one transaction: `_valid_from` is that commit's time,
`_valid_to` the commit time of the change that ended it (the next version, a delete, a truncate)
or null while current, `_current` says it is, `_commit_ts` is its commit's HLC timestamp (exact
order; a transaction that changed a key twice makes one version). A snapshot row (`r`) becomes a
version (valid from its window's time) only if it differs from the key's current version.

Versions are kept in commit-timestamp order per key whatever order they arrive in: a version
placed before a later one ends where that one starts, unless a delete ended it sooner. So
replays and late arrivals never make versions overlap. A key change ends the old key's version
and starts the new key's; an unchanged TOASTed value comes from the key's current version, or,
after a key change, from the old key's (delta.mirror: departed / pending, with `_commit_ts` in
the row's identity). While the batch is applied a value still to come from the old key is held
as its `Move`, not as null: a later unchanged update of the new key, or a move on to another key,
must carry the placeholder on, since null is a real value the copy would keep.
"""
from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa

from changefeed.core import change as ch
from changefeed.core.hlc import physical_ms
from changefeed.sinks.delta.mirror import Bucket, Key, Move, Position, keys_of, old_key_of, ordered_changes, positions
from changefeed.sinks.delta.rows import VALIDITY, fills, source_schema


def _when(time_us: int | None, ts: int) -> datetime:
    us = time_us if time_us is not None else physical_ms(ts) * 1000
    return datetime.fromtimestamp(us // 1_000_000, tz=timezone.utc).replace(microsecond=us % 1_000_000)


def apply_history(existing: pa.Table | None, parts: Sequence[tuple[ch.TableShape, Any]],
                  shape: ch.TableShape) -> Bucket:
    """The bucket's versions after the batch: `existing` (its versions before, None if none) with
    `parts` (its changes: (shape, change rows) pairs) applied; `shape` is the table's latest."""
    source, filled = source_schema(shape), fills(shape)
    schema = pa.schema([*source, *VALIDITY])
    changes = ordered_changes(parts, filled, source)
    columns = [c for c in changes.column_names if not c.startswith("_")]
    before = existing if existing is not None else schema.empty_table()
    for c, v in filled.items():  # versions from before the column was added hold its default
        if c not in before.column_names:
            before = before.append_column(schema.field(c), pa.array([v] * len(before), schema.field(c).type))
    keys = keys_of(changes, shape.key)
    at = positions(changes)
    touched = set(keys)
    old_keys = keys_of(before, shape.key)
    versions: dict[Key, list[dict[str, Any]]] = {}
    for k, row in zip(old_keys, before.to_pylist()):
        versions.setdefault(k, []).append(row)
    out = Bucket(pa.table({}))
    rows = changes.to_pylist()
    for i, r in enumerate(rows):
        op, when, ts = r["_op"], _when(r["_time"], r["_s2"]), r["_s2"]
        if op == "t":  # ends every current version of the table
            for vs in versions.values():
                _end(vs, when)
            continue
        key = keys[i]
        vs = versions.setdefault(key, [])
        current = vs[-1] if vs and vs[-1]["_current"] else None
        if op == "d":
            if r["_moved"]:
                out.departed[Move(key, at[i])] = {c: current[c] if current else None for c in columns}
            _end(vs, when)
            continue
        values = {c: r[c] for c in columns}
        for c in r["_unchanged"] or ():
            values[c] = _unchanged(r, c, current, shape.key, at[i])
        if op == "r" and current is not None and all(current[c] == values[c] for c in columns):
            continue  # the snapshot saw the version the stream made
        if current is not None and current["_commit_ts"] == ts:
            current.update(values)  # the same transaction changed the key again: one version
            continue
        if any(v["_commit_ts"] == ts for v in vs):
            continue  # this version is there already (a replay)
        vs.append({**values, "_valid_from": when, "_valid_to": None, "_current": True, "_commit_ts": ts})
        _order(vs)
    for k in touched | ({k for k in versions} if "t" in changes.column("_op").to_pylist() else set()):
        _order(versions.get(k, []))
    for k in touched:
        _still_pending(k, versions.get(k, []), out)
    kept = pa.unify_schemas([before.schema, schema])  # a dropped column's history stays
    out.rows = pa.Table.from_pylist([v for vs in versions.values() for v in vs], schema=kept)
    return out


def _unchanged(r: dict[str, Any], column: str, current: dict[str, Any] | None, key: Sequence[str],
               at: Position) -> Any:
    """The value change `r` (at `at`) left unchanged: for a key change the old key's row's (a Move:
    another bucket may hold it), else the key's current version's (itself maybe still a Move)."""
    if r["_old_key"] is not None and r["_op"] == "u":
        return Move(old_key_of(r["_old_key"], key), at)
    return current[column] if current is not None else None


def _still_pending(key: Key, vs: list[dict[str, Any]], out: Bucket) -> None:
    """Each value of `key`'s versions still held as a Move: null in the row, and reported pending
    (by the version's identity, key and `_commit_ts`) for delta.table.fill_moved to complete."""
    for v in vs:
        for c, value in v.items():
            if isinstance(value, Move):
                v[c] = None
                out.pending.append(((*key, v["_commit_ts"]), c, value))


def _end(vs: list[dict[str, Any]], when: datetime) -> None:
    if vs and vs[-1]["_current"]:
        vs[-1]["_valid_to"], vs[-1]["_current"] = when, False


def _order(vs: list[dict[str, Any]]) -> None:
    """Versions in commit order, each ending where the next starts unless it ended sooner; only
    the last may be current."""
    vs.sort(key=lambda v: v["_commit_ts"])
    for a, b in zip(vs, vs[1:]):
        if a["_valid_to"] is None or a["_valid_to"] > b["_valid_from"]:
            a["_valid_to"] = b["_valid_from"]
        a["_current"] = False
