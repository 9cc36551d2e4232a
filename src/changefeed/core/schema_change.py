"""How a replica table follows its source table's new shape, from what a Relation (an `R` row) says.

pgoutput sends a table's Relation before its first change after any schema change, in WAL order,
so the replica learns each new shape exactly where it starts. What the shape alone can tell:

* columns only added: add them (rows written before read as the source's missing value, or NULL);
  but a column added with a default computed per row (a table rewrite: `DEFAULT now()`) has values
  the WAL does not carry: stop;
* columns only gone: drop them;
* a column's type widened so that every value keeps its text (int -> bigint, varchar(n) -> text,
  numeric(p,s) -> numeric(p+k,s), real -> double precision): alter the replica's type the same way;
  any other type change: stop;
* other key columns (a new primary key or replica identity index): move the replica's key;
* columns gone AND new ones at once: a RENAME COLUMN or a DROP + ADD, which the Relation cannot tell
  apart: stop.

A stop names the table, the change and the fix: `changefeed snapshot --tables T` and run the feed
again. While that request waits to be taken in (`resync`), the table follows any change (new and
changed columns start empty) and its rows are then read again. With `--capture-ddl` the DDL
itself comes first (`told`) and settles what the shape cannot. Pure: the replica's columns come
in as a `Current`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from changefeed.core.change import TableShape
from changefeed.errors import UnfollowableChange

_INTS = ("smallint", "integer", "bigint")
_VARCHAR = re.compile(r"character varying(?:\((\d+)\))?$")
_NUMERIC = re.compile(r"numeric(?:\((\d+),(\d+)\))?$")


@dataclass(frozen=True)
class Current:
    """The replica table now: columns in order, their types (format_type), its key columns."""

    columns: tuple[str, ...]
    types: tuple[str, ...]
    key: tuple[str, ...]


@dataclass(frozen=True)
class Step:
    """One change to the replica table: add, drop, type (value: the new type), key (columns)."""

    kind: str
    column: str = ""
    type: str = ""
    missing: str | None = None  # add: what the rows written before read as
    key: tuple[str, ...] = ()
    reset: bool = False  # type: the values do not convert (resync): they start empty


def widens(old: str, new: str) -> bool:
    """Whether every value of type `old` converts to `new` with the same text."""
    if old == new:
        return True
    if old in _INTS and new in _INTS:
        return _INTS.index(new) >= _INTS.index(old)
    if (old, new) == ("real", "double precision"):
        return False  # float4 -> float8 prints more digits (0.1 becomes 0.10000000149011612)
    varchar_old, varchar_new = _VARCHAR.match(old), _VARCHAR.match(new)
    if varchar_old or old == "text":
        if new == "text" or (varchar_new and varchar_new.group(1) is None):
            return True
        if varchar_old and varchar_new:
            return varchar_old.group(1) is not None and int(varchar_new.group(1)) >= int(varchar_old.group(1))
        return False
    numeric_old, numeric_new = _NUMERIC.match(old), _NUMERIC.match(new)
    if numeric_old and numeric_new:
        if numeric_new.group(1) is None:
            return True
        if numeric_old.group(1) is None:
            return False
        p, s = int(numeric_old.group(1)), int(numeric_old.group(2))
        p2, s2 = int(numeric_new.group(1)), int(numeric_new.group(2))
        return s2 == s and p2 >= p
    return False


def plan(feed: str, current: Current, shape: TableShape, *, resync: bool = False, told: bool = False,
         keep_dropped: bool = False) -> list[Step]:
    """The steps that bring the replica table to `shape`, or UnfollowableChange. `told`: a captured
    DDL event (postgres.ddl_capture) came first, with the columns it renamed (already renamed on the
    replica) and a rewrite's values as updates right after it, so nothing is ambiguous and a type
    changes by the same cast. `keep_dropped` (a feed of several nodes, whose nodes change shape one
    after another): columns missing from `shape` stay on the replica."""
    table = f"{shape.schema}.{shape.table}"
    have = dict(zip(current.columns, current.types))
    missing = shape.missing or (None,) * len(shape.columns)
    filled = shape.filled or (False,) * len(shape.columns)
    added = [i for i, c in enumerate(shape.columns) if c not in have]
    dropped = [c for c in current.columns if c not in shape.columns]
    fix = (f"re-read the table: changefeed snapshot --name {feed} --tables {table}, then run the feed again "
           "(it follows the new shape and reads the table's rows again); to have such changes followed from "
           f"now on: changefeed alter --name {feed} --capture-ddl")

    def stop(change: str) -> UnfollowableChange:
        return UnfollowableChange(f"table {table} changed on the source in a way the replica cannot follow from "
                                  f"the WAL: {change}; nothing past it was applied", fix)

    if added and dropped and not resync and not told and not keep_dropped:
        gone = ", ".join(dropped)
        new = ", ".join(shape.columns[i] for i in added)
        raise stop(f"column(s) {gone} are gone and {new} are new (a RENAME COLUMN, or a DROP and an ADD COLUMN, "
                   "which the WAL does not tell apart)")
    steps: list[Step] = []
    for i, (c, t) in enumerate(zip(shape.columns, shape.types)):
        if c not in have:
            if filled[i] and not resync and not told:
                raise stop(f"column {c} was added with a default computed for each row (a table rewrite), "
                           "whose values the WAL does not carry")
            steps.append(Step("add", c, t, None if resync else missing[i]))
        elif have[c] != t:
            if not widens(have[c], t) and not resync and not told:
                raise stop(f"column {c} changed type from {have[c]} to {t}")
            steps.append(Step("type", c, t, reset=resync and not widens(have[c], t)))
    if not keep_dropped:
        steps += [Step("drop", c) for c in dropped if c not in shape.key]
    if tuple(shape.key) != tuple(current.key):
        steps.append(Step("key", key=tuple(shape.key)))
    return steps
