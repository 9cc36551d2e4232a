"""Bad input fails at once, clearly, and leaves nothing behind.

Every case runs the real CLI (`python -m changefeed run ...`) as a subprocess and checks:
* a non-zero exit code (the one `changefeed.errors` documents for the error's type);
* stderr starts with `changefeed: error:`, names the problem, has a `hint:` line, and no traceback;
* nothing was created or advanced: no replication slot or publication on the source, no target
  tables or `changefeed` schema on the sink, no stored feed definition or checkpoint, and where a
  slot already existed its confirmed_flush_lsn did not move.

The "feed already running" and "slot missing" cases share one real runner (one Spark start).
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from changefeed.local.postgres import LocalPostgres
from support.feeds import changefeed_cli, start_changefeed
from support.servers import Dbs

# exit codes documented in changefeed.errors
EX_USAGE = 64  # ConfigError
EX_TEMPFAIL = 75  # TransientError (ConnectionFailed)
EX_DEFINITE = 2  # other DefiniteErrors: AuthenticationFailed, SourceNotReady, FeedBusy, SlotLost



# -- helpers ----------------------------------------------------------------------------------

def closed_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def with_password(uri: str, password: str) -> str:
    return re.sub(r"^(postgresql://[^:]+:)[^@]*@", rf"\g<1>{password}@", uri)


def with_port(uri: str, port: int) -> str:
    return re.sub(r"@127\.0\.0\.1:\d+/", f"@127.0.0.1:{port}/", uri)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The command, with a fault point at the runner's start (where Spark would start next): a run
    that reaches it says so (`fault injected at startup`), which assert_clean_failure refuses."""
    env = {**os.environ, "CHANGEFEED_FAIL_AT": "startup", "CHANGEFEED_FAULT_DIR": str(cwd)}
    return changefeed_cli(*args, timeout=300, cwd=cwd, env=env)


def run_args(name: str, source: str, sink: str, tables: str, state: Path, *extra: str) -> list[str]:
    # --available-now: should a check be missing, the run ends by itself instead of running forever
    return ["run", "--name", name, "--source", source, "--sink", sink, "--tables", tables,
            "--state", str(state), "--available-now", *extra]


def assert_clean_failure(proc: subprocess.CompletedProcess[str], exit_code: int, *mentions: str) -> str:
    """Non-zero documented exit code, `changefeed: error: ...` naming the problem, a hint, no traceback,
    and refused before the runner's start (see cli)."""
    out = f"exit {proc.returncode}\n--- stderr:\n{proc.stderr}\n--- stdout:\n{proc.stdout}"
    assert proc.returncode != 0, f"bad input was accepted: {out}"
    assert "Traceback" not in proc.stderr, f"a Python traceback instead of a typed error: {out}"
    spark = [line for line in (proc.stderr + proc.stdout).splitlines()
             if any(w in line for w in ("WARN", "log4j", "setLogLevel", "at org.apache", "Py4J"))]
    assert not spark, f"Spark's or the JVM's lines on the console: {spark}\n{out}"
    assert proc.stderr.startswith("changefeed: error:"), f"stderr does not start with 'changefeed: error:': {out}"
    for m in mentions:
        assert m in proc.stderr, f"the message does not name {m!r}: {out}"
    hints = [line for line in proc.stderr.splitlines() if re.match(r"^\s*hint: \S", line)]
    assert hints, f"no 'hint:' line saying what to do: {out}"
    assert proc.returncode == exit_code, f"expected exit code {exit_code}: {out}"
    assert "fault injected at startup" not in proc.stdout + proc.stderr, f"refused only after its start: {out}"
    return proc.stderr


def assert_hint_commands_exist(stderr: str) -> None:
    """A hint that tells the operator to run `changefeed X` must name a command the CLI has."""
    from changefeed.cli import parser

    sub = next(a for a in parser()._actions if a.dest == "command")
    commands = set(sub.choices)  # type: ignore[arg-type]
    for line in stderr.splitlines():
        if "hint:" in line:
            for cmd in re.findall(r"\bchangefeed ([a-z]+) --", line):
                assert cmd in commands, (f"the hint tells the operator to run `changefeed {cmd}`, "
                                         f"but the CLI has only {sorted(commands)}: {line.strip()}")


def source_snapshot(uri: str) -> dict[str, Any]:
    """Slots of this database (with their positions) and its publications (with their tables)."""
    with psycopg.connect(uri, autocommit=True) as c:
        return {
            "slots": c.execute(
                "SELECT slot_name, plugin, confirmed_flush_lsn::text, restart_lsn::text FROM pg_replication_slots "
                "WHERE database = current_database() ORDER BY 1").fetchall(),
            "publications": c.execute("SELECT pubname FROM pg_publication ORDER BY 1").fetchall(),
            "publication_tables": c.execute(
                "SELECT pubname, schemaname, tablename FROM pg_publication_tables ORDER BY 1, 2, 3").fetchall(),
        }


def sink_snapshot(uri: str) -> dict[str, Any]:
    """Schemas, tables and every table's contents."""
    with psycopg.connect(uri, autocommit=True) as c:
        schemas = [r[0] for r in c.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname !~ '^pg_' AND nspname <> 'information_schema' "
            "ORDER BY 1")]
        tables = c.execute("SELECT schemaname, tablename FROM pg_tables "
                           "WHERE schemaname NOT IN ('pg_catalog', 'information_schema') ORDER BY 1, 2").fetchall()
        contents = {}
        for schema, table in tables:
            q = sql.SQL("SELECT count(*), coalesce(md5(string_agg(x::text, '|' ORDER BY x::text)), '') "
                                "FROM {} x").format(sql.Identifier(schema, table))
            contents[f"{schema}.{table}"] = c.execute(q).fetchone()
        return {"schemas": schemas, "tables": contents}


def cluster_slot(uri: str, slot: str) -> tuple[Any, ...] | None:
    with psycopg.connect(uri, autocommit=True) as c:
        return c.execute("SELECT slot_name, database, confirmed_flush_lsn::text FROM pg_replication_slots "
                         "WHERE slot_name = %s", (slot,)).fetchone()


def assert_nothing_created(source: str, sink: str, state: Path, name: str) -> None:
    """A fresh feed's failed run left no slot, publication, sink object, definition or checkpoint."""
    assert cluster_slot(source, f"changefeed_{name}") is None, f"replication slot changefeed_{name} was created"
    src = source_snapshot(source)
    assert src["slots"] == [], f"replication slots were created on the source: {src['slots']}"
    assert src["publications"] == [], f"publications were created on the source: {src['publications']}"
    dst = sink_snapshot(sink)
    assert dst["schemas"] == ["public"], f"schemas were created on the sink: {dst['schemas']}"
    assert dst["tables"] == {}, f"tables were created on the sink: {sorted(dst['tables'])}"
    left = sorted(str(p.relative_to(state)) for p in (state / name).rglob("*")) if (state / name).exists() else []
    assert not (state / name).exists(), f"a failed first run left {state / name} ({left}), which list cannot show"


def make_tables(uri: str) -> None:
    with psycopg.connect(uri, autocommit=True) as c:
        c.execute("CREATE TABLE public.items (id int PRIMARY KEY, v text)")
        c.execute("CREATE TABLE public.nokey (id int, v text)")
        c.execute("CREATE TABLE public.fullident (id int, v text)")
        c.execute("ALTER TABLE public.fullident REPLICA IDENTITY FULL")
        c.execute("INSERT INTO public.items VALUES (1, 'one'), (2, 'two')")


@pytest.fixture
def fresh(dbs: Dbs, tmp_path: Path) -> Dbs:
    """Source and sink databases; the source has public.items (keyed), nokey and fullident (keyless)."""
    make_tables(dbs.source)
    return dbs


# -- connection problems ----------------------------------------------------------------------

@pytest.mark.parametrize("role", ["source", "sink"])
def test_unreachable_server(fresh: Dbs, tmp_path: Path, role: str) -> None:
    port = closed_port()
    source = with_port(fresh.source, port) if role == "source" else fresh.source
    sink = with_port(fresh.sink, port) if role == "sink" else fresh.sink
    state = tmp_path / "state"
    proc = cli(*run_args(fresh.name, source, sink, "public.items", state), cwd=tmp_path)
    assert_clean_failure(proc, EX_TEMPFAIL, f"cannot reach {role}", f"127.0.0.1:{port}")
    assert_nothing_created(fresh.source, fresh.sink, state, fresh.name)


def test_unreachable_webhook(fresh: Dbs, tmp_path: Path) -> None:
    """A webhook is connected to before anything is created (no request is sent)."""
    port = closed_port()
    state = tmp_path / "state"
    proc = cli(*run_args(fresh.name, fresh.source, f"webhook-http://u:s3cr3t@127.0.0.1:{port}/hook?retry_max=inf",
                             "public.items", state), cwd=tmp_path)
    err = assert_clean_failure(proc, EX_TEMPFAIL, "cannot reach webhook", f"127.0.0.1:{port}",
                               "nothing was created")
    assert "s3cr3t" not in err
    assert_nothing_created(fresh.source, fresh.sink, state, fresh.name)


def test_https_webhook_that_speaks_plain_http(fresh: Dbs, tmp_path: Path) -> None:
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        state = tmp_path / "state"
        sink = f"webhook-https://127.0.0.1:{server.server_address[1]}/hook"
        proc = cli(*run_args(fresh.name, fresh.source, sink, "public.items", state), cwd=tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    assert_clean_failure(proc, EX_DEFINITE, "TLS handshake failed", "webhook-http://")
    assert_nothing_created(fresh.source, fresh.sink, state, fresh.name)


@pytest.mark.parametrize("role", ["source", "sink"])
def test_wrong_password(fresh: Dbs, tmp_path: Path, role: str) -> None:
    secret = "Wr0ng-s3cret"
    source = with_password(fresh.source, secret) if role == "source" else fresh.source
    sink = with_password(fresh.sink, secret) if role == "sink" else fresh.sink
    state = tmp_path / "state"
    proc = cli(*run_args(fresh.name, source, sink, "public.items", state), cwd=tmp_path)
    err = assert_clean_failure(proc, EX_DEFINITE, f"{role} ", "refused the credentials", "postgres")
    assert secret not in err + proc.stdout, f"the password leaked into the output: {err}"
    assert_nothing_created(fresh.source, fresh.sink, state, fresh.name)


# -- the source cannot be captured as asked ----------------------------------------------------

def test_wal_level_not_logical(dbs: Dbs, tmp_path: Path) -> None:
    server = LocalPostgres.start(tmp_path / "replica-level", wal_level="replica")
    try:
        with psycopg.connect(server.uri(), autocommit=True) as c:
            c.execute("CREATE DATABASE walrep")
        source = server.uri("walrep")
        make_tables(source)
        state = tmp_path / "state"
        proc = cli(*run_args(dbs.name, source, dbs.sink, "public.items", state), cwd=tmp_path)
        assert_clean_failure(proc, EX_DEFINITE, "wal_level=replica", "wal_level=logical")
        assert_nothing_created(source, dbs.sink, state, dbs.name)
    finally:
        server.stop("immediate")


@pytest.mark.parametrize("tables, problem", [
    ("public.missing", ["public.missing", "does not exist"]),
    ("public.items,public.missing", ["public.missing", "does not exist"]),  # a good table is not set up alone
    ("Items", ["public.Items", "does not exist"]),  # names are case-sensitive
    ("nosuchschema.items", ["nosuchschema.items", "does not exist"]),
    ("public.nokey", ["public.nokey", "primary key"]),
    ("public.items,public.nokey", ["public.nokey", "primary key"]),
    ("public.fullident", ["public.fullident", "primary key", "sink replica"]),  # FULL: for appending sinks only
], ids=["missing", "good+missing", "wrong-case", "missing-schema", "no-key", "good+no-key", "identity-full"])
def test_source_table_problems(fresh: Dbs, tmp_path: Path, tables: str, problem: list[str]) -> None:
    state = tmp_path / "state"
    proc = cli(*run_args(fresh.name, fresh.source, fresh.sink, tables, state), cwd=tmp_path)
    assert_clean_failure(proc, EX_DEFINITE, *problem)
    assert_nothing_created(fresh.source, fresh.sink, state, fresh.name)


def test_foreign_slot_with_the_feeds_name(fresh: Dbs, tmp_path: Path) -> None:
    """A slot named changefeed_<name> that is not pgoutput is refused and left exactly as it was."""
    slot = f"changefeed_{fresh.name}"
    with fresh.src() as c:
        c.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding')", (slot,))
        c.execute("INSERT INTO public.items VALUES (3, 'three')")
    try:
        before = source_snapshot(fresh.source)
        state = tmp_path / "state"
        proc = cli(*run_args(fresh.name, fresh.source, fresh.sink, "public.items", state), cwd=tmp_path)
        assert_clean_failure(proc, EX_DEFINITE, slot, "test_decoding")
        assert source_snapshot(fresh.source) == before, "the pre-existing slot moved, or a publication was created"
        dst = sink_snapshot(fresh.sink)
        assert dst == {"schemas": ["public"], "tables": {}}, f"the sink was changed: {dst}"
        assert not list(state.rglob("feed.json")), "a failed first run stored a feed definition"
    finally:
        with fresh.src() as c:
            c.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


# -- malformed options ------------------------------------------------------------------------

@pytest.mark.parametrize("change, problem", [
    ({"--name": "BadName"}, ["'BadName'", "not allowed"]),
    ({"--name": "bad name"}, ["'bad name'", "not allowed"]),
    ({"--name": "9lives"}, ["'9lives'", "not allowed"]),
    ({"--name": "a" * 41}, ["not allowed"]),
    ({"--tables": "a.b.c"}, ["a.b.c", "schema.table"]),
    ({"--tables": "public.items,items"}, ["twice"]),
    ({"--sink": "kafka://x"}, ["--sink", "HOST:PORT", "'x'"]),
    ({"--source": "kafka://x"}, ["--source", "postgresql://", "'kafka'"]),
    ({"--sink": ""}, ["--sink is required"]),
    ({"--source": None, "--sink": None, "--tables": None}, ["--source, --sink, --tables are required"]),
    ({"--max-changes-per-batch": "-1"}, ["--max-changes-per-batch", "negative"]),
    ({"--trigger-interval": "-5"}, ["--trigger-interval", "negative"]),
    ({"--max-bytes-per-batch": "lots"}, ["--max-bytes-per-batch", "'lots'", "size"]),
    ({"--max-bytes-per-batch": "-1MB"}, ["--max-bytes-per-batch", "'-1MB'", "size"]),
    ({"--resolved": "soon"}, ["--resolved", "'soon'", "duration"]),
    ({"--resolved": "-1s"}, ["--resolved", "'-1s'", "duration"]),
    ({"--retention": "-5h"}, ["--retention", "'-5h'", "duration"]),
    ({"--max-retained-wal": "abc"}, ["--max-retained-wal", "'abc'", "size"]),
    ({"--snapshot": "sometimes"}, ["--snapshot", "'sometimes'", "initial"]),
    ({"--snapshot-chunk-rows": "0"}, ["--snapshot-chunk-rows", "at least 1"]),
    ({"--snapshot-chunks-per-batch": "-1"}, ["--snapshot-chunks-per-batch", "0 (auto) or more"]),
    ({"--snapshot-reads": "fast"}, ["--snapshot-reads", "'fast'", "auto"]),
    ({"--metrics-port": "70000"}, ["metrics", "127.0.0.1:70000", "0-65535"]),
    ({"--metrics-port": "http"}, ["--metrics-port", "'http'"]),
], ids=["upper-name", "space-name", "digit-name", "long-name", "three-part-table", "table-twice", "kafka-sink",
        "kafka-source", "empty-sink", "all-missing", "negative-changes", "negative-interval", "bytes-lots",
        "bytes-negative", "resolved-soon", "resolved-negative", "retention-negative", "wal-abc", "snapshot-mode",
        "snapshot-chunk-rows", "snapshot-chunks-per-batch", "snapshot-reads", "metrics-port-range",
        "metrics-port-word"])
def test_malformed_options(fresh: Dbs, tmp_path: Path, change: dict[str, str | None], problem: list[str]) -> None:
    opts = {"--name": fresh.name, "--source": fresh.source, "--sink": fresh.sink, "--tables": "public.items",
            "--state": str(tmp_path / "state"), **change}
    args = ["run", "--available-now"] + [f"{k}={v}" for k, v in opts.items() if v is not None]  # =: "-1MB" a value
    proc = cli(*args, cwd=tmp_path)
    assert_clean_failure(proc, EX_USAGE, *problem)
    assert_nothing_created(fresh.source, fresh.sink, tmp_path / "state", fresh.name)
    assert not (tmp_path / "state").exists(), "malformed options should be rejected before the state folder is made"


def test_metrics_port_taken(fresh: Dbs, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = cli(*run_args(fresh.name, fresh.source, fresh.sink, "public.items", tmp_path / "state",
                                 "--metrics-port", str(port)), cwd=tmp_path)
    assert_clean_failure(proc, EX_USAGE, f"127.0.0.1:{port}", "--metrics-port")
    assert_nothing_created(fresh.source, fresh.sink, tmp_path / "state", fresh.name)
    assert not (tmp_path / "state").exists(), "a taken metrics port should be found before the state folder is made"


@pytest.mark.parametrize("role", ["source", "sink"])
def test_mistyped_uri_does_not_echo_the_password(fresh: Dbs, tmp_path: Path, role: str) -> None:
    secret = "S3cret-typo"
    typo = f"postgresql:/postgres:{secret}@127.0.0.1:5432/db"  # one slash short
    opts = {"--source": fresh.source, "--sink": fresh.sink, f"--{role}": typo}
    proc = cli("run", "--available-now", f"--name={fresh.name}", "--tables=public.items",
                   f"--state={tmp_path / 'state'}", *[f"{k}={v}" for k, v in opts.items()], cwd=tmp_path)
    err = assert_clean_failure(proc, EX_USAGE, f"--{role}", "postgresql://")
    assert secret not in err + proc.stdout, f"the password of a mistyped URI leaked into the output: {err}"
    assert_nothing_created(fresh.source, fresh.sink, tmp_path / "state", fresh.name)


@pytest.mark.parametrize("with_state", [True, False], ids=["state", "default-state"])
def test_status_of_unknown_feed(tmp_path: Path, with_state: bool) -> None:
    args = ["status", "--name", "nosuch"] + (["--state", str(tmp_path / "state")] if with_state else [])
    proc = cli(*args, cwd=tmp_path)
    assert_clean_failure(proc, EX_USAGE, "nosuch", "no feed")
    assert proc.stdout == ""


# -- a real feed: busy, clean stop, then a lost slot ----------------------------------------------

@dataclass
class Runner:
    dbs: Dbs
    state: Path
    log: Path
    proc: subprocess.Popen[bytes]
    args: list[str] = field(default_factory=list)
    next_id: int = 100
    rc: int | None = None

    @property
    def slot(self) -> str:
        return f"changefeed_{self.dbs.name}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def assert_alive(self) -> None:
        assert self.proc.poll() is None, f"the first runner exited ({self.proc.returncode}):\n{self.log_text()[-4000:]}"

    def replicates(self, timeout: float = 90) -> None:
        """Insert a row on the source and wait until the runner delivered it to the sink."""
        self.next_id += 1
        key = self.next_id
        with self.dbs.src() as c:
            c.execute("INSERT INTO public.items VALUES (%s, 'x')", (key,))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.assert_alive()
            with self.dbs.dst() as c:
                if c.execute("SELECT to_regclass('public.items')").fetchone()[0] and \
                        c.execute("SELECT 1 FROM public.items WHERE id = %s", (key,)).fetchone():
                    return
            time.sleep(0.3)
        raise AssertionError(f"row {key} not replicated within {timeout}s:\n{self.log_text()[-4000:]}")

    def stop(self) -> int:
        """SIGTERM (the clean stop) to the runner; its exit code. Idempotent."""
        if self.rc is None:
            self.proc.send_signal(signal.SIGTERM)
            self.rc = self.proc.wait(timeout=120)
        return self.rc


@pytest.fixture(scope="module")
def runner(servers: tuple[LocalPostgres, LocalPostgres], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runner]:
    """One feed on public.items, started in the background and seen delivering a row."""
    source, sink = servers
    name = f"busy{os.getpid()}"
    for server in servers:
        with psycopg.connect(server.uri(), autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
    dbs = Dbs(source.uri(name), sink.uri(name), name)
    make_tables(dbs.source)
    root = tmp_path_factory.mktemp("runner")
    state, log = root / "state", root / "runner.log"
    args = ["run", "--name", name, "--source", dbs.source, "--sink", dbs.sink, "--tables", "public.items",
            "--state", str(state)]
    proc = start_changefeed(*args, log=log)
    r = Runner(dbs, state, log, proc, args)
    try:
        deadline = time.monotonic() + 180
        while "running" not in r.log_text():
            r.assert_alive()
            assert time.monotonic() < deadline, f"the runner did not start:\n{r.log_text()[-4000:]}"
            time.sleep(0.3)
        r.replicates()
        yield r
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)


def test_feed_running_elsewhere_other_state(runner: Runner, tmp_path: Path) -> None:
    runner.assert_alive()
    d = runner.dbs
    other = tmp_path / "other-state"
    pubs_before = source_snapshot(d.source)["publication_tables"]
    sink_schemas = sink_snapshot(d.sink)["schemas"]
    proc = cli(*run_args(d.name, d.source, d.sink, "public.items", other), cwd=tmp_path)
    assert_clean_failure(proc, EX_DEFINITE, f"feed {d.name} is already running", str(runner.proc.pid))
    src = source_snapshot(d.source)
    assert [s[0] for s in src["slots"]] == [runner.slot], f"slots: {src['slots']}"
    assert src["publication_tables"] == pubs_before
    assert sink_snapshot(d.sink)["schemas"] == sink_schemas
    assert not (other / d.name).exists(), f"the refused runner left {sorted(map(str, other.rglob('*')))}"
    runner.replicates()  # the first runner is undisturbed


def test_feed_running_elsewhere_same_state(runner: Runner, tmp_path: Path) -> None:
    runner.assert_alive()
    d = runner.dbs
    spec_before = (runner.state / d.name / "feed.json").read_bytes()
    lock_before = (runner.state / d.name / "run.lock").read_bytes()
    proc = cli(*run_args(d.name, d.source, d.sink, "public.items", runner.state), cwd=tmp_path)
    assert_clean_failure(proc, EX_DEFINITE, f"feed {d.name} is already running", str(runner.proc.pid))
    assert (runner.state / d.name / "feed.json").read_bytes() == spec_before
    assert (runner.state / d.name / "run.lock").read_bytes() == lock_before, "the refused runner rewrote the lock"
    assert [s[0] for s in source_snapshot(d.source)["slots"]] == [runner.slot]
    runner.replicates()


def test_sigterm_stops_the_runner_cleanly(runner: Runner) -> None:
    runner.assert_alive()
    rc = runner.stop()
    assert rc == 0, f"SIGTERM is the clean stop, but the runner exited {rc}:\n{runner.log_text()[-4000:]}"
    assert "stopped cleanly" in runner.log_text()
    offsets = runner.state / runner.dbs.name / "checkpoint" / "offsets"
    assert offsets.is_dir() and any(offsets.iterdir()), "the runner left no checkpoint"
    slot = cluster_slot(runner.dbs.source, runner.slot)
    assert slot is not None and slot[2] is not None


def test_table_lost_its_key_on_a_stopped_feed(runner: Runner, tmp_path: Path) -> None:
    """The slot exists and the feed has a checkpoint: a failing check must not move the slot."""
    assert runner.stop() == 0
    d = runner.dbs
    with d.src() as c:
        c.execute("INSERT INTO public.items VALUES (900, 'pending')")  # WAL the slot must not skip
        c.execute("ALTER TABLE public.items DROP CONSTRAINT items_pkey")
    try:
        src_before, dst_before = source_snapshot(d.source), sink_snapshot(d.sink)
        proc = cli(*run_args(d.name, d.source, d.sink, "public.items", runner.state), cwd=tmp_path)
        assert_clean_failure(proc, EX_DEFINITE, "public.items", "primary key")
        assert source_snapshot(d.source) == src_before, "the slot moved or the publication changed"
        assert sink_snapshot(d.sink) == dst_before, "the sink was changed"
    finally:
        with d.src() as c:
            c.execute("ALTER TABLE public.items ADD PRIMARY KEY (id)")


def test_slot_missing_while_checkpoint_exists(runner: Runner, tmp_path: Path) -> None:
    assert runner.stop() == 0
    d = runner.dbs
    assert (runner.state / d.name / "checkpoint" / "offsets").is_dir()
    with d.src() as c:
        c.execute("SELECT pg_drop_replication_slot(%s)", (runner.slot,))
        c.execute("INSERT INTO public.items VALUES (901, 'after the slot was lost')")
    src_before, dst_before = source_snapshot(d.source), sink_snapshot(d.sink)
    checkpoint = runner.state / d.name / "checkpoint"  # (the run records its failure next to it)
    checkpoint_before = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*"))
    proc = cli(*run_args(d.name, d.source, d.sink, "public.items", runner.state), cwd=tmp_path)
    err = assert_clean_failure(proc, EX_DEFINITE, runner.slot, "missing", "checkpoint")
    assert cluster_slot(d.source, runner.slot) is None, "the lost slot was silently re-created"
    assert source_snapshot(d.source) == src_before
    assert sink_snapshot(d.sink) == dst_before, "the sink was changed"
    assert sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*")) == checkpoint_before
    # and the same again with only the stored definition (no --source/--sink/--tables)
    proc = cli("run", "--name", d.name, "--state", str(runner.state), "--available-now", cwd=tmp_path)
    assert_clean_failure(proc, EX_DEFINITE, runner.slot, "missing")
    assert cluster_slot(d.source, runner.slot) is None, "the lost slot was silently re-created"
    # last, the wording: no made-up position, and a hint the operator can actually follow
    problems = []
    if re.search(r"checkpoint at 0/0\b", err):
        problems.append("the message claims the checkpoint is at 0/0, but it is past the delivered rows")
    try:
        assert_hint_commands_exist(err)
    except AssertionError as e:
        problems.append(str(e).splitlines()[0])
    assert not problems, "\n".join(problems) + f"\n--- stderr:\n{err}"


# -- alter and snapshot requests ------------------------------------------------------------------

def test_alter_and_snapshot_requests_refuse_bad_tables(fresh: Dbs, tmp_path: Path) -> None:
    from changefeed.spec.definition import FeedSpec
    from changefeed.spec.state import FeedState

    state = FeedState(tmp_path / "state", fresh.name)
    state.save(FeedSpec(fresh.name, fresh.source, fresh.sink, ("public.items", "public.fullident")))
    before_src, before_dst = source_snapshot(fresh.source), sink_snapshot(fresh.sink)
    base = ["--name", fresh.name, "--state", str(tmp_path / "state")]
    for where, code, words in [
            ("public.other=id > 0", EX_USAGE, ["does not capture", "public.other"]),
            ("public.items=idd > 0", EX_USAGE, ["PostgreSQL refuses", "idd"]),
            ("public.items=v = 'x'", EX_USAGE, ["outside the table's replica identity", "REPLICA IDENTITY FULL"]),
            ("public.fullident=id > 0", EX_USAGE, ["has no key", "public.fullident"]),
            ("items", EX_USAGE, ["SCHEMA.TABLE=PREDICATE"])]:
        proc = cli("alter", *base, "--where", where, cwd=tmp_path)
        assert_clean_failure(proc, code, *words)
    proc = cli("alter", *base, "--where", "public.items=id > 0", "--where", "public.items=id > 1", cwd=tmp_path)
    assert_clean_failure(proc, EX_USAGE, "one --where at a time")
    proc = cli("alter", *base, "--add-tables", "public.nosuch", cwd=tmp_path)
    assert_clean_failure(proc, EX_DEFINITE, "public.nosuch", "does not exist")
    proc = cli("alter", *base, "--add-tables", "public.items", cwd=tmp_path)
    assert_clean_failure(proc, EX_USAGE, "already captures", "public.items")
    proc = cli("snapshot", *base, "--tables", "public.other", cwd=tmp_path)
    assert_clean_failure(proc, EX_USAGE, "does not capture", "public.other", "alter --add-tables")
    proc = cli("alter", "--name", "nosuch", "--state", str(tmp_path / "state"), "--add-tables", "public.x",
                   cwd=tmp_path)
    assert_clean_failure(proc, EX_USAGE, "no feed", "nosuch")
    assert source_snapshot(fresh.source) == before_src and sink_snapshot(fresh.sink) == before_dst
    assert state.load().tables == ("public.items", "public.fullident")  # type: ignore[union-attr]
    assert state.load().where == ()  # type: ignore[union-attr]
    import psycopg

    from changefeed.postgres.requests import SourceRequests

    with psycopg.connect(fresh.source, autocommit=True) as c:
        assert SourceRequests(lambda: c, fresh.name, state.requests).after(0) == [], "a refused request was queued"


# -- a Kafka sink that cannot be used ------------------------------------------------------------

def test_unreachable_kafka(fresh: Dbs, tmp_path: Path) -> None:
    port = closed_port()
    state = tmp_path / "state"
    proc = cli(*run_args(fresh.name, fresh.source, f"kafka://127.0.0.1:{port}?timeout=3s", "public.items", state),
                   cwd=tmp_path)
    assert_clean_failure(proc, EX_TEMPFAIL, "cannot reach Kafka", f"127.0.0.1:{port}")
    assert f"waiting for the sink kafka://127.0.0.1:{port} to answer" in proc.stdout, proc.stdout  # not silence
    assert_nothing_created(fresh.source, fresh.sink, state, fresh.name)


@pytest.mark.parametrize("query, problem", [
    ("delivery=sometimes", "delivery must be one of"),
    ("transactional.id=x", "sets transactional.id itself"),
    ("kafka_config=@/nonexistent.json", "cannot read the kafka_config file"),
])
def test_malformed_kafka_options(fresh: Dbs, tmp_path: Path, query: str, problem: str) -> None:
    state = tmp_path / "state"
    proc = cli(*run_args(fresh.name, fresh.source, f"kafka://127.0.0.1:9?{query}", "public.items", state),
                   cwd=tmp_path)
    assert_clean_failure(proc, EX_USAGE, problem)
    assert_nothing_created(fresh.source, fresh.sink, state, fresh.name)


@pytest.mark.parametrize("query, named", [
    ('kafka_config={"acks":"1"}', "acks=1"),
    ("transaction.timeout.ms=20000&socket.timeout.ms=60000", "socket.timeout.ms=60000"),
    ("message.timeout.ms=300000&transaction.timeout.ms=60000", "message.timeout.ms=300000"),
    ("timeout=16m", "timeout must be between 1s and 15m"),
], ids=["acks", "socket-timeout", "message-timeout", "timeout-range"])
def test_kafka_settings_the_client_refuses(fresh: Dbs, tmp_path: Path, kafka: Any, query: str, named: str) -> None:
    """Refused by run's checks, naming the setting the user gave: before the slot, the publication or
    any topic (the broker is reachable, so a later check would have created them)."""
    from confluent_kafka.admin import AdminClient

    prefix = f"refused{fresh.name}."
    state = tmp_path / "state"
    sink = f"kafka://{kafka.bootstrap}?topic_prefix={prefix}&progress_topic={prefix}progress&{query}"
    proc = cli(*run_args(fresh.name, fresh.source, sink, "public.items", state), cwd=tmp_path)
    assert_clean_failure(proc, EX_USAGE, named)
    assert "fix the client settings" not in proc.stderr
    assert_nothing_created(fresh.source, fresh.sink, state, fresh.name)
    topics = AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(timeout=10).topics
    assert not [t for t in topics if t.startswith(prefix)], "a topic was created before the settings were refused"


# -- an outbox table that cannot be used ----------------------------------------------------------

@pytest.mark.parametrize("ddl, extra, code, problem", [
    ("CREATE TABLE public.outbox (id text PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text, "
     "event_type text NOT NULL, payload jsonb)", [], EX_DEFINITE, "SET NOT NULL"),
    ("CREATE TABLE public.outbox (id text PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL, "
     "event_type text NOT NULL, body jsonb)", [], EX_USAGE, "no column payload"),
    ("CREATE TABLE public.outbox (id text PRIMARY KEY)", ["--outbox-topic", "x.{table}"], EX_USAGE, "unknown fields"),
], ids=["nullable-aggregate-id", "missing-payload", "bad-topic-template"])
def test_unusable_outbox(fresh: Dbs, tmp_path: Path, ddl: str, extra: list[str], code: int, problem: str) -> None:
    with psycopg.connect(fresh.source, autocommit=True) as c:
        c.execute(ddl)
    state = tmp_path / "state"
    proc = cli(*run_args(fresh.name, fresh.source, "webhook-http://127.0.0.1:9/hook", "public.items", state),
                   "--outbox", "public.outbox", *extra, cwd=tmp_path)
    assert_clean_failure(proc, code, problem)
    assert_nothing_created(fresh.source, fresh.sink, state, fresh.name)
