"""core.rate with a fake clock: a paced reader never gets ahead of its rate by more than a nap,
the allowance fills at its rate up to one second's worth, and a share splits a rate over the
reads that run at once."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from changefeed.core.rate import BURST_S, NAP_S, Allowance, Pace, share


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        assert s > 0
        self.now += s


@given(st.floats(1, 1e6), st.lists(st.tuples(st.integers(1, 5000), st.floats(0, 0.5)), min_size=1, max_size=60))
def test_a_paced_read_stays_at_its_rate(per_s: float, reads: list[tuple[int, float]]) -> None:
    clock = Clock()
    pace = Pace(per_s, clock=clock, sleep=clock.sleep)
    done = 0
    for amount, work in reads:
        clock.now += work  # the reading itself
        pace.took(amount)
        done += amount
        assert done / per_s - (clock.now - pace.began) < NAP_S  # never ahead by a nap or more
    assert clock.now - pace.began >= done / per_s - NAP_S


def test_the_allowance_fills_at_its_rate_up_to_a_burst() -> None:
    clock = Clock()
    a = Allowance(1000, clock)
    assert a.available() == 1000 * BURST_S
    a.spend(1000)
    assert a.available() == 0
    clock.now += 0.25
    assert a.available() == 250
    clock.now += 60
    assert a.available() == 1000 * BURST_S  # an idle minute saves no more than the burst
    a.set_rate(100)
    assert a.available() == 100 * BURST_S
    a.spend(300)  # a batch may overshoot by its last transaction: the debt is paid first
    clock.now += 1
    assert a.available() == 0
    clock.now += 2
    assert a.available() == 100


def test_a_rate_is_shared_by_the_reads_that_run_at_once() -> None:
    assert share(1000, 4, 2) == 500  # 4 reads, 2 at a time
    assert share(1000, 1, 8) == 1000
    assert share(1000, 0, 2) == 1000
    assert share(0, 4, 2) == 0


def test_a_credit_is_read_at_once_then_the_rate_holds() -> None:
    clock = Clock()
    pace = Pace(100, credit=50, clock=clock, sleep=clock.sleep)
    pace.took(50)
    assert clock.now == 100.0  # the credit: no sleep
    pace.took(100)
    assert abs(clock.now - 101.0) < 1e-9  # then 100 a second


def test_the_saved_up_rows_are_split_over_a_batch_s_reads_and_spent() -> None:
    from changefeed.spark.rates import SNAPSHOT_BURST_S, Rates

    rates = Rates({"snapshot_rate_rows": "1000", "task_slots": "2"})
    rows, size, credit = rates.per_read(4, 4000, parallel=True)
    assert (rows, size) == (500, 0)  # two reads at a time share the rate
    assert credit == 1000 * SNAPSHOT_BURST_S / 4  # the burst, over all four reads
    _, _, credit = rates.per_read(4, 4000, parallel=False)
    assert credit == 0  # the first batch spent it, and more: the next reads wait their turn
    assert rates.per_read(3, 3000, parallel=False)[:2] == (1000, 0)  # one read at a time: the whole rate
