"""Snapshot requests as an older changefeed kept them: numbered JSON files (`000001.json`:
{"tables": [...]}) in the feed's `requests` folder, written atomically. Requests are now on the
feed's first source node (postgres.requests), which takes these in, numbers kept, and reads them
while the source has none; the numbers are what a checkpoint counts as taken
(core.snapshot.Cursor.requests).
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path


class SnapshotRequests:
    def __init__(self, folder: Path | str) -> None:
        self.folder = Path(folder)

    def _numbers(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        return sorted(int(p.stem) for p in self.folder.glob("*.json") if p.stem.isdigit())

    def add(self, tables: Sequence[str]) -> int:
        """Queue a request; returns its number."""
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            no = (self._numbers() or [0])[-1] + 1
            tmp = self.folder / f".{no:06d}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps({"tables": list(tables)}))
            try:
                os.link(tmp, self.folder / f"{no:06d}.json")  # fails if another request took `no`
                return no
            except FileExistsError:
                continue
            finally:
                tmp.unlink()

    def after(self, taken: int) -> list[tuple[int, list[str]]]:
        """Requests numbered above `taken`, in order: (number, tables)."""
        return [(no, json.loads((self.folder / f"{no:06d}.json").read_text())["tables"])
                for no in self._numbers() if no > taken]
