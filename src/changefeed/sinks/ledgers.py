"""The ledgers of a feed's several sinks (spec.sinks), asked as one: the feed is as far as the
sink that is least far.

Every sink records each batch in its own ledger, in its own transaction; the slot moves only once
Spark recorded the batch, after all of them committed it. So the feed's checkpoint (what status,
the retention check and the metrics report) is the least of the sinks' checkpoints, and a sink
without a batch yet (one just added) is not waited for. Sinks of one feed differ by at most the
batch that was being committed when a runner ended: `resume_offset` is then the least sink's
position, and the furthest one's (`offsets`) is where the first batch of a runner without the
feed's checkpoint ends, so that it covers exactly what the least sink lacks (spark.source: the
other sinks find that batch in their ledgers and skip it).
"""
from __future__ import annotations

from typing import Any

from changefeed.core.offsets import Offset
from changefeed.sinks.fan_out import named
from changefeed.sinks.ledger import LastBatch, Ledger


class SinkLedgers:
    """The Ledger of a feed with several sinks; `each` gives them one by one (status, metrics)."""

    def __init__(self, each: list[tuple[str, Ledger]]) -> None:
        self.each = each  # (sink name, its ledger), in the feed's order

    def _all(self, what: str, *args: Any) -> list[Any]:
        """`what(*args)` of every sink's ledger, an error naming its sink."""
        out = []
        for name, ledger in self.each:
            with named(name):
                out.append(getattr(ledger, what)(*args))
        return out

    def check(self) -> None:
        self._all("check")

    def prepare(self, tables: list[Any]) -> None:
        self._all("prepare", tables)

    def notes(self) -> list[str]:
        return [f"sink {name}: {note}" for (name, _), notes in zip(self.each, self._all("notes")) for note in notes]

    def checkpoint(self) -> dict[str, int] | None:
        """Per node the least position a sink recorded (sinks without a batch yet left out)."""
        known = [c for c in self._all("checkpoint") if c is not None]
        if not known:
            return None
        return {node: min(c.get(node, 0) for c in known) for node in set().union(*known)}

    def last_resolved_ts(self) -> int | None:
        known = [ts for ts in self._all("last_resolved_ts") if ts is not None]
        return min(known) if known else None

    def last_batch(self) -> LastBatch | None:
        """The least far sink's last batch."""
        known = [b for b in self._all("last_batch") if b is not None]
        return min(known, key=lambda b: (b.end_lsn, b.resolved_ts)) if known else None

    def recent_rate(self) -> float:
        return float(min(self._all("recent_rate")))

    def totals(self) -> tuple[int, int]:
        """The least far sink's (batches, changes)."""
        batches, changes = min(self._all("totals"), key=lambda t: (t[1], t[0]))
        return int(batches), int(changes)

    def snapshot_totals(self) -> dict[str, tuple[int, int]]:
        """Per table what every sink has."""
        each = self._all("snapshot_totals")
        tables = set().union(*each)
        return {t: min((s.get(t, (0, 0)) for s in each), key=lambda c: (c[1], c[0])) for t in tables}

    def forget(self) -> bool:
        return any(self._all("forget"))

    def offsets(self) -> list[tuple[str, Offset]]:
        """Each sink's position, least far first (sinks that do not record it left out)."""
        found = [(name, Offset.from_json(o)) for (name, _), o in zip(self.each, self._all("resume_offset"))
                 if o is not None]
        return sorted(found, key=lambda f: f[1].order)

    def resume_offset(self) -> dict[str, Any] | None:
        """The least far sink's position (of those that record it; the others resume from Spark's
        checkpoint alone, and are refused as standbys' feeds: control.standby). The furthest one's
        is where the first batch then ends (spark.checkpoint.resume_until, from `offsets`)."""
        offsets = self.offsets()
        return offsets[0][1].to_json() if offsets else None

    def batch_ends(self, after: Offset) -> list[Offset]:
        """Every sink's batch ends past `after`, each once: the sinks record the same batches, but
        for those before a sink was added, or while one was behind."""
        ends = {o.order: o for each in self._all("batch_ends", after) for o in each}
        return [ends[k] for k in sorted(ends)]

    def fence(self, epoch: int, holder: str) -> bool:
        return all(self._all("fence", epoch, holder))

    def close(self) -> None:
        for _, ledger in self.each:
            ledger.close()
