"""Build the Spark session and start a feed's streaming query."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from changefeed.core import followed
from changefeed.core.offsets import Offset
from changefeed.sinks.base import Sink, task_slots
from changefeed.sinks.registry import sink_of, sinks_of
from changefeed.spark import connect, jvm_archive, settings, shipping, spark_log, stop_signals
from changefeed.spec.definition import FeedSpec
from changefeed.spec.state import FeedState


def spark_session(master: str = "local[*]", app: str = "changefeed", java_options: str | None = None,
                  log: Path | None = None, executor_env: dict[str, str] | None = None) -> Any:
    """One SparkSession per process, with our data sources registered: on a Spark Connect server
    for a `master` sc://HOST:PORT (spark.connect), else with a driver of its own. The driver JVM gets
    `java_options`, by default the class archive's when there is one (see jvm_archive).

    With `log`, the JVM's output goes to that file instead of the console, and with it that of
    everything the JVM starts (Spark's Python workers, their tracebacks): the console keeps
    changefeed's own lines, and a failure is reported once, as its typed error. A stop signal
    sent to the whole process group is the runner's to handle, not the JVM's (stop_signals).

    `executor_env` goes to the executors' environment on a cluster (a local master's share the
    driver's): the variables the feed's URIs name and the key of its stored secrets (see
    secrets.py). Spark's logs and UI show every executor variable's value as redacted."""
    if connect.is_remote(master):
        spark = connect.session(master)
        _register_sources(spark)
        return spark
    # on a cluster the workers must reach the driver: its address is Spark's choice
    settings.python_env(loopback=not shipping.needs_shipping(master))
    if java_options is None:
        java_options = jvm_archive.java_options()
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    conf = SparkConf().setMaster(master).setAppName(app).setAll(list(settings.driver(java_options).items()))
    if shipping.needs_shipping(master):
        for name, value in (executor_env or {}).items():
            conf.set(f"spark.executorEnv.{name}", value)
    with stop_signals.handlers_kept():
        if SparkContext._active_spark_context is None:
            with stop_signals.jvm_ignores_stop_signals():
                gateway = spark_log.launch_gateway(conf, log)
            SparkContext(conf=conf, gateway=gateway)
        spark = SparkSession.builder.config(conf=conf).getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("CHANGEFEED_SPARK_LOG_LEVEL", "ERROR"))
    shipping.ship(spark, master)  # before the data sources are registered: they take the includes along
    _register_sources(spark)
    return spark


def _register_sources(spark: Any) -> None:
    from changefeed.spark.source import ChangefeedSource
    from changefeed.spark.writer import SinkSource

    spark.dataSource.register(ChangefeedSource)
    spark.dataSource.register(SinkSource)


def _unjudged(spec: FeedSpec) -> str:
    """The tables whose snapshot reads are not judged (core.judge): the outbox (core.outbox), whose
    events are its inserts: a read that saw an event inserted and deleted again lacks it."""
    return spec.outbox


def start_query(spark: Any, spec: FeedSpec, state: FeedState, *, available_now: bool = False,
                parallel_reads: bool = False, resync: tuple[str, ...] = (), epoch: int | None = None,
                resume: Offset | None = None, until: Offset | None = None,
                read_from: dict[str, str] | None = None) -> Any:
    """Start the feed's query. `parallel_reads` (while snapshot chunks are pending, and always on a
    feed of several nodes) reads a batch's input partitions, its WAL windows and its chunks, as
    parallel tasks and shuffles them to the writer task(s); without it the writer task reads them
    itself, one after the other, and no shuffle is paid for (see sinks.base.Sink.plan). `epoch`, the
    runner's lease term, goes to the sink's writer: a sink with a fence refuses it once a later
    term claimed the sink (control.lease_keeper). `resume`: where the query starts when the state
    folder has no checkpoint of the feed (spark.checkpoint.resume), and `until` where its first
    batch then ends (spark.checkpoint.resume_until). `read_from`: per node, the slot read instead of
    the feed's (a copy that kept the WAL of sinks being caught up: control.lag_budget)."""
    nodes = [[n.name, n.uri, (read_from or {}).get(n.name, n.slot), n.publication] for n in spec.sources]
    # low-latency mode (core.followed): where a followed batch's sink keeps its end, for the next to start there
    follow_end = str(state.checkpoint / followed.END_FILE) if spec.low_latency_s else ""
    targets = []
    for target in spec.sink_targets:
        one = spec.for_sink(target)
        sink = sink_of(one.sink)
        targets.append({"name": target.name, "sink": sink.name, "uri": one.sink, "feed": spec.name, "key": one.key,
                        "multi_node": str(spec.multi_node).lower(), "resync": ",".join(resync),
                        "epoch": "" if epoch is None else str(epoch), "follow_end": follow_end,
                        **sink.writer_options(one, state)})
    # several sinks write side by side in one task (sinks.fan_out), as the base shape has it
    only = spec if spec.several_sinks else spec.for_sink(spec.sink_targets[0])
    shape = Sink() if spec.several_sinks else sink_of(only.sink)
    reader = (spark.readStream.format("changefeed")
              .option("nodes", json.dumps(nodes)).option("feed", spec.name)
              .option("max_bytes_per_batch", str(spec.max_bytes_per_batch))
              .option("max_changes_per_batch", str(spec.max_changes_per_batch))
              .option("wal_reader", spec.wal_reader)
              .option("parallel_reads", str(parallel_reads or spec.multi_node).lower())
              .option("read_in_writer", str(shape.takes_rows_as_read).lower())
              .option("resolved_interval_s", str(spec.resolved_interval_s))
              .option("snapshot_tables", "" if spec.snapshot == "never" else ",".join(spec.tables))
              .option("unjudged_tables", _unjudged(spec))
              .option("snapshot_chunk_rows", str(spec.snapshot_chunk_rows))
              .option("snapshot_chunks_per_batch", str(spec.snapshot_chunks_per_batch))
              .option("snapshot_budget", str(min(sink.snapshot_budget for _, _, sink in sinks_of(spec))))
              .option("requests_dir", str(state.requests))
              .option("barrier_file", str(state.barrier_file))
              .option("joining_file", str(state.joining_file))
              .option("sinks", ",".join(t.name for t in spec.sink_targets))
              .option("row_filters", json.dumps(spec.row_filters))
              .option("column_lists", json.dumps(spec.column_lists))
              .option("spec_file", str(state.spec_file))
              .option("snapshot_rate_rows", str(spec.snapshot_rate_rows))
              .option("snapshot_rate_bytes", str(spec.snapshot_rate_bytes))
              .option("max_rate", str(spec.max_rate))
              .option("task_slots", str(task_slots(spark)))
              .option("max_clock_skew_us", str(int(spec.max_clock_skew_s * 1_000_000)))
              .option("resume_offset", json.dumps(resume.to_json()) if resume else "")
              .option("resume_until", json.dumps(until.to_json()) if resume and until else "")
              .option("replay_file", str(state.replay_file))
              .option("checkpoint", str(state.checkpoint))
              .option("follow_s", str(spec.low_latency_s)).option("follow_end", follow_end)
              .option("follow_sink", json.dumps(targets[0]) if follow_end else ""))
    writer = (shape.plan(reader.load(), only, parallel_reads).writeStream.format("changefeed-sink")
              .queryName(f"changefeed_{spec.name}").option("targets", json.dumps(targets))
              .option("checkpointLocation", str(state.checkpoint)))
    if available_now:
        writer = writer.trigger(availableNow=True)
    elif spec.trigger_interval_s:
        writer = writer.trigger(processingTime=f"{spec.trigger_interval_s} seconds")
    return writer.start()

