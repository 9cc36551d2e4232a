"""Named fault points for crash tests: SIGKILL (or freeze) the whole feed at an awkward moment.

`CHANGEFEED_KILL_AT=point[:n]` kills the feed's process group (driver, JVM, Python workers) the
n-th time (default 1st) execution reaches `point`: node_created (a feed's publication and slot
exist on one more source node), startup, read, snapshot_export (the planner fixed a snapshot
batch's window end and is about to export the snapshot its first read is read in), pending (a
node's window ended with a prepared part undecided on it), snapshot_chunk (a chunk was read),
sink_write (a message sink wrote another 1000 messages of a batch), insert_run (the replica COPYed
a run of inserts into its target, inside the batch's transaction), delta_files_written (a Delta
writer task wrote its files), delta_term_checked (the driver checked a Delta table's lease term,
about to commit to it), delta_table_committed (it committed one table of the batch),
webhook_request (a webhook request is due, its lease not checked yet), tables_published (`alter
--add-tables` on a feed of several nodes published the tables on each, their request not made
yet), before_sink_commit or after_sink_commit. `CHANGEFEED_STOP_AT=point[:n]` freezes it
there instead (SIGSTOP; the process groups stopped are written to `.stopped-groups` in the fault
folder, for the test to SIGCONT). `CHANGEFEED_FAIL_AT=point[:n]` instead raises
an unexpected error there, once (the n-th time): a task failing for a reason changefeed has no type
for. Counting uses a file next to the feed state (`CHANGEFEED_FAULT_DIR`), because the points run in
different processes. With `CHANGEFEED_FAULT_ARMED=FILE`, hits count only once FILE exists (a test
arms the fault when the scene is set, e.g. a standby waiting). Unset: no cost.
"""
from __future__ import annotations

import os
import signal


def reach(point: str) -> None:
    if _due("CHANGEFEED_KILL_AT", point, "fault"):
        # The feed's group (driver + JVM), then ours: PySpark's worker daemon has its own group.
        os.killpg(int(os.environ.get("CHANGEFEED_PGID", os.getpgrp())), signal.SIGKILL)
        os.killpg(os.getpgrp(), signal.SIGKILL)
    if _due("CHANGEFEED_STOP_AT", point, "stop"):  # frozen: the groups noted for the test to wake them
        groups = {int(os.environ.get("CHANGEFEED_PGID", os.getpgrp())), os.getpgrp()}
        with open(os.path.join(os.environ.get("CHANGEFEED_FAULT_DIR", "."), ".stopped-groups"), "w") as f:
            f.write(" ".join(map(str, sorted(groups))))
        for group in groups - {os.getpgrp()}:
            os.killpg(group, signal.SIGSTOP)
        os.killpg(os.getpgrp(), signal.SIGSTOP)  # ours last: this process stops here
    if _due("CHANGEFEED_FAIL_AT", point, "fail"):
        raise InjectedFault(f"fault injected at {point} (CHANGEFEED_FAIL_AT)")


class InjectedFault(RuntimeError):
    """Deliberately not a ChangefeedError: it stands for a failure nobody foresaw."""


def _due(variable: str, point: str, kind: str) -> bool:
    """Whether this is the n-th time `point` is reached and `variable` names it."""
    spec = os.environ.get(variable)
    if not spec:
        return False
    name, _, nth = spec.partition(":")
    if name != point:
        return False
    armed = os.environ.get("CHANGEFEED_FAULT_ARMED")
    if armed and not os.path.exists(armed):
        return False
    counter = os.path.join(os.environ.get("CHANGEFEED_FAULT_DIR", "."), f".{kind}-{point}")
    fd = os.open(counter, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        # An append moves this descriptor to the end of its own byte, atomically: the count is this
        # hit's own, also when tasks in parallel reach the point together (the file's size after the
        # write may already hold another task's hit, and then no task would see the n-th).
        os.write(fd, b"x")
        hits = os.lseek(fd, 0, os.SEEK_CUR)
    finally:
        os.close(fd)
    return hits == int(nth or 1)


def mark_feed_group() -> None:
    """Called by the driver before Spark starts, so workers know which group is the feed."""
    if os.environ.get("CHANGEFEED_KILL_AT") or os.environ.get("CHANGEFEED_STOP_AT"):
        os.environ["CHANGEFEED_PGID"] = str(os.getpgrp())
