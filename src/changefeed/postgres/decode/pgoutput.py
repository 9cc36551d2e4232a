"""Sans-I/O decoder of PostgreSQL's pgoutput logical replication protocol (version 1).

Bytes of one pgoutput message in, one message object out; no sockets, no state. Tuple values stay
as the server sent them: `bytes` in PostgreSQL text form, `None` for NULL, and `UNCHANGED` for a
TOASTed value the update did not touch (the server does not resend it; the replica keeps its own).
Message layouts: PostgreSQL docs, "Logical Replication Message Formats"; a slot created with
`two_phase` adds the prepared-transaction messages of protocol version 3 (b, P, K, r), which the
server sends for such a slot whatever protocol version is asked for. The layout of an Insert,
Update or Delete is read in one place, `change_layout`, which the change builder uses too (and
tuple_block's vectorised parse takes its byte positions from here).
"""
from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Union

from changefeed.core.hlc import PG_EPOCH_US
from changefeed.errors import DefiniteError

REPORT_HINT = ("nothing of this WAL window was applied and the slot keeps it; this is a changefeed bug or a "
               "pgoutput it does not know: report it with the PostgreSQL version and the window's messages "
               "(pg_logical_slot_peek_binary_changes on the slot, proto_version '1')")


class DecodeError(DefiniteError, ValueError):
    """The bytes are not a pgoutput message this decoder understands. Reading the same WAL again
    would fail the same way, so the feed stops before applying anything of that window."""

    def __init__(self, message: str, hint: str = REPORT_HINT, *, component: str = "source") -> None:
        super().__init__(message, hint, component=component)


class _Unchanged:
    """Marker for an unchanged TOASTed column (pgoutput 'u')."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Final = _Unchanged()
Value = Union[bytes, None, _Unchanged]

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_U64 = struct.Struct(">Q")


# Insert, Update and Delete: the message kind, the relation's OID, then a tuple kind and its
# TupleData (a column count, then the columns). An Update carries the old row's key columns ('K')
# or the whole old row ('O') before its new tuple ('N') when the key changed or under REPLICA
# IDENTITY FULL; a Delete's only tuple is such an old one. Byte positions from the message start:
INSERT, UPDATE, DELETE = b"IUD"  # message kinds
NEW, KEY, OLD = b"NKO"  # tuple kinds
OID_AT = 1  # the relation's OID (uint32)
TUPLE_KIND_AT = 5  # the first tuple's kind
TUPLE_AT = 6  # the first tuple's TupleData: its column count (int16), then its columns
COLUMNS_AT = TUPLE_AT + 2  # the first tuple's first column


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type_oid: int
    typmod: int
    is_key: bool


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int
    commit_time_us: int  # Unix epoch microseconds
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time_us: int


@dataclass(frozen=True, slots=True)
class Origin:
    commit_lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class Relation:
    oid: int
    schema: str
    name: str
    replica_identity: str  # d default, n nothing, f full, i index
    columns: tuple[Column, ...]

    @property
    def key_indexes(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.columns) if c.is_key)


@dataclass(frozen=True)
class RelationInfo:
    """What pgoutput does not say about a relation: SQL type names, the primary key (pgoutput
    flags every column as key under REPLICA IDENTITY FULL), and the value rows that predate a
    column read as (None where there is none)."""

    types: tuple[str, ...]
    key: tuple[int, ...]
    missing: tuple[str | None, ...]
    filled: tuple[bool, ...] = ()  # per column: a default but no missing value (postgres.source.filled_columns)


@dataclass(frozen=True, slots=True)
class Type:
    oid: int
    schema: str
    name: str


@dataclass(frozen=True, slots=True)
class Insert:
    relation_oid: int
    new: list[Value]


@dataclass(frozen=True, slots=True)
class Update:
    relation_oid: int
    old: list[Value] | None  # key columns only ('K') or the whole row ('O'); None if not sent
    old_is_key: bool
    new: list[Value]


@dataclass(frozen=True, slots=True)
class Delete:
    relation_oid: int
    old: list[Value]
    old_is_key: bool


@dataclass(frozen=True, slots=True)
class Truncate:
    relation_oids: tuple[int, ...]
    cascade: bool
    restart_identity: bool


@dataclass(frozen=True, slots=True)
class Message:
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


@dataclass(frozen=True, slots=True)
class BeginPrepare:
    """A prepared transaction's changes follow (two-phase decoding, protocol version 3)."""

    prepare_lsn: int  # where its PREPARE TRANSACTION record starts
    end_lsn: int  # where that record ends
    prepare_time_us: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class Prepare:
    """The end of a prepared transaction's changes: prepared, not committed yet."""

    prepare_lsn: int
    end_lsn: int
    prepare_time_us: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class CommitPrepared:
    commit_lsn: int  # where the COMMIT PREPARED record starts
    end_lsn: int
    commit_time_us: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class RollbackPrepared:
    prepare_end_lsn: int
    end_lsn: int  # where the ROLLBACK PREPARED record ends
    rollback_time_us: int
    xid: int
    gid: str


TwoPhase = Union[BeginPrepare, Prepare, CommitPrepared, RollbackPrepared]
PgOutputMessage = Union[Begin, Commit, Origin, Relation, Type, Insert, Update, Delete, Truncate, Message, TwoPhase]


def _cstring(buf: bytes, pos: int) -> tuple[str, int]:
    end = buf.index(b"\0", pos)
    return buf[pos:end].decode(), end + 1


def _pg_time(us: int) -> int:
    return us + PG_EPOCH_US


def decode_tuple(buf: bytes, pos: int) -> tuple[list[Value], int]:
    """TupleData at `pos` -> (values, position after it)."""
    (n,) = _I16.unpack_from(buf, pos)
    pos += 2
    values: list[Value] = []
    append = values.append
    for _ in range(n):
        kind = buf[pos]
        pos += 1
        if kind == 0x74 or kind == 0x62:  # 't' text, 'b' binary
            (length,) = _I32.unpack_from(buf, pos)
            pos += 4
            if length < 0 or pos + length > len(buf):
                raise DecodeError(f"column value of {length} bytes runs past the message end at byte {pos}")
            append(buf[pos:pos + length])
            pos += length
        elif kind == 0x6E:  # 'n'
            append(None)
        elif kind == 0x75:  # 'u'
            append(UNCHANGED)
        else:
            raise DecodeError(f"unknown tuple column kind {chr(kind)!r} at byte {pos - 1}")
    return values, pos


# Where the parts of an Insert, Update or Delete message are (see `change_layout`): (kind: INSERT,
# UPDATE or DELETE; the relation's OID; the old tuple's kind, KEY or OLD, its TupleData at TUPLE_AT,
# or 0: none; where the new tuple's TupleData starts, or 0: a Delete has none, and an Update's
# follows its old tuple, see `new_tuple_at`). A plain tuple: the builder reads the layout of every
# change that is not part of a long run.
ChangeLayout = tuple[int, int, int, int]
_oid_at = _U32.unpack_from


def change_layout(data: bytes) -> ChangeLayout:
    """The layout of Insert, Update or Delete message `data`: the one reading of its header and
    tuple kinds. Tuple values are not read here: an Update's old tuple is walked by its reader,
    which then gets the new one's position from `new_tuple_at`, and whether the last tuple ends
    where its message does is for its reader to tell."""
    try:
        kind, sub = data[0], data[TUPLE_KIND_AT]
    except IndexError:
        raise _layout_error(data) from None
    if sub == NEW and (kind == INSERT or kind == UPDATE):
        return kind, _oid_at(data, OID_AT)[0], 0, TUPLE_AT
    if (sub == KEY or sub == OLD) and (kind == UPDATE or kind == DELETE):
        return kind, _oid_at(data, OID_AT)[0], sub, 0
    raise _layout_error(data)


def _layout_error(data: bytes) -> DecodeError:
    kind, got = data[:1], data[TUPLE_KIND_AT:TUPLE_KIND_AT + 1]
    if kind == b"I":
        return DecodeError(f"Insert: expected 'N', got {got!r}")
    if kind == b"U":
        return DecodeError(f"Update: expected 'K', 'O' or 'N', got {got!r}")
    if kind == b"D":
        return DecodeError(f"Delete: expected 'K' or 'O', got {got!r}")
    return DecodeError(f"not an Insert, Update or Delete message: {kind!r}")


def new_tuple_at(data: bytes, old_end: int) -> int:
    """Where the new tuple of Update `data` starts, its old tuple ending at `old_end`."""
    if data[old_end:old_end + 1] != b"N":
        raise DecodeError(f"Update: expected 'N' after the old tuple, got {data[old_end:old_end + 1]!r}")
    return old_end + 1


def decode(data: bytes) -> PgOutputMessage:
    """Decode one pgoutput message."""
    try:
        return _DECODERS[data[0]](data)
    except KeyError:
        raise DecodeError(f"unknown pgoutput message type {chr(data[0])!r}") from None
    except (IndexError, struct.error, ValueError, UnicodeDecodeError) as e:
        if isinstance(e, DecodeError):
            raise
        raise DecodeError(f"truncated or malformed {chr(data[0]) if data else 'empty'!r} message: {e}") from e


def _begin(b: bytes) -> Begin:
    final_lsn, ts = _U64.unpack_from(b, 1)[0], _I64.unpack_from(b, 9)[0]
    return Begin(final_lsn, _pg_time(ts), _U32.unpack_from(b, 17)[0])


def _commit(b: bytes) -> Commit:
    return Commit(b[1], _U64.unpack_from(b, 2)[0], _U64.unpack_from(b, 10)[0], _pg_time(_I64.unpack_from(b, 18)[0]))


def _origin(b: bytes) -> Origin:
    name, _ = _cstring(b, 9)
    return Origin(_U64.unpack_from(b, 1)[0], name)


def _relation(b: bytes) -> Relation:
    (oid,) = _U32.unpack_from(b, 1)
    schema, pos = _cstring(b, 5)
    name, pos = _cstring(b, pos)
    ident = chr(b[pos])
    (n,) = _I16.unpack_from(b, pos + 1)
    pos += 3
    cols = []
    for _ in range(n):
        flags = b[pos]
        cname, pos = _cstring(b, pos + 1)
        type_oid, typmod = _U32.unpack_from(b, pos)[0], _I32.unpack_from(b, pos + 4)[0]
        pos += 8
        cols.append(Column(cname, type_oid, typmod, bool(flags & 1)))
    return Relation(oid, schema, name, ident, tuple(cols))


def _type(b: bytes) -> Type:
    schema, pos = _cstring(b, 5)
    name, _ = _cstring(b, pos)
    return Type(_U32.unpack_from(b, 1)[0], schema, name)


def _insert(b: bytes) -> Insert:
    _, oid, _, new_at = change_layout(b)
    return Insert(oid, decode_tuple(b, new_at)[0])


def _update(b: bytes) -> Update:
    _, oid, old, new_at = change_layout(b)
    old_values = None
    if old:
        old_values, end = decode_tuple(b, TUPLE_AT)
        new_at = new_tuple_at(b, end)
    return Update(oid, old_values, old == KEY, decode_tuple(b, new_at)[0])


def _delete(b: bytes) -> Delete:
    _, oid, old, _ = change_layout(b)
    return Delete(oid, decode_tuple(b, TUPLE_AT)[0], old == KEY)


def _truncate(b: bytes) -> Truncate:
    (n,) = _I32.unpack_from(b, 1)
    opts = b[5]
    oids = struct.unpack_from(f">{n}I", b, 6)
    return Truncate(tuple(oids), bool(opts & 1), bool(opts & 2))


def _message(b: bytes) -> Message:
    flags = b[1]
    (lsn,) = _U64.unpack_from(b, 2)
    prefix, pos = _cstring(b, 10)
    (length,) = _I32.unpack_from(b, pos)
    content = b[pos + 4:pos + 4 + length]
    if len(content) != length:
        raise DecodeError("Message: content shorter than its length")
    return Message(bool(flags & 1), lsn, prefix, content)


def _prepare_like(b: bytes, pos: int) -> tuple[int, int, int, int, str]:
    """(first LSN, second LSN, time, xid, gid) at `pos`: the layout 'b', 'P' and 'K' share."""
    gid, _ = _cstring(b, pos + 28)
    return (_U64.unpack_from(b, pos)[0], _U64.unpack_from(b, pos + 8)[0], _pg_time(_I64.unpack_from(b, pos + 16)[0]),
            _U32.unpack_from(b, pos + 24)[0], gid)


def _begin_prepare(b: bytes) -> BeginPrepare:
    return BeginPrepare(*_prepare_like(b, 1))


def _prepare(b: bytes) -> Prepare:
    return Prepare(*_prepare_like(b, 2))  # after the flags byte


def _commit_prepared(b: bytes) -> CommitPrepared:
    return CommitPrepared(*_prepare_like(b, 2))


def _rollback_prepared(b: bytes) -> RollbackPrepared:
    # flags, prepare end LSN, rollback end LSN, prepare time, rollback time, xid, gid
    gid, _ = _cstring(b, 38)
    return RollbackPrepared(_U64.unpack_from(b, 2)[0], _U64.unpack_from(b, 10)[0],
                            _pg_time(_I64.unpack_from(b, 26)[0]), _U32.unpack_from(b, 34)[0], gid)


_DECODERS: dict[int, Callable[[bytes], PgOutputMessage]] = {
    ord("B"): _begin, ord("C"): _commit, ord("O"): _origin, ord("R"): _relation, ord("Y"): _type,
    ord("I"): _insert, ord("U"): _update, ord("D"): _delete, ord("T"): _truncate, ord("M"): _message,
    ord("b"): _begin_prepare, ord("P"): _prepare, ord("K"): _commit_prepared, ord("r"): _rollback_prepared,
}
