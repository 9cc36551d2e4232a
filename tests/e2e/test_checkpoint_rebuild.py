"""A runner without the feed's Spark checkpoint (deleted, a new host's folder, a copy older than
the sink) carries on from the replica's ledger exactly once, with no snapshot read again."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from support.feeds import assert_no_traceback, changefeed_cli
from support.servers import Dbs, fingerprint

pytestmark = pytest.mark.timeout(600)


def _ledger(dbs: Dbs) -> tuple[int, int, int]:
    """(progress rows, distinct end LSNs, snapshot chunks) of the feed on the replica."""
    with dbs.dst() as d:
        rows, ends = d.execute("SELECT count(*), count(DISTINCT end_lsn) FROM changefeed.progress WHERE feed = %s",
                               (dbs.name,)).fetchone()  # type: ignore[misc]
        chunks = d.execute("SELECT count(*) FROM changefeed.snapshot_chunks WHERE feed = %s",
                           (dbs.name,)).fetchone()[0]  # type: ignore[index]
    return int(rows), int(ends), int(chunks)


def _write(dbs: Dbs, first: int, n: int) -> None:
    with dbs.src() as c:
        c.execute("INSERT INTO t SELECT g, 'v' || g FROM generate_series(%s::bigint, %s::bigint) g",
                  (first, first + n - 1))
        c.execute("UPDATE t SET v = v || '+' WHERE id % 7 = 0")
        c.execute("DELETE FROM t WHERE id %% 11 = 0 AND id >= %s::bigint", (first,))


def test_a_lost_or_stale_checkpoint_resumes_from_the_replica(dbs: Dbs, tmp_path: Path, spark_server: str) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text)")
    _write(dbs, 1, 3000)
    state = tmp_path / "state"
    base = ("run", "--name", dbs.name, "--state", str(state), "--master", spark_server, "--available-now")
    first = changefeed_cli(*base, "--source", dbs.source, "--sink", dbs.sink, "--tables", "public.t",
                           "--snapshot-chunk-rows", "500", "--max-changes-per-batch", "400")
    assert first.returncode == 0, first.stderr[-3000:]
    _, _, chunks = _ledger(dbs)
    assert chunks >= 6  # the snapshot was read in chunks
    old = tmp_path / "old-copy"  # another host's copy of the state folder, taken now
    shutil.copytree(state, old)

    # 1. The checkpoint deleted: the next run resumes where the replica's last batch ended.
    _write(dbs, 10_000, 2000)
    shutil.rmtree(state / dbs.name / "checkpoint")
    second = changefeed_cli(*base)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "no checkpoint" in second.stdout + second.stderr
    assert fingerprint(dbs.source, "public.t") == fingerprint(dbs.sink, "public.t")
    rows, ends, chunks_after = _ledger(dbs)
    assert rows == ends and chunks_after == chunks, "a batch recorded twice, or the snapshot read again"

    # 2. The old copy's checkpoint is behind the replica: it is moved aside, the feed resumes from the replica.
    _write(dbs, 20_000, 1500)
    stale = changefeed_cli("run", "--name", dbs.name, "--state", str(old), "--master", spark_server,
                           "--available-now")
    assert stale.returncode == 0, stale.stderr[-3000:]
    assert "older than the sink" in stale.stdout + stale.stderr
    assert (old / dbs.name / "checkpoint.replaced" / "offsets").is_dir()
    assert fingerprint(dbs.source, "public.t") == fingerprint(dbs.sink, "public.t")
    rows2, ends2, chunks_after2 = _ledger(dbs)
    assert rows2 == ends2 > rows and chunks_after2 == chunks
    assert_no_traceback(second.stderr + stale.stderr)

    # 3. The first folder, now behind too, goes on as well: its own checkpoint is replaced the same way.
    _write(dbs, 30_000, 500)
    again = changefeed_cli(*base)
    assert again.returncode == 0, again.stderr[-3000:]
    assert fingerprint(dbs.source, "public.t") == fingerprint(dbs.sink, "public.t")
    rows3, ends3, _ = _ledger(dbs)
    assert rows3 == ends3 > rows2
