"""core.rate with a fake clock: a paced reader never gets ahead of its rate by more than a nap,
the allowance fills at its rate up to one second's worth, and a share splits a rate over the
reads that run at once."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from changefeed.core.rate import BURST_S, CATCH_UP, NAP_S, Allowance, Pace, share


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


def test_a_credit_is_spent_a_little_above_the_rate_then_the_rate_holds() -> None:
    clock = Clock()
    pace = Pace(100, credit=50, clock=clock, sleep=clock.sleep)
    pace.took(110)
    assert abs(clock.now - 101.0) < 1e-9  # at CATCH_UP times the rate: 110 in a second, not 50 at once
    pace.took(440)
    assert abs(clock.now - 105.0) < 1e-9  # 550 in 5 s: the credit is spent (550 - 50 = 100 a second)
    pace.took(100)
    assert abs(clock.now - 106.0) < 1e-9  # then 100 a second


@given(st.floats(1, 1e6), st.floats(0, 1e6), st.lists(st.floats(0.01, 1e5), min_size=1, max_size=50))
def test_no_read_runs_more_than_catch_up_times_its_rate_nor_above_it_past_its_credit(
        per_s: float, credit: float, pieces: list[float]) -> None:
    clock = Clock()
    pace = Pace(per_s, credit=credit, clock=clock, sleep=clock.sleep)
    began, done = clock.now, 0.0
    for n in pieces:
        pace.took(n)
        done += n
        elapsed = clock.now - began
        slack = NAP_S * per_s * CATCH_UP  # (a read naps only once it is this far ahead)
        assert done <= per_s * CATCH_UP * elapsed + slack + 1e-6 * done
        assert done - credit <= per_s * elapsed + slack + 1e-6 * done


def test_the_saved_up_rows_are_split_over_a_batch_s_reads_and_spent() -> None:
    from changefeed.spark.rates import SNAPSHOT_BURST_S, Rates

    rates = Rates({"snapshot_rate_rows": "1000", "task_slots": "2"})
    rows, size, credit = rates.per_read(4, 4000, parallel=True)
    assert (rows, size) == (500, 0)  # two reads at a time share the rate
    assert credit == 1000 * SNAPSHOT_BURST_S / 4  # the burst, over all four reads
    _, _, credit = rates.per_read(4, 4000, parallel=False)
    assert credit == 0  # the first batch spent it, and more: the next reads wait their turn
    assert rates.per_read(3, 3000, parallel=False)[:2] == (1000, 0)  # one read at a time: the whole rate
