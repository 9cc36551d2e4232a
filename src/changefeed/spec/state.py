"""A feed's state folder: its stored definition, Spark checkpoint, lock and the notes a run leaves."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from changefeed.spec.definition import FeedSpec


class FeedState:
    """A feed's folder under the state directory: its definition and Spark checkpoint."""

    def __init__(self, root: Path | str, name: str) -> None:
        self.dir = Path(root).absolute() / name
        self.spec_file = self.dir / "feed.json"
        self.checkpoint = self.dir / "checkpoint"
        self.lock_file = self.dir / "run.lock"
        self.requests = self.dir / "requests"
        self.outbox_marks = self.dir / "outbox_marks.jsonl"  # postgres.outbox.OutboxCleanup
        self.paused_file = self.dir / "paused"
        self.failed_file = self.dir / "failed"
        self.spark_log = self.dir / "spark.log"  # the Spark driver's and workers' output (spark.spark_log)
        self.retrying_file = self.dir / "retrying"  # while a running feed waits out a fault (retry)
        self.barrier_file = self.dir / "barrier.json"  # where a verify wants the batches to stop (core.barrier)
        self.verified_file = self.dir / "verified.json"  # the last verification's outcome (verify)
        self.joining_file = self.dir / "joining"  # nodes being added to a running feed (lifecycle.add_node)
        self.behind_file = self.dir / "behind.json"  # sinks the others went on without (control.lag_budget)
        self.replay_file = self.dir / "replay.json"  # the batch ends such a sink is caught up by
        self.warm_up = self.dir / "warm-up"  # the checkpoint of a run's warm-up query (spark.warm_up)

    @property
    def paused(self) -> bool:
        return self.paused_file.exists()

    def joining(self) -> list[str]:
        """Nodes being added to the running feed (postgres/cut.py plans nothing until it reads them)."""
        try:
            return self.joining_file.read_text().split()
        except OSError:
            return []

    def set_joining(self, names: list[str]) -> None:
        if names:
            self.joining_file.write_text("".join(f"{n}\n" for n in names))
        else:
            self.joining_file.unlink(missing_ok=True)

    def record_failure(self, error: Exception) -> None:
        """Note why the last run of a stored feed stopped on an error (`status` and `list` show it)."""
        if self.spec_file.exists():
            self.failed_file.write_text(str(error).splitlines()[0])

    def failure(self) -> str | None:
        return f"failed: {self.failed_file.read_text()}" if self.failed_file.exists() else None

    def load(self) -> FeedSpec | None:
        return FeedSpec.from_json(self.spec_file.read_text(), str(self.spec_file)) if self.spec_file.exists() else None

    def save(self, spec: FeedSpec) -> None:
        """Store the feed's definition, readable by its owner only (its secrets are references or
        encrypted anyway: see FeedSpec.protected)."""
        self.make()
        tmp = self.spec_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(spec.to_json())
        tmp.replace(self.spec_file)

    def make(self) -> None:
        """The state folder (and the state directory above it, if new), for its owner only."""
        self.dir.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.dir.mkdir(exist_ok=True, mode=0o700)

    def last_verified(self) -> dict[str, Any] | None:
        """The last verification's outcome, as `core.verify.Report.to_json` made it (None if none)."""
        try:
            found = json.loads(self.verified_file.read_text())
        except (OSError, ValueError):
            return None
        return found if isinstance(found, dict) else None

    def save_verified(self, outcome: dict[str, Any]) -> None:
        self.make()
        tmp = self.verified_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(outcome))
        tmp.replace(self.verified_file)

    def has_checkpoint(self) -> bool:
        offsets = self.checkpoint / "offsets"
        return offsets.is_dir() and any(offsets.iterdir())
