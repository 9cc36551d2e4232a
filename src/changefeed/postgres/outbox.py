"""The outbox table on the source: check its shape before the feed starts, delete delivered rows after a TTL.

`check_outbox_table` fails fast on a table the router (core.outbox) would trip over later: a
missing table or column, a NULL-able id / aggregate / event type column (a NULL there stops the
feed mid-stream), a payload that is not JSON or text.

`OutboxCleanup` deletes outbox rows older than the TTL, but only rows the feed has delivered, so
cleanup can never lose an event. "Delivered" means: the row's inserting transaction committed at
an LSN at or below the feed's checkpoint. A row does not carry its commit LSN, so cleanup bridges
xids and LSNs with *marks*, taken now and then and kept in a JSON-lines file:

    mark = (time, horizon = xmin of a fresh snapshot (xid8), lsn = WAL insert position read after it)

Every transaction with xid < horizon had ended when the snapshot was taken; a transaction writes
its commit record before it leaves the proc array, so that record lies below `lsn`. Hence once
the checkpoint is >= mark.lsn, every committed row with xmin < mark.horizon has been delivered,
and once mark.time <= now - TTL, every such row is at least TTL old. Rows of transactions still
open at the mark (xid >= horizon) wait for a later mark, whatever the checkpoint says.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg
from psycopg import sql

from changefeed.core.lsn import format_lsn, parse_lsn
from changefeed.core.outbox import ROLES, OutboxSpec
from changefeed.errors import ChangefeedError, ConfigError, DefiniteError, SourceNotReady, TransientError
from changefeed.postgres.connect import connect, one_row
from changefeed.postgres.source import split_table, table_oid

REQUIRED_ROLES = ("id", "aggregate_type", "aggregate_id", "event_type")  # NULL in these stops the router
PAYLOAD_TYPES = ("json", "jsonb", "text")

# age() is a 32-bit signed difference to the next xid: it is exact only within 2^31 xids. Cleanup
# refuses a horizon further back than this (with a wide margin for xids used while it deletes).
MAX_HORIZON_AGE = 1 << 30


def _qualified(conn: psycopg.Connection[Any], schema: str, name: str) -> str:
    return sql.Identifier(schema, name).as_string(conn)


def check_outbox_table(conn: psycopg.Connection[Any], spec: OutboxSpec) -> None:
    """Raise a typed error, with the fix in its hint, unless the outbox table can feed the router."""
    schema, name = split_table(spec.table)
    try:
        oid = table_oid(conn, schema, name)
        if oid is None:
            raise SourceNotReady(f"outbox table {schema}.{name} does not exist on the source",
                                 "create it, or fix --outbox (names are schema.table, case-sensitive)")
        # a domain over json/jsonb/text is fine: compare its base type
        found = {r[0]: (bool(r[1]), str(r[2])) for r in conn.execute(
            "SELECT a.attname, a.attnotnull, "
            "format_type(CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE a.atttypid END, NULL) "
            "FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
            "WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped", (oid,)).fetchall()}
        qualified = _qualified(conn, schema, name)
    except psycopg.Error as e:
        raise _typed(e, f"checking outbox table {spec.table}") from None
    missing = [f"{col} (role {role})" for role, col in spec.columns if col not in found]
    if missing:
        raise ConfigError(f"outbox table {schema}.{name} has no column {', '.join(missing)}",
                          "add the columns, or name the table's columns with --outbox-columns ROLE=COLUMN,... "
                          f"(roles: {', '.join(ROLES)})")
    nullable = [spec.column(role) for role in REQUIRED_ROLES if not found[spec.column(role)][0]]
    if nullable:
        fixes = "; ".join(f"ALTER TABLE {qualified} ALTER COLUMN {sql.Identifier(c).as_string(conn)} SET NOT NULL"
                          for c in nullable)
        raise SourceNotReady(f"outbox table {schema}.{name}: column {', '.join(nullable)} allows NULL; "
                             "an event without it would stop the feed", f"run {fixes}")
    payload = spec.column("payload")
    if found[payload][1] not in PAYLOAD_TYPES:
        raise SourceNotReady(f"outbox table {schema}.{name}: payload column {payload} is {found[payload][1]}, "
                             "the feed sends the payload as is and needs json, jsonb or text",
                             f"run ALTER TABLE {qualified} ALTER COLUMN {sql.Identifier(payload).as_string(conn)} "
                             "TYPE jsonb USING ...::jsonb (or json / text)")


@dataclass(frozen=True)
class Mark:
    """At `time` (the cleanup's clock, read after both), every xid below `horizon` (xid8) had
    ended and WAL had been inserted up to `lsn`."""

    time: float
    horizon: int
    lsn: int


class OutboxCleanup:
    """Deletes delivered outbox rows older than spec.ttl_s, in batches; see the module docstring.

    Marks live in `marks_path` (one JSON object a line), so a restarted feed can delete rows it
    saw before the restart. One instance per file at a time. `clock` must be the same clock
    across restarts (wall time by default), as mark times are compared with it.
    """

    def __init__(self, conninfo: str, spec: OutboxSpec, marks_path: Path, *,
                 clock: Callable[[], float] = time.time, batch_rows: int = 10_000,
                 mark_every_s: float | None = None) -> None:
        if spec.ttl_s < 0:
            raise ConfigError(f"outbox TTL {spec.ttl_s}s is negative", "give a TTL in seconds, 0 to keep all rows")
        if batch_rows < 1:
            raise ConfigError(f"outbox cleanup batch of {batch_rows} rows", "use at least 1 row a batch")
        self.conninfo = conninfo
        self.spec = spec
        self.marks_path = Path(marks_path)
        self.clock = clock
        self.batch_rows = batch_rows
        # marks every ~TTL/10: a row becomes deletable at most ~10% later than its TTL says
        self.mark_every_s = min(60.0, max(1.0, spec.ttl_s / 10)) if mark_every_s is None else mark_every_s
        self.last_batches = 0  # DELETE statements (= transactions) of the last tick
        self._conn: psycopg.Connection[Any] | None = None
        self._marks: list[Mark] | None = None  # loaded on first use

    # -- public ---------------------------------------------------------------------------

    def tick(self, checkpoint_lsn: int | None) -> int:
        """Take a mark if one is due; delete the rows the newest usable mark covers. Rows deleted."""
        self.last_batches = 0
        if not self.spec.ttl_s:
            return 0
        marks = self._load()
        if not marks or self.clock() - marks[-1].time >= self.mark_every_s:
            self._add(self._take_mark())
            marks = self._load()
        if checkpoint_lsn is None:
            return 0
        cutoff = self.clock() - self.spec.ttl_s
        usable = [i for i, m in enumerate(marks) if m.time <= cutoff and m.lsn <= checkpoint_lsn]
        if not usable:
            return 0
        i = usable[-1]
        deleted = self._delete_below(marks[i].horizon)
        if i > 0:  # older marks cover less than marks[i]: never needed again
            self._marks = marks[i:]
            self._rewrite()
        return deleted

    @property
    def marks(self) -> tuple[Mark, ...]:
        return tuple(self._load())

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> OutboxCleanup:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- PostgreSQL -----------------------------------------------------------------------

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.conninfo, "source")  # autocommit: every statement its own transaction
        return self._conn

    def _query(self, query: Any, params: tuple[Any, ...] = (), what: str = "") -> psycopg.Cursor[Any]:
        try:
            return self._connection().execute(query, params)
        except psycopg.Error as e:
            if isinstance(e, (psycopg.OperationalError, psycopg.InterfaceError)) or \
                    (self._conn is not None and (self._conn.closed or self._conn.broken)):
                self.close()  # start from a fresh connection next time
            raise _typed(e, f"outbox cleanup of {self.spec.table}: {what}") from None

    def _take_mark(self) -> Mark:
        # two autocommit statements, so the LSN is read after the snapshot that gave the horizon
        horizon = int(one_row(self._query("SELECT pg_snapshot_xmin(pg_current_snapshot())::text",
                                          what="reading the xid horizon"))[0])
        lsn = parse_lsn(one_row(self._query("SELECT pg_current_wal_insert_lsn()::text",
                                            what="reading the WAL position"))[0])
        return Mark(self.clock(), horizon, lsn)  # the clock read after: the snapshot was no later

    def _delete_below(self, horizon: int) -> int:
        """Delete rows whose xmin precedes `horizon`, batch_rows at a time, each batch its own transaction.

        `age(xmin) > age(horizon)`: xids compare modulo 2^32, relative to the next xid. Frozen rows
        keep their raw xmin (PostgreSQL >= 9.4), which is compared like any other; rows with the
        special FrozenTransactionId (pre-9.4 freezing, bootstrap) have age() = INT_MAX, the oldest
        possible, and are deleted: they are from long before any mark, delivered by any snapshot.
        A row whose xmin is more than 2^31 xids old wraps to a negative age and is kept (safe). The
        horizon itself must be within 2^31 of the next xid, else every row would look old: refused.

        `(tableoid, ctid)`, not `ctid` alone: in a partitioned table, two partitions have rows at the
        same ctid, and `ctid IN (...)` on the parent would delete both. Rows another session holds
        locked are skipped (SKIP LOCKED), not waited for: the next tick takes them.
        """
        nxt = int(one_row(self._query("SELECT pg_snapshot_xmax(pg_current_snapshot())::text",
                                      what="reading the next xid"))[0])
        if nxt - horizon >= MAX_HORIZON_AGE:
            raise ConfigError(
                f"outbox cleanup of {self.spec.table}: the usable mark is {nxt - horizon:,} transactions old; "
                "32-bit xmin comparisons cannot tell old rows from new ones that far back",
                "lower the outbox TTL (it must span well under a billion transactions), and let the feed's "
                "checkpoint catch up")
        schema, name = split_table(self.spec.table)
        table = sql.Identifier(schema, name)
        delete = sql.SQL("DELETE FROM {t} WHERE (tableoid, ctid) IN (SELECT tableoid, ctid FROM {t} "
                         "WHERE age(xmin) > age(%s::text::xid) LIMIT %s FOR UPDATE SKIP LOCKED)").format(t=table)
        params = (str(horizon & 0xFFFFFFFF), self.batch_rows)
        total = 0
        while True:
            n = self._query(delete, params, what="deleting delivered rows").rowcount
            self.last_batches += 1
            total += n
            if n < self.batch_rows:
                return total

    # -- marks file -----------------------------------------------------------------------

    def _load(self) -> list[Mark]:
        if self._marks is not None:
            return self._marks
        try:
            data = self.marks_path.read_bytes()
        except FileNotFoundError:
            self._marks = []
            return self._marks
        except OSError as e:
            raise DefiniteError(f"cannot read outbox cleanup marks {self.marks_path}: {e}",
                                "check the feed's state directory") from None
        lines = data.split(b"\n")
        marks: list[Mark] = []
        torn = not data.endswith(b"\n") and data != b""
        for k, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                marks.append(Mark(float(d["time"]), int(d["horizon"]), int(d["lsn"])))
            except (ValueError, KeyError, TypeError):
                if k == len(lines) - 1:  # a line cut short by a crash while appending
                    torn = True
                    continue
                raise DefiniteError(f"outbox cleanup marks {self.marks_path}: line {k + 1} is corrupt",
                                    "delete the file; cleanup then collects new marks and deletes nothing "
                                    "until a TTL has passed") from None
        self._marks = marks
        if torn:  # rewrite it whole, so the next append starts on a line of its own
            self._rewrite()
        return marks

    def _add(self, mark: Mark) -> None:
        self.marks_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.marks_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(mark)) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._load().append(mark)

    def _rewrite(self) -> None:
        """Replace the file with the marks in memory: write aside, fsync, rename (never half a file)."""
        assert self._marks is not None
        self.marks_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.marks_path.with_name(self.marks_path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(asdict(m)) + "\n" for m in self._marks)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.marks_path)

    def __repr__(self) -> str:
        last = self._marks[-1] if self._marks else None
        return (f"OutboxCleanup({self.spec.table}, ttl {self.spec.ttl_s}s, "
                f"last mark {None if last is None else format_lsn(last.lsn)})")


def _typed(e: psycopg.Error, doing: str) -> ChangefeedError:
    """The typed error for a driver error: the table or rights missing are definite, the rest of
    the server's refusals too; a lost connection, a timeout, a deadlock are transient."""
    text = str(e).strip()
    if isinstance(e, psycopg.errors.UndefinedTable):
        return SourceNotReady(f"{doing}: {text}", "create the outbox table, or fix --outbox")
    if isinstance(e, psycopg.errors.InsufficientPrivilege):
        return SourceNotReady(f"{doing}: {text}",
                              "GRANT SELECT, DELETE on the outbox table to the source URI's user")
    if isinstance(e, (psycopg.OperationalError, psycopg.InterfaceError)):
        return TransientError(f"{doing}: {text}", "the next cleanup retries; check the source server if it persists")
    return DefiniteError(f"{doing}: {text}", "fix the cause on the source; cleanup deletes nothing until then")
