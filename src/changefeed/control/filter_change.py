"""`changefeed alter --where SCHEMA.TABLE=PREDICATE`: a captured table's row filter changed, the
feed running or not.

On every node the publication's filter is switched in one transaction that also sends the rows
leaving the feed as deletes (postgres.filter_switch); then the definition is saved (a running
feed restarts its query on it), and a snapshot of the table is requested for a batch that starts
past every node's switch, which brings the rows the new filter lets in (not with --no-snapshot).
An interrupted alter is finished by running it again.
"""
from __future__ import annotations

from contextlib import ExitStack

from changefeed.errors import ConfigError
from changefeed.postgres import filter_switch, requests, row_filter
from changefeed.postgres import source as src
from changefeed.postgres.connect import connect
from changefeed.spec.definition import FeedSpec
from changefeed.spec.state import FeedState


def change_filter(spec: FeedSpec, state: FeedState, table: str, predicate: str, *,
                  snapshot: bool = True) -> tuple[FeedSpec, dict[str, int]]:
    """Give `table` the row filter `predicate` ("" removes it); returns the new definition and, per
    node whose publication holds the table, how many rows left the feed."""
    if table not in spec.tables:
        raise ConfigError(f"feed {spec.name} does not capture {table}", "add it first with changefeed alter "
                          "--add-tables, or name one of its tables: " + ", ".join(spec.tables))
    where = {**spec.row_filters, table: predicate}
    changed = FeedSpec(**{**spec.__dict__, "where": tuple((t, p) for t, p in where.items() if p)}).validate()
    left: dict[str, int] = {}
    after: dict[str, int] = {}
    with ExitStack() as stack:
        conns = [(node, stack.enter_context(connect(node.uri, spec.role(node.name)))) for node in spec.sources]
        described = []
        for _, conn in conns:  # every node first: one that refuses leaves all as they were
            one = src.describe_tables(conn, [table], spec.column_lists)[0]
            if not one.key:
                raise ConfigError(f"table {table} has no key: the sinks could not tell which of its rows left the "
                                  "filter", "a table without a key keeps the filter it was created with")
            row_filter.check(conn, {table: predicate} if predicate else {}, spec.name)
            described.append(one)
        for (node, conn), one in zip(conns, described):
            held, _ = row_filter.published(conn, node.publication, table)
            if held:  # (else the feed's first run makes the publication with the new filter)
                left[node.name], after[node.name] = filter_switch.switch(
                    conn, node.publication, one, predicate or None, table in spec.column_lists)
    state.save(changed)
    if snapshot and after:
        with requests.on_source(changed, state) as queued:
            queued.add([table], after=after)
    return changed, left
