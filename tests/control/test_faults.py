"""The crash tests' fault points: the n-th arrival is found once, also when tasks arrive together."""
from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from changefeed import faults


def _arrive(args: tuple[str, int]) -> list[bool]:
    import os
    os.environ.update(CHANGEFEED_FAIL_AT="snapshot_chunk:37", CHANGEFEED_FAULT_DIR=args[0])
    return [faults._due("CHANGEFEED_FAIL_AT", "snapshot_chunk", "fail") for _ in range(args[1])]


def test_the_nth_arrival_is_due_exactly_once_among_racing_processes(tmp_path: Path) -> None:
    for round_ in range(5):
        folder = tmp_path / str(round_)
        folder.mkdir()
        with multiprocessing.get_context("fork").Pool(4) as pool:
            due = [d for run in pool.map(_arrive, [(str(folder), 25)] * 4) for d in run]
        assert due.count(True) == 1, round_  # 100 arrivals, the 37th among them once


def test_a_fault_raises_at_its_nth_arrival_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHANGEFEED_FAIL_AT", "read:2")
    monkeypatch.setenv("CHANGEFEED_FAULT_DIR", str(tmp_path))
    faults.reach("read")
    faults.reach("startup")  # another point: not counted
    with pytest.raises(faults.InjectedFault, match="fault injected at read"):
        faults.reach("read")
    faults.reach("read")


def test_an_armed_fault_counts_only_once_its_file_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    armed = tmp_path / "armed"
    monkeypatch.setenv("CHANGEFEED_FAIL_AT", "read:2")
    monkeypatch.setenv("CHANGEFEED_FAULT_DIR", str(tmp_path))
    monkeypatch.setenv("CHANGEFEED_FAULT_ARMED", str(armed))
    for _ in range(5):
        faults.reach("read")  # not armed yet: none of these count
    armed.touch()
    faults.reach("read")
    with pytest.raises(faults.InjectedFault):
        faults.reach("read")
