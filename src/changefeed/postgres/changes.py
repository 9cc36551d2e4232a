"""Turn a stream of pgoutput messages into change rows for one batch window (start, end].

A transaction belongs to the window iff its commit's end LSN is in (start, end], so windows never
split a transaction and consecutive windows neither overlap nor leave gaps. Commit timestamps
continue from the window's starting timestamp (see core.hlc), so re-reading a window yields the
same rows. Pure: no I/O; type names come from an injected function.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..core import change as ch
from ..core.copytext import NULL, escape
from ..core.hlc import next_commit_ts
from . import pgoutput as po



@dataclass(frozen=True)
class RelationInfo:
    """What pgoutput does not say about a relation: SQL type names, the primary key (pgoutput
    flags every column as key under REPLICA IDENTITY FULL), and the value rows that predate a
    column read as (None where there is none)."""

    types: tuple[str, ...]
    key: tuple[int, ...]
    missing: tuple[str | None, ...]


Catalog = Callable[[po.Relation], RelationInfo]
HEARTBEAT_PREFIX = "changefeed.heartbeat"


def offline_catalog(rel: po.Relation) -> RelationInfo:
    """Without a database: type OIDs for names, the key as pgoutput flags it."""
    return RelationInfo(tuple(f"oid:{c.type_oid}" for c in rel.columns), rel.key_indexes,
                        (None,) * len(rel.columns))


def _line(values: list[po.Value]) -> tuple[bytes, str | None]:
    """Values -> (COPY text line, unchanged-column array literal or None)."""
    parts = []
    unchanged = None
    for i, v in enumerate(values):
        if v is None:
            parts.append(NULL)
        elif v is po.UNCHANGED:
            parts.append(NULL)
            unchanged = f"{unchanged},{i}" if unchanged else str(i)
        else:
            parts.append(escape(v))  # type: ignore[arg-type]
    return b"\t".join(parts), ("{" + unchanged + "}" if unchanged else None)


class ChangeBuilder:
    """Feed pgoutput messages in server order; take Arrow record batches of change rows."""

    def __init__(self, start_lsn: int, end_lsn: int, start_ts: int, end_ts: int,
                 catalog: Catalog = offline_catalog) -> None:
        self.start_lsn, self.end_lsn, self.end_ts = start_lsn, end_lsn, end_ts
        self.last_ts = start_ts
        self.catalog = catalog
        self.relations: dict[int, po.Relation] = {}
        self._info: dict[int, RelationInfo] = {}
        self._described: set[int] = set()
        self._txn: list[tuple[Any, ...]] | None = None
        self._begin: po.Begin | None = None
        self._cols: list[list[Any]] = [[] for _ in ch.NAMES]
        self.last_commit_time: int | None = None
        self.changes = 0
        self.done = False  # a commit past the window's end was seen: nothing more can belong

    # -- input ---------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        msg = po.decode(data)
        kind = type(msg)
        if kind is po.Insert:
            self._row(msg.relation_oid, "c", *_line(msg.new), None, None)  # type: ignore[union-attr]
        elif kind is po.Update:
            self._update(msg)  # type: ignore[arg-type]
        elif kind is po.Delete:
            before, _ = _line(msg.old)  # type: ignore[union-attr]
            self._row(msg.relation_oid, "d", None, None, before, None)  # type: ignore[union-attr]
        elif kind is po.Begin:
            self._begin, self._txn = msg, []  # type: ignore[assignment]
        elif kind is po.Commit:
            self._commit(msg)  # type: ignore[arg-type]
        elif kind is po.Relation:
            self.relations[msg.oid] = msg  # type: ignore[union-attr]
            self._info.pop(msg.oid, None)  # type: ignore[union-attr]
            self._described.discard(msg.oid)  # type: ignore[union-attr]
        elif kind is po.Truncate:
            for oid in msg.relation_oids:  # type: ignore[union-attr]
                self._row(oid, "t", None, None, None, None)
        elif kind is po.Message:
            self._message(msg)  # type: ignore[arg-type]
        # Origin and Type messages carry nothing a sink needs.

    def _update(self, msg: po.Update) -> None:
        after, unchanged = _line(msg.new)
        before = old_key = None
        if msg.old is not None:
            before, _ = _line(msg.old)
            keys = self.info(msg.relation_oid).key
            if any(msg.old[i] != msg.new[i] for i in keys if msg.new[i] is not po.UNCHANGED):
                old_key = b"\t".join(NULL if msg.old[i] is None else escape(msg.old[i]) for i in keys)  # type: ignore[arg-type]
        self._row(msg.relation_oid, "u", after, unchanged, before, old_key)

    def _row(self, oid: int, op: str, after: bytes | None, unchanged: str | None,
             before: bytes | None, old_key: bytes | None) -> None:
        if self._txn is None:
            raise po.DecodeError(f"change for relation {oid} outside a transaction")
        rel = self.relations.get(oid)
        if rel is None:
            raise po.DecodeError(f"change for relation {oid} before its Relation message")
        if oid not in self._described:
            self._described.add(oid)
            self._txn.append((ch.RELATION, rel.schema, rel.name, None, None, None, None, self._describe(rel)))
        self._txn.append((op, rel.schema, rel.name, after, before, old_key, unchanged, None))

    def info(self, oid: int) -> RelationInfo:
        if oid not in self._info:
            if oid not in self.relations:
                raise po.DecodeError(f"change for relation {oid} before its Relation message")
            self._info[oid] = self.catalog(self.relations[oid])
        return self._info[oid]

    def _describe(self, rel: po.Relation) -> str:
        info = self.info(rel.oid)
        return ch.TableShape(
            rel.schema, rel.name, tuple(c.name for c in rel.columns), info.types,
            tuple(rel.columns[i].name for i in info.key), rel.replica_identity, info.missing,
        ).to_meta()

    def _message(self, msg: po.Message) -> None:
        if msg.prefix == HEARTBEAT_PREFIX:
            return
        row = ("m", None, None, msg.content, None, None, None, json.dumps({"prefix": msg.prefix}))
        if msg.transactional and self._txn is not None:
            self._txn.append(row)
        elif self.start_lsn < msg.lsn <= self.end_lsn:
            self._emit([row], msg.lsn, 0, self.last_ts, None)

    def _commit(self, msg: po.Commit) -> None:
        txn, begin = self._txn or [], self._begin
        self._txn = self._begin = None
        if msg.end_lsn <= self.start_lsn:
            # Already delivered: the slot lags the window (its advance comes after the sink commits).
            self._described.clear()  # R rows it carried were dropped with it: describe again
            return
        if msg.end_lsn > self.end_lsn:
            self.done = True
            return
        ts = next_commit_ts(self.last_ts, msg.commit_time_us)
        # A server clock that stepped back may put a commit past the window's resolved ts: stay inside.
        self.last_ts = ts if ts <= self.end_ts else self.last_ts + 1
        self.last_commit_time = msg.commit_time_us
        assert begin is not None
        self._emit(txn, msg.end_lsn, begin.xid, self.last_ts, msg.commit_time_us)

    def _emit(self, rows: list[tuple[Any, ...]], lsn: int, xid: int, ts: int, commit_time: int | None) -> None:
        c = self._cols
        for seq, (op, schema, table, after, before, old_key, unchanged, meta) in enumerate(rows):
            for col, v in zip(c, (op, schema, table, lsn, seq, xid, commit_time, ts,
                                  after, before, old_key, unchanged, meta)):
                col.append(v)
            if op != ch.RELATION:
                self.changes += 1

    # -- output --------------------------------------------------------------------------
    def pending(self) -> int:
        return len(self._cols[0])

    def take(self) -> Any:
        """The rows built so far as one Arrow record batch (then forgets them)."""
        import pyarrow as pa

        cols, self._cols = self._cols, [[] for _ in ch.NAMES]
        return pa.RecordBatch.from_arrays(
            [pa.array(v, type=f.type) for v, f in zip(cols, ch.arrow_schema())], schema=ch.arrow_schema())

    def finish(self) -> Any:
        """Close the window: append the `P` progress row and take the remaining rows."""
        progress = ch.Progress(self.end_lsn, self.end_ts, self.last_commit_time, self.changes)
        self._emit([(ch.PROGRESS, None, None, None, None, None, None, progress.to_meta())],
                   self.end_lsn, 0, self.end_ts, self.last_commit_time)
        return self.take()

    def batches(self, messages: Iterator[bytes], rows_per_batch: int = 65536) -> Iterator[Any]:
        """Feed all `messages`, yielding record batches of about `rows_per_batch` rows."""
        for data in messages:
            self.feed(data)
            if len(self._cols[0]) >= rows_per_batch and self._txn is None:
                yield self.take()
            if self.done:
                break
        yield self.finish()
