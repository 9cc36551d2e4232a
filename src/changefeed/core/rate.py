"""Rate limits: how hard a feed presses its source and its sinks.

`--snapshot-rate` caps the rows (or bytes) per second a feed's snapshot reads take from the
source, across all its reads: each of the batch's reads that run at once gets its share, and a
`Pace` makes a read sleep whenever it got ahead of its share since it began (the COPY then waits
in the server too: the socket fills). A rows limit also keeps an `Allowance` on the driver, so
the time between batches (planning, the sink's commit) is made up by the next batch's reads, at
most CATCH_UP times their share (no read presses the source much above the limit).
`--max-rate` caps the changes per second the stream delivers: an `Allowance` (a token bucket
filled at that rate, holding at most `BURST_S` of it) says how many changes the next batch may
carry, and the batch's window is cut after that many (postgres.source.lsn_after_changes). Both
are taken in at the next batch when `alter` changes them.
"""
from __future__ import annotations

import time
from collections.abc import Callable

BURST_S = 1.0  # the most an idle feed saves up for its next batch, in seconds of --max-rate
NAP_S = 0.01  # a read sleeps once it is this far ahead of its rate (not after every row)
CATCH_UP = 1.1  # a read spends its credit at most this much faster than its rate


class Pace:
    """Keeps one reader at `per_s` units per second on average since it began, after a `credit`
    (what the feed's reads left unused between batches: `Allowance`), which it spends by reading
    at most CATCH_UP times faster: the source never sees a read much above the limit."""

    def __init__(self, per_s: float, credit: float = 0.0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        assert per_s > 0
        self.per_s, self.clock, self.sleep = per_s, clock, sleep
        self.began, self.credit, self.done = clock(), max(0.0, credit), 0.0

    def took(self, amount: float) -> None:
        self.done += amount
        due = max((self.done - self.credit) / self.per_s, self.done / (self.per_s * CATCH_UP))
        ahead = due - (self.clock() - self.began)
        if ahead >= NAP_S:
            self.sleep(ahead)


class Allowance:
    """A token bucket: filled at `per_s`, at most `per_s * burst_s` held."""

    def __init__(self, per_s: float, clock: Callable[[], float] = time.monotonic, burst_s: float = BURST_S) -> None:
        self.per_s, self.clock, self.burst_s = per_s, clock, burst_s
        self.tokens, self.at = per_s * burst_s, clock()

    def set_rate(self, per_s: float) -> None:
        self._fill()
        self.per_s = per_s
        self.tokens = min(self.tokens, per_s * self.burst_s)

    def available(self) -> int:
        """How many changes the next batch may carry now (0: plan none yet)."""
        self._fill()
        return max(0, int(self.tokens))

    def spend(self, changes: int) -> None:
        self._fill()
        self.tokens -= changes

    def _fill(self) -> None:
        now = self.clock()
        self.tokens = min(self.per_s * self.burst_s, self.tokens + (now - self.at) * self.per_s)
        self.at = now


def share(per_s: float, reads: int, slots: int) -> float:
    """Each read's rate when `reads` reads of a batch run on `slots` task slots at once."""
    return per_s / max(1, min(reads, slots))
