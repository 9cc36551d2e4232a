"""A chunk read on an executor reaches the sink before the next one is read (real Spark session).

Without the push-through rows the end of each chunk stays in the Python worker's output buffer
until the next chunk is written, so the sink's apply would trail the reader by a chunk or two
(see change.push_through).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark import cloudpickle

from changefeed.core import change as ch
from changefeed.spark import reads as feed_reads

# With push-through the reader waits for the sink to have the first chunk: the bound only ends a
# hang (the chunk would never come), it is no claim about speed. Without, the probe waits a while
# to see that the chunk does not come (Spark keeps it in the worker's buffer).
HANG_S, PROBE_S = 120.0, 3.0


def _chunk(n: int) -> Any:
    """A packed chunk of 1,000 rows tagged `n`, about 100 KB (bigger than Spark's output buffer)."""
    return ch.pack(pa.RecordBatch.from_pydict({"n": [n] * 1000, "pad": [b"x" * 100] * 1000}))


def _read(options: dict[str, str]) -> Any:
    """Yield a chunk, then wait until the sink has it (or the `wait` option's seconds), then yield a
    last chunk."""
    marker = Path(options["dir"]) / "got-1"
    yield _chunk(1)
    if options["push"] == "1":
        yield from feed_reads.push_through()
    t0 = time.monotonic()
    while not marker.exists() and time.monotonic() - t0 < float(options["wait"]):
        time.sleep(0.02)
    (Path(options["dir"]) / "waited").write_text(f"{time.monotonic() - t0:.3f} {marker.exists()}")
    yield _chunk(2)


def _write(options: dict[str, str], iterator: Any) -> None:
    for packed in iterator:
        for rb in ch.unpack(packed):
            (Path(options["dir"]) / f"got-{rb.column('n')[0].as_py()}").touch()


def _register(spark: Any) -> None:
    from pyspark.sql.datasource import (
        DataSource,
        DataSourceArrowWriter,
        DataSourceReader,
        InputPartition,
        WriterCommitMessage,
    )

    class Reader(DataSourceReader):
        def __init__(self, options: dict[str, str]) -> None:
            self.options = options

        def partitions(self) -> list[InputPartition]:
            return [InputPartition(0)]

        def read(self, partition: InputPartition) -> Any:
            yield from _read(self.options)

    class Writer(DataSourceArrowWriter):
        def __init__(self, options: dict[str, str]) -> None:
            self.options = options

        def write(self, iterator: Any) -> WriterCommitMessage:
            _write(self.options, iterator)
            return WriterCommitMessage()

    class PushThroughProbe(DataSource):
        @classmethod
        def name(cls) -> str:
            return "changefeed-push-through-probe"

        def schema(self) -> str:
            return ch.PACKED_DDL

        def reader(self, schema: Any) -> Reader:
            return Reader(dict(self.options))

        def writer(self, schema: Any, overwrite: bool) -> Writer:
            return Writer(dict(self.options))

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    spark.dataSource.register(PushThroughProbe)  # type: ignore[attr-defined]


def _run(spark: Any, tmp: Path, push: bool) -> tuple[float, bool]:
    tmp.mkdir()
    probe = "changefeed-push-through-probe"
    (spark.read.format(probe).option("dir", str(tmp)).option("push", "1" if push else "0")
     .option("wait", str(HANG_S if push else PROBE_S)).load()
     .coalesce(1).write.format(probe).option("dir", str(tmp)).option("push", "0").mode("append").save())
    waited, seen = (tmp / "waited").read_text().split()
    assert (tmp / "got-2").exists(), "the last chunk never reached the sink"
    return float(waited), seen == "True"


def test_chunk_reaches_sink_before_the_next_is_read(spark: object, tmp_path: Path) -> None:
    _register(spark)
    _, seen = _run(spark, tmp_path / "pushed", push=True)
    assert seen, "the sink did not get the first chunk before the next was read"
    # The probe can tell: without the push-through row the first chunk waits for the second.
    waited, seen = _run(spark, tmp_path / "plain", push=False)
    assert not seen and waited >= PROBE_S - 0.1, "Spark now flushes each batch: push_through may be dropped"


def test_unpack_skips_push_through_rows() -> None:
    fillers = ch.push_through(65537)
    assert [f.column("rows").to_pylist() for f in fillers] == [[0], [0]]
    assert [f.column("changes")[0].as_buffer().size for f in fillers] == [65537, 65537]
    rb = pa.RecordBatch.from_pydict({"n": [1, 2, 3]})
    packed = pa.concat_batches([_packed_as_plain(p) for p in (fillers[0], ch.pack(rb), fillers[1])])
    out = list(ch.unpack(packed))
    assert [b.to_pydict() for b in out] == [rb.to_pydict()]


def _packed_as_plain(packed: Any) -> Any:
    """The same packed row with plain (not sliced) buffers, so that two can be concatenated."""
    return pa.RecordBatch.from_pylist(packed.to_pylist(), schema=packed.schema)
