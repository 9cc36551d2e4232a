"""The feed's lease on a real server: one holder at a time, a new term at each taking, ended by the
source's clock, extended only by its own term, and racing takers never share a term."""
from __future__ import annotations

import threading
import time

import psycopg

from changefeed.postgres import lease
from support.servers import Dbs


def test_a_lease_is_held_until_it_ends_then_taken_in_a_new_term(dbs: Dbs) -> None:
    with dbs.src() as a, dbs.src() as b:
        assert lease.current(a, dbs.name) is None  # never taken: no table needed to say so
        first = lease.take(a, dbs.name, 1.0, "runner a")
        assert first == 1
        held = lease.current(b, dbs.name)
        assert held is not None and held.holder == "runner a" and 0 < held.remaining_s <= 1.0 and not held.free
        assert lease.take(b, dbs.name, 1.0, "runner b") is None  # held: refused
        assert lease.renew(a, dbs.name, first, 1.0)
        time.sleep(1.2)  # no renewal for longer than the lease: it ends by the source's clock
        ended = lease.current(b, dbs.name)
        assert ended is not None and ended.free
        second = lease.take(b, dbs.name, 30.0, "runner b")
        assert second == 2
        assert not lease.renew(a, dbs.name, first, 30.0)  # the old term is over for good
        again = lease.current(a, dbs.name)
        assert again is not None and again.holder == "runner b" and again.epoch == 2


def test_an_ended_lease_nobody_took_is_still_its_terms_and_a_release_frees_it_at_once(dbs: Dbs) -> None:
    with dbs.src() as c:
        term = lease.take(c, dbs.name, 0.2, "frozen")
        assert term is not None
        time.sleep(0.4)
        ran_out = lease.current(c, dbs.name)
        assert ran_out is not None and ran_out.free and not ran_out.released
        assert lease.renew(c, dbs.name, term, 30.0)  # woken, nobody took it meanwhile: carries on
        assert lease.take(c, dbs.name, 30.0, "standby") is None
        lease.release(c, dbs.name, term)
        released = lease.current(c, dbs.name)
        assert released is not None and released.free and released.released  # a clean stop, told apart
        assert lease.take(c, dbs.name, 30.0, "standby") == term + 1
        lease.release(c, dbs.name, term)  # an old term's release frees nothing
        assert lease.take(c, dbs.name, 30.0, "third") is None


def test_force_takes_a_held_lease_in_a_new_term(dbs: Dbs) -> None:
    with dbs.src() as c:
        assert lease.take(c, dbs.name, 60.0, "killed") == 1
        assert lease.take(c, dbs.name, 60.0, "restarted", force=True) == 2
        assert not lease.renew(c, dbs.name, 1, 60.0)
        lease.forget(c, dbs.name)
        assert lease.current(c, dbs.name) is None


def test_racing_takers_get_a_term_each_and_never_the_same(dbs: Dbs) -> None:
    """Eight takers race for a lease that ends as soon as it is taken: each taking is a new term,
    and no two takers ever hold the same one."""
    with dbs.src() as c:
        lease.ensure(c)
    got: list[int] = []
    errors: list[BaseException] = []
    go = threading.Barrier(8)

    def taker(i: int) -> None:
        try:
            with psycopg.connect(dbs.source, autocommit=True) as c:
                go.wait()
                for _ in range(20):
                    term = lease.take(c, dbs.name, 0.0, f"taker {i}")  # ends at once: free for the next
                    if term is not None:
                        got.append(term)
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)

    threads = [threading.Thread(target=taker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(got) == len(set(got)) and sorted(got) == list(range(1, len(got) + 1)), sorted(got)


def test_a_runner_back_from_a_fault_keeps_the_feed_unless_another_took_it(dbs: Dbs) -> None:
    """check_still_held: a later term of this runner's own (an attempt that took it, then failed)
    is no takeover; another runner's is."""
    import pytest

    from changefeed.control.lease_keeper import check_still_held
    from changefeed.errors import LeaseLost
    from changefeed.spec.definition import FeedSpec

    spec = FeedSpec(name=dbs.name, source=dbs.source, sink=dbs.sink, tables=["public.t"])
    with dbs.src() as c:
        first = lease.take(c, dbs.name, 30.0, force=True)
        assert first is not None
        check_still_held(spec, first)
        assert lease.take(c, dbs.name, 30.0, force=True) == first + 1  # this runner again: a failed attempt's
        check_still_held(spec, first)
        assert lease.take(c, dbs.name, 30.0, "another runner", force=True) == first + 2
        with pytest.raises(LeaseLost, match="held by another runner"):
            check_still_held(spec, first)
