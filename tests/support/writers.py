"""Writers that change the source while a feed runs, and what the replica holds of them."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg

from support.servers import Dbs

# The pause of a test's writer between its transactions: a rate that a feed follows on a busy
# 2-core machine. Faster writers prove nothing more (the races are per transaction), but every
# catch-up after a kill replays what they wrote, which made the suite's kill tests long.
WRITE_PAUSE = 0.01


def moving_money(accounts: int, amount: int = 1) -> Callable[[str, threading.Event, list[int]], None]:
    """A `writing` worker: transaction n appends row n to `ledger` and moves `amount` from account
    n % accounts to account (7n + 1) % accounts; `written` = [n]."""
    def mover(uri: str, stop: threading.Event, written: list[int]) -> None:
        with psycopg.connect(uri, autocommit=True) as c:
            n = 0
            while not stop.is_set():
                n += 1
                with c.transaction():
                    c.execute("INSERT INTO ledger (id, v) VALUES (%s, %s)", (n, f"entry {n}"))
                    c.execute("UPDATE accounts SET balance = balance - %s WHERE id = %s", (amount, n % accounts))
                    c.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s",
                              (amount, (n * 7 + 1) % accounts))
                written[:] = [n]
                time.sleep(WRITE_PAUSE)
    return mover


def money_tables(dbs: Dbs, accounts: int, balance: int = 1000) -> None:
    """`moving_money`'s tables on the source: an empty `ledger`, and `accounts` accounts of `balance`."""
    with dbs.src() as c:
        c.execute("CREATE TABLE ledger (id bigint PRIMARY KEY, v text NOT NULL)")
        c.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        c.execute("INSERT INTO accounts SELECT g, %s FROM generate_series(0, %s) g", (balance, accounts - 1))


def replicated(uri: str) -> int:
    """The highest `ledger` id on the replica at `uri` (moving_money's rows; 0 before the table exists)."""
    with psycopg.connect(uri) as d:
        if d.execute("SELECT to_regclass('public.ledger') IS NULL").fetchone()[0]:  # type: ignore[index]
            return 0
        return int(d.execute("SELECT coalesce(max(id), 0) FROM ledger").fetchone()[0])  # type: ignore[index]


def most_sub_windows(uri: str, feed: str, epoch: int | None = None) -> int:
    """The most progress rows one batch of `feed` committed on the replica (of lease term `epoch`,
    if given): a followed batch of low-latency mode commits many sub-windows, a micro-batch one."""
    with psycopg.connect(uri) as d:
        if d.execute("SELECT to_regclass('changefeed.progress') IS NULL").fetchone()[0]:  # type: ignore[index]
            return 0
        return int(d.execute("SELECT coalesce(max(n), 0) FROM (SELECT count(*) n FROM changefeed.progress "
                             "WHERE feed = %s AND (%s::bigint IS NULL OR epoch = %s) GROUP BY batch_id) x",
                             (feed, epoch, epoch)).fetchone()[0])  # type: ignore[index]


@contextmanager
def writing(writer: Callable[[str, threading.Event, list[int]], None], uri: str, written: list[int]) -> Iterator[None]:
    """Run `writer(uri, stop, written)` in a thread for the block; stop it and wait for it after."""
    stop = threading.Event()
    w = threading.Thread(target=writer, args=(uri, stop, written))
    w.start()
    try:
        yield
    finally:
        stop.set()
        w.join()


def terminating(uri: str, stop: threading.Event, _: list[int]) -> None:
    """A `writing` worker: terminate the feed's backends on the source (its runner's, its readers')
    every 0.2 s until stopped."""
    with psycopg.connect(uri, autocommit=True) as c:
        while not stop.is_set():
            c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
                      "AND application_name LIKE 'changefeed%%' AND pid <> pg_backend_pid()")
            time.sleep(0.2)
