"""`python -m changefeed.spark.jvm_exercise OPTION`: the work a JVM class archive is recorded from
(jvm_archive runs it in a process of its own, with the JVM option that writes or tests an archive)."""
from __future__ import annotations

import sys
import time

from changefeed.spark.job import spark_session


def exercise(option: str) -> None:
    """Start a SparkSession whose driver JVM has `option`, run the kinds of work a feed runs, and
    wait for the JVM to exit (it writes an archive as it exits)."""
    spark = spark_session("local[2]", "changefeed-jvm-archive", java_options=option)
    spark.range(100).count()
    spark.sparkContext.parallelize(range(100), 1).map(lambda x: x + 1).sum()  # a Python worker
    query = spark.readStream.format("rate").load().writeStream.format("noop").start()
    deadline = time.monotonic() + 120
    while query.lastProgress is None and time.monotonic() < deadline:
        time.sleep(0.2)
    query.stop()
    jvm = spark.sparkContext._gateway.proc
    spark.stop()
    jvm.stdin.close()  # the JVM exits when its stdin closes
    jvm.wait(timeout=600)


if __name__ == "__main__":
    exercise(sys.argv[1])
