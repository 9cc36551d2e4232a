"""The warm-up query (spark.warm_up): a feed's first streaming commit takes a Python worker the
warm-up left, with the feed's modules loaded, instead of starting one."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from changefeed.spark import warm_up
from changefeed.spec.definition import FeedSpec

# On a Spark of its own (a session shared with other tests has idle commit workers of theirs,
# which Spark hands out first): a warm-up told to load a module nothing in a Spark worker
# imports, then one batch through a probe sink whose commit says whether it finds the module.
PROBE = """
import sys, time
from pathlib import Path
from pyspark.sql.datasource import DataSource, DataSourceStreamWriter, WriterCommitMessage
from changefeed.spark import warm_up
from changefeed.spark.job import spark_session

MARKER, folder = "colorsys", Path(sys.argv[1])

class Done(WriterCommitMessage):
    pass

class Probe(DataSourceStreamWriter):
    def write(self, iterator):
        return Done()

    def commit(self, messages, batchId):
        (folder / "probe").write_text(str(MARKER in sys.modules))

class ProbeSink(DataSource):
    @classmethod
    def name(cls):
        return "changefeed-test-probe"

    def schema(self):
        return "value long"

    def streamWriter(self, schema, overwrite):
        return Probe()

spark = spark_session("local[1]", log=folder / "spark.log")
started = time.monotonic()
warm_up._warm_query(spark, MARKER, folder / "warm-up")
assert time.monotonic() - started < warm_up.WARM_S, "stopped, not ended by itself"
assert not (folder / "warm-up").exists(), "its checkpoint left behind"
spark.dataSource.register(ProbeSink)
query = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", 1).load().select("value")
         .writeStream.format("changefeed-test-probe").option("checkpointLocation", str(folder / "probe-checkpoint"))
         .trigger(availableNow=True).start())
assert query.awaitTermination(120)
print((folder / "probe").read_text())
"""


def test_the_first_commit_of_a_query_takes_the_worker_the_warm_up_left(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "True"


def test_a_session_is_warmed_once_and_a_warm_up_that_fails_stays_quiet(tmp_path: Path) -> None:
    class Session:  # a session of the feed's own, as far as warm_commit looks
        _jsparkSession = object()

    session = Session()
    thread = warm_up.warm_commit(session, _spec(), tmp_path / "warm-up")
    assert thread is not None
    thread.join(60)
    assert not thread.is_alive()  # (its query could not even start: nothing raised)
    assert warm_up.warm_commit(session, _spec(), tmp_path / "warm-up") is None
    remote = object()  # a Spark Connect session: no driver of the feed's own
    assert warm_up.warm_commit(remote, _spec(), tmp_path / "warm-up") is None


def _spec() -> FeedSpec:
    return FeedSpec("f", "postgresql://localhost/src", "postgresql://localhost/dst", ("public.t",))
