"""Build the Spark session and start a feed's streaming query."""
from __future__ import annotations

import os
import sys
from typing import Any

from ..config import FeedSpec, FeedState


def spark_session(master: str = "local[*]", app: str = "changefeed") -> Any:
    """One SparkSession per process, with our data sources registered."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from .sink import PostgresReplicaSink
    from .source import ChangefeedSource

    spark = (SparkSession.builder.master(master).appName(app)
             .config("spark.driver.extraJavaOptions", "-Xss64m")
             .config("spark.driver.memory", os.environ.get("CHANGEFEED_DRIVER_MEMORY", "4g"))
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2")
             # a packed row is a whole chunk of changes: hand each to the sink as soon as it is read
             .config("spark.sql.execution.arrow.maxRecordsPerBatch", "1")
             .config("spark.sql.streaming.stopTimeout", "60s")
             .config("spark.python.worker.faulthandler.enabled", "true")
             .getOrCreate())
    spark.sparkContext.setLogLevel(os.environ.get("CHANGEFEED_SPARK_LOG_LEVEL", "ERROR"))
    spark.dataSource.register(ChangefeedSource)
    spark.dataSource.register(PostgresReplicaSink)
    return spark


def start_query(spark: Any, spec: FeedSpec, state: FeedState, *, available_now: bool = False) -> Any:
    reader = (spark.readStream.format("changefeed")
              .option("uri", spec.source).option("slot", spec.slot).option("publication", spec.publication)
              .option("feed", spec.name)
              .option("max_bytes_per_batch", str(spec.max_bytes_per_batch))
              .option("max_changes_per_batch", str(spec.max_changes_per_batch))
              .option("resolved_interval_s", str(spec.resolved_interval_s))
              .option("snapshot_tables", "" if spec.snapshot == "never" else ",".join(spec.tables))
              .option("snapshot_chunk_rows", str(spec.snapshot_chunk_rows))
              .option("requests_dir", str(state.requests)))
    # One writer task per batch: it applies the batch in one target transaction (see spark.sink).
    writer = (reader.load().coalesce(1).writeStream.format("changefeed-postgres")
              .queryName(f"changefeed_{spec.name}")
              .option("uri", spec.sink).option("feed", spec.name)
              .option("checkpointLocation", str(state.checkpoint)))
    if available_now:
        writer = writer.trigger(availableNow=True)
    elif spec.trigger_interval_s:
        writer = writer.trigger(processingTime=f"{spec.trigger_interval_s} seconds")
    return writer.start()
