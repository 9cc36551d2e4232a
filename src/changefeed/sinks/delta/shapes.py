"""A Delta table follows its source table's shape by the rules every sink follows (core.schema_change).

Each table commit records the source shape it was written under (`changefeed.shape` in its
commit info). Before the next commit, the shapes the batch's tasks saw are put back in stream
order (by their `R` rows' positions) and checked one after the other from the recorded one: what
the WAL cannot tell (a column renamed or dropped and added, a type narrowed, a per-row default's
rewrite) stops the feed before anything of the batch is committed, as for a replica. On top, a
Delta table keeps its column types (a type change stops too, delta.table) and, in mirror and
history mode, its rows sit in buckets of their key's hash: a new key stops.
"""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from changefeed.core import schema_change
from changefeed.core.change import TableShape
from changefeed.errors import UnfollowableChange
from changefeed.sinks.delta.options import DeltaOptions
from changefeed.sinks.delta.table import open_table

HISTORY_DEPTH = 50  # commits searched back for the last recorded shape (past compactions, column adds)


def recorded(table: Any) -> TableShape | None:
    """The source shape the table's last data commit recorded."""
    for entry in table.history(HISTORY_DEPTH):
        if "changefeed.shape" in entry:
            d = json.loads(entry["changefeed.shape"])
            return TableShape(d["schema"], d["table"], tuple(d["columns"]), tuple(d["types"]), tuple(d["key"]), "")
    return None


def follow(feed: str, uri: str, seen: list[tuple[Any, TableShape]], opts: DeltaOptions,
           resync: frozenset[str]) -> str:
    """Check the batch's shapes of one table in stream order; the last one, as JSON to record."""
    stream = [s for _, s in seen if not s.ahead]  # a snapshot's shape may be ahead of the stream's
    if not stream:
        return ""
    table = open_table(uri, opts.storage)
    current = recorded(table) if table is not None else None
    for shape in stream:
        qualified = f"{shape.schema}.{shape.table}"
        if current is not None and (current.columns, current.types, current.key) != \
                (shape.columns, shape.types, shape.key):
            schema_change.plan(feed, schema_change.Current(current.columns, current.types, current.key),
                               shape, resync=qualified in resync)
            if opts.mode != "changelog" and tuple(current.key) != tuple(shape.key):
                raise UnfollowableChange(
                    f"the key of {qualified} changed on the source ({', '.join(current.key)} -> "
                    f"{', '.join(shape.key)}): the {opts.mode} table's rows are placed by their key; nothing "
                    "past it was written", f"move the Delta table {uri} away and take a new snapshot: "
                    f"changefeed snapshot --name {feed} --tables {qualified}")
        current = replace(shape, missing=(), filled=())
    assert current is not None
    return to_json(current)


def to_json(shape: TableShape) -> str:
    return json.dumps({"schema": shape.schema, "table": shape.table, "columns": shape.columns,
                       "types": shape.types, "key": shape.key})


def create_tables(opts: DeltaOptions, tables: list[Any]) -> None:
    """The Delta tables of `tables` (postgres.source.SourceTable) that do not exist yet, empty, each
    recording the source shape it starts from (the shape the stream's first change is checked against)."""
    from deltalake import CommitProperties, DeltaTable

    from changefeed.sinks.delta.rows import BUCKET, table_schema

    for t in tables:
        uri = opts.table_uri(t.schema, t.name)
        if open_table(uri, opts.storage) is not None:
            continue
        shape = TableShape(t.schema, t.name, tuple(t.columns), tuple(t.types), tuple(t.key), "")
        DeltaTable.create(uri, table_schema(opts.mode, shape, opts.diff), mode="ignore",
                          partition_by=[BUCKET] if opts.mode != "changelog" else None,
                          storage_options=opts.storage or None,
                          commit_properties=CommitProperties(custom_metadata={"changefeed.shape": to_json(shape)}))
