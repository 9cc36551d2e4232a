"""Merging a batch's node partitions: snapshot rows first, transactions in commit-ts order, nothing lost."""
from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.core import change as ch
from changefeed.core import merge
from changefeed.errors import IncompleteBatch


def rows(node: str, txns: list[tuple[int, int, int]], op: str = "u") -> pa.RecordBatch:
    """`txns`: (lsn, commit_ts, rows) each; a row's `after` names node, lsn and its place."""
    cols: dict[str, list[object]] = {n: [] for n in ch.NAMES}
    for lsn, ts, n in txns:
        for seq in range(n):
            for name, v in (("op", op), ("schema", "public"), ("table", "t"), ("lsn", lsn), ("seq", seq), ("xid", 1),
                            ("commit_time", None), ("commit_ts", ts), ("after", f"{node}/{lsn}/{seq}".encode()),
                            ("before", None), ("old_key", None), ("unchanged", None), ("meta", None)):
                cols[name].append(v)
    return ch.record_batch(cols)


def progress(node: str, part: int, parts: int, chunk: bool = False) -> pa.RecordBatch:
    return ch.progress_batch(ch.Progress(0, 0, None, 0, {"no": part} if chunk else None, part, parts, node,
                                         {"n1": 1, "n2": 1, "n3": 1}))


node_txns = st.lists(st.tuples(st.integers(1, 50), st.integers(1, 4)), max_size=8)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(["n1", "n2", "n3"]), node_txns, min_size=1))
def test_merge_keeps_each_node_in_order_and_all_nodes_in_commit_ts_order(txns: dict[str, list[tuple[int, int]]]) -> None:
    batches, parts = [], len(txns)
    for i, (node, spec) in enumerate(sorted(txns.items())):
        ts, per_node = 0, []
        for lsn, (step, n) in enumerate(spec, 1):
            ts += step  # timestamps grow with LSN on one node
            per_node.append((lsn * 10, ts, n))
        batches += [rows(node, per_node), progress(node, i, parts)]
    out = merge.ordered(merge.split(batches))
    after = [a.decode().split("/") for a in out.column("after").to_pylist()]
    assert len(after) == sum(n for spec in txns.values() for _, n in spec)
    assert out.column("lsn").to_pylist() == list(range(len(after)))  # positions in the order
    keys = [(int(ts), node, int(lsn), int(seq)) for (node, lsn, seq), ts in zip(after, out.column("commit_ts").to_pylist())]
    assert keys == sorted(keys)  # by commit ts, then node name, then LSN; a transaction's rows in order


def test_snapshot_rows_of_a_node_come_before_every_transaction() -> None:
    batches = [rows("n2", [(10, 5, 2)]), progress("n2", 0, 3),
               rows("n1", [(0, 99, 3)], op="r"), progress("n1", 1, 3, chunk=True),
               rows("n1", [(20, 7, 1)]), progress("n1", 2, 3)]
    out = merge.ordered(merge.split(batches))
    assert out.column("op").to_pylist() == ["r", "r", "r", "u", "u", "u"]
    assert [a.split(b"/")[0] for a in out.column("after").to_pylist()] == [b"n1"] * 3 + [b"n2", b"n2", b"n1"]


def test_rows_after_the_last_progress_row_mean_a_cut_short_batch() -> None:
    with pytest.raises(IncompleteBatch):
        merge.split([rows("n1", [(1, 1, 1)]), progress("n1", 0, 2), rows("n2", [(1, 1, 1)])])
