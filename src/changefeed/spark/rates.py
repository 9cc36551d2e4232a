"""The feed's rate limits (core.rate) as its Spark source plans each batch: read again from the
stored definition whenever it changed, so `changefeed alter --snapshot-rate/--max-rate` reaches a
running feed at its next batch without a restart."""
from __future__ import annotations

from pathlib import Path

from changefeed.core.rate import Allowance, share
from changefeed.errors import ConfigError
from changefeed.spec.definition import FeedSpec

SNAPSHOT_BURST_S = 2.0  # the most of --snapshot-rate (rows) a batch's reads take at once, in seconds of it


class Rates:
    """Options: spec_file (the stored definition), snapshot_rate_rows, snapshot_rate_bytes,
    max_rate (as the query started), task_slots (how many reads run at once, at most)."""

    def __init__(self, options: dict[str, str]) -> None:
        self.path = Path(options["spec_file"]) if options.get("spec_file") else None
        self.rows = int(options.get("snapshot_rate_rows") or 0)
        self.bytes = int(options.get("snapshot_rate_bytes") or 0)
        self.max_rate = int(options.get("max_rate") or 0)
        self.slots = int(options.get("task_slots") or 1)
        self._seen: tuple[int, int] | None = None
        self.allowance = Allowance(self.max_rate) if self.max_rate else None
        self.snapshot_allowance = Allowance(self.rows, burst_s=SNAPSHOT_BURST_S) if self.rows else None

    def refresh(self) -> None:
        """Take in what an alter stored since (a definition being written is read at the next batch)."""
        if self.path is None:
            return
        try:
            st = self.path.stat()
            if self._seen == (st.st_size, st.st_mtime_ns):
                return
            spec = FeedSpec.from_json(self.path.read_text(), str(self.path))
            self._seen = st.st_size, st.st_mtime_ns
        except (OSError, ConfigError):
            return
        if spec.snapshot_rate_rows != self.rows:
            self.snapshot_allowance = Allowance(spec.snapshot_rate_rows, burst_s=SNAPSHOT_BURST_S) \
                if spec.snapshot_rate_rows else None
        self.rows, self.bytes = spec.snapshot_rate_rows, spec.snapshot_rate_bytes
        if spec.max_rate != self.max_rate:
            self.max_rate = spec.max_rate
            if not spec.max_rate:
                self.allowance = None
            elif self.allowance is None:
                self.allowance = Allowance(spec.max_rate)
            else:
                self.allowance.set_rate(spec.max_rate)

    def changes_allowed(self) -> int | None:
        """How many row changes the next batch may carry under --max-rate; None without one."""
        return None if self.allowance is None else self.allowance.available()

    def spent(self, changes: int) -> None:
        if self.allowance is not None:
            self.allowance.spend(changes)

    def per_read(self, reads: int, rows: int, parallel: bool) -> tuple[float, float, float]:
        """(rows, bytes) per second for each of a batch's `reads` snapshot reads of about `rows`
        rows in all (0: no limit), and the rows each may read at once (the allowance saved up)."""
        at_once = min(reads, self.slots) if parallel else 1
        credit = 0.0
        if self.snapshot_allowance is not None and reads:
            credit = self.snapshot_allowance.available() / reads  # (split over all: sequential reads too)
            self.snapshot_allowance.spend(rows)
        return share(self.rows, at_once, self.slots), share(self.bytes, at_once, self.slots), credit
