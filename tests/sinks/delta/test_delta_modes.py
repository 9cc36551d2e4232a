"""The Delta sink's mirror and history modes against a model (hypothesis): random changes of a
few keys (inserts, updates, key changes, deletes, truncates), split into buckets by key hash
(delta.split) and applied bucket by bucket, batch after batch, as the writer tasks do."""
from __future__ import annotations

from typing import Any

import pyarrow as pa
from hypothesis import example, given, settings
from hypothesis import strategies as st

from changefeed.core import change as ch
from changefeed.sinks.delta.history import apply_history
from changefeed.sinks.delta.mirror import apply_mirror
from changefeed.sinks.delta.split import MOVED, by_bucket
from changefeed.sinks.delta.table import Files, fill_moved

SHAPE = ch.TableShape("public", "t", ("id", "v"), ("integer", "text"), ("id",), "d")
BUCKETS = 3

# one step: (op, key, value, new key)
steps = st.lists(st.tuples(st.sampled_from("cudkt"), st.integers(0, 6), st.text("ab\t\\", max_size=3),
                           st.integers(0, 6)), max_size=30)


def _line(*values: Any) -> bytes:
    from changefeed.core.copytext import join_line

    return join_line([None if v is None else str(v).encode() for v in values])


def _changes(script: list[tuple[str, int, str, int]]) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Change rows for the steps that make sense against the model, and the model after them."""
    model: dict[int, str] = {}
    rows: list[dict[str, Any]] = []
    for n, (op, key, value, new) in enumerate(script):
        row = {"op": op, "schema": "public", "table": "t", "lsn": n, "seq": 0, "xid": n, "commit_time": n * 1000,
               "commit_ts": n << 18, "after": None, "before": None, "old_key": None, "unchanged": None, "meta": None}
        if op == "c" and key not in model:
            model[key] = value
            row["after"] = _line(key, value)
        elif op == "u" and key in model:
            unchanged = value == ""  # an empty new value stands for "TOASTed, left unchanged"
            model[key] = model[key] if unchanged else value
            row.update(after=_line(key, None if unchanged else value), unchanged="{1}" if unchanged else None)
        elif op == "k" and key in model and new not in model:  # a key change, the value left unchanged
            model[new] = model.pop(key)
            row.update(op="u", after=_line(new, None), before=_line(key, None), old_key=_line(key), unchanged="{1}")
        elif op == "d" and key in model:
            del model[key]
            row["before"] = _line(key, None)
        elif op == "t":
            model.clear()
        else:
            continue
        rows.append(row)
    return rows, model


def _run(script: list[tuple[str, int, str, int]], cut: int, apply: Any, key: tuple[str, ...]) -> tuple[Any, dict]:
    rows, model = _changes(script)
    state: dict[int, pa.Table | None] = {b: None for b in range(BUCKETS)}
    for batch in (rows[:cut], rows[cut:]):
        if not batch:
            continue
        files = Files("", pa.schema([]), True, key=key)
        outs = {}
        for bucket, piece in by_bucket(ch.record_batch({n: [r[n] for r in batch] for n in ch.NAMES}), SHAPE, BUCKETS):
            out = apply(state[bucket], [(SHAPE, piece)], SHAPE)
            files.departed.update(out.departed)
            outs[bucket] = out
        for bucket, out in outs.items():  # what delta.table.fill_moved does with the files, on the tables
            rows_now = out.rows
            if out.pending:
                patched = Files("", rows_now.schema, True, key=key, departed=files.departed)
                rows_now = _patched(rows_now, out.pending, patched)
            state[bucket] = rows_now
    return state, model


def _patched(rows: pa.Table, pending: list[Any], files: Files) -> pa.Table:
    import os
    import tempfile

    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as d:
        pq.write_table(rows, os.path.join(d, "f.parquet"))
        files.uri, files.adds, files.pending = d, [{"path": "f.parquet"}], [("f.parquet", pending)]
        fill_moved([files])
        return pq.read_table(os.path.join(d, "f.parquet"))


# key changes whose unchanged value must come from the old row (first found by hypothesis); keys 0
# and 1 share a bucket, 2 and 3 are in another (test_the_examples_stay_in_and_cross_buckets)
MOVED_THEN_UNCHANGED = [("c", 0, "", 0), ("k", 0, "", 1), ("u", 1, "", 0)]  # '' is a real value here
MOVED_ON = [("c", 0, "x", 0), ("k", 0, "", 1), ("k", 1, "", 2)]  # a chain of key changes
MOVED_OUT_TWICE = [("c", 0, "a", 0), ("k", 0, "", 1), ("c", 0, "b", 0), ("k", 0, "", 2)]  # 1 gets a, 2 gets b
MOVED_BACK = [("c", 0, "a", 0), ("k", 0, "", 3), ("u", 3, "b", 0), ("k", 3, "", 0), ("u", 0, "", 0)]


def key_change_examples(f: Any) -> Any:
    """The examples above, each as one batch and cut in two, checked on every run."""
    for script in (MOVED_THEN_UNCHANGED, MOVED_ON, MOVED_OUT_TWICE, MOVED_BACK):
        f = example(script, 0)(example(script, 2)(f))
    return f


@settings(max_examples=150, deadline=None)
@given(steps, st.integers(0, 30))
@key_change_examples
def test_mirror_equals_the_model(script: list[tuple[str, int, str, int]], cut: int) -> None:
    state, model = _run(script, cut, apply_mirror, ("id",))
    got = {r["id"]: r["v"] for t in state.values() if t is not None for r in t.to_pylist()}
    assert got == model


@settings(max_examples=150, deadline=None)
@given(steps, st.integers(0, 30))
@key_change_examples
def test_history_current_versions_equal_the_model_and_never_overlap(script: list[tuple[str, int, str, int]],
                                                                   cut: int) -> None:
    state, model = _run(script, cut, apply_history, ("id", "_commit_ts"))
    versions = [r for t in state.values() if t is not None for r in t.to_pylist()]
    assert {r["id"]: r["v"] for r in versions if r["_current"]} == model
    for k in {r["id"] for r in versions}:
        vs = sorted((r for r in versions if r["id"] == k), key=lambda r: r["_commit_ts"])
        assert sum(r["_current"] for r in vs) <= 1 and all(not r["_current"] for r in vs[:-1])
        assert all(a["_valid_to"] is not None and a["_valid_to"] <= b["_valid_from"] for a, b in zip(vs, vs[1:]))


def test_a_key_change_is_split_into_its_buckets_and_a_truncate_goes_everywhere() -> None:
    rows, _ = _changes([("c", 1, "x", 0), ("k", 1, "", 2), ("t", 0, "", 0)])
    groups = dict(by_bucket(ch.record_batch({n: [r[n] for r in rows] for n in ch.NAMES}), SHAPE, BUCKETS))
    assert sorted(groups) == list(range(BUCKETS))
    ops = [r for b in groups.values() for r in b.to_pylist()]
    assert sum(r["op"] == "t" for r in ops) == BUCKETS
    assert [r["meta"] for r in ops if r["op"] == "d"] == [MOVED]


def test_the_examples_stay_in_and_cross_buckets() -> None:
    """The examples test the hand-over within a bucket and between buckets."""
    def bucket(key: int) -> int:
        rows, _ = _changes([("c", key, "x", 0)])
        return next(b for b, _ in by_bucket(ch.record_batch({n: [r[n] for r in rows] for n in ch.NAMES}), SHAPE,
                                            BUCKETS))

    assert bucket(0) == bucket(1) != bucket(2) == bucket(3)


def test_every_version_after_a_key_change_gets_the_old_rows_unchanged_value() -> None:
    """Not only the key change's version: the next unchanged update's copies the value too (it
    used to copy the null that stood in for it until the driver filled the first one)."""
    state, _ = _run(MOVED_THEN_UNCHANGED + [("u", 1, "", 0)], 0, apply_history, ("id", "_commit_ts"))
    versions = sorted((r for t in state.values() if t is not None for r in t.to_pylist()),
                      key=lambda r: r["_commit_ts"])
    assert [(r["id"], r["v"]) for r in versions] == [(0, ""), (1, ""), (1, ""), (1, "")]
