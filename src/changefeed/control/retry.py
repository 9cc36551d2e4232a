"""Riding out transient faults: capped exponential backoff with full jitter, and a give-up deadline.

A running feed that meets a TransientError (a server restarting, a connection lost, a broker or
endpoint down) stops its query, waits, and starts again from its checkpoint; nothing is lost or
applied twice because every attempt resumes from what the sink committed. The n-th wait in a row
is uniform in [0, min(max_backoff, first × 2ⁿ⁻¹)], so runners hit by the same outage do not come
back in step. A fault that lasts longer than `give_up_after`, or fails more attempts in a row
than its type allows (errors.QueryFailed: an error changefeed does not know, that may be a bug),
ends the run with its error (exit 75).
While it lasts, the state folder holds a `retrying` note (component, reason, since, attempts) that
`status` and the metrics show.
"""
from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from changefeed.core.backoff import full_jitter
from changefeed.errors import TransientError

FIRST_BACKOFF_S = 0.5


@dataclass(frozen=True)
class Retrying:
    """What a running feed is waiting out."""

    component: str  # source, sink, query
    reason: str
    since: float  # Unix seconds: when the fault began
    attempts: int  # failed attempts in a row

    def describe(self, now: float | None = None) -> str:
        lasted = (now if now is not None else time.time()) - self.since
        return f"retrying for {lasted:.0f}s after {self.attempts} failure(s) of the {self.component}: {self.reason}"


class Retry:
    """The policy of one run: `failed(error)` -> seconds to wait (or the error, past the deadline)."""

    def __init__(self, max_backoff_s: float = 30.0, give_up_after_s: float | None = None, *,
                 first_s: float = FIRST_BACKOFF_S, rng: Callable[[], float] = random.random,
                 clock: Callable[[], float] = time.time) -> None:
        self.max_backoff_s, self.give_up_after_s, self.first_s = max_backoff_s, give_up_after_s, first_s
        self._rng, self._clock = rng, clock
        self.current: Retrying | None = None
        self._kind: tuple[type[TransientError], int] | None = None  # the last error's type, failures of it in a row

    def failed(self, error: TransientError) -> float:
        """Note `error`; the wait before the next attempt. Raises `error` once the fault has lasted
        longer than give_up_after, or once its type failed `max_attempts` times in a row."""
        now = self._clock()
        since = self.current.since if self.current else now
        attempts = (self.current.attempts if self.current else 0) + 1
        self.current = Retrying(error.component or "feed", error.message.splitlines()[0], since, attempts)
        same = self._kind[1] + 1 if self._kind and self._kind[0] is type(error) else 1
        self._kind = (type(error), same)
        past_deadline = self.give_up_after_s is not None and now - since >= self.give_up_after_s
        if past_deadline or (error.max_attempts is not None and same >= error.max_attempts):
            error.message = f"{error.message} (gave up after {now - since:.0f}s and {attempts} attempt(s))"
            raise error
        return full_jitter(attempts, self.first_s, self.max_backoff_s, self._rng)

    def succeeded(self) -> None:
        self.current = self._kind = None


def write_note(path: Path, retrying: Retrying | None) -> None:
    """The `retrying` note of the state folder: written while a fault lasts, removed after."""
    if retrying is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(retrying)))
    tmp.replace(path)


def read_note(path: Path) -> Retrying | None:
    try:
        return Retrying(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
