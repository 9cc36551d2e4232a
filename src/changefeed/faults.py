"""Named fault points for crash tests: SIGKILL the whole feed at an awkward moment.

`CHANGEFEED_KILL_AT=point[:n]` kills the feed's process group (driver, JVM, Python workers) the
n-th time (default 1st) execution reaches `point`: startup, read, snapshot_chunk (a chunk was
read), sink_write (a message sink wrote another 1000 messages of a batch), insert_run (the replica
COPYed a run of inserts into its target, inside the batch's transaction), before_sink_commit or
after_sink_commit. Counting uses a file next to the feed state
(`CHANGEFEED_FAULT_DIR`), because the points run in different processes. Unset: no cost.
"""
from __future__ import annotations

import os
import signal

def reach(point: str) -> None:
    spec = os.environ.get("CHANGEFEED_KILL_AT")
    if not spec:
        return
    name, _, nth = spec.partition(":")
    if name != point:
        return
    counter = os.path.join(os.environ.get("CHANGEFEED_FAULT_DIR", "."), f".fault-{point}")
    fd = os.open(counter, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, b"x")
        hits = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if hits == int(nth or 1):
        # The feed's group (driver + JVM), then ours: PySpark's worker daemon has its own group.
        os.killpg(int(os.environ.get("CHANGEFEED_PGID", os.getpgrp())), signal.SIGKILL)
        os.killpg(os.getpgrp(), signal.SIGKILL)


def mark_feed_group() -> None:
    """Called by the driver before Spark starts, so workers know which group is the feed."""
    if os.environ.get("CHANGEFEED_KILL_AT"):
        os.environ["CHANGEFEED_PGID"] = str(os.getpgrp())
