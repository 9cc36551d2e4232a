"""Real PostgreSQL servers shared by the session, and each test's own databases on them."""
from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass

import psycopg
import pytest

from changefeed.local.postgres import LocalPostgres

_counter = itertools.count()


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalPostgres, LocalPostgres]]:
    root = tmp_path_factory.mktemp("pg")
    slots = {"max_replication_slots": "64"}  # every test's feed has one while it runs (dbs drops them after)
    # the source can prepare transactions: feeds of several nodes decode them (core.distributed)
    source = LocalPostgres.start(root / "source", settings={**slots, "max_prepared_transactions": "64"})
    sink = LocalPostgres.start(root / "sink", settings=slots)
    yield source, sink
    source.stop("immediate")
    sink.stop("immediate")


@dataclass
class Dbs:
    source: str
    sink: str
    name: str  # a fresh name for the feed of this test

    def src(self) -> psycopg.Connection:
        return psycopg.connect(self.source, autocommit=True)

    def dst(self) -> psycopg.Connection:
        return psycopg.connect(self.sink, autocommit=True)


@pytest.fixture
def dbs(servers: tuple[LocalPostgres, LocalPostgres]) -> Iterator[Dbs]:
    """A fresh empty database on each server, and a fresh feed name. Afterwards the replication
    slots left in the source database are dropped: the shared server has a fixed number of them,
    and each one keeps WAL back for the rest of the session."""
    n = next(_counter)
    name = f"t{os.getpid()}_{n}"
    source, sink = servers
    for server in servers:
        with psycopg.connect(server.uri(), autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
    yield Dbs(source.uri(name), sink.uri(name), name)
    drop_slots(source.uri(), name)


def drop_slots(uri: str, database: str) -> None:
    """Drop the inactive replication slots of `database` (a slot a process still reads stays)."""
    with suppress(psycopg.Error), psycopg.connect(uri, autocommit=True) as c:
        c.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                  "WHERE database = %s AND NOT active", (database,))


def fingerprint(uri: str, table: str) -> tuple[int, str]:
    """(row count, md5 over the rows' text in key order): equal fingerprints = equal tables."""
    with psycopg.connect(uri) as c:
        row = c.execute(f"SELECT count(*), coalesce(md5(string_agg(x::text, '|' ORDER BY x::text)), '') "
                        f"FROM {table} x").fetchone()
    assert row is not None
    return int(row[0]), str(row[1])


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
