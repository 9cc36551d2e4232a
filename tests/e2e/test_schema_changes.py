"""Schema changes on captured tables while the feed runs: the replica follows what the WAL tells
(then `verify` says equal), or the feed stops before the change with the documented error, and the
fix it names (`changefeed snapshot --tables T`, or `alter --add-tables NEW`) gets it going again."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import psycopg
import pytest

from support.feeds import assert_no_traceback, changefeed_cli, start_changefeed, wait_for
from support.servers import Dbs
from support.writers import writing

pytestmark = pytest.mark.timeout(900)

FOLLOWED = {  # table -> its DDL, run while writes go on
    "c_add": ["ALTER TABLE c_add ADD COLUMN n int", "ALTER TABLE c_add ADD COLUMN k int DEFAULT 7"],
    "c_drop": ["ALTER TABLE c_drop DROP COLUMN gone"],
    "c_int": ["ALTER TABLE c_int ALTER COLUMN v TYPE bigint"],
    "c_varchar": ["ALTER TABLE c_varchar ALTER COLUMN s TYPE text"],
    "c_null": ["ALTER TABLE c_null ALTER COLUMN w DROP NOT NULL", "ALTER TABLE c_null ALTER COLUMN w SET DEFAULT 5",
               "ALTER TABLE c_null ALTER COLUMN s SET DEFAULT 'd'", "UPDATE c_null SET s = 'x' WHERE s IS NULL",
               "ALTER TABLE c_null ALTER COLUMN s SET NOT NULL"],
    "c_key": ["ALTER TABLE c_key DROP CONSTRAINT c_key_pkey, ADD PRIMARY KEY (id, u)"],
    "c_ident": ["ALTER TABLE c_ident REPLICA IDENTITY FULL"],
    "c_trunc": ["TRUNCATE c_trunc"],
}


def _tables(dbs: Dbs) -> None:
    with dbs.src() as c:
        for t in FOLLOWED:
            extra = {"c_drop": ", gone text", "c_varchar": ", s varchar(10)",
                     "c_null": ", w int NOT NULL DEFAULT 1, s text", "c_key": ", u int NOT NULL DEFAULT 0"}.get(t, "")
            c.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, v int{extra})")
            c.execute(f"INSERT INTO {t} (id, v) SELECT g, g FROM generate_series(1, 200) g")
        c.execute("UPDATE c_drop SET gone = 'g' || id")
        c.execute("UPDATE c_varchar SET s = 's' || id")


def _writes(tables: list[str]):
    def write(uri: str, stop: threading.Event, written: list[int]) -> None:
        rnd = random.Random(3)
        with psycopg.connect(uri, autocommit=True) as c:
            n = 1000
            while not stop.is_set():
                with c.transaction():
                    for t in tables:
                        c.execute(f"UPDATE {t} SET v = v + 1 WHERE id = %s", (rnd.randint(1, 200),))
                        c.execute(f"INSERT INTO {t} (id, v) VALUES (%s, %s)", (n, n))
                n += 1
                written.append(n)
                time.sleep(0.01)
    return write


def _feed(dbs: Dbs, tmp_path: Path, tables: list[str]) -> tuple[list[str], list[str]]:
    name = ["--name", dbs.name, "--state", str(tmp_path / "state")]
    return name, [*name, "--source", dbs.source, "--sink", dbs.sink, "--tables", ",".join(tables)]


def _verify(name: list[str]) -> tuple[int, dict, str]:
    out = changefeed_cli("verify", *name, "--json")
    return out.returncode, json.loads(out.stdout) if out.stdout.strip() else {}, out.stderr


def _replica_key(dbs: Dbs, table: str) -> list[str]:
    with dbs.dst() as c:
        return [r[0] for r in c.execute(
            "SELECT a.attname FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(n, o) "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.n "
            "WHERE i.indrelid = %s::regclass AND i.indisprimary ORDER BY k.o", (table,))]


def _killed_and_restarted(p: subprocess.Popen[bytes], name: list[str], log: Path, written: list[int],
                          master: str) -> subprocess.Popen[bytes]:
    """SIGKILL the feed right after the changes (maybe mid batch), start it again on `master` (it
    is stopped, not killed: the shared Spark Connect server serves), and wait until it runs and the
    writes go on after the restart."""
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=60)
    p = start_changefeed("run", *name, "--master", master, log=log)
    wait_for("the feed running again", lambda: log.read_text().count("running (until stopped)") >= 2, log)
    before = len(written)
    wait_for("writes after the restart", lambda: len(written) > before + 50, log)
    return p


def test_changes_the_wal_tells_are_followed_across_a_kill(dbs: Dbs, tmp_path: Path, spark_server: str) -> None:
    _tables(dbs)
    name, first = _feed(dbs, tmp_path, list(FOLLOWED))
    log = tmp_path / "run.log"
    written: list[int] = []
    with writing(_writes(list(FOLLOWED)), dbs.source, written):
        p = start_changefeed("run", *first, log=log)
        try:
            wait_for("a first verification", lambda: _verify(name)[0] == 0, log)
            with dbs.src() as c:
                for ddl in (d for ddls in FOLLOWED.values() for d in ddls):
                    c.execute(ddl)
                    time.sleep(0.05)  # writes land between the changes
            time.sleep(1.5)
            p = _killed_and_restarted(p, name, log, written, spark_server)
        except BaseException:
            os.killpg(p.pid, signal.SIGKILL)
            raise
    try:
        rc, report, err = _verify(name)  # the writes have stopped: one consistent point, then equal
        assert rc == 0 and report["equal"], "\n".join((err, json.dumps(report, indent=1)[:3000],
                                                         log.read_text()[-3000:]))
        assert {t["table"] for t in report["tables"]} == {f"public.{t}" for t in FOLLOWED}
        assert _replica_key(dbs, "public.c_key") == ["id", "u"]
        with dbs.dst() as c:
            assert c.execute("SELECT count(*) FROM c_trunc WHERE id <= 200").fetchone()[0] == 0  # type: ignore[index]
            assert c.execute("SELECT count(*), min(k), max(k) FROM c_add WHERE id <= 200").fetchone() == (200, 7, 7)
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 0, log.read_text()[-3000:]
    assert_no_traceback(log.read_text())


def _stops(dbs: Dbs, run: list[str], log: Path, ddl: str, says: str, marker: int) -> str:
    """Run the feed; make the change (writes follow it) and expect the feed to stop with exit 2,
    having applied nothing past the change (row `marker`, inserted right after it, is not on the
    replica); returns its error."""
    table = "s_u" if "RENAME TO" in ddl else "s_t"
    p = start_changefeed("run", *run, log=log)
    try:
        wait_for("the feed to catch up", lambda: "running (until stopped)" in log.read_text() and _caught_up(dbs), log)
        with dbs.src() as c:
            c.execute(ddl)
            c.execute(f"INSERT INTO {table} (id, v) VALUES (%s, 1)", (marker,))
            c.execute(f"UPDATE {table} SET v = v + 1 WHERE id = 5")
        assert p.wait(timeout=180) == 2, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    text = log.read_text()
    assert says in text and "nothing past it was applied" in text, text[-3000:]
    assert_no_traceback(text)
    with dbs.dst() as c:
        for t in ("s_t", "s_u"):
            if c.execute("SELECT to_regclass(%s) IS NOT NULL", (t,)).fetchone()[0]:  # type: ignore[index]
                assert c.execute(f"SELECT count(*) FROM {t} WHERE id = %s", (marker,)).fetchone()[0] == 0  # type: ignore[index]
    return text


def _caught_up(dbs: Dbs) -> bool:
    with dbs.src() as s, dbs.dst() as d:
        if not d.execute("SELECT to_regclass('public.s_t') IS NOT NULL").fetchone()[0]:  # type: ignore[index]
            return False
        return s.execute("SELECT count(*), sum(v) FROM s_t").fetchone() == d.execute(
            "SELECT count(*), sum(v) FROM s_t").fetchone()


@pytest.mark.slow
@pytest.mark.usefixtures("warm_spark")
def test_changes_the_wal_cannot_tell_stop_the_feed_until_the_named_fix(dbs: Dbs, tmp_path: Path) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE s_t (id int PRIMARY KEY, v int, a text)")
        c.execute("INSERT INTO s_t SELECT g, g, 'a' || g FROM generate_series(1, 300) g")
    name, first = _feed(dbs, tmp_path, ["s_t"])
    run = first
    for i, (ddl, says) in enumerate([
            ("ALTER TABLE s_t RENAME COLUMN a TO b", "column(s) a are gone and b are new"),
            ("ALTER TABLE s_t ALTER COLUMN v TYPE smallint", "column v changed type from integer to smallint"),
            ("ALTER TABLE s_t ADD COLUMN at timestamptz DEFAULT clock_timestamp()",
             "column at was added with a default computed for each row")]):
        log = tmp_path / f"stop{i}.log"
        text = _stops(dbs, run, log, ddl, says, -1 - i)
        assert "table public.s_t changed on the source" in text
        assert f"changefeed snapshot --name {dbs.name} --tables public.s_t" in text
        if i == 0:  # a restart stops at the same place again: nothing moves until the fix
            again = start_changefeed("run", *name, log=log)
            assert again.wait(timeout=180) == 2 and log.read_text().count(says) >= 2
        run = name
        fixed = changefeed_cli("snapshot", *name, "--tables", "public.s_t")
        assert fixed.returncode == 0, fixed.stderr
        p = start_changefeed("run", *name, log=tmp_path / f"fixed{i}.log")
        try:
            wait_for("the fixed feed equal", lambda: _verify(name)[0] == 0, tmp_path / f"fixed{i}.log")
        finally:
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=120) == 0
    text = _stops(dbs, name, tmp_path / "rename.log", "ALTER TABLE s_t RENAME TO s_u",
                  "table public.s_u has changes but is not on the replica", -9)
    assert f"changefeed alter --name {dbs.name} --rename-table OLD=public.s_u" in text
    renamed = changefeed_cli("alter", *name, "--rename-table", "public.s_t=public.s_u")
    assert renamed.returncode == 0 and "now captures public.s_u (was public.s_t)" in renamed.stdout, renamed.stderr
    p = start_changefeed("run", *name, log=tmp_path / "renamed.log")
    try:
        wait_for("the renamed table equal", lambda: _verify(name)[0] == 0, tmp_path / "renamed.log")
        rc, report, _ = _verify(name)
        assert [t["table"] for t in report["tables"]] == ["public.s_u"]
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 0


def test_capture_ddl_applies_each_change_in_order_across_a_kill(dbs: Dbs, tmp_path: Path, spark_server: str) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE d_t (id int PRIMARY KEY, v int, a text, n int, gone int)")
        c.execute("INSERT INTO d_t SELECT g, g, 'a' || g, g % 100, g FROM generate_series(1, 300) g")
    name, first = _feed(dbs, tmp_path, ["d_t"])
    log = tmp_path / "run.log"
    written: list[int] = []

    def write(uri: str, stop: threading.Event, written: list[int]) -> None:
        rnd = random.Random(5)
        with psycopg.connect(uri, autocommit=True) as c:
            n = 1000
            while not stop.is_set():
                table = c.execute("SELECT relname FROM pg_class WHERE relname IN ('d_t', 'd_u')").fetchone()[0]
                try:
                    with c.transaction():
                        c.execute(f"UPDATE {table} SET v = v + 1 WHERE id = %s", (rnd.randint(1, 300),))
                        c.execute(f"INSERT INTO {table} (id, v) VALUES (%s, %s)", (n, n))
                except psycopg.errors.UndefinedTable:
                    continue  # renamed between the lookup and the statement
                n += 1
                written.append(n)
                time.sleep(0.01)

    with writing(write, dbs.source, written):
        p = start_changefeed("run", *first, "--capture-ddl", log=log)
        try:
            wait_for("a first verification", lambda: _verify(name)[0] == 0, log)
            with dbs.src() as c:
                for ddl in ("ALTER TABLE d_t RENAME COLUMN a TO b",  # a rename, not a drop and an add
                            "ALTER TABLE d_t ADD COLUMN at timestamptz DEFAULT clock_timestamp()",  # a rewrite
                            "ALTER TABLE d_t ALTER COLUMN n TYPE smallint",  # narrowing
                            "ALTER TABLE d_t DROP COLUMN gone, ADD COLUMN fresh int DEFAULT 3",
                            "ALTER TABLE d_t RENAME TO d_u"):
                    c.execute(ddl)
                    time.sleep(0.2)
            time.sleep(1)
            p = _killed_and_restarted(p, name, log, written, spark_server)
        except BaseException:
            os.killpg(p.pid, signal.SIGKILL)
            raise
    try:
        rc, report, err = _verify(name)
        assert rc == 0 and report["equal"], "\n".join((err, json.dumps(report, indent=1)[:3000],
                                                         log.read_text()[-3000:]))
        assert [t["table"] for t in report["tables"]] == ["public.d_u"]  # the feed follows the rename
        with dbs.src() as c:  # a change with no row change after it: the replica takes it at once
            c.execute("ALTER TABLE d_u ADD COLUMN late int DEFAULT 9")
        rc, report, err = _verify(name)
        assert rc == 0 and report["equal"], "\n".join((err, json.dumps(report, indent=1)[:3000]))
        with dbs.dst() as c:
            assert c.execute("SELECT b FROM d_u WHERE id = 7").fetchone() == ("a7",)  # values kept by the rename
            assert c.execute("SELECT count(*) FROM d_u WHERE at IS NULL").fetchone() == (0,)  # the rewrite's values
            assert c.execute("SELECT to_regclass('public.d_t')").fetchone() == (None,)
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 0, log.read_text()[-3000:]
    assert_no_traceback(log.read_text())
    removed = changefeed_cli("remove", *name)
    assert removed.returncode == 0 and f"event trigger changefeed_ddl_{dbs.name}" in removed.stdout, removed.stdout
    with dbs.src() as c:
        assert c.execute("SELECT count(*) FROM pg_event_trigger WHERE evtname LIKE %s",
                         (f"changefeed_ddl%{dbs.name}",)).fetchone() == (0,)


def test_a_table_renamed_while_the_feed_is_stopped_keeps_its_rows_on_the_replica(dbs: Dbs, tmp_path: Path,
                                                                                 spark_server: str) -> None:
    """The runner that starts after the source renamed a table (the rename still in the slot)
    captures it under its new name and makes that table on the replica; when the rename's message
    is applied, the empty new table gives way to the old one, renamed with its rows (they stayed
    behind under the old name before, "missing on the sink")."""
    with dbs.src() as c:
        c.execute("CREATE TABLE r_t (id int PRIMARY KEY, v int)")
        c.execute("INSERT INTO r_t SELECT g, g FROM generate_series(1, 200) g")
    name, first = _feed(dbs, tmp_path, ["r_t"])
    out = changefeed_cli("run", *first, "--capture-ddl", "--available-now", "--master", spark_server)
    assert out.returncode == 0, out.stderr[-3000:]
    with dbs.src() as c:
        c.execute("INSERT INTO r_t VALUES (201, 201)")
        c.execute("ALTER TABLE r_t RENAME TO r_u")
        c.execute("INSERT INTO r_u VALUES (202, 202)")
    out = changefeed_cli("run", *name, "--available-now", "--master", spark_server)
    assert out.returncode == 0, out.stderr[-3000:]
    with dbs.dst() as d:
        assert d.execute("SELECT count(*), sum(v) FROM r_u").fetchone() == (202, sum(range(1, 203)))
        assert d.execute("SELECT to_regclass('public.r_t')").fetchone() == (None,)
    rc, report, err = _verify(name)
    assert rc == 0 and report["equal"], err + json.dumps(report)[:3000]
