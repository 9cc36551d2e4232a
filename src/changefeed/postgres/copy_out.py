"""A `COPY ... TO STDOUT` read in blocks of whole lines, not a line at a time.

libpq hands a COPY's rows over one per call, and psycopg's `Copy` iteration pays a Python
generator and a wait (with the watchdog's check around it, postgres.watchdog) for each row: most
of a snapshot reader's CPU per row (bench/README.md, snapshot_throughput.py). Here one wait drains
every row libpq already holds, up to a block's bounds, and hands them over as one bytes object of
newline-ended lines; `lines_array` turns a block into an Arrow column of its lines in two passes
over its bytes. In COPY's text format a newline inside a value is written as `\\n`, so a raw
newline byte always ends a row.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import pq
from psycopg.generators import fetch_many
from psycopg.waiting import Wait

_NL = 10


def blocks(conn: psycopg.Connection[Any], query: Any, rows: int, size: int) -> Iterator[tuple[bytes, int]]:
    """(block, rows in it) for the rows `query` (a COPY TO STDOUT in text format) sends, in order:
    each block holds at most `rows` rows and ends at the row that reaches `size` bytes; none is
    empty (a COPY of no rows gives none)."""
    with conn.cursor().copy(query):  # starts the COPY; its end (no error) reads nothing more
        more = True
        while more:
            block = bytearray()
            held = 0
            while more and held < rows and len(block) < size:
                more, added = conn.wait(_drain(conn.pgconn, block, rows - held, size - len(block),
                                               conn.info.encoding))
                held += added
            if held:
                yield bytes(block), held


def _drain(pgconn: Any, block: bytearray, rows: int, size: int, encoding: str) -> Any:
    """A psycopg wait generator: append the rows libpq holds to `block`, at most `rows` of them and
    about `size` bytes, waiting for the socket only until some came; returns (whether the COPY goes
    on, rows added): False once the COPY's result is read. (Each row is copied into the block at
    once, so that libpq's buffer for it is freed right away: holding thousands of them costs more
    than the copy.)"""
    got = 0
    start = len(block)
    while got < rows and len(block) - start < size:
        n, data = pgconn.get_copy_data(1)
        if n > 0:
            block += data
            got += 1
            continue
        if n == 0:  # nothing buffered: hand over what came, or wait for the socket
            if got:
                return True, got
            while not (yield Wait.R):
                continue
            pgconn.consume_input()
            continue
        # -1: the COPY's end; its result follows (an error the server met while sending, too)
        results = yield from fetch_many(pgconn)
        if not results or results[0].status != pq.ExecStatus.COMMAND_OK:
            if results:
                raise psycopg.errors.error_from_result(results[0], encoding=encoding)
            raise psycopg.OperationalError("the COPY ended without a result")
        return False, got
    return True, got


def lines_array(block: bytes, rows: int) -> Any:
    """The `rows` newline-ended lines of `block` as an Arrow binary array, each without its newline."""
    import numpy as np
    import pyarrow as pa

    ends = np.flatnonzero(np.frombuffer(block, np.uint8) == _NL)
    if len(ends) != rows:
        raise ValueError(f"a COPY block of {rows} rows holds {len(ends)} newlines")
    # line i spans [end[i-1] + 1, end[i]) in the block, so [end[i-1] + 1 - i, end[i] - i) once
    # the newlines before it are gone
    offsets = np.empty(rows + 1, np.int32)
    offsets[0] = 0
    offsets[1:] = ends - np.arange(rows)
    return pa.Array.from_buffers(pa.binary(), rows, [None, pa.py_buffer(offsets),
                                                     pa.py_buffer(block.replace(b"\n", b""))])
