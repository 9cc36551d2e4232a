"""The Spark settings a feed runs with, in one place: a feed's own driver takes them all, a Spark
Connect server started by changefeed (spark.connect) takes the driver's, and every session a feed
opens on any server sets the session's."""
from __future__ import annotations

import os

# The driver JVM plans batches and passes packed chunks between Python processes; it never runs
# long enough in one place to repay C2's slow compiles, which on two cores compete with the start
# of the feed itself. C1 alone starts a feed much sooner at the same batch throughput (bench/README.md).
QUICK_JIT = "-XX:TieredStopAtLevel=1"

# Per session: a query's plan depends on them, whatever Spark it runs on.
SESSION = {
    "spark.sql.shuffle.partitions": "2",
    # a packed row is a whole chunk of changes: hand each to the sink as soon as it is read
    "spark.sql.execution.arrow.maxRecordsPerBatch": "1",
    "spark.sql.streaming.stopTimeout": "60s",
}


def driver(java_options: str) -> dict[str, str]:
    """The driver's settings (with SESSION): its JVM's options and memory, no UI, the checkpoint's
    files the owner's only (the state folder is 0700 too, see spec.state), secrets redacted from
    Spark's logs, and a Python worker that crashes shows where."""
    return {
        "spark.driver.extraJavaOptions": f"-Xss64m {QUICK_JIT} {java_options}".strip(),
        "spark.driver.memory": os.environ.get("CHANGEFEED_DRIVER_MEMORY", "4g"),
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.hadoop.fs.permissions.umask-mode": "077",
        "spark.redaction.regex": "(?i)secret|password|token|access[.]?key|executorEnv",
        "spark.python.worker.faulthandler.enabled": "true",
        **SESSION,
    }


def python_env(loopback: bool = True) -> None:
    """The Python Spark's workers run (this one), with `loopback` on the loopback address, and a
    SPARK_HOME whose workers import pyspark with bytecode (spark.spark_home)."""
    import sys

    from changefeed.spark.spark_home import use_linked_home

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if loopback:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    use_linked_home()
