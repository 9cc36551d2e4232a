"""Hybrid logical clock commit timestamps: physical milliseconds << 18 | logical counter.

A transaction's timestamp is the larger of its commit time (as HLC) and one past the previous
transaction's, so timestamps strictly increase in commit order. Feeding the same commits from the
same starting value gives the same timestamps, which is what makes a replayed batch identical.
"""
from __future__ import annotations

LOGICAL_BITS = 18
LOGICAL_MASK = (1 << LOGICAL_BITS) - 1
PG_EPOCH_US = 946_684_800_000_000  # 2000-01-01 in microseconds since the Unix epoch


def from_millis(ms: int, logical: int = 0) -> int:
    return (ms << LOGICAL_BITS) | logical


def physical_ms(ts: int) -> int:
    return ts >> LOGICAL_BITS


def logical(ts: int) -> int:
    return ts & LOGICAL_MASK


def next_commit_ts(previous: int, commit_time_us: int) -> int:
    """Timestamp of a transaction committed at `commit_time_us` (Unix µs) after `previous`."""
    return max(previous + 1, (commit_time_us // 1000) << LOGICAL_BITS)


def ceiling_of_ms(ms: int) -> int:
    """The largest timestamp within millisecond `ms`: a bound nothing earlier can exceed."""
    return (ms << LOGICAL_BITS) | LOGICAL_MASK


def window_end_ts(start_ts: int, clock_ms: int) -> int:
    """Resolved ts of a batch planned at `clock_ms` after one resolved at `start_ts`.

    At least a millisecond above `start_ts`, so resolved timestamps strictly increase and each
    window has 2^18 timestamps for its transactions even if the server clock stalls or steps back.
    """
    return max(ceiling_of_ms(clock_ms), ceiling_of_ms(physical_ms(start_ts) + 1))
