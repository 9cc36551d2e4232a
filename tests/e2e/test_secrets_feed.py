"""Secrets a feed is given never land on disk in plain text, nor in what it prints (issue 37): a
literal password (stored encrypted), a password by reference (${VAR}), libpq's password file,
and a webhook receiver that checks a bearer token and every Standard Webhooks signature."""
from __future__ import annotations

import base64
import json
import os
import re
import secrets as pysecrets
import stat
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest

from changefeed.local.postgres import LocalPostgres
from support.feeds import changefeed_cli, start_changefeed, wait_for

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[LocalPostgres, LocalPostgres]]:
    started = [LocalPostgres.start(tmp_path / name) for name in ("source", "sink")]
    yield started[0], started[1]
    for server in started:
        server.stop("immediate")


def _user(server: LocalPostgres, name: str, password: str) -> str:
    with psycopg.connect(server.uri(), autocommit=True) as c:
        c.execute(f"CREATE ROLE {name} LOGIN REPLICATION PASSWORD '{password}'")
        c.execute(f"GRANT CREATE, CONNECT ON DATABASE postgres TO {name}")
        c.execute(f"GRANT ALL ON SCHEMA public TO {name}")
    return f"127.0.0.1:{server.port}/postgres"


def _table(server: LocalPostgres, owner: str) -> None:
    with psycopg.connect(server.uri(), autocommit=True) as c:
        c.execute("CREATE TABLE acct (id int PRIMARY KEY, balance int NOT NULL)")
        c.execute("INSERT INTO acct SELECT g, 100 FROM generate_series(1, 500) g")
        c.execute(f"ALTER TABLE acct OWNER TO {owner}")


def _users(servers: tuple[LocalPostgres, LocalPostgres], prefixes: tuple[str, str]) -> tuple[str, str, str, str]:
    """A reader on the source (owning its table) and a writer on the sink, with fresh passwords:
    (source password, sink password, source address, sink address)."""
    source, sink = servers
    pw_source, pw_sink = (f"{p}-{pysecrets.token_hex(8)}" for p in prefixes)
    at_source, at_sink = _user(source, "reader", pw_source), _user(sink, "writer", pw_sink)
    _table(source, "reader")
    return pw_source, pw_sink, at_source, at_sink


def _cli(*args: str, env: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> Any:
    """changefeed ARGS with `env` added to this environment (and `drop` taken out of it)."""
    return changefeed_cli(*args, env={**{k: v for k, v in os.environ.items() if k not in drop}, **(env or {})})


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def _found_in(root: Path, *needles: str) -> list[str]:
    hits = []
    for path in _files(root):
        data = path.read_bytes()
        hits += [f"{path}: {n!r}" for n in needles if n.encode() in data]
    return hits


def test_no_secret_under_the_state_folder_or_on_the_console(servers: tuple[LocalPostgres, LocalPostgres],
                                                            tmp_path: Path) -> None:
    source, sink = servers
    pw_source, pw_sink, at_source, at_sink = _users(servers, ("Src", "Snk"))
    state = tmp_path / "state"
    name = ["--name", "sec", "--state", str(state)]
    source_uri, sink_uri = f"postgresql://reader:{pw_source}@{at_source}", f"postgresql://writer:{pw_sink}@{at_sink}"
    first = changefeed_cli("run", *name, "--source", source_uri, "--sink", sink_uri, "--tables", "public.acct",
                           "--available-now")
    assert first.returncode == 0, first.stderr[-3000:]
    with psycopg.connect(source.uri(), autocommit=True) as c:
        c.execute("UPDATE acct SET balance = balance + 1 WHERE id < 50")
    log = tmp_path / "run.log"
    p = start_changefeed("run", *name, "--metrics-port", "0", log=log)  # the stored definition: it decrypts
    try:
        wait_for("the change applied", lambda: psycopg.connect(sink.uri()).execute(
            "SELECT sum(balance) FROM acct").fetchone() == (50049,), log)
        url = re.search(r"metrics on (http://\S+)", log.read_text())
        assert url, log.read_text()
        metrics = urllib.request.urlopen(url.group(1), timeout=5).read().decode()
    finally:
        p.terminate()
        assert p.wait(timeout=120) == 0, log.read_text()[-3000:]
    again = changefeed_cli("run", *name, "--source", source_uri, "--available-now")  # the same, given again
    assert again.returncode == 0, again.stderr[-3000:]
    shown = [changefeed_cli("status", *name, "--json").stdout, changefeed_cli("status", *name).stdout,
             changefeed_cli("list", "--state", str(state)).stdout, first.stdout + first.stderr, log.read_text(),
             metrics]
    for text in shown:
        assert pw_source not in text and pw_sink not in text, text[-2000:]
    assert (state / "sec" / "spark.log").stat().st_size > 0 and (state / "sec" / "checkpoint" / "offsets").is_dir()
    assert not _found_in(state, pw_source, pw_sink)  # feed.json, Spark's checkpoint and log, ledgers, notes
    stored = json.loads((state / "sec" / "feed.json").read_text())
    assert "${enc." in stored["source"] and "${enc." in stored["sink"]
    assert stat.S_IMODE(state.stat().st_mode) == 0o700 and stat.S_IMODE((state / "sec").stat().st_mode) == 0o700
    loose = [f"{p} {oct(stat.S_IMODE(p.stat().st_mode))}" for p in _files(state) if p.stat().st_mode & 0o077]
    assert not loose, loose

    # a state folder made readable by hand is warned about
    os.chmod(state / "sec", 0o755)
    warned = changefeed_cli("run", *name, "--available-now")
    assert warned.returncode == 0 and "open to other users" in warned.stdout + warned.stderr


def test_passwords_by_reference_and_from_the_password_file(servers: tuple[LocalPostgres, LocalPostgres],
                                                           tmp_path: Path) -> None:
    source, sink = servers
    pw_source, pw_sink, at_source, at_sink = _users(servers, ("Ref", "File"))
    passfile = tmp_path / "pgpass"
    passfile.write_text(f"127.0.0.1:{sink.port}:postgres:writer:{pw_sink}\n")
    os.chmod(passfile, 0o600)
    state = tmp_path / "state"
    name = ["--name", "refs", "--state", str(state)]
    env = {"SRC_PASS": pw_source, "PGPASSFILE": str(passfile)}
    args = ["--source", f"postgresql://reader:${{SRC_PASS}}@{at_source}", "--sink", f"postgresql://writer@{at_sink}",
            "--tables", "public.acct"]

    unset = _cli("run", *name, *args, "--available-now", env={"PGPASSFILE": str(passfile)}, drop=("SRC_PASS",))
    assert unset.returncode == 64 and "SRC_PASS" in unset.stderr and "not set" in unset.stderr, unset.stderr
    assert not (state / "refs" / "feed.json").exists() and _slots(source) == []  # nothing created
    os.chmod(passfile, 0o644)  # libpq would skip it
    loose = _cli("run", *name, *args, "--available-now", env=env)
    assert loose.returncode == 64 and "others may read it" in loose.stderr, loose.stderr
    assert _slots(source) == []
    os.chmod(passfile, 0o600)

    copied = _cli("run", *name, *args, "--available-now", env=env)
    assert copied.returncode == 0, copied.stderr[-3000:]
    stored = json.loads((state / "refs" / "feed.json").read_text())
    assert "${SRC_PASS}" in stored["source"] and "writer@" in stored["sink"], stored
    assert not _found_in(state, pw_source, pw_sink)
    later = _cli("run", *name, "--available-now", env={"PGPASSFILE": str(passfile)}, drop=("SRC_PASS",))  # gone
    assert later.returncode == 64 and "SRC_PASS" in later.stderr and pw_source not in later.stderr, later.stderr


def _slots(server: LocalPostgres) -> list[str]:
    with psycopg.connect(server.uri()) as c:
        return [r[0] for r in c.execute("SELECT slot_name FROM pg_replication_slots")]


@pytest.fixture
def receiver() -> Iterator[tuple[dict[str, Any], int]]:
    """An endpoint that checks the bearer token and the Standard Webhooks signature of every
    request (standardwebhooks, with the secret in `seen["secret"]`), failing each first attempt."""
    from standardwebhooks.webhooks import Webhook, WebhookVerificationError

    seen: dict[str, Any] = {"ids": [], "verified": 0, "refused": 0, "messages": 0, "secret": "", "token": ""}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            try:
                if self.headers.get("Authorization") != f"Bearer {seen['token']}":
                    raise WebhookVerificationError("no token")
                Webhook(seen["secret"]).verify(body, dict(self.headers))
            except WebhookVerificationError:
                with lock:
                    seen["refused"] += 1
                self.send_response(401)
                self.end_headers()
                self.wfile.write(b'{"error": "signature"}')
                return
            with lock:
                seen["verified"] += 1
                first = self.headers["webhook-id"] not in seen["ids"]
                seen["ids"].append(self.headers["webhook-id"])
                if not first:
                    seen["messages"] += json.loads(body).get("length", 0)
            self.send_response(500 if first else 200)  # every request is sent twice: the same id again
            self.end_headers()
            self.wfile.write(b"{}")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield seen, server.server_address[1]
    server.shutdown()


def test_a_signed_webhook_verified_by_its_receiver_and_refused_with_another_secret(
        servers: tuple[LocalPostgres, LocalPostgres], receiver: tuple[dict[str, Any], int], tmp_path: Path) -> None:
    seen, port = receiver
    source, _ = servers
    _table(source, "postgres")
    secret = "whsec_" + base64.b64encode(os.urandom(32)).decode()
    token = pysecrets.token_hex(12)
    seen["secret"], seen["token"] = secret, token
    env = {"HOOK_SECRET": secret, "HOOK_TOKEN": token}
    sink = (f"webhook-http://127.0.0.1:{port}/in?flush_messages=100&retry_backoff=10ms&"
            "header=Authorization:Bearer%20${HOOK_TOKEN}&signing_secret=${HOOK_SECRET}")
    state = tmp_path / "state"
    name = ["--name", "hook", "--state", str(state)]
    bad = _cli("run", *name, "--source", source.uri(), "--tables", "public.acct", "--available-now",
               "--sink", sink.replace("${HOOK_SECRET}", "whsec_short"), env=env)
    assert bad.returncode == 64 and "Standard Webhooks secret" in bad.stderr and "whsec_short" not in bad.stderr
    assert _slots(source) == []
    ran = _cli("run", *name, "--source", source.uri(), "--tables", "public.acct", "--available-now",
               "--sink", sink, env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert seen["messages"] >= 500 and seen["refused"] == 0 and seen["verified"] == len(seen["ids"])
    ids = seen["ids"]
    assert all(ids.count(i) == 2 for i in ids) and len(set(ids)) >= 5  # each retried once, with its id
    assert not _found_in(state, secret, token)

    seen["secret"] = "whsec_" + base64.b64encode(os.urandom(32)).decode()  # the receiver's secret changes
    with psycopg.connect(source.uri(), autocommit=True) as c:
        c.execute("UPDATE acct SET balance = 0 WHERE id = 1")
    began = time.monotonic()
    refused = _cli("run", *name, "--available-now", env=env)
    assert refused.returncode == 2 and "401" in refused.stderr and "signing_secret" in refused.stderr, \
        refused.stderr[-3000:]
    assert secret not in refused.stderr and token not in refused.stderr and time.monotonic() - began < 120
