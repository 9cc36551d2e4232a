"""What both demos share: the bank-like schema, its writers, and how a demo says its feed failed."""
from __future__ import annotations

import random
import threading

import psycopg
from psycopg.types.json import Jsonb

from changefeed.errors import ChangefeedError, DefiniteError
from changefeed.postgres.connect import one_row

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
