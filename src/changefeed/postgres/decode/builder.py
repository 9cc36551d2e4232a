"""Turn a stream of pgoutput messages into change rows for one batch window [start, end).

A transaction belongs to the window iff its commit record STARTS in [start, end) (the Begin
message's final LSN), so windows never split a transaction and consecutive windows neither
overlap nor leave gaps. That is PostgreSQL's own rule: a slot at `start` skips every transaction
whose commit record starts before it, and a peek up to `end` decodes exactly the records that
start before it when `end` is a record boundary or a WAL page boundary. The input is such a peek,
from a slot at `start` for its non-transactional messages (they carry only their END LSN, so
their window cannot be told from the message); transactions from a slot that lags are dropped
here. Commit timestamps continue from the window's starting timestamp (see core.hlc), so
re-reading a window yields the same rows. Pure: no I/O; type names come from an injected function.

Messages come in blocks (a peek's fetches). The plain changes of a block, which are nearly all of
them, are parsed and turned into COPY lines for the whole block at once (see tuple_block); the
rest, and any change that tuple_block leaves out, go through `feed` one at a time, which is the
reference behaviour. Both read a change's layout as pgoutput.change_layout says; record batches
are assembled in columns.py.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from changefeed.core import change as ch
from changefeed.core.change import HEARTBEAT_PREFIX
from changefeed.core.hlc import next_commit_ts
from changefeed.core.lsn import format_lsn
from changefeed.errors import TornTransaction
from changefeed.postgres.decode import pgoutput as po
from changefeed.postgres.decode import tuple_block as tb
from changefeed.postgres.decode.columns import Txn, record_batch
from changefeed.postgres.decode.leaving import PREFIX as LEAVE_PREFIX
from changefeed.postgres.decode.leaving import Leaving
from changefeed.postgres.decode.pgoutput import RelationInfo, change_layout
from changefeed.postgres.decode.rows import Chunk, Rows
from changefeed.postgres.decode.tuple_lines import copy_line, copy_tuple, last_tuple

Catalog = Callable[[po.Relation], RelationInfo]


def offline_catalog(rel: po.Relation) -> RelationInfo:
    """Without a database: type OIDs for names, the key as pgoutput flags it."""
    return RelationInfo(tuple(f"oid:{c.type_oid}" for c in rel.columns), rel.key_indexes,
                        (None,) * len(rel.columns))


_I, _U, _D, _B, _C = po.INSERT, po.UPDATE, po.DELETE, *b"BC"
_TWO_PHASE = frozenset(b"bPKr")
_INSERT, _UPDATE, _DELETE, _TRUNCATE, _MESSAGE = b"cudtm"  # row ops, as the byte of their letter
_RELATION, _PROGRESS = ord(ch.RELATION), ord(ch.PROGRESS)
_OP_OF_KIND = np.zeros(256, np.uint8)  # a plain change's message kind -> its row op
_OP_OF_KIND[[_I, _U, _D]] = [_INSERT, _UPDATE, _DELETE]
_NO_TABLE = 0  # table id of rows that have none (messages, progress)
_SHORT_RUN = 12  # fewer plain changes in a row cost less one by one than as arrays
_TORN_HINT = ("nothing of the batch was delivered; this is a bug in changefeed or a source that changed under it: "
              "report it with `changefeed status --name NAME --json`")


class ChangeBuilder:
    """Feed pgoutput messages in server order; take Arrow record batches of change rows.

    Built for speed (this is the per-row cost of capture): whole blocks of plain changes become
    rows at once (see `feed_block`), columns that are mostly NULL (old_key, unchanged, meta) are
    kept sparse, and the per-transaction columns (lsn, seq, xid, times) are recorded once per
    transaction and expanded when taken. An open transaction's rows start at `_mark`; dropping
    it truncates the rows back to there. The window is node `node`'s, input partition `part` of
    its batch's `parts` (named in its `P` row, with the batch's `positions` on a feed of several
    nodes, and `read`: which task read it, from when; the builder adds when it ended).

    A prepared transaction arrives at its COMMIT PREPARED like any commit (the slot has no
    two-phase decoding). On a feed of several nodes the plan names the prepared parts the window
    holds (`prepared`: commit LSN -> gid, xid, from the planner's scan of the prepare slot, see
    postgres/twophase.py): the builder finds each one (its `P` row names them, with the gids still
    `undecided` on the node), and a part the WAL does not hold where the plan saw it is
    TornTransaction: never a distributed transaction delivered in part.
    """

    def __init__(self, start_lsn: int, end_lsn: int, start_ts: int, end_ts: int,
                 catalog: Catalog = offline_catalog, *, part: int = 0, parts: int = 1, node: str = "n1",
                 positions: Mapping[str, int] | None = None, read: dict[str, Any] | None = None,
                 prepared: dict[int, tuple[str, int]] | None = None, undecided: list[str] | None = None,
                 offset: dict[str, Any] | None = None, publication: str | None = None) -> None:
        self.offset = offset  # the batch's end offset, for the P row
        self.publication = publication  # the feed's on this node: rows leaving its filter (decode.leaving)
        self.start_lsn, self.end_lsn, self.end_ts = start_lsn, end_lsn, end_ts
        self.part, self.parts, self.node, self.positions, self.read = part, parts, node, positions, read
        self.last_ts = start_ts
        self.catalog = catalog
        self.relations: dict[int, po.Relation] = {}
        self._tables: list[tuple[str | None, str | None]] = [(None, None)]  # by table id (_NO_TABLE first)
        self._table_ids: dict[tuple[str | None, str | None], int] = {(None, None): _NO_TABLE}
        self._table_of: dict[int, int] = {}  # relation oid -> table id
        self._info: dict[int, RelationInfo] = {}
        self._described: set[int] = set()
        self._begin: po.Begin | None = None
        self._deferred: list[po.Message] = []  # non-transactional messages seen inside a transaction
        self.last_commit_time: int | None = None
        self.last_end: int | None = None  # the end of the last commit record in the window (see `cut`)
        self.changes = 0
        self.done = False  # a transaction past the window's end was seen: nothing more can belong
        self._rows = Rows()
        self._sparse: dict[str, dict[int, Any]] = {"old_key": {}, "unchanged": {}, "meta": {}}
        self._txns: list[Txn] = []  # closed rows by transaction (or part of one)
        self._open_ts: int | None = None  # the open transaction's commit ts, once some of its rows went out
        self._open_seq = 0  # rows of the open transaction that went out already
        self._closed = 0  # rows of closed transactions (the first rows)
        self._mark = 0
        self._open_relation_rows = 0  # R rows from `_mark` on: not changes
        self._planned = dict(prepared or {})  # prepared parts the plan put in the window, not found yet
        self.undecided = undecided or []  # gids with a part prepared on the node and undecided at the window's end
        self.gids: list[list[Any]] = []  # prepared parts delivered: [gid, xid]

    # -- input ---------------------------------------------------------------------------
    def feed_block(self, messages: list[bytes]) -> None:
        """Feed consecutive messages (the same as feeding each, only faster)."""
        for _ in self._steps(messages):
            pass

    def _steps(self, messages: list[bytes]) -> Iterator[None]:
        """Feed a block: runs of plain changes at once, other messages one by one, yielding after
        each of those (only they close or drop transactions, or see the window's end)."""
        for block in tb.blocks(messages):
            lo = 0
            for i in [*np.flatnonzero(~block.fast).tolist(), len(block.messages)]:
                self._run(block, lo, i)
                if i < len(block.messages):
                    self.feed(block.messages[i])
                    yield
                lo = i + 1

    def feed(self, data: bytes) -> None:
        """Feed one message."""
        kind = data[0] if data else -1  # an empty message gets its DecodeError from po.decode
        if kind == _I or kind == _U or kind == _D:
            self._change(data)
        elif kind == _B:
            begin = po.decode(data)
            assert isinstance(begin, po.Begin)  # a 'B' message decodes to a Begin
            self._open(begin)
        elif kind == _C:
            commit = po.decode(data)
            assert isinstance(commit, po.Commit)  # a 'C' message decodes to a Commit
            self._commit(commit)
        elif kind in _TWO_PHASE:
            raise po.DecodeError(f"two-phase message {chr(kind)!r} from a slot that should not decode prepared "
                                 "transactions at their PREPARE (a slot created by an older changefeed)")
        else:
            msg = po.decode(data)
            if isinstance(msg, po.Relation):
                self.relations[msg.oid] = msg
                self._table_of[msg.oid] = self._table_id(msg.schema, msg.name)
                self._info.pop(msg.oid, None)
                self._described.discard(msg.oid)
            elif isinstance(msg, po.Truncate):
                for oid in msg.relation_oids:
                    self._row(oid, _TRUNCATE, None, None)
            elif isinstance(msg, po.Message):
                self._message(msg)
            # Origin and Type messages carry nothing a sink needs.

    def _table_id(self, schema: str, name: str) -> int:
        key = (schema, name)
        if key not in self._table_ids:
            self._table_ids[key] = len(self._tables)
            self._tables.append(key)
        return self._table_ids[key]

    def _change(self, data: bytes) -> None:
        """An Insert, Update or Delete message, alone."""
        kind, oid, old, new_at = change_layout(data)
        if kind == _I:
            self._row(oid, _INSERT, last_tuple(data, new_at, "Insert")[0], None)
            return
        if kind == _D:
            self._row(oid, _DELETE, None, last_tuple(data, po.TUPLE_AT, "Delete")[0])
            return
        before = None
        if old:  # an old key or row
            before, _, end = copy_tuple(data, po.TUPLE_AT)
            new_at = po.new_tuple_at(data, end)
        line, unchanged = last_tuple(data, new_at, "Update")
        i = self._row(oid, _UPDATE, line, before)
        if unchanged:
            self._sparse["unchanged"][i] = "{" + ",".join(map(str, unchanged)) + "}"
        if before is not None:
            old_values, new = po.decode_tuple(data, po.TUPLE_AT)[0], po.decode_tuple(data, new_at)[0]
            keys = self.info(oid).key
            if any(old_values[k] != new[k] for k in keys if new[k] is not po.UNCHANGED):
                self._sparse["old_key"][i] = copy_line([old_values[k] for k in keys])

    def _row(self, oid: int, op: int, after: bytes | None, before: bytes | None) -> int:
        """Append one row of the open transaction; returns its index."""
        if self._begin is None:
            raise po.DecodeError(f"change for relation {oid} outside a transaction")
        table = self._table_of.get(oid)
        if table is None:
            raise po.DecodeError(f"change for relation {oid} before its Relation message")
        if oid not in self._described:
            self._describe_row(oid, table)
        return self._rows.append(op, table, after, before)

    def _describe_row(self, oid: int, table: int) -> None:
        """The R row that comes before a table's first change (in the window, or since its Relation)."""
        self._described.add(oid)
        self._sparse["meta"][len(self._rows)] = self._describe(self.relations[oid])
        self._rows.append(_RELATION, table, None, None)
        self._open_relation_rows += 1

    def _run(self, block: tb.Block, lo: int, hi: int) -> None:
        """Messages lo..hi of `block`, all plain changes, as rows: as arrays, unless they are few
        (then one by one costs less) or one is an error (which `feed` raises as it always has)."""
        if hi - lo >= _SHORT_RUN and self._begin is not None:
            oids = block.oids[lo:hi]
            if (oids == oids[0]).all():
                relations, first = [int(oids[0])], [0]
            else:
                unique, index = np.unique(oids, return_index=True)
                relations, first = unique.tolist(), index.tolist()
            known = [self._table_of.get(oid) for oid in relations]
            tables = [t for t in known if t is not None]
            if len(tables) == len(known):
                if len(tables) == 1:
                    table = np.full(hi - lo, tables[0], np.int32)
                else:
                    table = np.array(tables, np.int32)[np.searchsorted(relations, oids)]
                cut = lo
                for at, oid, t in sorted(zip(first, relations, tables)):
                    if oid not in self._described:  # its R row goes right before its first change
                        self._add_run(block, cut, lo + at, table[cut - lo:at])
                        self._describe_row(oid, t)
                        cut = lo + at
                self._add_run(block, cut, hi, table[cut - lo:])
                return
        for data in block.messages[lo:hi]:
            self.feed(data)

    def _add_run(self, block: tb.Block, lo: int, hi: int, table: np.ndarray) -> None:
        """Messages lo..hi of `block` as rows of tables `table`: one chunk, no row by row work."""
        if hi <= lo:
            return
        op = _OP_OF_KIND[block.kinds[lo:hi]]
        self._rows.extend(Chunk.of_lines(op, table, block.lines.slice(int(block.line_of[lo]), hi - lo), op == _DELETE))

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
            tuple(rel.columns[i].name for i in info.key), rel.replica_identity, info.missing, info.filled,
        ).to_meta()

    def _message(self, msg: po.Message) -> None:
        if msg.prefix == HEARTBEAT_PREFIX:
            return
        if msg.prefix == LEAVE_PREFIX:
            if msg.transactional and self._begin is not None:
                self._leaving(Leaving.decode(msg.content))
            return
        if msg.transactional and self._begin is not None:
            self._append_message(msg)
        elif not msg.transactional and self._begin is not None:
            self._deferred.append(msg)  # keep the open transaction's rows contiguous
        elif msg.lsn > self.start_lsn and not self.done:  # see the module docstring
            self._set_mark()
            self._append_message(msg)
            self._close(msg.lsn, 0, self.last_ts, None)
            if self.last_end is not None and msg.lsn > self.last_end:
                self.last_end = None  # past the last commit: a cut waits for the next one (see `cut`)

    def _leaving(self, leaving: Leaving) -> None:
        """Rows the feed's row filter let through until this transaction changed it: deletes of
        the table (a message for another feed's publication is not this feed's)."""
        if leaving.publication != self.publication:
            return
        rel = leaving.relation
        if rel.oid not in self.relations:  # no change of the table decoded yet: as pgoutput would describe it
            self.relations[rel.oid] = rel
            self._table_of[rel.oid] = self._table_id(rel.schema, rel.name)
        for line in leaving.lines:
            self._row(rel.oid, _DELETE, None, line)

    def _append_message(self, msg: po.Message) -> None:
        self._sparse["meta"][len(self._rows)] = json.dumps({"prefix": msg.prefix})
        self._rows.append(_MESSAGE, _NO_TABLE, msg.content, None)

    def _set_mark(self) -> None:
        self._mark = len(self._rows)
        self._open_relation_rows = 0

    def _open(self, begin: po.Begin) -> None:
        self._begin = begin
        self._open_ts, self._open_seq = None, 0
        self._set_mark()
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
            ts = self._stamp(msg.commit_time_us) if self._open_ts is None else self._open_ts
            self._close(begin.final_lsn, begin.xid, ts, msg.commit_time_us, self._open_seq)
            self._found(begin)
            self.last_end = msg.end_lsn
        self._open_ts, self._open_seq = None, 0
        self._flush_deferred()

    def _found(self, begin: po.Begin) -> None:
        """A commit in the window: note it if the plan named it as a prepared part."""
        planned = self._planned.pop(begin.final_lsn, None)
        if planned is not None:
            gid, xid = planned
            if xid != begin.xid:
                raise TornTransaction(f"the plan put prepared transaction {gid!r} (xid {xid}) at "
                                      f"{format_lsn(begin.final_lsn)} on node {self.node}, but the transaction "
                                      f"committed there is xid {begin.xid}", _TORN_HINT)
            self.gids.append([gid, xid])

    def _part_out(self) -> None:
        """Let the open transaction's rows so far go out ahead of its commit (a large transaction:
        the builder's memory stays bounded). Only for a plain transaction that belongs to the
        window: its Begin already says where and when it commits, and that it is not dropped."""
        begin = self._begin
        assert begin is not None and self.start_lsn <= begin.final_lsn < self.end_lsn
        if self._open_ts is None:
            self._open_ts = self._stamp(begin.commit_time_us)
        n = len(self._rows) - self._mark
        self._close(begin.final_lsn, begin.xid, self._open_ts, begin.commit_time_us, self._open_seq)
        self._open_seq += n

    def _large_open(self, rows: int) -> bool:
        """Whether the open transaction holds `rows` rows or more and may go out in parts."""
        begin = self._begin
        return (begin is not None and len(self._rows) - self._mark >= rows
                and self.start_lsn <= begin.final_lsn < self.end_lsn)

    def _stamp(self, commit_time_us: int) -> int:
        """The commit timestamp of the window's next transaction."""
        ts = next_commit_ts(self.last_ts, commit_time_us)
        # A server clock that stepped back may put a commit past the window's resolved ts: stay inside.
        self.last_ts = ts if ts <= self.end_ts else self.last_ts + 1
        self.last_commit_time = commit_time_us
        return self.last_ts

    def _flush_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for m in deferred:
            self._message(m)

    def _drop_open(self) -> None:
        """Forget the open transaction's rows (back to `_mark`)."""
        if len(self._rows) > self._mark:
            self._rows.truncate(self._mark)
            for name, d in self._sparse.items():
                self._sparse[name] = {i: v for i, v in d.items() if i < self._mark}
            self._described.clear()  # R rows it carried were dropped with it: describe again
        self._open_relation_rows = 0

    def _close(self, lsn: int, xid: int, ts: int, commit_time: int | None, seq: int = 0) -> None:
        """The rows from `_mark` on are one transaction committed at `lsn` (or its part from row
        `seq` on): record its columns."""
        n = len(self._rows) - self._mark
        if n:
            self._txns.append((n, lsn, xid, commit_time, ts, seq))
            self._closed += n
        self.changes += n - self._open_relation_rows
        self._set_mark()

    # -- output --------------------------------------------------------------------------
    def pending(self) -> int:
        """Rows of closed transactions not taken yet."""
        return self._closed

    def take(self) -> pa.RecordBatch:
        """The rows of closed transactions as one Arrow record batch (then forgets them)."""
        n = self._closed
        batch = record_batch(self._rows.split(n), self._tables, self._txns, self._sparse)
        for name, d in self._sparse.items():
            self._sparse[name] = {i - n: v for i, v in d.items() if i >= n}
        self._txns, self._closed = [], 0
        self._mark -= n
        return batch

    def finish(self) -> pa.RecordBatch:
        """Close the window: drop an unfinished transaction, append the `P` progress row, take all."""
        self._drop_open()
        self._begin = None
        if self._planned:
            lsn, (gid, xid) = min(self._planned.items())
            raise TornTransaction(f"the plan put prepared transaction {gid!r} (xid {xid}) at {format_lsn(lsn)} on node "
                                  f"{self.node}, but the window [{format_lsn(self.start_lsn)}, "
                                  f"{format_lsn(self.end_lsn)}) holds no commit of it", _TORN_HINT)
        return self._progress(self.end_lsn, self.end_ts)

    def _progress(self, end_lsn: int, end_ts: int) -> pa.RecordBatch:
        """Append the `P` row of what was read up to `end_lsn`, resolved at `end_ts`; take all."""
        progress = ch.Progress(end_lsn, end_ts, self.last_commit_time, self.changes,
                               part=self.part, parts=self.parts, node=self.node, positions=self.positions,
                               read=self.read and {**self.read, "ended": time.time()},
                               gids=self.gids or None, pending=self.undecided or None, offset=self.offset)
        self._sparse["meta"][len(self._rows)] = progress.to_meta()
        self._rows.append(_PROGRESS, _NO_TABLE, None, None)
        self._txns.append((1, end_lsn, 0, self.last_commit_time, end_ts, 0))
        self._closed += 1
        self._set_mark()
        return self.take()

    def parted(self, rows: int) -> pa.RecordBatch | None:
        """What is read so far, taken, once the open transaction holds `rows` rows or more (they go
        out ahead of its commit, so that memory holds about `rows`); else None."""
        if not self._large_open(rows):
            return None
        self._part_out()
        return self.take()

    @property
    def in_transaction(self) -> bool:
        """Whether a transaction's messages are being received (its Begin came, its Commit not yet)."""
        return self._begin is not None

    def cuttable(self) -> bool:
        """Whether `cut` may end a sub-window now: no transaction open, a commit since the last cut."""
        return self._begin is None and self.last_end is not None and self.last_end > self.start_lsn

    def cut(self) -> pa.RecordBatch:
        """End a sub-window of a window followed as the server writes it (`end_lsn` unbounded):
        everything up to the last commit, with a `P` row at that commit record's end, resolved at
        its commit timestamp. The next sub-window starts there, its tables described again before
        their first change (each sub-window is applied on its own). Only when `cuttable`."""
        assert self.cuttable() and self.last_end is not None
        rows = self._progress(self.last_end, self.last_ts)
        self.start_lsn, self.changes, self.gids = self.last_end, 0, []
        self._described.clear()
        return rows

    def batches(self, blocks: Iterable[list[bytes]], rows_per_batch: int = 65536) -> Iterator[pa.RecordBatch]:
        """Feed all `blocks` of messages, yielding record batches of about `rows_per_batch` rows.

        The first batches are smaller (from 1/16 of it, growing fourfold), so that a consumer
        can start working on them early. Reading stops at the first transaction past the window.
        A transaction larger than `rows_per_batch` goes out in parts (its rows keep their `seq`
        and their transaction's columns): memory holds about a block and `rows_per_batch` rows,
        however large the transaction.
        """
        size = max(1, rows_per_batch // 16)
        for messages in blocks:
            for _ in self._steps(messages):
                if self.done:
                    break
                if self._closed >= size:
                    yield self.take()
                    size = min(size * 4, rows_per_batch)
            if self.done:
                break
            if (part := self.parted(rows_per_batch)) is not None:
                yield part
        yield self.finish()
