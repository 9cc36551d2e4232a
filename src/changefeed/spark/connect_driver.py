"""The driver program of a Spark Connect server that changefeed starts (spark.connect.server_command):
a pyspark driver whose Spark runs Spark Connect as a plugin, with the settings spark-submit gives
it, until it is told to stop (SIGTERM, SIGINT).

Why not Spark's own server class (`SparkConnectServer`): it turns on artifact isolation for every
session, and Spark then keys its pools of Python workers by session. Every feed started on such a
server started Python daemons and workers of its own, one kind for each Python call Spark makes
(finding the data source, planning the read, the write, the sink's commit), paid their start
inside its first batch, and left them behind when it ended. With isolation off (the settings in
server_command), the sessions share one pool: a feed started on a server that ran feeds before
finds their Python workers running (figures in bench/README.md). Feeds add no artifacts (jars or
Python files) to their sessions, so there is nothing of theirs to isolate.

spark-submit runs this file as a script, so it imports nothing of changefeed's: its own folder
is taken off the module path, where its neighbours' names would stand for top-level modules.
"""
from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path


def main() -> int:
    from pyspark.sql import SparkSession

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    spark = SparkSession.builder.getOrCreate()  # the settings come from spark-submit's --conf
    stop.wait()
    spark.stop()
    return 0


if __name__ == "__main__":
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and str(Path(p).resolve()) != here]
    sys.exit(main())
