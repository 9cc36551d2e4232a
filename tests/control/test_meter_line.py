"""The runner's progress line (control.meter.Meter): its resolved lag is the newer of Spark's last
batch's end and what the sink recorded, so that a batch in low-latency mode, which commits
sub-windows for many seconds before Spark sees it end, does not show a lag that only grows."""
from __future__ import annotations

import re
import time
from typing import Any

from changefeed.control.meter import Meter
from changefeed.core.hlc import from_millis
from changefeed.core.offsets import Offset


class _Query:
    def __init__(self, end_ts: int) -> None:
        end = Offset({"n1": 100}, end_ts).to_json()
        self.lastProgress: dict[str, Any] = {"durationMs": {"triggerExecution": 3000}, "sources": [{"endOffset": end}]}


class _Ledger:
    """The sink's ledger as the meter reads it: totals, then its last resolved timestamp."""

    def __init__(self, counted: list[tuple[int, int]], resolved: list[int | None]) -> None:
        self.counted, self.resolved = iter(counted), resolved

    def totals(self) -> tuple[int, int]:
        return next(self.counted)

    def last_resolved_ts(self) -> int | None:
        return self.resolved[0]


def _lag(line: str) -> float:
    found = re.search(r"resolved lag ([0-9.]+)s", line)
    assert found, line
    return float(found.group(1))


def test_the_lag_follows_the_sink_while_spark_s_batch_runs() -> None:
    now_ms = int(time.time() * 1000)
    sink: list[int | None] = [from_millis(now_ms - 100)]
    lines: list[str] = []
    meter = Meter(lines.append, _Ledger([(0, 0), (5, 500), (9, 900)], sink))  # type: ignore[arg-type]
    meter.update(_Query(from_millis(now_ms - 30_000)))  # Spark's last batch ended 30 s ago
    assert _lag(lines[-1]) < 5  # the sink's sub-windows are 0.1 s old
    sink[0] = from_millis(now_ms - 60_000)  # (a sink behind Spark's last batch: several sinks, the least far)
    meter.update(_Query(from_millis(now_ms - 20_000)))
    assert 15 < _lag(lines[-1]) < 40


def test_without_a_resolved_timestamp_the_line_has_no_lag() -> None:
    lines: list[str] = []
    Meter(lines.append, _Ledger([(0, 0), (1, 10)], [None])).update(_Query(0))  # type: ignore[arg-type]
    assert lines and "resolved lag" not in lines[-1]
