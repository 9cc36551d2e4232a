"""`verify` of a Kafka sink: the source's rows at the point against the rows a consumer of each
table's topic holds after reading it up to the high watermarks noted at that point.

Both sides are compared as the envelope renders them (core.envelope's typed JSON values), so a
difference is one a consumer would see. The topics are read whole (sinks.kafka.readback): the
time and memory grow with everything the topic holds, not only with the table.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from psycopg import sql

from changefeed.core import verify as cv
from changefeed.core.copytext import split_line
from changefeed.core.pgvalue import to_json
from changefeed.postgres import checksum as cs
from changefeed.postgres import row_filter
from changefeed.postgres.connect import connect, lost_connection
from changefeed.postgres.consistent_point import ConsistentPoint
from changefeed.postgres.source import describe_tables, split_table
from changefeed.sinks.kafka.options import KafkaOptions
from changefeed.sinks.kafka.readback import bag_key, high_marks, read_rows, reading, row_identity
from changefeed.spec.definition import FeedSpec

Rows = dict[str, dict[str, Any]]


def high_marks_of(spec: FeedSpec, tables: Sequence[str]) -> dict[str, dict[int, int]]:
    """Per table: the high watermark of each partition of its topic now."""
    opts = reading(KafkaOptions.parse(spec.sink), spec.key)
    return {t: high_marks(opts, opts.topic(*split_table(t))) for t in tables}


def compare_topic(spec: FeedSpec, sources: Mapping[str, ConsistentPoint], marks: Mapping[int, int],
                  table: str) -> cv.TableResult:
    result = cv.TableResult(table)
    source: Rows = {}
    key: Sequence[str] = ()
    for node in spec.sources:
        role = spec.role(node.name)
        with connect(node.uri, role) as conn, lost_connection(role):
            cs.session(conn)
            cs.adopt(conn, sources[node.name].snapshot)
            if cs.columns(conn, table) is None:
                result.schema = ["the table is missing on the source (dropped or renamed there)"]
                return result
            described = describe_tables(conn, [table], spec.column_lists)[0]
            key = described.key
            source.update(_rows(conn, described.schema, described.name, described.columns, described.types, key,
                                spec.row_filters.get(table)))
    opts = reading(KafkaOptions.parse(spec.sink), spec.key)
    sink = read_rows(opts, opts.topic(*split_table(table)), marks, spec.format, key)
    result.source_rows, result.sink_rows = len(source), len(sink)
    differing = sorted([(k, cv.MISSING) for k in source.keys() - sink.keys()]
                       + [(k, cv.EXTRA) for k in sink.keys() - source.keys()]
                       + [(k, cv.CHANGED) for k in source.keys() & sink.keys() if source[k] != sink[k]])
    for k, kind in differing:
        result.counts[kind] = result.counts.get(kind, 0) + 1
    for k, kind in differing[:cv.SHOWN]:
        d = cv.Difference(_shown_key(k), kind)
        if kind == cv.CHANGED:
            d.columns = cv.column_differences(_texts(source[k]), _texts(sink[k]))
            d.columns.update({c: (None, v) for c, v in _texts(sink[k]).items() if c not in source[k]})
        result.differences.append(d)
    return result


def _rows(conn: Any, schema: str, name: str, columns: Sequence[str], types: Sequence[str],
          key: Sequence[str], where: str | None) -> Rows:
    """The table's rows that its row filter `where` lets through, as the envelope renders them, by
    key (a JSON list of the key's values)."""
    out: Rows = {}
    query = sql.SQL("COPY (SELECT {} FROM {} WHERE {}) TO STDOUT").format(
        sql.SQL(", ").join(map(sql.Identifier, columns)), sql.Identifier(schema, name), row_filter.clause(where))
    with conn.cursor().copy(query) as copy:
        for data in copy:
            line = bytes(data)
            values = split_line(line[:-1] if line.endswith(b"\n") else line)
            row = json.loads(json.dumps({c: to_json(v, t) for c, t, v in zip(columns, types, values)}))
            out[json.dumps([row[k] for k in key]) if key else bag_key(out, row_identity(row))] = row
    return out


def _texts(row: Mapping[str, Any]) -> dict[str, str | None]:
    return {c: None if v is None else json.dumps(v, ensure_ascii=False) for c, v in row.items()}


def _shown_key(key: str) -> str:
    """A key as verify shows keys: (v1,v2); a row of a table without a key by its values."""
    if key.startswith("{"):  # (readback.bag_key: the row's identity, then which copy)
        return "(" + ",".join(str(v) for v in json.loads(key.rsplit("#", 1)[0]).values()) + ")"
    return "(" + ",".join(str(v) for v in json.loads(key)) + ")"
