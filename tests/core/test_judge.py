"""core.judge: which window changes a snapshot read holds already (pure: the key order aside)."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from changefeed.core.judge import Judge, Read, carried, everything, reads_of
from changefeed.core.offsets import Offset
from changefeed.core.snapshot import Chunk, Cursor


def test_a_batchs_neighbouring_chunks_are_one_read_and_keyless_scoped_or_later_ones_none() -> None:
    chunks = [Chunk(3, "s.a", ["10"], ["20"], first=True), Chunk(2, "s.a", None, ["10"], first=True),
              Chunk(4, "s.b", None, None, first=True), Chunk(5, "s.c", None, None, ("lake",)),
              Chunk(6, "s.k", None, None, first=True), Chunk(7, "s.a", None, None)]
    reads = reads_of(chunks, {"main": ("5:9:7", 100)}, "main", keyless=["s.k"])
    assert reads == [Read("s.a", None, ["20"], "5:9:7", 100), Read("s.b", None, None, "5:9:7", 100)]
    assert reads_of(chunks, {}, "main") == []  # no export: nothing is judged


def test_reads_are_carried_until_the_stream_passes_their_high_water_mark() -> None:
    reads = [Read("s.a", None, None, "5:9:", 100), Read("n2:s.a", None, None, "5:9:", 300)]
    assert carried(reads, {"n1": 99, "n2": 300}, "n1") == reads[:1]
    assert carried(reads, {"n1": 100, "n2": 299}, "n1") == reads[1:]
    assert carried(reads, {"n1": 0}, "n1") == reads[:1]  # a node gone from the feed drops its reads


def test_a_judge_drops_what_the_read_saw_and_what_is_still_to_be_read() -> None:
    reads = [Read("s.a", None, ["20"], "100:110:104,107", 1)]
    cursor = Cursor(pending=("s.a", "s.b", "s.c", "s.k", "s.d"), after=["20"], upto=["90"],
                    only=("", "", "lake", "", ""), first=4)
    judge = Judge.of("main", reads, cursor, keyless=["s.k"])  # (s.d: a request, read again after the first reads)
    assert judge.tables() == {"s.a", "s.b"}
    assert judge.ranges("s.a", 99) == [(["20"], ["90"]), (None, ["20"])]  # seen: below xmin
    assert judge.ranges("s.a", 104) == [(["20"], ["90"])]  # in progress when read: not seen
    assert judge.ranges("s.a", 110) == [(["20"], ["90"])]  # at or past xmax: not seen
    assert everything(judge.ranges("s.b", 1)) and not judge.ranges("s.c", 1)


def test_a_judge_of_a_node_takes_its_own_entries_only() -> None:
    reads = [Read("n1:s.a", None, None, "5:9:", 1), Read("n2:s.a", ["3"], None, "5:9:", 1)]
    judge = Judge.of("n2", reads, Cursor(pending=("n1:s.b", "n2:s.c"), first=2))
    assert judge.ranges("s.a", 6) == [(["3"], None)] and judge.tables() == {"s.a", "s.c"}
    assert not Judge.of("n3", reads, Cursor())


keys = st.none() | st.lists(st.integers(0, 99).map(str), min_size=1, max_size=2)


@given(st.lists(st.tuples(st.sampled_from(["s.a", "n2:s.b"]), keys, keys, st.integers(1, 5), st.integers(0, 1 << 40))),
       st.dictionaries(st.sampled_from(["main", "n2"]), st.integers(0, 1 << 40)))
def test_reads_and_exports_round_trip_in_offsets(raw: list[tuple[str, list[str] | None, list[str] | None, int, int]],
                                                  exports: dict[str, int]) -> None:
    reads = tuple(Read(e, lo, hi, f"{x}:{x + 3}:{x + 1}", hw) for e, lo, hi, x, hw in raw)
    ids = {n: f"00000003-{i:08X}-1" for n, i in exports.items()}
    offset = Offset({"main": 5, "n2": 7}, 3, reads=reads, exports=ids)
    assert Offset.from_json(offset.to_json()) == offset
    assert "reads" not in Offset({"main": 5}).to_json()  # (an offset without them keeps its old shape)


def test_a_first_read_stays_first_through_its_chunks_and_a_request_after_it_is_not() -> None:
    cursor = Cursor(pending=("s.a", "s.b"), first=2).request(["s.a"], 1)
    assert cursor.pending == ("s.a", "s.b", "s.a") and cursor.first == 2
    seen: list[tuple[str, bool]] = []
    while cursor.pending:
        chunks, cursor = cursor.plan(lambda t, after, rows, upto: None if after else ["5"], 1, 10,
                                     last=lambda t: ["9"])
        seen += [(c.table, c.first) for c in chunks]
        assert Cursor.from_offset({"snap": cursor.to_json()}) == cursor
        assert all(Chunk.from_json(c.to_json()) == c for c in chunks)
    assert seen == [("s.a", True), ("s.a", True), ("s.b", True), ("s.b", True), ("s.a", False), ("s.a", False)]


def test_a_table_brought_into_the_feed_is_a_first_read_behind_a_request_being_read() -> None:
    """alter --add-tables while a request of a table the sinks hold is read (core.requests.Request.first):
    the new table's read is first, wherever it waits; a request of it again, for all sinks, is
    merged into it, and one read again after it began is not first."""
    cursor = Cursor(pending=("s.a",), after=["5"], upto=["9"]).request(["s.n"], 1, first=True)
    assert cursor.pending == ("s.a", "s.n") and cursor.first_reads() == (False, True)
    assert Cursor.from_offset({"snap": cursor.to_json()}) == cursor
    judge = Judge.of("main", [], cursor)
    assert judge.tables() == {"s.n"} and everything(judge.ranges("s.n", 1)) and not judge.ranges("s.a", 1)
    assert cursor.request(["s.n"], 2).pending == cursor.pending  # (pending: merged into the first read)
    assert not Cursor(pending=("s.a",)).request(["s.n"], 1, ["lake"], first=True).fresh  # (for some sinks: not first)
    seen: list[tuple[str, bool]] = []
    while cursor.pending:
        chunks, cursor = cursor.plan(lambda t, after, rows, upto: None if after else ["5"], 1, 10,
                                     last=lambda t: ["9"])
        seen += [(c.table, c.first) for c in chunks]
        if cursor.pending == ("s.n",) and cursor.after and cursor.fresh:  # a request while its read is under way
            cursor = cursor.request(["s.n"], 3)
            assert cursor.pending == ("s.n", "s.n") and cursor.first_reads() == (True, False)
    assert seen == [("s.a", False), ("s.n", True), ("s.n", True), ("s.n", False), ("s.n", False)]
    assert not cursor.fresh and "fresh" not in cursor.to_json()


def test_a_read_is_carried_only_if_its_table_held_its_storage_by_the_window_end() -> None:
    from changefeed.core.judge import Truncates

    t = Truncates()
    assert not t.steady("s.a", "1", 100)  # never noted: not known
    t.note("s.a", "1", 50)
    t.note("s.a", "1", 80)  # (the earliest note of a storage counts)
    assert t.steady("s.a", "1", 50) and t.steady("s.a", "1", 100) and not t.steady("s.a", "1", 49)
    assert not t.steady("s.a", "2", 100)  # the read saw a truncate the planner had not noted
    t.note("s.a", "2", 120)
    assert t.steady("s.a", "2", 120) and not t.steady("s.a", "2", 100)  # truncated between 100 and 120
    assert not t.steady("s.a", "", 200)
