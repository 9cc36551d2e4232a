"""COPY text lines for a whole block of pgoutput messages at once (numpy + Arrow, no I/O).

Per-message Python parsing was capture's largest CPU cost. Here a block's messages are joined
into one buffer, and the plain changes (Insert 'N', Update with only a new tuple, Delete 'K'/'O')
have their TupleData parsed column by column across all messages together. Their COPY lines are
assembled by Arrow: every piece of a line (a value, or `\\N` for NULL, with the tab before it) is
a binary view into the buffer, and one cast to `binary` copies the pieces back to back, which
is the lines' data. Anything unusual is left `fast = False` for the per-message reference path
(`tuple_lines.copy_tuple`), which also raises the DecodeError for malformed messages: values that
COPY must escape, unchanged TOAST columns ('u'), updates with an old tuple, tuples that do not
end exactly at their message end, and every other kind of message. Sizes are bounded (see the
MAX_ constants) so that offsets fit Arrow's int32 and temporary arrays stay small.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from changefeed.postgres.decode import pgoutput as po

_TEXT, _BINARY, _NULL = b"tbn"
_NULL_PIECE = b"\t\\N"  # after the messages: what a NULL column's piece points at
_PAD = bytes(16)  # after everything: unaligned reads of up to 16 bytes near the end stay inside
MAX_BLOCK_BYTES = 64 << 20  # joined at once; lines are at most 3x that: far from int32 offsets (2 GiB)
MAX_MESSAGE_BYTES = 16 << 20  # bigger ones go the per-message way (their overhead is nothing)
MAX_COLUMNS = 1 << 20  # columns parsed together: bounds the temporary arrays (~100 bytes a column)
_VIEW_MASK = np.frombuffer(  # by size (13: longer): what a view keeps of the 12 bytes after its size
    b"".join(bytes([0] * 4 + [0xFF] * k + [0] * (12 - k)) for k in range(13)) + bytes([0] * 4 + [0xFF] * 4 + [0] * 8),
    np.uint32).reshape(14, 4)


@dataclass(frozen=True)
class Block:
    """Some consecutive pgoutput messages and the COPY lines of their plain changes."""

    messages: list[bytes]
    kinds: np.ndarray  # uint8 per message: its first byte, 0 for an empty message
    fast: np.ndarray  # bool per message: a plain change whose line is in `lines`
    oids: np.ndarray  # uint32 per message: the relation of a plain change
    line_of: np.ndarray  # int64 per message: the index of a plain change's line in `lines`
    lines: pa.Array  # binary, in message order: exactly `tuple_lines.copy_tuple`'s line where `fast`


def blocks(messages: list[bytes], max_bytes: int = MAX_BLOCK_BYTES) -> Iterator[Block]:
    """`messages` as one Block, or as several if they exceed `max_bytes` together."""
    lens = np.fromiter(map(len, messages), np.int64, len(messages))
    for lo, hi in _ranges(lens, max_bytes):
        yield parse(messages[lo:hi], lens[lo:hi])


def parse(messages: list[bytes], lens: np.ndarray | None = None) -> Block:
    """Parse the plain changes among `messages` (at most MAX_BLOCK_BYTES together) and build their lines."""
    if lens is None:
        lens = np.fromiter(map(len, messages), np.int64, len(messages))
    ends = np.cumsum(lens)
    starts = ends - lens
    buf = bytearray().join([*messages, _NULL_PIECE, _PAD])
    a = np.frombuffer(buf, np.uint8)
    kinds = np.where(lens > 0, a[starts], 0).astype(np.uint8)
    sub = a[starts + po.TUPLE_KIND_AT]  # past an empty or short message: harmless, it fails the length test
    # The layout of pgoutput.change_layout, for a block at once: changes with one tuple, the new or the old
    one_tuple = (((kinds == po.INSERT) | (kinds == po.UPDATE)) & (sub == po.NEW)) \
        | ((kinds == po.DELETE) & ((sub == po.KEY) | (sub == po.OLD)))
    candidate = one_tuple & (lens >= po.COLUMNS_AT) & (lens <= MAX_MESSAGE_BYTES)
    msg = np.flatnonzero(candidate)
    oids = np.zeros(len(messages), np.uint32)
    oids[msg] = _view(buf, ">u4")[starts[msg] + po.OID_AT]
    ncols = _view(buf, ">i2")[starts[msg] + po.TUPLE_AT].astype(np.int64)
    counted = (ncols >= 0) & (ncols <= lens[msg] - po.COLUMNS_AT)  # each column takes a byte at least
    ncols[~counted] = 0
    fast = np.zeros(len(messages), bool)
    line_of = np.full(len(messages), -1, np.int64)
    null_at = len(buf) - len(_NULL_PIECE) - len(_PAD)
    parts: list[pa.Array] = []
    done = 0
    for lo, hi in _ranges(ncols, MAX_COLUMNS):
        group, n = msg[lo:hi], ncols[lo:hi]
        valid, start, length = _columns(buf, starts[group] + po.COLUMNS_AT, ends[group], n)
        valid &= counted[lo:hi]
        if not valid.all():
            columns = np.repeat(valid, n)
            group, n, start, length = group[valid], n[valid], start[columns], length[columns]
        lines, dirty = _lines(buf, null_at, n, start, length)
        line_of[group] = np.arange(done, done + len(group))
        fast[group[~dirty]] = True
        parts.append(lines)
        done += len(group)
    return Block(messages, kinds, fast, oids, line_of, parts[0] if len(parts) == 1 else pa.concat_arrays(parts))


def _ranges(sizes: np.ndarray, limit: int) -> Iterator[tuple[int, int]]:
    """Consecutive ranges of `sizes` that sum to at most `limit` (or hold just one), covering all
    of it; one empty range if it is empty."""
    ends = np.cumsum(sizes)
    lo = 0
    while True:
        hi = min(len(sizes), max(lo + 1, int(np.searchsorted(ends, (ends[lo - 1] if lo else 0) + limit, "right"))))
        yield lo, hi
        if hi >= len(sizes):
            return
        lo = hi


def _view(buf: bytearray, dtype: str, skip: int = 0) -> np.ndarray:
    """`buf` read as `dtype` at every byte offset (overlapping, unaligned) where it fits, the
    one at index i read from offset i + `skip`."""
    size = np.dtype(dtype).itemsize
    return np.ndarray((len(buf) - size - skip + 1,), dtype, buf, skip, (1,))


def _columns(buf: bytearray, at: np.ndarray, ends: np.ndarray, ncols: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Walk the columns of the tuples at `at` (ncols each; one per message ending at `ends`),
    a column at a time across all tuples.

    Returns (valid, start, length): whether each tuple has only 't', 'b' and 'n' columns and
    ends exactly at its message's end; per column, tuple by tuple, its value's start and length
    (negative for NULL). Columns of invalid tuples are meaningless.
    """
    a = np.frombuffer(buf, np.uint8)
    length_at = _view(buf, ">i4", 1)  # a value's length, by the position of its column's kind byte
    first = np.cumsum(ncols) - ncols  # index of each tuple's first column among all
    start = np.empty(int(ncols.sum()), np.int64)
    length = np.empty(len(start), np.int32)
    valid = np.ones(len(at), bool)
    done = at.copy()  # where each tuple ends
    live = np.flatnonzero(ncols)  # tuples with columns left to read, and per live tuple:
    pos, end, column, left = at[live], ends[live], first[live], ncols[live]
    while len(live):
        kind = a[pos]
        n = np.where((kind == _TEXT) | (kind == _BINARY), length_at[pos], -4)  # NULL: -4, so 1 byte on
        value_at = pos + 5
        after = value_at + n
        ok = (n >= 0) | (kind == _NULL)
        ok &= after <= end
        start[column] = value_at
        length[column] = n
        left -= 1
        if ok.all() and left.all():  # the common case: every tuple has another column
            pos = after
            column += 1
            continue
        valid[live[~ok]] = False
        last = ok & (left == 0)
        done[live[last]] = after[last]
        more = ok & (left > 0)
        live, pos, end, column, left = live[more], after[more], end[more], column[more] + 1, left[more]
    valid &= done == ends
    return valid, start, length


def _lines(buf: bytearray, null_at: int, ncols: np.ndarray, start: np.ndarray, length: np.ndarray
           ) -> tuple[pa.Array, np.ndarray]:
    """The COPY lines of parsed tuples, and which of them hold a value COPY must escape.

    A line's pieces are its values, each but the first with the tab before it (the last byte
    of its length field, overwritten with a tab), and NULLs (`\\N` at `null_at`, after a tab
    there too). As views into `buf`, one cast from binary_view copies them out back to back:
    that is the lines' data.
    """
    tuples = len(ncols)
    bounds = np.zeros(tuples + 1, np.int64)
    np.cumsum(ncols, out=bounds[1:])
    later = np.ones(len(start), np.int64)  # 1 for columns after the first: their piece starts with a tab
    later[bounds[:-1][ncols > 0]] = 0
    null = length < 0
    value_at = np.where(null, null_at + 1, start)
    at = value_at - later
    size = np.where(null, 2, length) + later
    # Where a tab goes; a first value's length byte, or the tab at `null_at`, take one harmlessly.
    np.frombuffer(buf, np.uint8)[value_at - 1] = 0x09
    pieces = pa.Array.from_buffers(pa.binary_view(), len(start), [None, pa.py_buffer(_views(buf, at, size)),
                                                                  pa.py_buffer(buf)])
    flat = pieces.cast(pa.binary())
    if len(start):
        line_offsets = np.frombuffer(flat.buffers()[1], np.int32)[bounds]
        text = flat.buffers()[2]
    else:
        line_offsets, text = np.zeros(tuples + 1, np.int32), pa.py_buffer(b"")
    lines = pa.Array.from_buffers(pa.binary(), tuples, [None, pa.py_buffer(line_offsets), text])
    nulls = np.bincount(np.repeat(np.arange(tuples), ncols)[null], minlength=tuples)
    return lines, _needs_escape(text, line_offsets, np.maximum(ncols - 1, 0), nulls)


def _views(buf: bytearray, at: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Arrow binary views of buf[at:at + size] (at >= 4): per piece its size, then 12 bytes:
    the data zero-padded if it fits, else its first 4 bytes, buffer 0 and the offset `at`.

    Read as 16 bytes from 4 before each piece; then the size goes in front and the mask keeps
    of the rest what the size says."""
    views: np.ndarray = _view(buf, "V16")[at - 4].view(np.uint32).reshape(-1, 4)
    views &= np.take(_VIEW_MASK, np.minimum(size, 13), axis=0)
    views[:, 0] = size
    np.bitwise_or(views[:, 3], np.where(size > 12, at, 0).astype(np.uint32), out=views[:, 3])
    return views


def _needs_escape(text: pa.Buffer, line_offsets: np.ndarray, tabs: np.ndarray, nulls: np.ndarray) -> np.ndarray:
    """Per line: does a value hold a tab, newline, carriage return or backslash?

    A clean line holds just its `tabs` and a backslash per NULL: one count over all lines tells
    whether all are clean (other bytes below 14 are rare in text), else each line is counted.
    """
    d = np.frombuffer(text, np.uint8)[:line_offsets[-1]]
    if np.count_nonzero(d < 14) == tabs.sum() and np.count_nonzero(d == 0x5C) == nulls.sum():
        return np.zeros(len(tabs), bool)
    special = np.flatnonzero((d == 0x09) | (d == 0x0A) | (d == 0x0D) | (d == 0x5C))
    found = np.bincount(np.searchsorted(line_offsets, special, "right") - 1, minlength=len(tabs))
    needs: np.ndarray = found != tabs + nulls
    return needs
