"""`changefeed verify` on a running feed: equal under a running workload, differences found by key
(a row changed on the replica, a missing row, an extra row, a changed TOASTed value), repaired."""
from __future__ import annotations

import json
import random
import signal
import threading
import time
from pathlib import Path

import psycopg
import pytest

from support.feeds import changefeed_cli, start_changefeed, wait_for
from support.servers import Dbs, fingerprint
from support.writers import WRITE_PAUSE, writing

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("warm_spark")]

TABLES = "public.acct,public.doc"


def _setup(dbs: Dbs) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE acct (id int PRIMARY KEY, balance bigint NOT NULL, note text, at timestamptz)")
        c.execute("INSERT INTO acct SELECT g, 100, 'n' || g, now() FROM generate_series(1, 3000) g")
        # composite key, a TOASTed value (compressed poorly: random text)
        c.execute("CREATE TABLE doc (k1 text, k2 int, body text, PRIMARY KEY (k1, k2))")
        c.execute("INSERT INTO doc SELECT 'd' || (g % 7), g, (SELECT string_agg(md5(random()::text || g || i), '') "
                  "FROM generate_series(1, 200) i) FROM generate_series(1, 50) g")


def _transfers(uri: str, stop: threading.Event, written: list[int]) -> None:
    """Move money between accounts, insert and delete rows, rewrite documents, until stopped."""
    rnd = random.Random(7)
    with psycopg.connect(uri, autocommit=True) as c:
        n = 0
        while not stop.is_set():
            a, b = rnd.randint(1, 3000), rnd.randint(1, 3000)
            with c.transaction():
                c.execute("UPDATE acct SET balance = balance - 1, at = now() WHERE id = %s", (a,))
                c.execute("UPDATE acct SET balance = balance + 1, at = now() WHERE id = %s", (b,))
                c.execute("INSERT INTO acct VALUES (%s, 0, NULL, now()) ON CONFLICT (id) DO UPDATE SET note = 'again'",
                          (3000 + n,))
                c.execute("DELETE FROM acct WHERE id = %s", (3000 + n - 5,))
                if n % 5 == 0:
                    c.execute("UPDATE doc SET body = body || 'x' WHERE k2 = %s", (rnd.randint(1, 50),))
            n += 1
            written.append(n)
            time.sleep(WRITE_PAUSE)


def _same(dbs: Dbs, table: str) -> bool:
    try:
        return fingerprint(dbs.source, table) == fingerprint(dbs.sink, table)
    except psycopg.errors.UndefinedTable:
        return False


def _verify(*args: str) -> tuple[int, dict, str]:
    out = changefeed_cli("verify", *args, "--json")
    report = json.loads(out.stdout) if out.stdout.strip() else {}
    return out.returncode, report, out.stderr


def test_verify_equal_under_load_then_finds_and_repairs_each_difference(dbs: Dbs, tmp_path: Path) -> None:
    _setup(dbs)
    state = str(tmp_path / "state")
    name = ["--name", dbs.name, "--state", state]
    log = tmp_path / "run.log"
    stopped = changefeed_cli("verify", *name)
    assert stopped.returncode == 2 and "no feed named" in stopped.stderr, stopped.stderr
    p = start_changefeed("run", *name, "--source", dbs.source, "--sink", dbs.sink, "--tables", TABLES, log=log)
    try:
        wait_for("the snapshot", lambda: _same(dbs, "public.doc") and _same(dbs, "public.acct"), log)
        written: list[int] = []
        with writing(_transfers, dbs.source, written):
            for _ in range(3):  # no false alarm from timing: the point is one consistent cut
                rc, report, err = _verify(*name, "--chunk-rows", "100")
                assert rc == 0 and report["equal"], (err, report)
                assert {t["table"] for t in report["tables"]} == {"public.acct", "public.doc"}
                acct = next(t for t in report["tables"] if t["table"] == "public.acct")
                assert acct["source_rows"] == acct["sink_rows"] >= 2990 and acct["chunks"] >= 30
            assert written, "the workload ran"
        wait_for("the feed to catch up", lambda: _same(dbs, "public.doc") and _same(dbs, "public.acct"), log)
        # Break the replica behind the feed's back (the workload has stopped).
        with dbs.dst() as c:
            c.execute("UPDATE acct SET balance = balance + 1 WHERE id = 17")
            c.execute("DELETE FROM acct WHERE id = 18")
            c.execute("INSERT INTO acct VALUES (-1, 5, 'stray', now())")
            c.execute("UPDATE doc SET body = body || 'tampered' WHERE k1 = 'd3' AND k2 = 3")
        rc, report, err = _verify(*name)
        assert rc == 1 and not report["equal"], (err, report)
        by_table = {t["table"]: t for t in report["tables"]}
        acct = {d["key"]: d for d in by_table["public.acct"]["differences"]}
        assert set(acct) == {"(17)", "(18)", "(-1)"}, acct
        assert acct["(17)"]["kind"] == "differs" and set(acct["(17)"]["columns"]) == {"balance"}
        assert acct["(18)"]["kind"] == "missing on the sink" and acct["(-1)"]["kind"] == "extra on the sink"
        doc = by_table["public.doc"]["differences"]
        assert [(d["key"], d["kind"], list(d["columns"])) for d in doc] == [("(d3,3)", "differs", ["body"])]
        assert report["mismatched_rows"] == 4
        text = changefeed_cli("verify", *name)
        assert text.returncode == 1 and "key (18): missing on the sink" in text.stdout, text.stdout
        assert "chars, md5" in text.stdout  # the TOASTed value is shown shortened, with its digest

        rc, report, err = _verify(*name, "--repair")
        assert rc == 1 and sum(t["repaired"] for t in report["tables"]) == 4, (err, report)
        rc, report, err = _verify(*name)
        assert rc == 0 and report["equal"], (err, report)
        status = changefeed_cli("status", *name, "--json")
        assert json.loads(status.stdout)["verified"]["equal"] is True, status.stdout
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=120)
    assert fingerprint(dbs.source, "public.acct") == fingerprint(dbs.sink, "public.acct")
    rc, report, err = _verify(*name)  # stopped now: verify holds it and compares (tests/e2e/test_verify_stopped.py)
    assert rc == 0 and report["equal"], (err, report)


def test_run_every_verifies_periodically_into_status_and_metrics(dbs: Dbs, tmp_path: Path) -> None:
    import re
    import urllib.request

    with dbs.src() as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        c.execute("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 500) g")
    state = str(tmp_path / "state")
    name = ["--name", dbs.name, "--state", state]
    log = tmp_path / "run.log"
    p = start_changefeed("run", *name, "--source", dbs.source, "--sink", dbs.sink, "--tables", "public.t",
                         "--every", "2s", "--metrics-port", "0", log=log)

    def metric(name: str) -> float | None:
        url = re.search(r"metrics on (http://\S+)", log.read_text())
        if not url:
            return None
        text = urllib.request.urlopen(url.group(1), timeout=5).read().decode()
        found = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
        return float(found.group(1)) if found else None

    try:
        wait_for("a first verification", lambda: metric("changefeed_verify_mismatched_rows") == 0, log)
        first = metric("changefeed_verify_last_timestamp_seconds")
        assert first is not None and abs(first - time.time()) < 120
        with dbs.dst() as c:
            c.execute("UPDATE t SET v = 'tampered' WHERE id IN (3, 4)")
        wait_for("the tampered rows found", lambda: metric("changefeed_verify_mismatched_rows") == 2, log)
        status = changefeed_cli("status", *name)
        assert "verified: " in status.stdout and "2 rows differ" in status.stdout, status.stdout
        wait_for("the keys in the log", lambda: "verify:   key (3): differs: v: source 'v3', sink 'tampered'"
                 in log.read_text(), log)
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 0, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text()


@pytest.mark.parametrize("fmt", ["json", "debezium"])
def test_verify_reads_a_kafka_sink_back_as_a_consumer_would(dbs: Dbs, tmp_path: Path, kafka: object,
                                                            fmt: str) -> None:
    from confluent_kafka import Producer

    from changefeed.local.kafka import read_partition

    _setup(dbs)
    prefix = f"{dbs.name}."
    bootstrap = kafka.bootstrap  # type: ignore[attr-defined]
    sink = f"kafka://{bootstrap}?topic_prefix={prefix}&progress_topic=progress-{dbs.name}&topic_partitions=3"
    name = ["--name", dbs.name, "--state", str(tmp_path / "state")]
    log = tmp_path / "run.log"
    p = start_changefeed("run", *name, "--source", dbs.source, "--sink", sink, "--tables", TABLES, "--format", fmt,
                         log=log)
    try:
        written: list[int] = []
        with writing(_transfers, dbs.source, written):
            wait_for("the feed running", lambda: "running (until stopped)" in log.read_text(), log)
            for _ in range(2):  # a consistent point under load: no false alarm (the feed may be behind
                rc, report, err = _verify(*name, "--wait", "5m")  # on a loaded machine: time to reach it)
                assert rc == 0 and report["equal"], (err, json.dumps(report)[:3000])
                acct = next(t for t in report["tables"] if t["table"] == "public.acct")
                assert acct["source_rows"] == acct["sink_rows"] >= 2990
        rc, report, err = _verify(*name)  # a point after the last write: the feed delivered all of it
        assert rc == 0 and report["equal"], (err, json.dumps(report)[:3000])
        # what a consumer would now hold for key 17 is not the source's row: a record after the
        # feed's ones, in the partition that holds them
        topic = f"{prefix}public.acct"

        def key(k: int) -> bytes:
            return json.dumps({"id": k} if fmt == "debezium" else [k]).encode()

        def event(row: dict, op: str) -> bytes:
            common = {"source": {"ts_us": 1}} if fmt == "debezium" else {"key": [row["id"]], "updated": "1"}
            return json.dumps({"after": row, "op": op, **common}).encode()

        part = next(p for p in range(3) if any(r.key and json.loads(r.key) == json.loads(key(17))
                                               for r in read_partition(bootstrap, topic, p)))
        producer = Producer({"bootstrap.servers": bootstrap})
        producer.produce(topic, partition=part, key=key(17), value=event({"id": 17, "balance": -5}, "u"))
        producer.produce(topic, key=key(-7), value=event({"id": -7, "balance": 1, "note": None, "at": None}, "c"))
        producer.flush(10)
        rc, report, err = _verify(*name, "--tables", "public.acct")
        assert rc == 1, (err, report)
        found = {d["key"]: d for d in report["tables"][0]["differences"]}
        assert set(found) == {"(17)", "(-7)"} and found["(-7)"]["kind"] == "extra on the sink"
        assert list(found["(17)"]["columns"]) == ["balance"]
        repair = changefeed_cli("verify", *name, "--repair")
        assert repair.returncode == 2 and "cannot take back" in repair.stderr, repair.stderr
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 0, log.read_text()[-3000:]
    rc, report, err = _verify(*name, "--tables", "public.acct")  # the stopped feed's topics, read back the same way
    assert rc == 1 and {d["key"] for d in report["tables"][0]["differences"]} == {"(17)", "(-7)"}, (err, report)
