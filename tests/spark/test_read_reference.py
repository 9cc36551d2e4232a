"""A WAL window or snapshot chunk read by its writer task (spark.reads.resolve): where one task
reads and writes a batch, the read yields a reference and the writer reads the window or chunk
where the reference arrived. The rows it reads are the ones a reader task would have yielded, in
the same place of the batch."""
from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.core import change as ch
from changefeed.core import snapshot
from changefeed.core.lsn import Lsn
from changefeed.core.offsets import Offset
from changefeed.errors import Carried, carried, carried_in
from changefeed.sinks.base import Sink
from changefeed.sinks.registry import sink_of
from changefeed.spark import reads
from changefeed.spec.definition import SourceNode
from support.servers import Dbs


def _packed(tags: list[int]) -> Any:
    """A record batch of packed rows, one per tag: `rows` the tag, or a reference for a negative tag."""
    rows = [reads.REFERENCE if t < 0 else t for t in tags]
    changes = [pickle.dumps(-t) if t < 0 else t.to_bytes(4, "big") for t in tags]
    return pa.RecordBatch.from_arrays([pa.array(rows, pa.int32()), pa.array(changes, pa.binary())],
                                      names=["rows", "changes"])


def _what(packed: list[Any]) -> list[int]:
    return [int.from_bytes(c, "big") if r >= 0 else -1 for rb in packed
            for r, c in zip(rb.column("rows").to_pylist(), rb.column("changes").to_pylist())]


@settings(max_examples=200, deadline=None)  # (the first call imports Arrow)
@given(st.lists(st.lists(st.one_of(st.integers(1, 1000), st.integers(-9, -1)), max_size=6), max_size=6))
def test_each_reference_is_replaced_by_what_it_stands_for_in_its_place(batches: list[list[int]]) -> None:
    """Tag -k stands for part k, which reads as the rows 10000k+1 and 10000k+2 (two packed batches):
    whatever the batches' cuts, the output holds every row in order, each part where its reference was."""
    def read(part: int, sources: reads.Sources) -> Any:
        yield _packed([10_000 * part + 1])
        yield _packed([10_000 * part + 2])

    with pytest.MonkeyPatch.context() as m:
        m.setattr(reads, "_read", read)
        got = _what(list(reads.resolve(iter([_packed(b) for b in batches]))))
    expected = [x for b in batches for t in b for x in ([10_000 * -t + 1, 10_000 * -t + 2] if t < 0 else [t])]
    assert got == expected


def test_a_failed_read_is_the_sources_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's own errors are the sink's; a window or chunk it reads fails as the source's part."""
    def read(part: int, sources: reads.Sources) -> Any:
        raise psycopg.OperationalError("gone")
        yield  # (a generator)

    monkeypatch.setattr(reads, "_read", read)
    with pytest.raises(Carried) as raised, carried("sink"):
        list(reads.resolve(iter([_packed([1, -1])])))
    got = carried_in(str(raised.value))
    assert got is not None and got.component == "source", got


def test_sinks_that_take_the_rows_as_read_are_the_ones_that_may_get_references() -> None:
    assert Sink().takes_rows_as_read  # several sinks: side by side in the one task (sinks.fan_out)
    assert sink_of("postgresql://h/db").takes_rows_as_read
    assert not sink_of("delta:///tmp/x").takes_rows_as_read  # split before a shuffle: rows needed there


def _rows(packed: list[Any]) -> list[dict[str, Any]]:
    """The rows of packed record batches, as dicts; a progress row without who read it, and when:
    a chunk's `read_lsn` is the WAL's insert position at its read, which anything written on the
    server in between (a standby snapshot record, another test) moves."""
    out = [r for p in packed for rb in ch.unpack(p) for r in rb.to_pylist()]
    for r in out:
        if r["op"] == ch.PROGRESS:
            meta = ch.Progress.from_meta(r["meta"])
            chunk = meta.chunk and {**meta.chunk, "read_lsn": meta.chunk["read_lsn"] > 0}
            r["meta"] = dataclasses.replace(meta, read=None, chunk=chunk)
    return out


def test_a_chunk_read_by_reference_gives_the_rows_a_reader_task_gives(dbs: Dbs) -> None:
    with psycopg.connect(dbs.source, autocommit=True) as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY, v text, x numeric)")
        c.execute("INSERT INTO t SELECT g, repeat(md5(g::text), g % 5) || E'\\t\\n\\\\', g / 7.0 "
                  "FROM generate_series(1, 3000) g")
    node = SourceNode("default", dbs.source, "no_such_slot", "no_such_publication")
    start, end = Offset({"default": Lsn(16)}, 1), Offset({"default": Lsn(32)}, 2)

    def part(by_reference: bool) -> reads.ChunkPartition:
        p = reads.ChunkPartition(node, snapshot.Chunk(0, "public.t", [100], [2500]), start, end, 1000, False)
        p.by_reference = by_reference
        return p

    direct = list(reads.read_partition(reads.GroupPartition([part(False)])))
    referred = list(reads.read_partition(reads.GroupPartition([part(True)])))
    assert [rb.column("rows").to_pylist() for rb in referred[:1]] == [[reads.REFERENCE]]

    got, want = _rows(list(reads.resolve(iter(referred)))), _rows(direct)
    assert len([r for r in want if r["op"] == "r"]) == 2400
    assert got == want


def test_a_window_read_by_reference_gives_the_rows_a_reader_task_gives(dbs: Dbs) -> None:
    with psycopg.connect(dbs.source, autocommit=True) as c:
        c.execute("CREATE TABLE w (id int PRIMARY KEY, v text)")
        c.execute("CREATE PUBLICATION w_pub FOR TABLE w")
        c.execute("SELECT pg_create_logical_replication_slot('w_slot', 'pgoutput')")

        def insert_lsn() -> Lsn:
            row = c.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
            assert row is not None
            return Lsn.parse(row[0])

        start = insert_lsn()
        c.execute("INSERT INTO w SELECT g, md5(g::text) FROM generate_series(1, 3000) g")
        with c.transaction():
            c.execute("UPDATE w SET v = E'a\\tb\\n' WHERE id % 3 = 0")
            c.execute("DELETE FROM w WHERE id % 7 = 0")
        end = insert_lsn()
    node = SourceNode("default", dbs.source, "w_slot", "w_pub")

    def part(by_reference: bool) -> reads.WindowPartition:
        p = reads.WindowPartition(node, Offset({"default": start}, 1), Offset({"default": end}, 2), 1000, False)
        p.by_reference = by_reference
        return p

    direct = list(reads.read_partition(part(False)))  # (a peek: the slot is not moved past `start`)
    referred = list(reads.read_partition(part(True)))
    assert [rb.column("rows").to_pylist() for rb in referred[:1]] == [[reads.REFERENCE]]
    got, want = _rows(list(reads.resolve(iter(referred)))), _rows(direct)
    ops = [r["op"] for r in want]
    assert (ops.count("c"), ops.count("u"), ops.count("d"), ops.count(ch.PROGRESS)) == (3000, 1000, 428, 1)
    assert got == want


def test_the_chunks_one_task_reads_share_a_source_connection(dbs: Dbs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read one after the other, by a reader task or by the writer, a batch's chunks share one
    connection (each in its own snapshot), closed when the task's read ends."""
    with psycopg.connect(dbs.source, autocommit=True) as c:
        c.execute("CREATE TABLE s (id int PRIMARY KEY, v text)")
        c.execute("INSERT INTO s SELECT g, md5(g::text) FROM generate_series(1, 900) g")
    node = SourceNode("default", dbs.source, "no_such_slot", "no_such_publication")
    start, end = Offset({"default": Lsn(16)}, 1), Offset({"default": Lsn(32)}, 2)
    opened: list[Any] = []

    def counted(uri: str, role: str, **kw: Any) -> Any:
        opened.append(reads_connect(uri, role, **kw))
        return opened[-1]

    reads_connect = reads.connect
    monkeypatch.setattr(reads, "connect", counted)

    def group(by_reference: bool) -> reads.GroupPartition:
        parts = [reads.ChunkPartition(node, snapshot.Chunk(i, "public.s", [300 * i] if i else None,
                                                           [300 * (i + 1)] if i < 2 else None), start, end, 1000, False)
                 for i in range(3)]
        for p in parts:
            p.by_reference = by_reference
        return reads.GroupPartition(parts)

    direct = _rows(list(reads.read_partition(group(False))))
    assert len(opened) == 1 and opened[0].closed
    referred = list(reads.read_partition(group(True)))
    assert len(opened) == 1  # (references: nothing read yet)
    got = _rows(list(reads.resolve(iter(referred))))
    assert len(opened) == 2 and opened[1].closed
    assert got == direct and len([r for r in got if r["op"] == "r"]) == 900
    assert [r["meta"].chunk["no"] for r in got if r["op"] == ch.PROGRESS] == [0, 1, 2]
