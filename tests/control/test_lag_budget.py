"""--sink-lag-budget without servers: the option, the definition's checks, and what the runner
keeps in the state folder while a sink is behind (control.lag_budget)."""
from __future__ import annotations

from pathlib import Path

import pytest

from changefeed.control.lag_budget import Behind, Lag, fell_behind
from changefeed.core.offsets import Offset
from changefeed.core.snapshot import Cursor
from changefeed.errors import ConfigError, ConnectionFailed
from changefeed.spark.checkpoint import committed_end, planned_ends
from changefeed.spec.definition import FeedSpec
from changefeed.spec.sinks import parse_sinks
from changefeed.spec.state import FeedState
from changefeed.spec.units import parse_budget
from support.feeds import planned

DR, EVENTS = "postgresql://u:p@replica/db", "kafka://broker:9092"


def spec(*sinks: str, **kw: object) -> FeedSpec:
    sink, named = parse_sinks(list(sinks))
    return FeedSpec("shop", "postgresql://u:p@src/db", sink, ("public.orders",), sinks=named, **kw)  # type: ignore[arg-type]


def _offset(lsn: int) -> Offset:
    return Offset({"n1": lsn}, lsn * 10, Cursor())


def _plan(state: FeedState, batch: int, end: Offset, committed: bool = True) -> None:
    planned(state.checkpoint, batch, end.to_json(), committed)


@pytest.mark.parametrize("text, seconds, size", [("30s", 30.0, 0), ("5m", 300.0, 0), ("90", 90.0, 0),
                                                 ("2GB", 0.0, 2 << 30), ("512MB", 0.0, 512 << 20), ("0", 0.0, 0)])
def test_a_budget_is_a_duration_or_a_size_that_ends_in_b(text: str, seconds: float, size: int) -> None:
    assert parse_budget(text) == (seconds, size)


def test_a_budget_that_is_neither_says_what_to_write() -> None:
    with pytest.raises(ConfigError, match="not a duration or a size") as e:
        parse_budget("soon")
    assert "5m" in e.value.hint and "2GB" in e.value.hint


def test_a_budget_needs_several_sinks_and_one_node() -> None:
    with pytest.raises(ConfigError, match="has one sink"):
        spec(DR, sink_lag_budget_s=60.0).validate()
    nodes = FeedSpec("shop", "", "", ("public.orders",), nodes=(("a", "postgresql://a/db"), ("b", "postgresql://b/db")),
                     sinks=(("dr", DR), ("events", EVENTS)), sink_lag_budget_s=60.0)
    with pytest.raises(ConfigError, match="several nodes"):
        nodes.validate()
    two = spec(f"dr={DR}", f"events={EVENTS}", sink_lag_budget_bytes=1 << 30).validate()
    assert two.sink_lag_budget and not spec(f"dr={DR}", f"events={EVENTS}").sink_lag_budget


def test_without_a_sink_the_others_keep_their_names_and_keys() -> None:
    bare = spec(DR, f"events={EVENTS}", "lake=delta:///lake")
    assert [(t.name, t.key) for t in bare.without_sinks({"events"}).sink_targets] == [("replica", "shop"),
                                                                                      ("lake", "shop.lake")]
    assert [(t.name, t.key) for t in bare.without_sinks({"replica"}).sink_targets] == [("events", "shop.events"),
                                                                                       ("lake", "shop.lake")]
    alone = bare.without_sinks({"replica", "lake"})
    assert not alone.several_sinks and [(t.name, t.key) for t in alone.sink_targets] == [("events", "shop.events")]


def test_the_checkpoint_says_what_was_committed_and_which_ends_were_planned(tmp_path: Path) -> None:
    state = FeedState(tmp_path, "shop")
    assert committed_end(state) is None
    for batch, lsn in enumerate((100, 200, 300)):
        _plan(state, batch, _offset(lsn))
    _plan(state, 3, _offset(400), committed=False)  # planned, and cut by a failure
    assert committed_end(state) == _offset(300)
    assert planned_ends(state, _offset(100)) == [_offset(200), _offset(300), _offset(400)]
    assert planned_ends(state, _offset(400)) == []


def test_the_state_of_sinks_behind_is_kept_and_read_back(tmp_path: Path) -> None:
    state = FeedState(tmp_path, "shop")
    state.dir.mkdir(parents=True)
    lag = Lag(state, {"events": Behind(1.0, _offset(200).to_json(), "broker down")})
    lag.save()
    back = Lag.load(state)
    assert back.sinks == lag.sinks and back.left_out() == {"events"}
    assert back.read_from(spec(f"dr={DR}", f"events={EVENTS}")) is None  # (left out: the feed's own slot)
    assert "broker down" in back.describe("events") and back.describe("dr") == "no"
    _plan(state, 0, _offset(200))
    _plan(state, 1, _offset(300))
    back.record_ends()
    _plan(state, 2, _offset(400))
    back.record_ends()
    assert back.replay() == [_offset(300), _offset(400)]  # (each end once, in order)
    back.sinks["events"].catching_up = True
    assert back.read_from(spec(f"dr={DR}", f"events={EVENTS}")) == {"n1": "cflag_shop"}
    assert back.catching_from() == _offset(200)
    back.forget({"events"})
    assert not state.behind_file.exists() and not state.replay_file.exists()


def test_without_a_budget_or_a_name_a_failure_is_waited_out(tmp_path: Path) -> None:
    state = FeedState(tmp_path, "shop")
    state.dir.mkdir(parents=True)
    _plan(state, 0, _offset(200))
    lag, said = Lag(state), []
    failed = ConnectionFailed("broker down", component="sink events")
    assert not fell_behind(failed, spec(f"dr={DR}", f"events={EVENTS}"), lag, said.append)
    budget = spec(f"dr={DR}", f"events={EVENTS}", sink_lag_budget_s=60.0)
    assert not fell_behind(ConnectionFailed("source down", component="source"), budget, lag, said.append)
    assert not fell_behind(ConnectionFailed("?", component="sink other"), budget, lag, said.append)
    lag.sinks["dr"] = Behind(1.0, _offset(200).to_json(), "replica down")  # the last sink going on
    assert not fell_behind(failed, budget, lag, said.append)
    assert not said and "events" not in lag.sinks


def test_the_sinks_ledgers_give_the_batch_ends_they_recorded_each_once(tmp_path: Path) -> None:
    from changefeed.core.change import BatchProgress
    from changefeed.sinks.ledger import FileLedger
    from changefeed.sinks.ledgers import SinkLedgers

    def record(ledger: FileLedger, batch: int, end: Offset) -> None:
        ledger.record(batch, BatchProgress(end.lsn, end.ts, None, 1, (), None, (), end.to_json()), 0.0, 1.0)

    old, new = FileLedger(tmp_path / "old.jsonl"), FileLedger(tmp_path / "new.jsonl")
    for batch, lsn in enumerate((100, 200, 300, 400)):
        record(old, batch, _offset(lsn))
    record(new, 0, _offset(300))  # (added to the feed later)
    record(new, 1, _offset(400))
    record(new, 2, _offset(500))  # (the other's file trails it by a batch)
    both = SinkLedgers([("old", old), ("new", new)])
    assert both.batch_ends(_offset(100)) == [_offset(200), _offset(300), _offset(400), _offset(500)]
    assert both.batch_ends(_offset(500)) == [] and old.batch_ends(_offset(300)) == [_offset(400)]
