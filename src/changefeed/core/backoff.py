"""Capped exponential backoff with full jitter, the one formula of every retry loop.

The n-th wait in a row is `rng() * min(cap, first * 2**(n-1))`: it doubles so a long outage is not
hammered, is capped so recovery is noticed soon, and is uniform below that step (full jitter) so
clients hit by the same outage do not come back in step. The feed's retry policy (control.retry)
and the webhook client (sinks.webhook, which runs in Spark tasks and may not import control) both
use it; it lives in core so both layers can. Pure Python, stdlib only.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable


def backoff_step(attempt: int, first: float, cap: float) -> float:
    """The upper bound of the `attempt`-th wait (1-based): `min(cap, first * 2**(attempt-1))`.
    Exact (scaling by a power of two), and `cap` rather than OverflowError however many attempts."""
    if attempt < 1:
        raise ValueError(f"attempt counts from 1, got {attempt}")
    try:
        return min(cap, math.ldexp(first, attempt - 1))
    except OverflowError:  # first * 2**(attempt-1) is past the largest float, so far past any cap
        return cap


def full_jitter(attempt: int, first: float, cap: float, rng: Callable[[], float] = random.random) -> float:
    """The wait before retry `attempt` (1-based): `rng() * backoff_step(attempt, first, cap)`, in
    [0, cap] for `rng` in [0, 1]."""
    return rng() * backoff_step(attempt, first, cap)
