"""What both demos share: the bank-like schema, its writers, and how a demo says its feed failed."""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import psycopg
from psycopg.types.json import Jsonb

from changefeed.errors import ChangefeedError, DefiniteError
from changefeed.postgres.connect import insert_lsn, one_row
from changefeed.spec.definition import FeedSpec
from changefeed.spec.state import FeedState

SCHEMA = """
CREATE TABLE accounts (id bigint PRIMARY KEY, owner text NOT NULL, balance numeric(14,2) NOT NULL,
                       tags text[], updated_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE transfers (id bigserial PRIMARY KEY, from_id bigint NOT NULL, to_id bigint NOT NULL,
                        amount numeric(14,2) NOT NULL, memo text, created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE outbox (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), aggregate_type text NOT NULL,
                     aggregate_id text NOT NULL, event_type text NOT NULL, payload jsonb NOT NULL,
                     created_at timestamptz NOT NULL DEFAULT now());
"""
TABLES = ("public.accounts", "public.transfers", "public.outbox")
ACCOUNTS = 2000


def transfer(conn: psycopg.Connection, rng: random.Random) -> None:
    a, b = rng.sample(range(1, ACCOUNTS + 1), 2)
    amount = round(rng.uniform(1, 500), 2)
    with conn.transaction():
        conn.execute("UPDATE accounts SET balance = balance - %s, updated_at = now() WHERE id = %s", (amount, a))
        conn.execute("UPDATE accounts SET balance = balance + %s, updated_at = now() WHERE id = %s", (amount, b))
        memo = rng.choice([None, "rent", "coffee\tand cake", "a\nb"])
        tid = one_row(conn.execute("INSERT INTO transfers (from_id, to_id, amount, memo) VALUES (%s, %s, %s, %s) "
                                   "RETURNING id", (a, b, amount, memo)))[0]
        conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                     "VALUES ('transfer', %s, 'TransferMade', %s)",
                     (str(tid), Jsonb({"from": a, "to": b, "amount": str(amount)})))
        if rng.random() < 0.05:  # the app prunes old outbox rows itself sometimes
            conn.execute("DELETE FROM outbox WHERE id IN (SELECT id FROM outbox ORDER BY created_at LIMIT 5)")


def writer(uri: str, seed: int, stop: threading.Event, counts: list[int]) -> None:
    rng = random.Random(seed)
    with psycopg.connect(uri, autocommit=True) as conn:
        while not stop.is_set():
            transfer(conn, rng)
            counts[seed] += 1


def failed(doing: str, failure: list[BaseException]) -> ChangefeedError:
    """The feed's own typed error if it raised one, else one that says where to look."""
    if failure and isinstance(failure[0], ChangefeedError):
        return failure[0]
    return DefiniteError(f"the demo's feed did not {doing}" + (f": {failure[0]!r}" if failure else ""),
                         "see the feed's Spark log, WORKDIR/state/demo/spark.log (--workdir, default "
                         "./changefeed-demo)")


class FeedThread:
    """A feed run in a thread of the demo's own process, and what it raised."""

    def __init__(self, spec: FeedSpec, state: FeedState, master: str) -> None:
        from changefeed.control.runner import run

        self.spec, self.stop, self.failure = spec, threading.Event(), list[BaseException]()

        def feed() -> None:
            try:
                run(spec, state, master=master, stop_event=self.stop, report=lambda s: print(s, flush=True))
            except BaseException as e:  # noqa: BLE001 - raised by check() and end()
                self.failure.append(e)

        self.thread = threading.Thread(target=feed, name="feed")
        self.thread.start()

    def check(self, doing: str) -> None:
        if self.failure or not self.thread.is_alive():
            raise failed(doing, self.failure)

    def end(self) -> None:
        self.stop.set()
        self.thread.join()
        if self.failure:
            raise self.failure[0]


def transfers_while_feeding(source: str, feed: FeedThread, writers: int, seconds: float, started: str,
                            first_batch: Callable[[], bool] | None = None) -> int:
    """Once the feed's slot exists, fill the accounts and run `writers` transfer writers for
    `seconds` (counted once `first_batch()` holds: the feed's start is not the workload's time);
    the source's WAL position past the last transfer's commit."""
    with psycopg.connect(source, autocommit=True) as c:
        while not c.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (feed.spec.slot,)).fetchone():
            feed.check("start")
            time.sleep(0.2)
        c.execute("INSERT INTO accounts (id, owner, balance, tags) SELECT g, 'owner ' || g, 1000, "
                  "ARRAY['demo', 'n' || g %% 7] FROM generate_series(1, %s) g", (ACCOUNTS,))
    if first_batch is not None:
        wait_until(first_batch, feed)
    print(f"demo: {started}; {writers} writers run transfers for {seconds:.0f} s")
    stop, counts = threading.Event(), [0] * writers
    threads = [threading.Thread(target=writer, args=(source, i, stop, counts)) for i in range(writers)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    with psycopg.connect(source, autocommit=True) as c:
        target = committed_end(c)
    print(f"demo: workload done ({sum(counts)} transfers); waiting for the feed to catch up")
    return target


def committed_end(conn: psycopg.Connection) -> int:
    """A WAL position past every commit so far (postgres.connect.insert_lsn). The demo's server
    commits asynchronously, so the last commits' records may still wait in WAL buffers past the
    write position, and a feed whose window ended there would look caught up without them."""
    return int(insert_lsn(conn))


def wait_until(caught_up: Callable[[], bool], feed: FeedThread, timeout_s: float = 300) -> None:
    """Until `caught_up()`; the feed's failure (or a timeout) as the demo's error."""
    deadline = time.monotonic() + timeout_s
    while not caught_up():
        if time.monotonic() > deadline:
            raise failed(f"catch up within {timeout_s:.0f} s", feed.failure)
        feed.check(f"catch up within {timeout_s:.0f} s")
        time.sleep(0.5)
