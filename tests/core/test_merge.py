"""Merging a batch's node partitions: snapshot rows first, transactions in commit-ts order, nothing lost."""
from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.core import change as ch
from changefeed.core import merge
from changefeed.errors import IncompleteBatch, TornTransaction


def rows(node: str, txns: list[tuple[int, int, int]], op: str = "u", times: list[int] | None = None,
         xids: list[int] | None = None) -> pa.RecordBatch:
    """`txns`: (lsn, commit_ts, rows) each (commit time: `times`, else the ts in µs; xid: `xids`,
    else 1); a row's `after` names node, lsn and its place."""
    cols: dict[str, list[object]] = {n: [] for n in ch.NAMES}
    for i, (lsn, ts, n) in enumerate(txns):
        for seq in range(n):
            for name, v in (("op", op), ("schema", "public"), ("table", "t"), ("lsn", lsn), ("seq", seq),
                            ("xid", xids[i] if xids else 1), ("commit_time", times[i] if times else ts * 1000),
                            ("commit_ts", ts), ("after", f"{node}/{lsn}/{seq}".encode()),
                            ("before", None), ("old_key", None), ("unchanged", None), ("meta", None)):
                cols[name].append(v)
    return ch.record_batch(cols)


def progress(node: str, part: int, parts: int, chunk: bool = False, gids: list[list[object]] | None = None,
             pending: list[str] | None = None) -> pa.RecordBatch:
    return ch.progress_batch(ch.Progress(0, 0, None, 0, {"no": part} if chunk else None, part, parts, node,
                                         {"n1": 1, "n2": 1, "n3": 1}, gids=gids, pending=pending))


node_txns = st.lists(st.tuples(st.integers(1, 50), st.integers(1, 4)), max_size=8)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(["n1", "n2", "n3"]), node_txns, min_size=1))
def test_merge_keeps_each_node_in_order_and_all_nodes_in_commit_ts_order(
        txns: dict[str, list[tuple[int, int]]]) -> None:
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
    keys = [(int(ts), node, int(lsn), int(seq))
            for (node, lsn, seq), ts in zip(after, out.column("commit_ts").to_pylist())]
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


def test_a_transaction_keeps_its_place_after_a_concurrent_commit_with_a_later_time() -> None:
    # n1 wrote a commit of time 50 before one of time 40 (concurrent commits): the second stays
    # behind the first, after n2's commit of time 45 (which cannot have read it: it was written
    # after the first, so after time 50)
    batches = [rows("n1", [(10, 1, 1), (20, 2, 1)], times=[50, 40]), progress("n1", 0, 2),
               rows("n2", [(10, 1, 1)], times=[45]), progress("n2", 1, 2)]
    out = merge.ordered(merge.split(batches))
    assert [a.decode() for a in out.column("after").to_pylist()] == ["n2/10/0", "n1/10/0", "n1/20/0"]


def test_parts_share_the_latest_timestamp_and_a_node_never_goes_back() -> None:
    # g: xid 7 on n1 (ts 10), xid 8 on n2 (ts 30); n1 commits xid 9 (ts 20) after its part of g
    batches = [rows("n1", [(10, 10, 1), (20, 20, 1)], xids=[7, 9]), progress("n1", 0, 2, gids=[["g", 7]]),
               rows("n2", [(10, 30, 1)], xids=[8]), progress("n2", 1, 2, gids=[["g", 8]])]
    out = merge.ordered(merge.split(batches), renumber=False)
    got = {a.decode(): (ts, t) for a, ts, t in zip(out.column("after").to_pylist(), out.column("commit_ts").to_pylist(),
                                                    out.column("commit_time").to_pylist())}
    assert got == {"n1/10/0": (30, 30_000), "n2/10/0": (30, 30_000), "n1/20/0": (30, 20_000)}


def test_a_part_delivered_while_another_is_pending_stops_the_batch() -> None:
    batches = [rows("n1", [(10, 10, 1)], xids=[7]), progress("n1", 0, 2, gids=[["g", 7]]),
               rows("n2", [(10, 30, 1)]), progress("n2", 1, 2, pending=["g"])]
    with pytest.raises(TornTransaction, match="'g'.*source node n1.*source node n2"):
        merge.refuse_torn(merge.split(batches))
