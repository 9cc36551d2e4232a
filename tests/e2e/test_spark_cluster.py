"""A feed of three nodes, and a feed in low-latency mode, on a Spark standalone cluster the test
starts itself (a master and two workers from pyspark's own `spark-class`), with changefeed shipped
by the feed: the workers' Python cannot import it from its installation."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from changefeed.local.postgres import LocalPostgres
from changefeed.spark.spark_home import use_linked_home
from support.feeds import changefeed_cli, start_changefeed, wait_for
from support.servers import Dbs, drop_slots, fingerprint, free_port
from support.writers import most_sub_windows, moving_money, writing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
NODES = ("n1", "n2", "n3")
ACCOUNTS, BALANCE = 200, 1_000

# Spark's Python workers for this test: the venv's Python, and on the executors (whose working
# folders are in the workers' folders) changefeed's installation is off the path, so that only the
# code the feed ships can be imported there. (The driver's host has changefeed: it runs the feed.)
HIDE = """import os
import sys
if os.getcwd().startswith({root!r}):
    sys.path[:] = [p for p in sys.path if p != {src!r}]
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    """(master URL, the workers' root folder, the Python the feed's Spark workers run)."""
    root = tmp_path_factory.mktemp("cluster")
    use_linked_home()
    import pyspark

    home = Path(os.environ.get("SPARK_HOME") or Path(pyspark.__file__).parent)
    spark_class = str(home / "bin" / "spark-class")
    env = {**os.environ, "SPARK_HOME": str(home), "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOG_DIR": str(root)}
    port, ui = free_port(), free_port()
    procs = [subprocess.Popen([spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(port), "--webui-port", str(ui)], env=env,
                              stdout=open(root / "master.log", "wb"), stderr=subprocess.STDOUT)]
    master = f"spark://127.0.0.1:{port}"
    for i in (1, 2):
        work = root / f"worker{i}"
        work.mkdir()
        procs.append(subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.worker.Worker", master, "--host", "127.0.0.1", "--cores", "1",
             "--memory", "2g", "--webui-port", str(free_port()), "--work-dir", str(work)],
            env=env, stdout=open(root / f"worker{i}.log", "wb"), stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=5) as r:
                    if sum(w["state"] == "ALIVE" for w in json.load(r)["workers"]) == 2:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, (root / "master.log").read_text()[-3000:]
            time.sleep(0.5)
        import changefeed

        hide = root / "hide"
        hide.mkdir()
        (hide / "sitecustomize.py").write_text(
            HIDE.format(root=str(root), src=str(Path(changefeed.__file__).parent.parent)))
        python = root / "python"
        python.write_text(f'#!/bin/sh\nexport PYTHONPATH="{hide}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
                          f'exec {sys.executable} "$@"\n')
        python.chmod(0o755)
        yield master, root, python
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)


def test_three_nodes_on_a_standalone_cluster_read_on_both_workers(
        dbs: Dbs, servers: tuple[LocalPostgres, LocalPostgres], cluster: tuple[str, Path, Path],
        tmp_path: Path) -> None:
    from test_multi_node import TABLES, bank, transfers, union

    master, root, python = cluster
    hidden = subprocess.run([str(python), "-c", "import changefeed"], capture_output=True, text=True,
                            cwd=root / "worker1")
    assert hidden.returncode != 0 and "No module named 'changefeed'" in hidden.stderr
    nodes = {"n1": dbs.source}
    for n in NODES[1:]:
        with psycopg.connect(servers[0].uri(), autocommit=True) as c:
            c.execute(f"CREATE DATABASE {dbs.name}_{n}")
        nodes[n] = servers[0].uri(f"{dbs.name}_{n}")
    try:
        for i, uri in enumerate(nodes.values(), 1):
            bank(uri, i)
        base = ["run", "--name", dbs.name, "--state", str(tmp_path / "state"), "--sink", dbs.sink,
                "--tables", ",".join(TABLES), "--master", master, "--available-now",
                *[a for n, uri in nodes.items() for a in ("--source", f"{n}={uri}")]]
        env = {**os.environ, "PYSPARK_PYTHON": str(python), "SPARK_LOCAL_IP": "127.0.0.1"}
        first = changefeed_cli(*base, env=env)
        assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
        written = {n: [0] for n in nodes}
        with writing(transfers(1), nodes["n1"], written["n1"]), writing(transfers(2), nodes["n2"], written["n2"]), \
                writing(transfers(3), nodes["n3"], written["n3"]):
            pass
        second = changefeed_cli(*base, env=env)
        assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
        for table in TABLES:
            assert union(nodes, table) == sorted(psycopg.connect(dbs.sink).execute(f"SELECT * FROM {table}"), key=repr)
        with psycopg.connect(dbs.sink) as d:
            reads = [r for (batch,) in d.execute("SELECT reads FROM changefeed.progress WHERE feed = %s",
                                                 (dbs.name,)) for r in batch]
        workers = {Path(r["cwd"]).relative_to(root).parts[0] for r in reads if Path(r["cwd"]).is_relative_to(root)}
        assert workers == {"worker1", "worker2"}, [r.get("cwd") for r in reads]  # executors of both workers read
        # ... and within one batch: the node windows of a batch ran on both workers' executors
        by_batch = {}
        with psycopg.connect(dbs.sink) as d:
            for batch_id, batch in d.execute("SELECT batch_id, reads FROM changefeed.progress WHERE feed = %s",
                                             (dbs.name,)):
                by_batch[batch_id] = {Path(r["cwd"]).relative_to(root).parts[0] for r in batch if "no" not in r}
        assert any(w == {"worker1", "worker2"} for w in by_batch.values()), by_batch
    finally:
        for n in NODES[1:]:
            drop_slots(servers[0].uri(), f"{dbs.name}_{n}")


def test_a_low_latency_feed_follows_the_slot_on_a_standalone_cluster(dbs: Dbs, cluster: tuple[str, Path, Path],
                                                                      tmp_path: Path) -> None:
    """`--low-latency` with the followed batch's task on an executor of the cluster (changefeed
    shipped, not installed there): sub-windows committed while the batch runs; SIGKILLed in a
    followed batch, then finished in micro-batches on the cluster: every change once, money whole."""
    master, _, python = cluster
    with psycopg.connect(dbs.source, autocommit=True) as c:
        c.execute("CREATE TABLE ledger (id bigint PRIMARY KEY, v text NOT NULL)")
        c.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        c.execute("INSERT INTO accounts SELECT g, %s FROM generate_series(0, %s) g", (BALANCE, ACCOUNTS - 1))
    base = ["run", "--name", dbs.name, "--state", str(tmp_path / "state"), "--master", master]
    env = {"PYSPARK_PYTHON": str(python), "SPARK_LOCAL_IP": "127.0.0.1"}
    log = tmp_path / "run.log"
    written = [0]
    with writing(moving_money(ACCOUNTS), dbs.source, written):
        feed = start_changefeed(*base, "--source", dbs.source, "--sink", dbs.sink, "--tables",
                                "public.ledger,public.accounts", "--low-latency", "20s", log=log, env=env)
        try:
            wait_for("sub-windows of a followed batch", lambda: most_sub_windows(dbs.sink, dbs.name) > 5, log,
                     timeout=240)
        finally:
            os.killpg(feed.pid, signal.SIGKILL)
            feed.wait()
    final = changefeed_cli(*base, "--available-now", env={**os.environ, **env})
    assert final.returncode == 0, final.stdout[-2000:] + final.stderr[-3000:]
    for table in ("public.ledger", "public.accounts"):
        assert fingerprint(dbs.source, table) == fingerprint(dbs.sink, table), table
    with psycopg.connect(dbs.sink) as d:
        assert d.execute("SELECT sum(balance) FROM accounts").fetchone() == (ACCOUNTS * BALANCE,)

