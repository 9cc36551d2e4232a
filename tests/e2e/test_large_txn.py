"""Large transactions: 2,000,000 rows in one transaction, and as many in one that rolls back.

The committed one reaches the replica whole and once; the rolled-back one never does. Memory is
bounded by the batch size, not by the transaction: the change builder lets a transaction larger
than a record batch go out in parts (postgres/decode/builder.py) and the replica applies part after part
inside its one batch transaction. Every process of the feed (driver, JVM, Python workers) is
sampled from /proc while it runs; the Python workers, which hold the rows, must stay far below
what the transaction's rows take (measured: ~240 MB per worker and a 620 MB JVM; a builder that
held the transaction whole peaked at ~790 MB per worker and a 2 GB JVM, and fails this test).
"""
from __future__ import annotations

import signal
import threading
from pathlib import Path

import psycopg
import pytest

from support.feeds import changefeed_cli, process_tree, start_changefeed
from support.servers import Dbs, fingerprint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROWS = 2_000_000
WORKER_BOUND_MB = 450  # a Python worker's peak RSS: libraries (~150 MB) and a few batches in flight


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _sample(root: int, stop: threading.Event, peaks: dict[int, tuple[float, str]]) -> None:
    while not stop.wait(0.2):
        for pid, cmd in process_tree(root).items():
            try:
                rss = _rss_mb(pid)
            except OSError:
                continue
            if rss > peaks.get(pid, (0.0, ""))[0]:
                peaks[pid] = (rss, cmd)


def test_a_two_million_row_transaction_passes_whole_once_with_bounded_memory(dbs: Dbs, tmp_path: Path,
                                                                             spark_server: str) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE big (id bigint PRIMARY KEY, v text NOT NULL)")
    state = str(tmp_path / "state")
    base = ["run", "--name", dbs.name, "--state", state, "--available-now"]
    first = changefeed_cli(*base, "--source", dbs.source, "--sink", dbs.sink, "--tables", "public.big",
                           "--master", spark_server)  # the feed's memory is measured in the next run
    assert first.returncode == 0, first.stderr
    with dbs.src() as c:
        with c.transaction():
            c.execute("INSERT INTO big SELECT g, 'row ' || g FROM generate_series(1, %s) g", (ROWS,))
        with pytest.raises(psycopg.errors.RaiseException), c.transaction():
            c.execute("INSERT INTO big SELECT -g, 'rolled back ' || g FROM generate_series(1, %s) g", (ROWS,))
            c.execute("DO $$ BEGIN RAISE EXCEPTION 'rolled back'; END $$")
        c.execute("UPDATE big SET v = 'after' WHERE id <= 10")

    log = tmp_path / "run.log"
    feed = start_changefeed(*base, log=log)
    stop, peaks = threading.Event(), {}  # type: ignore[var-annotated]
    sampler = threading.Thread(target=_sample, args=(feed.pid, stop, peaks), daemon=True)
    sampler.start()
    try:
        rc = feed.wait(timeout=600)
    finally:
        stop.set()
        sampler.join()
        if feed.poll() is None:
            feed.send_signal(signal.SIGKILL)
    assert rc == 0, log.read_text()[-3000:]

    assert fingerprint(dbs.sink, "big") == fingerprint(dbs.source, "big")
    with dbs.dst() as d:
        assert d.execute("SELECT count(*), count(*) FILTER (WHERE v = 'after') FROM big").fetchone() == (ROWS, 10)
        assert d.execute("SELECT sum(changes) FROM changefeed.progress WHERE feed = %s",
                         (dbs.name,)).fetchone()[0] == ROWS + 10  # each change once, none rolled back
    workers = {pid: mb for pid, (mb, cmd) in peaks.items() if "pyspark" in cmd and "java" not in cmd}
    jvm = max((mb for mb, cmd in peaks.values() if "java" in cmd), default=0.0)
    report = ", ".join(f"{mb:.0f} MB" for mb in sorted(workers.values(), reverse=True))
    print(f"\npeak RSS: JVM {jvm:.0f} MB; Python workers {report}; driver process {peaks[feed.pid][0]:.0f} MB")
    assert workers, peaks
    assert max(workers.values()) < WORKER_BOUND_MB, report
