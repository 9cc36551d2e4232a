"""What `verify` found: chunk checksums compared, mismatching chunks narrowed down to keys.

Pure: the checksums and rows come from postgres/checksum.py. A table is split into chunks by a
hash of the key; a chunk's checksum is (rows, sum of row hashes), so checksums of parts (block
ranges, nodes) add up to the table's. Only chunks whose checksums differ are read row by row.
"""
from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from changefeed.core.lsn import format_lsn

Sums = dict[int, tuple[int, int]]  # chunk -> (rows, sum of row hashes)
MISSING, EXTRA, CHANGED = "missing on the sink", "extra on the sink", "differs"
MAX_CHUNKS = 1 << 16
SHOWN = 20  # differences per table reported with their values


def chunk_count(rows: int, chunk_rows: int) -> int:
    """How many chunks a table of about `rows` rows is split into (at least 1)."""
    return max(1, min(MAX_CHUNKS, math.ceil(max(rows, 0) / max(chunk_rows, 1))))


def block_ranges(blocks: int, parts: int, min_blocks: int = 1024) -> list[tuple[int, int | None]]:
    """Block ranges [lo, hi) covering a table of `blocks` blocks in up to `parts` pieces of at
    least `min_blocks`; the last one is open (rows in blocks added meanwhile are newer than the
    snapshot, but an open end never misses one)."""
    n = max(1, min(parts, blocks // max(min_blocks, 1)))
    cuts = [blocks * i // n for i in range(n + 1)]
    return [(cuts[i], cuts[i + 1] if i < n - 1 else None) for i in range(n)]


def add(into: Sums, part: Mapping[int, tuple[int, int]]) -> Sums:
    """Add a part's checksums into `into` (returned)."""
    for chunk, (rows, total) in part.items():
        have = into.get(chunk, (0, 0))
        into[chunk] = (have[0] + rows, have[1] + total)
    return into


def mismatched(source: Mapping[int, tuple[int, int]], sink: Mapping[int, tuple[int, int]]) -> list[int]:
    """Chunks whose checksums differ (a chunk absent on one side has (0, 0) there)."""
    return sorted(c for c in source.keys() | sink.keys() if source.get(c, (0, 0)) != sink.get(c, (0, 0)))


def keys_differing(source: Mapping[str, int], sink: Mapping[str, int]) -> list[tuple[str, str]]:
    """(key, kind) for every key whose row differs between the two sides, sorted by key text."""
    out = [(k, MISSING) for k in source.keys() - sink.keys()]
    out += [(k, EXTRA) for k in sink.keys() - source.keys()]
    out += [(k, CHANGED) for k in source.keys() & sink.keys() if source[k] != sink[k]]
    return sorted(out)


def shown(value: str | None, width: int = 60) -> str:
    """A value for a report: NULL, or its text, long ones shortened with their length and digest."""
    if value is None:
        return "NULL"
    if len(value) <= width:
        return repr(value)
    digest = hashlib.md5(value.encode()).hexdigest()[:8]
    return f"{value[:width // 2]!r}... ({len(value)} chars, md5 {digest})"


@dataclass
class Difference:
    key: str  # the key's text, e.g. (42) or (7,abc)
    kind: str  # MISSING, EXTRA or CHANGED
    columns: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)  # column -> (source, sink)

    def line(self) -> str:
        if self.kind != CHANGED:
            return f"key {self.key}: {self.kind}"
        cols = "; ".join(f"{c}: source {shown(a)}, sink {shown(b)}" for c, (a, b) in self.columns.items())
        return f"key {self.key}: {self.kind}: {cols or 'same text, different row'}"


def column_differences(source: Mapping[str, str | None], sink: Mapping[str, str | None]
                       ) -> dict[str, tuple[str | None, str | None]]:
    return {c: (source.get(c), sink.get(c)) for c in source if source.get(c) != sink.get(c)}


@dataclass
class TableResult:
    table: str
    source_rows: int = 0
    sink_rows: int = 0
    chunks: int = 0
    chunks_mismatched: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # kind -> keys
    differences: list[Difference] = field(default_factory=list)  # the first ones, with their values
    schema: list[str] = field(default_factory=list)  # column differences
    repaired: int = 0

    @property
    def mismatched_rows(self) -> int:
        return sum(self.counts.values())

    @property
    def equal(self) -> bool:
        return not self.schema and not self.mismatched_rows

    def lines(self) -> list[str]:
        head = (f"{self.table}: {self.source_rows} rows on the source, {self.sink_rows} on the sink, "
                f"{self.chunks} chunks compared")
        if self.equal:
            return [head + ": equal"]
        kinds = ", ".join(f"{n} {k}" for k, n in self.counts.items() if n)
        out = [head + f", {self.chunks_mismatched} differ" + (f": {kinds}" if kinds else "")]
        out += [f"  column {s}" for s in self.schema]
        out += [f"  {d.line()}" for d in self.differences]
        more = self.mismatched_rows - len(self.differences)
        if more > 0:
            out.append(f"  ... and {more} more keys")
        if self.repaired:
            out.append(f"  repaired {self.repaired} keys "
                       "(the sink now holds the source's rows at a new consistent point)")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"table": self.table, "source_rows": self.source_rows, "sink_rows": self.sink_rows,
                "chunks": self.chunks, "chunks_mismatched": self.chunks_mismatched, "counts": self.counts,
                "schema": self.schema, "repaired": self.repaired, "equal": self.equal,
                "differences": [{"key": d.key, "kind": d.kind, "columns": {c: list(v) for c, v in d.columns.items()}}
                                for d in self.differences]}


def schema_differences(source: Iterable[tuple[str, str]], sink: Iterable[tuple[str, str]]) -> list[str]:
    """Column differences between (name, type) lists: missing, extra, other type."""
    src, dst = dict(source), dict(sink)
    out = [f"{c} ({t}) missing on the sink" for c, t in src.items() if c not in dst]
    out += [f"{c} ({t}) extra on the sink" for c, t in dst.items() if c not in src]
    out += [f"{c}: {t} on the source, {dst[c]} on the sink" for c, t in src.items() if c in dst and dst[c] != t]
    return out


@dataclass
class Report:
    lsns: dict[str, int]
    tables: list[TableResult]
    seconds: float
    at: float = field(default_factory=time.time)

    @property
    def equal(self) -> bool:
        return all(t.equal for t in self.tables)

    @property
    def mismatched_rows(self) -> int:
        return sum(t.mismatched_rows for t in self.tables)

    def lines(self) -> list[str]:
        where = ", ".join(f"{n} {format_lsn(lsn)}" for n, lsn in sorted(self.lsns.items()))
        out = [f"compared at {where} in {self.seconds:.1f}s"]
        for t in self.tables:
            out += t.lines()
        what = [f"{self.mismatched_rows} rows"] if self.mismatched_rows else []
        what += ["columns"] if any(t.schema for t in self.tables) else []
        out.append("equal" if self.equal else f"NOT equal: {' and '.join(what)} differ")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "lsns": self.lsns, "seconds": self.seconds, "equal": self.equal,
                "mismatched_rows": self.mismatched_rows, "tables": [t.to_json() for t in self.tables]}
