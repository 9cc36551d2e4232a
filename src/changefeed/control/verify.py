"""`changefeed verify`: compare a feed's source and sink at one consistent point.

The point, running feed or not, is met by verify_points.py: a snapshot exported on each node at
a position X, and the sink's side taken while it holds exactly what the source held at X. Both
snapshots then stay open while the tables are compared chunk by chunk (core.verify,
postgres/checksum.py), in parallel sessions over block ranges of each side.

`repair` meets a second point and, while the sink stays there (a running feed waits at it, a
stopped one is held by verify), writes the source's rows of every key that differed (deleting the
replica's) in one replica transaction under the feed's apply lock: the replica then holds the
source's state at that point for those keys, and the feed goes on from there.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from changefeed.control.verify_points import Held, Point, VerifyError, held, position
from changefeed.core import barrier as bar
from changefeed.core import verify as cv
from changefeed.errors import ChangefeedError, ConfigError, TransientError
from changefeed.postgres import checksum as cs
from changefeed.postgres import row_filter
from changefeed.postgres.connect import connect, lost_connection, one_row
from changefeed.postgres.requests import on_source
from changefeed.postgres.source import describe_tables
from changefeed.sinks.registry import sink_of, sinks_of
from changefeed.sinks.replica import ledger as replica_ledger
from changefeed.spec.definition import FeedSpec, node_role
from changefeed.spec.state import FeedState

DEFAULT_CHUNK_ROWS = 1000
DEFAULT_WORKERS = 2
__all__ = ["VerifyError", "verify", "verify_every"]


def verify(spec: FeedSpec, state: FeedState, *, tables: Sequence[str] = (), repair: bool = False,
           workers: int = DEFAULT_WORKERS, chunk_rows: int = DEFAULT_CHUNK_ROWS, wait_s: float = 120,
           report: Callable[[str], None] = print, master: str = "local[*]", sink: str | None = None) -> cv.Report:
    """Compare the feed's tables (or `tables`) on source and sink (`sink`, by name, where the feed
    has several); with `repair`, fix what differs. A feed that is not running is held meanwhile (and
    run, on `master`, if it is behind: see verify_points)."""
    whole, spec = spec, _sink_seen(spec, sink)
    chosen = _check(spec, state, tables, repair)
    with held(whole, state, master, report, spec) as feed:
        _wait_for_snapshot(feed, wait_s)
        began = time.monotonic()
        point = feed.meet(wait_s, tables=chosen)
        try:
            if point.sink_conn is None:
                from changefeed.control.verify_messages import compare_topic

                results: list[tuple[cv.TableResult, list[str]]] = [
                    (compare_topic(spec, point.sources, point.marks[t], t), []) for t in chosen]
            else:
                results = [_compare(spec, point, t, workers, chunk_rows) for t in chosen]
        finally:
            point.close()
        out = cv.Report(point.lsns, [r for r, _ in results], time.monotonic() - began)
        todo = {r.table: keys for r, keys in results if keys and not r.schema}
        if repair and todo:
            fixed = _repair(feed, todo, wait_s)
            for r in out.tables:
                r.repaired = fixed.get(r.table, 0)
    state.save_verified(out.to_json())
    return out


def _sink_seen(spec: FeedSpec, sink: str | None) -> FeedSpec:
    """The feed as the sink to verify sees it (FeedSpec.for_sink)."""
    if sink is None and spec.several_sinks:
        raise ConfigError(f"feed {spec.name} has several sinks: verify compares one at a time",
                          f"name it with --sink NAME (its sinks: {', '.join(t.name for t in spec.sink_targets)})")
    return spec.for_sink(spec.sink_named(sink) if sink is not None else spec.sink_targets[0])


def verifiable(spec: FeedSpec) -> bool:
    """Whether verify compares the feed's (only) sink: a replica, or Kafka in a JSON format."""
    kind = sink_of(spec.sink).name
    return kind == "replica" or kind == "kafka" and spec.format in ("json", "debezium")


def _check(spec: FeedSpec, state: FeedState, tables: Sequence[str], repair: bool) -> list[str]:
    kind = sink_of(spec.sink).name
    if not verifiable(spec):
        shown = f"{kind} sink" + (f" in format {spec.format}" if kind == "kafka" else "")
        raise ConfigError(f"feed {spec.name} writes to a {shown}: "
                          "verify compares a PostgreSQL replica, or Kafka topics of the json or debezium format, "
                          "with the source", "verify a replica or Kafka feed")
    if kind == "kafka" and repair:
        raise ConfigError("--repair rewrites rows on a replica; a Kafka sink cannot take back what it sent",
                          f"re-send the tables: changefeed snapshot --name {spec.name} --tables ...")
    unknown = [t for t in tables if t not in spec.tables]
    if unknown:
        raise ConfigError(f"--tables: {', '.join(unknown)} not captured by feed {spec.name}",
                          f"choose among {', '.join(spec.tables)}")
    return list(tables or [t for t in spec.tables if t != spec.outbox])  # (an outbox's rows are events)


def _wait_for_snapshot(feed: Held, wait_s: float) -> None:
    """A running feed reading existing rows: wait until it is done (the replica is no consistent
    cut before; a stopped feed is run through its snapshot by verify_points)."""
    from changefeed.spark.checkpoint import chunks_to_read

    spec, state = feed.spec, feed.state
    if feed.stopped:
        return
    with on_source(spec, state) as requests:
        if not chunks_to_read(spec, state, requests):
            return
        feed.report(f"verify: feed {spec.name} is reading existing rows (a snapshot): waiting for it to finish")
        deadline = time.monotonic() + wait_s
        while chunks_to_read(spec, state, requests):
            if time.monotonic() > deadline:
                raise VerifyError(f"feed {spec.name} is still reading existing rows (a snapshot) after "
                                  f"{wait_s:.0f}s", "verify once status shows the snapshot done, or give a longer "
                                  "--wait")
            time.sleep(0.5)


@dataclass(frozen=True)
class _Side:
    """One server a table is read from, at the point's snapshot."""

    uri: str
    role: str
    snapshot: str
    filters: dict[str, str] = field(default_factory=dict)  # per table, its row filter


def _sides(spec: FeedSpec, point: Point) -> tuple[list[_Side], _Side]:
    nodes = [_Side(n.uri, node_role(n.name, spec.multi_node), point.sources[n.name].snapshot, spec.row_filters)
             for n in spec.sources]
    # the replica's side filtered too: its table may hold other feeds' rows (a key-range split, capture.md)
    return nodes, _Side(spec.sink, "sink", point.sink_snapshot, spec.row_filters)


def _compare(spec: FeedSpec, point: Point, table: str, workers: int, chunk_rows: int
             ) -> tuple[cv.TableResult, list[str]]:
    """One table's result, and every differing key."""
    nodes, sink = _sides(spec, point)
    result = cv.TableResult(table)
    sessions = cs.Sessions()
    try:
        with sessions.on(nodes[0].uri, nodes[0].role, nodes[0].snapshot) as conn:
            source_cols = cs.columns(conn, table)
            if source_cols is None:
                result.schema = ["the table is missing on the source (dropped or renamed there: see alter "
                                 "--rename-table)"]
                return result, []
            described = describe_tables(conn, [table], spec.column_lists)[0]
            source_cols = cs.Columns(described.columns, described.types)  # what the feed captures
            rows = one_row(conn.execute(sql.SQL("SELECT count(*) FROM {}").format(  # (each node about as many)
                sql.Identifier(described.schema, described.name))))[0]
        with sessions.on(sink.uri, sink.role, sink.snapshot) as conn:
            sink_cols = cs.columns(conn, table)
        if sink_cols is None:
            result.schema = ["the table is missing on the sink"]
            return result, []
        result.schema = cv.schema_differences(zip(source_cols.names, source_cols.types),
                                              zip(sink_cols.names, sink_cols.types))
        key = list(described.key)
        cols = [c for c in source_cols.names if c in sink_cols.names]
        if any(k not in cols for k in key):
            return result, []
        chunks = cv.chunk_count(rows * len(nodes), chunk_rows)
        result.chunks = chunks
        with ThreadPoolExecutor(max(1, workers)) as pool:
            def sums(side: _Side) -> cv.Sums:
                with sessions.on(side.uri, side.role, side.snapshot) as c:
                    ranges = cv.block_ranges(cs.blocks(c, table), workers)

                def part(lo: int, hi: int | None) -> cv.Sums:
                    with sessions.on(side.uri, side.role, side.snapshot) as c:
                        return cs.chunk_sums(c, table, key, cols, chunks, lo, hi, side.filters.get(table))
                total: cv.Sums = {}
                for got in pool.map(lambda r: part(*r), ranges):
                    cv.add(total, got)
                return total

            source_sums: cv.Sums = {}
            for side in nodes:
                cv.add(source_sums, sums(side))
            sink_sums = sums(sink)
            result.source_rows = sum(n for n, _ in source_sums.values())
            result.sink_rows = sum(n for n, _ in sink_sums.values())
            bad = cv.mismatched(source_sums, sink_sums)
            result.chunks_mismatched = len(bad)
            if not bad:
                return result, []

            def rows_of(side: _Side) -> dict[str, int]:
                with sessions.on(side.uri, side.role, side.snapshot) as c:
                    return cs.chunk_rows(c, table, key, cols, chunks, bad, side.filters.get(table))
            got = list(pool.map(rows_of, [*nodes, sink]))
        source_rows: dict[str, int] = {}
        for part in got[:-1]:
            source_rows.update(part)
        differing = cv.keys_differing(source_rows, got[-1])
        for _, kind in differing:
            result.counts[kind] = result.counts.get(kind, 0) + 1
        _describe(result, differing[:cv.SHOWN], nodes, sink, sessions, table, key, cols)
        return result, [k for k, _ in differing]
    finally:
        sessions.close()


def _describe(result: cv.TableResult, differing: list[tuple[str, str]], nodes: list[_Side], sink: _Side,
              sessions: cs.Sessions, table: str, key: list[str], cols: list[str]) -> None:
    """The shown differences with their column values."""
    changed = [k for k, kind in differing if kind == cv.CHANGED]
    source_rows: dict[str, dict[str, str | None]] = {}
    for side in nodes:
        with sessions.on(side.uri, side.role, side.snapshot) as c:
            source_rows.update(cs.rows_of(c, table, key, cols, changed, side.filters.get(table)))
    with sessions.on(sink.uri, sink.role, sink.snapshot) as c:
        sink_rows = cs.rows_of(c, table, key, cols, changed)
    for k, kind in differing:
        d = cv.Difference(k, kind)
        if kind == cv.CHANGED:
            d.columns = cv.column_differences(source_rows.get(k, {}), sink_rows.get(k, {}))
        result.differences.append(d)


def _repair(feed: Held, todo: dict[str, list[str]], wait_s: float) -> dict[str, int]:
    """Write the source's rows of these keys into the replica at a new point (see the module doc)."""
    spec, state = feed.view, feed.state
    point = feed.meet(wait_s, hold=True)
    try:
        nodes, _ = _sides(spec, point)
        sessions = cs.Sessions()
        with connect(spec.sink, "sink") as conn, lost_connection("sink"):
            cs.session(conn)
            conn.execute("BEGIN")
            replica_ledger.lock_feed(conn, spec.key)
            if (position(conn, spec.key) or {}) != point.sink_at:
                raise TransientError("the feed moved on before the repair could start", "verify --repair again")
            for table, keys in todo.items():
                _rewrite(conn, table, keys, nodes, sessions)
            conn.execute("COMMIT")
        sessions.close()
        return {t: len(k) for t, k in todo.items()}
    finally:
        point.close()
        bar.remove(state.barrier_file)


def _rewrite(conn: psycopg.Connection[Any], table: str, keys: list[str], nodes: list[_Side],
             sessions: cs.Sessions) -> None:
    with sessions.on(nodes[0].uri, nodes[0].role, nodes[0].snapshot) as src:
        described = describe_tables(src, [table])[0]
    sink_cols = cs.columns(conn, table)
    assert sink_cols is not None
    cols = [c for c in described.columns if c in sink_cols.names]
    target = sql.Identifier(described.schema, described.name)
    key_text = sql.SQL("ROW({})::text").format(sql.SQL(", ").join(map(sql.Identifier, described.key)))
    conn.execute(sql.SQL("DELETE FROM {} WHERE {} = ANY(%s)").format(target, key_text), (keys,))
    col_list = sql.SQL(", ").join(map(sql.Identifier, cols))
    for side in nodes:
        rows = row_filter.clause(side.filters.get(table))
        with sessions.on(side.uri, side.role, side.snapshot) as src, \
                src.cursor().copy(sql.SQL("COPY (SELECT {} FROM {} WHERE {} = ANY({}) AND {}) TO STDOUT").format(
                    col_list, target, key_text, sql.Literal(keys), rows)) as out, \
                conn.cursor().copy(sql.SQL("COPY {} ({}) FROM STDIN").format(target, col_list)) as into:
            for data in out:
                into.write(data)


def verify_every(name: str, state: FeedState, every_s: float, stop: threading.Event,
                 report: Callable[[str], None]) -> None:
    """Verify the replica (each sink verify compares, of a feed with several) every `every_s` while
    the run lasts (a daemon thread: a verify that waits when the run ends leaves only its barrier,
    which expires); a failed verification is reported, it never stops the feed."""
    def once(spec: FeedSpec, sink: str | None) -> None:
        who = f"feed {name}" + (f" sink {sink}" if sink else "")
        try:
            found = verify(spec, state, report=report, sink=sink)
        except ChangefeedError as e:
            report(f"{who}: verify failed: {e.message}")
            return
        lines = found.lines()
        report(f"{who}: verified: {lines[-1]} ({lines[0]})" if found.equal
               else "\n".join(f"{who}: verify: {line}" for line in lines))

    def loop() -> None:
        while not stop.wait(every_s):
            spec = state.load()
            if spec is None:
                return
            if not spec.several_sinks:
                once(spec, None)
                continue
            for t, view, _ in sinks_of(spec):
                if verifiable(view):
                    once(spec, t.name)

    threading.Thread(target=loop, name="changefeed-verify", daemon=True).start()
