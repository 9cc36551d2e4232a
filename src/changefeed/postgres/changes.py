"""Turn a stream of pgoutput messages into change rows for one batch window [start, end).

A transaction belongs to the window iff its commit record STARTS in [start, end) (the Begin
message's final LSN), so windows never split a transaction and consecutive windows neither
overlap nor leave gaps. That is PostgreSQL's own rule: a slot at `start` skips every transaction
whose commit record starts before it, and a peek up to `end` decodes exactly the records that
start before it when `end` is a record boundary or a WAL page boundary. The input is such a peek,
from a slot at `start` for its non-transactional messages (they carry only their END LSN, so
their window cannot be told from the message); transactions from a slot that lags are dropped
here. Commit timestamps
continue from the window's starting timestamp (see core.hlc), so re-reading a window yields the
same rows. Pure: no I/O; type names come from an injected function.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..core import change as ch
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


def _final_tuple(data: bytes, pos: int, what: str) -> tuple[bytes, list[int] | None]:
    """The tuple at `pos`, which must end the message: (COPY line, unchanged columns)."""
    line, unchanged, end = po.copy_tuple(data, pos)
    if end != len(data):
        raise po.DecodeError(f"{what}: {len(data) - end} bytes after its tuple")
    return line, unchanged


_I, _U, _D, _B, _C = b"IUDBC"


class ChangeBuilder:
    """Feed pgoutput messages in server order; take Arrow record batches of change rows.

    Built for speed (this is the per-row cost of capture): rows go straight into column lists,
    columns that are mostly NULL (old_key, unchanged, meta) are kept sparse, and the per-
    transaction columns (lsn, seq, xid, times) are filled in bulk at the commit. An open
    transaction's rows start at `_mark`; dropping it truncates the lists back to there.
    """

    def __init__(self, start_lsn: int, end_lsn: int, start_ts: int, end_ts: int,
                 catalog: Catalog = offline_catalog) -> None:
        self.start_lsn, self.end_lsn, self.end_ts = start_lsn, end_lsn, end_ts
        self.last_ts = start_ts
        self.catalog = catalog
        self.relations: dict[int, po.Relation] = {}
        self._names: dict[int, tuple[str, str]] = {}
        self._info: dict[int, RelationInfo] = {}
        self._described: set[int] = set()
        self._begin: po.Begin | None = None
        self._deferred: list[po.Message] = []  # non-transactional messages seen inside a transaction
        self.last_commit_time: int | None = None
        self.changes = 0
        self.done = False  # a transaction past the window's end was seen: nothing more can belong
        self._reset()

    def _reset(self) -> None:
        self._op: list[str] = []
        self._schema: list[str | None] = []
        self._table: list[str | None] = []
        self._after: list[bytes | None] = []
        self._before: list[bytes | None] = []
        self._sparse: dict[str, dict[int, Any]] = {"old_key": {}, "unchanged": {}, "meta": {}}
        self._per_txn: dict[str, list[Any]] = {n: [] for n in ("lsn", "seq", "xid", "commit_time", "commit_ts")}
        self._mark = 0

    # -- input ---------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        kind = data[0] if data else -1  # an empty message gets its DecodeError from po.decode
        if kind == _I:
            self._insert(data)
        elif kind == _U:
            self._update(data)
        elif kind == _D:
            self._delete(data)
        elif kind == _B:
            self._open(po.decode(data))  # type: ignore[arg-type]
        elif kind == _C:
            self._commit(po.decode(data))  # type: ignore[arg-type]
        else:
            msg = po.decode(data)
            kind_ = type(msg)
            if kind_ is po.Relation:
                self.relations[msg.oid] = msg  # type: ignore[union-attr]
                self._names[msg.oid] = (msg.schema, msg.name)  # type: ignore[union-attr]
                self._info.pop(msg.oid, None)  # type: ignore[union-attr]
                self._described.discard(msg.oid)  # type: ignore[union-attr]
            elif kind_ is po.Truncate:
                for oid in msg.relation_oids:  # type: ignore[union-attr]
                    self._row(oid, "t", None, None)
            elif kind_ is po.Message:
                self._message(msg)  # type: ignore[arg-type]
            # Origin and Type messages carry nothing a sink needs.

    def _insert(self, data: bytes) -> None:
        if data[5:6] != b"N":
            raise po.DecodeError(f"Insert: expected 'N', got {data[5:6]!r}")
        line, _ = _final_tuple(data, 6, "Insert")
        self._row(int.from_bytes(data[1:5], "big"), "c", line, None)

    def _delete(self, data: bytes) -> None:
        if data[5:6] not in (b"K", b"O"):
            raise po.DecodeError(f"Delete: expected 'K' or 'O', got {data[5:6]!r}")
        line, _ = _final_tuple(data, 6, "Delete")
        self._row(int.from_bytes(data[1:5], "big"), "d", None, line)

    def _update(self, data: bytes) -> None:
        before, new_at = None, 6  # the common case: no old tuple (key unchanged, default identity)
        if data[5:6] in (b"K", b"O"):
            before, _, pos = po.copy_tuple(data, 6)
            if data[pos:pos + 1] != b"N":
                raise po.DecodeError(f"Update: expected 'N' after the old tuple, got {data[pos:pos + 1]!r}")
            new_at = pos + 1
        elif data[5:6] != b"N":
            raise po.DecodeError(f"Update: expected 'K', 'O' or 'N', got {data[5:6]!r}")
        line, unchanged = _final_tuple(data, new_at, "Update")
        oid = int.from_bytes(data[1:5], "big")
        i = self._row(oid, "u", line, before)
        if unchanged:
            self._sparse["unchanged"][i] = "{" + ",".join(map(str, unchanged)) + "}"
        if before is not None:
            old, new = po.decode_tuple(data, 6)[0], po.decode_tuple(data, new_at)[0]
            keys = self.info(oid).key
            if any(old[k] != new[k] for k in keys if new[k] is not po.UNCHANGED):
                self._sparse["old_key"][i] = po.copy_line([old[k] for k in keys])

    def _row(self, oid: int, op: str, after: bytes | None, before: bytes | None) -> int:
        """Append one row of the open transaction; returns its index."""
        if self._begin is None:
            raise po.DecodeError(f"change for relation {oid} outside a transaction")
        names = self._names.get(oid)
        if names is None:
            raise po.DecodeError(f"change for relation {oid} before its Relation message")
        if oid not in self._described:
            self._described.add(oid)
            self._sparse["meta"][len(self._op)] = self._describe(self.relations[oid])
            self._append(ch.RELATION, names, None, None)
        return self._append(op, names, after, before)

    def _append(self, op: str, names: tuple[str | None, str | None], after: bytes | None,
                before: bytes | None) -> int:
        self._op.append(op)
        self._schema.append(names[0])
        self._table.append(names[1])
        self._after.append(after)
        self._before.append(before)
        return len(self._op) - 1

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
        if msg.transactional and self._begin is not None:
            self._append_message(msg)
        elif not msg.transactional and self._begin is not None:
            self._deferred.append(msg)  # keep the open transaction's rows contiguous
        elif msg.lsn > self.start_lsn and not self.done:  # see the module docstring
            self._mark = len(self._op)
            self._append_message(msg)
            self._close(msg.lsn, 0, self.last_ts, None)

    def _append_message(self, msg: po.Message) -> None:
        self._sparse["meta"][len(self._op)] = json.dumps({"prefix": msg.prefix})
        self._append("m", (None, None), msg.content, None)

    def _open(self, begin: po.Begin) -> None:
        self._begin, self._mark = begin, len(self._op)
        if begin.final_lsn >= self.end_lsn:
            self.done = True  # its commit starts past the window, and so does every later one

    def _commit(self, msg: po.Commit) -> None:
        begin, self._begin = self._begin, None
        if begin is None:
            raise po.DecodeError("Commit without Begin")
        if not self.start_lsn <= begin.final_lsn < self.end_lsn:
            # Before: an earlier window's (the slot lags this one). After: the next window's.
            # Either way the rows go, and the R rows with them.
            self._drop_open()
            if begin.final_lsn >= self.end_lsn:
                self.done = True
        else:
            ts = next_commit_ts(self.last_ts, msg.commit_time_us)
            # A server clock that stepped back may put a commit past the window's resolved ts: stay inside.
            self.last_ts = ts if ts <= self.end_ts else self.last_ts + 1
            self.last_commit_time = msg.commit_time_us
            self._close(begin.final_lsn, begin.xid, self.last_ts, msg.commit_time_us)
        deferred, self._deferred = self._deferred, []
        for m in deferred:
            self._message(m)

    def _drop_open(self) -> None:
        """Forget the open transaction's rows (all lists back to `_mark`)."""
        if len(self._op) > self._mark:
            for col in (self._op, self._schema, self._table, self._after, self._before):
                del col[self._mark:]
            for name, d in self._sparse.items():
                self._sparse[name] = {i: v for i, v in d.items() if i < self._mark}
            self._described.clear()  # R rows it carried were dropped with it: describe again

    def _close(self, lsn: int, xid: int, ts: int, commit_time: int | None) -> None:
        """The rows from `_mark` on are one transaction committed at `lsn`: fill its columns."""
        n = len(self._op) - self._mark
        t = self._per_txn
        t["lsn"].extend([lsn] * n)
        t["seq"].extend(range(n))
        t["xid"].extend([xid] * n)
        t["commit_time"].extend([commit_time] * n)
        t["commit_ts"].extend([ts] * n)
        self.changes += n - sum(1 for i in self._sparse["meta"] if i >= self._mark and self._op[i] == ch.RELATION)
        self._mark = len(self._op)

    # -- output --------------------------------------------------------------------------
    def pending(self) -> int:
        """Rows of closed transactions not taken yet."""
        return len(self._per_txn["lsn"])

    def take(self) -> Any:
        """The rows of closed transactions as one Arrow record batch (then forgets them)."""
        n = self.pending()
        cols: dict[str, list[Any]] = {
            "op": self._op[:n], "schema": self._schema[:n], "table": self._table[:n],
            "after": self._after[:n], "before": self._before[:n], **self._per_txn}
        for name, d in self._sparse.items():
            cols[name] = [None] * n
            for i, v in d.items():
                if i < n:
                    cols[name][i] = v
        open_rows = (self._op[n:], self._schema[n:], self._table[n:], self._after[n:], self._before[n:])
        open_sparse = {name: {i - n: v for i, v in d.items() if i >= n} for name, d in self._sparse.items()}
        self._reset()
        self._op, self._schema, self._table, self._after, self._before = open_rows
        self._sparse = open_sparse
        return ch.record_batch(cols)

    def finish(self) -> Any:
        """Close the window: drop an unfinished transaction, append the `P` progress row, take all."""
        self._drop_open()
        self._begin = None
        progress = ch.Progress(self.end_lsn, self.end_ts, self.last_commit_time, self.changes)
        self._sparse["meta"][len(self._op)] = progress.to_meta()
        self._append(ch.PROGRESS, (None, None), None, None)
        t = self._per_txn
        for name, v in (("lsn", self.end_lsn), ("seq", 0), ("xid", 0), ("commit_time", self.last_commit_time),
                        ("commit_ts", self.end_ts)):
            t[name].append(v)
        self._mark = len(self._op)
        return self.take()

    def batches(self, messages: Iterator[bytes], rows_per_batch: int = 65536) -> Iterator[Any]:
        """Feed all `messages`, yielding record batches of about `rows_per_batch` rows.

        The first batches are smaller (from 1/16 of it, growing fourfold), so that a consumer
        can start working on them early.
        """
        feed = self.feed
        per_txn = self._per_txn["lsn"]
        size = max(1, rows_per_batch // 16)
        for data in messages:
            feed(data)
            if self.done:
                break
            if len(per_txn) >= size:
                yield self.take()
                per_txn = self._per_txn["lsn"]
                size = min(size * 4, rows_per_batch)
        yield self.finish()
