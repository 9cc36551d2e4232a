"""How far the sink recorded the feed, asked in the background by a followed batch's read
(spark.follow.Polled): the follower never waits for an ask, a failed ask keeps the answer
before, the answer never goes back, and the asking ends (and frees what it holds) when closed."""
from __future__ import annotations

import threading
import time

from changefeed.spark.follow import Polled


class Asks:
    def __init__(self, answers: list[int | Exception]) -> None:
        self.answers, self.closed, self.slow = answers, threading.Event(), threading.Event()

    def __call__(self) -> int:
        if self.slow.is_set():
            time.sleep(5)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def close(self) -> None:
        self.closed.set()


def _until(check: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_answers_are_kept_through_failures_and_never_go_back() -> None:
    asks = Asks([ConnectionError("down"), 100, ConnectionError("down again"), 50, 200])
    polled = Polled(asks, 0.01)
    seen: list[int] = []
    try:
        _until(lambda: seen.append(polled()) or seen[-1] == 200)
        seen += [polled() for _ in range(100)]
        assert seen == sorted(seen) and seen[-1] == 200
    finally:
        polled.close()
    _until(asks.closed.is_set)


def test_a_slow_ask_does_not_hold_up_the_caller() -> None:
    asks = Asks([7])
    asks.slow.set()
    polled = Polled(asks, 0.01)
    began = time.monotonic()
    assert polled() == 0 and time.monotonic() - began < 1.0  # (the first answer is not in yet)
    polled.close()
    assert time.monotonic() - began < 1.0, "close does not wait for the ask under way"
