"""The json format built by columns (core.envelope_columns) gives the very bytes the row-by-row
path gives, for batches of every op, every common type's odd values, NULLs and COPY escapes,
tables with and without a key, and runs cut by other tables and ops."""
from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.core import change as ch
from changefeed.core.copytext import join_line
from changefeed.core.envelope import formatter
from changefeed.sinks.messages import MessageStream

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
DIGITS = st.integers(-(2**63), 2**63 - 1).map(str)
TS = st.tuples(st.integers(1, 12345), st.integers(1, 12), st.integers(1, 28), st.integers(0, 23),
               st.sampled_from(["", ".5", ".123456"]), st.sampled_from(["", "+00", "+05:30", "-08", " BC"])).map(
    lambda t: f"{t[0]:04d}-{t[1]:02d}-{t[2]:02d} {t[3]:02d}:00:59{t[4]}{t[5]}")
VALUES: dict[str, Any] = {
    "integer": DIGITS, "bigint": DIGITS, "smallint": st.integers(-32768, 32767).map(str),
    "numeric": st.sampled_from(["0", "-1.50", "NaN", "Infinity", "123456789012345678901234567890.000001"]),
    "boolean": st.sampled_from(["t", "f"]),
    "text": st.one_of(TEXT, st.sampled_from(["it's", "a\\tb"])), "character varying(10)": TEXT, "character(3)": TEXT,
    "uuid": st.uuids().map(str),
    "timestamp with time zone": st.one_of(TS, st.just("infinity")),
    "timestamp without time zone": st.one_of(TS, st.just("-infinity")),
    "date": st.sampled_from(["2024-02-29", "0001-01-01 BC", "12345-01-01", "infinity"]),
    "jsonb": st.sampled_from(['{"a": 1, "b": [true, null]}', '"x"', "3.5", "null"]),
    "bytea": st.sampled_from(["\\x", "\\x00ff10"]),
    "integer[]": st.sampled_from(["{}", "{1,NULL,3}", "[0:1]={1,2}"]),
    "bit varying": st.sampled_from(["", "1011"]),
    "double precision": st.sampled_from(["1.5", "NaN", "-Infinity", "1e+20", "0.1"]),
}
TYPES = sorted(VALUES)


@st.composite
def shapes(draw: Any) -> ch.TableShape:
    types = draw(st.lists(st.sampled_from(TYPES), min_size=1, max_size=6))
    columns = tuple(f"c{i}" if i % 2 else f'"odd {i}"' for i in range(len(types)))
    key = tuple(draw(st.sets(st.sampled_from(columns[:3]), max_size=2)))
    identity = "f" if not key else draw(st.sampled_from("dfi"))
    return ch.TableShape("s", draw(st.sampled_from(["t", "u"])), columns, tuple(types), key, identity)


@st.composite
def batches(draw: Any) -> Any:
    shapes_ = draw(st.lists(shapes(), min_size=1, max_size=2, unique_by=lambda s: s.table))
    out: list[dict[str, Any]] = [{"op": ch.RELATION, "schema": s.schema, "table": s.table, "meta": s.to_meta()}
                                 for s in shapes_]
    for i in range(draw(st.integers(1, 40))):
        shape = draw(st.sampled_from(shapes_))
        op = draw(st.sampled_from("cccrruudt"))
        values = [draw(st.one_of(st.none(), VALUES[t])) if c not in shape.key else draw(VALUES[t])
                  for c, t in zip(shape.columns, shape.types)]
        line = join_line(None if v is None else v.encode() for v in values)
        # the old row of a delete: the identity's columns, others left out (NULL), unless FULL
        old = line if shape.replica_identity == "f" else join_line(
            None if v is None or c not in shape.key else v.encode() for c, v in zip(shape.columns, values))
        snapshot = op == "r"
        row = {"op": op, "schema": shape.schema, "table": shape.table, "lsn": 100 + i, "seq": i,
               "xid": 0 if snapshot else draw(st.sampled_from([7, 2**32 + 5])),
               "commit_time": None if snapshot else draw(st.sampled_from([1_700_000_000_123_456, -5_000_001])),
               "commit_ts": (draw(st.sampled_from([5, 1_700_000_000_123])) << 16) + i,
               "after": line if op in "cur" else None, "before": old if op == "d" else None}
        if op == "u" and shape.replica_identity == "f" and draw(st.booleans()):
            row["before"] = line  # an update with its old row
        if op == "u" and draw(st.booleans()) and shape.key:  # a key change, or an unchanged TOAST value
            if draw(st.booleans()):
                row["old_key"] = join_line(v.encode() for v in (draw(VALUES[shape.types[shape.columns.index(k)]])
                                                                 for k in shape.key))
            else:
                row["unchanged"] = "{0}"
        out.append(row)
    out.append({"op": ch.PROGRESS, "lsn": 999, "meta": ch.Progress(999, 6 << 16, None, len(out)).to_meta()})
    return ch.record_batch({n: [r.get(n) for r in out] for n in ch.NAMES})


@settings(max_examples=300, deadline=None)
@given(batches(), st.sampled_from(["json", "json-diff", "debezium", "text"]), st.booleans())
def test_by_columns_the_messages_are_those_row_by_row(rb: Any, fmt: str, tombstones: bool) -> None:
    name, diff = fmt.split("-")[0], fmt.endswith("-diff")
    tombstones = tombstones and name != "debezium"  # (the sink's: debezium makes its own)
    fast = MessageStream(formatter(name, "feed \"x\"", diff, "db"), lambda s, t: f"{s}.{t}", tombstones)
    slow = MessageStream(formatter(name, "feed \"x\"", diff, "db"), lambda s, t: f"{s}.{t}", tombstones)
    assert list(fast.messages(rb)) == list(slow._each(rb))
    assert fast.progress() == slow.progress()


def test_a_run_of_inserts_is_built_by_columns() -> None:
    """(so the property above compares two paths, not one with itself)"""
    from changefeed.core import envelope_columns

    shape = ch.TableShape("s", "t", ("id", "v"), ("integer", "text"), ("id",), "d")
    rows = ch.record_batch({n: [{"op": "c", "after": b"1\tx", "commit_ts": 3, "schema": "s", "table": "t"}.get(n)]
                            for n in ch.NAMES})
    assert envelope_columns.kinds(rows).tolist() == [envelope_columns.PLAIN]
    assert formatter("json", "f").by_columns(rows, shape, deleted=False) == (
        [b"[1]"], [b'{"after":{"id":1,"v":"x"},"key":[1],"op":"c","updated":"3","table":"s.t"}'], False)
    deleted = ch.record_batch({n: [{"op": "d", "before": b"1\t\\N", "commit_ts": 3 << 18, "commit_time": 3000, "xid": 9,
                                    "lsn": 77, "schema": "s", "table": "t"}.get(n)] for n in ch.NAMES})
    assert envelope_columns.kinds(deleted).tolist() == [envelope_columns.DELETE]
    built = formatter("debezium", "f", database="db").by_columns(deleted, shape, deleted=True)
    assert built is not None and built.keys == [b'{"id":1}'] and built.tombstones
    assert built.values[0].startswith(b'{"before":{"id":1},"after":null,"source":{"version":"changefeed-')
    assert built.values[0].endswith(b'"connector":"postgresql","name":"f","ts_ms":3,"ts_us":3000,"ts_ns":3000000,'
                                    b'"snapshot":"false","db":"db","schema":"s","table":"t","txId":9,"lsn":77,'
                                    b'"xmin":null},"op":"d","ts_ms":3,"ts_us":3000,"ts_ns":3000000,"transaction":null}')
