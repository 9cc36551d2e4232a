"""The change builder's rows not taken yet, column by column (see postgres/decode/builder.py).

Most rows come as chunks from vectorised runs of plain changes; the rest (R rows, messages, the
odd change) are gathered in lists until a chunk follows them. Arrow arrays are concatenated once
per record batch, not built row by row.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


@dataclass(frozen=True)
class Chunk:
    """Consecutive rows, column by column: op byte, table id, after and before lines."""

    op: np.ndarray  # uint8
    table: np.ndarray  # int32
    after: pa.Array  # binary
    before: pa.Array  # binary

    def __len__(self) -> int:
        return len(self.op)

    def slice(self, lo: int, hi: int) -> Chunk:
        return Chunk(self.op[lo:hi], self.table[lo:hi], self.after.slice(lo, hi - lo), self.before.slice(lo, hi - lo))

    @staticmethod
    def of_lines(op: np.ndarray, table: np.ndarray, lines: pa.Array, before: np.ndarray) -> Chunk:
        """Rows with one line each: their after image, or their before image where `before` (deletes)."""
        none = pa.nulls(len(op), pa.binary())
        if not before.any():
            return Chunk(op, table, lines, none)
        if before.all():
            return Chunk(op, table, none, lines)
        mask = pa.array(before)
        return Chunk(op, table, pc.if_else(mask, none, lines), pc.if_else(mask, lines, none))

    @staticmethod
    def concat(chunks: list[Chunk]) -> Chunk:
        if len(chunks) == 1:
            return chunks[0]
        if not chunks:
            return Chunk(np.zeros(0, np.uint8), np.zeros(0, np.int32), pa.array([], pa.binary()),
                          pa.array([], pa.binary()))
        return Chunk(np.concatenate([c.op for c in chunks]), np.concatenate([c.table for c in chunks]),
                      pa.concat_arrays([c.after for c in chunks]), pa.concat_arrays([c.before for c in chunks]))


class Rows:
    """The builder's rows not taken yet: chunks from vectorised runs, and rows of the per-message
    path gathered in lists until a chunk follows them (they are few: R rows, messages, the odd
    change). Arrow arrays are concatenated once per record batch, not built row by row."""

    def __init__(self) -> None:
        self._chunks: list[Chunk] = []
        self._in_chunks = 0
        self._op: list[int] = []
        self._table: list[int] = []
        self._after: list[bytes | None] = []
        self._before: list[bytes | None] = []

    def __len__(self) -> int:
        return self._in_chunks + len(self._op)

    def append(self, op: int, table: int, after: bytes | None, before: bytes | None) -> int:
        """Add one row; returns its index."""
        self._op.append(op)
        self._table.append(table)
        self._after.append(after)
        self._before.append(before)
        return len(self) - 1

    def extend(self, chunk: Chunk) -> None:
        self._seal()
        self._chunks.append(chunk)
        self._in_chunks += len(chunk)

    def truncate(self, n: int) -> Chunk:
        """Keep the first `n` rows; returns the others."""
        self._chunks, tail = self._cut(n)
        self._in_chunks = sum(map(len, self._chunks))
        return Chunk.concat(tail)

    def split(self, n: int) -> Chunk:
        """The first `n` rows, which are forgotten here."""
        head, self._chunks = self._cut(n)
        self._in_chunks = sum(map(len, self._chunks))
        return Chunk.concat(head)

    def _cut(self, n: int) -> tuple[list[Chunk], list[Chunk]]:
        """All rows as chunks: (the first `n`, the rest)."""
        self._seal()
        head: list[Chunk] = []
        tail: list[Chunk] = []
        seen = 0
        for c in self._chunks:
            if seen >= n:
                tail.append(c)
            elif seen + len(c) <= n:
                head.append(c)
            else:
                head.append(c.slice(0, n - seen))
                tail.append(c.slice(n - seen, len(c)))
            seen += len(c)
        return head, tail

    def _seal(self) -> None:
        if self._op:
            self._chunks.append(Chunk(np.array(self._op, np.uint8), np.array(self._table, np.int32),
                                       pa.array(self._after, pa.binary()), pa.array(self._before, pa.binary())))
            self._in_chunks += len(self._op)
            self._op, self._table, self._after, self._before = [], [], [], []
