"""The snapshot's progress lines (control.meter.SnapshotMeter): a table's "done" line comes once
it leaves the pending tables, also when its last rows were counted while the query's last
progress still named it pending (the sink records a batch before Spark reports it: the CI runs
where that line never came), and never twice."""
from __future__ import annotations

from typing import Any

import pytest

from changefeed.control.meter import SnapshotMeter


class _Totals:
    """The ledger's per-table snapshot totals, as a test sets them."""

    def __init__(self) -> None:
        self.rows: dict[str, int] = {}

    def snapshot_totals(self) -> dict[str, tuple[int, int]]:
        return {t: (1, n) for t, n in self.rows.items()}


@pytest.fixture
def meter(monkeypatch: pytest.MonkeyPatch) -> tuple[SnapshotMeter, _Totals, list[str]]:
    from changefeed.postgres import snapshot

    monkeypatch.setattr(snapshot, "estimated_rows", lambda _source, _table: 1000)
    lines: list[str] = []
    totals = _Totals()
    return SnapshotMeter(lines.append, None, totals), totals, lines  # type: ignore[arg-type]


def _done(lines: list[str]) -> list[str]:
    return [line for line in lines if "done" in line]


def test_done_when_the_last_rows_were_counted_while_still_pending(meter: Any) -> None:
    m, totals, lines = meter
    totals.rows["public.t"] = 400
    m.update(("public.t",))
    totals.rows["public.t"] = 1000  # the last chunk applied; Spark's progress still says pending
    m.update(("public.t",))
    assert not _done(lines) and "1,000 rows of ~1,000" in lines[-1]
    m.update(())  # nothing moved since: the table left the pending ones all the same
    assert _done(lines) == ["  snapshot public.t: done, 1,000 rows"]
    m.update(())
    m.update(())
    assert len(_done(lines)) == 1


def test_done_for_a_table_that_moved_unseen_and_nothing_for_an_earlier_runs_snapshot(meter: Any) -> None:
    m, totals, lines = meter
    totals.rows["public.quick"] = 50  # read and applied between two updates: never seen pending
    m.update(())
    assert _done(lines) == ["  snapshot public.quick: done, 50 rows"]
    lines.clear()
    again = SnapshotMeter(lines.append, None, totals)  # type: ignore[arg-type]  # a later run
    again.update(())
    assert lines == []  # its snapshot was an earlier run's: nothing to say


def test_a_table_snapshotted_again_is_done_again(meter: Any) -> None:
    m, totals, lines = meter
    totals.rows["public.t"] = 10
    m.update(("public.t",))
    m.update(())
    totals.rows["public.t"] = 20  # a re-snapshot (alter --where, a resync)
    m.update(("public.t",))
    m.update(())
    assert _done(lines) == ["  snapshot public.t: done, 10 rows", "  snapshot public.t: done, 20 rows"]
