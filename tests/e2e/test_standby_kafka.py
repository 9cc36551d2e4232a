"""A standby takes over a feed into Kafka (exactly once): the active runner SIGKILLed five times, a
standby with its own state folder takes over each time from the progress topic, and a
read_committed reader gets every change once; a runner of an earlier term is refused."""
from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from changefeed.core.change import BatchProgress
from changefeed.errors import LeaseLost
from changefeed.local.kafka import LocalKafka, committed, read_partition
from changefeed.sinks.kafka.batch import KafkaBatch, claim, committed_progress
from changefeed.sinks.kafka.options import KafkaOptions
from support.feeds import assert_no_traceback, changefeed_cli, kill_running, start_changefeed, wait_for
from support.kafka import kafka_sink
from support.servers import Dbs
from support.standby import kill_turns, standby_starter, stop_both, turn_env
from support.writers import money_tables, moving_money, writing

pytestmark = pytest.mark.timeout(900)
ACCOUNTS = 20
# the active runner ends five times: at random, and between the Kafka transaction's commit and the slot's advance
KILLS = ["random", "after_sink_commit:6", "random", "before_sink_commit:6", "random"]



def _ids(kafka: LocalKafka, topic: str) -> list[int]:
    """The ledger ids a read_committed reader gets from `topic` (one partition), in order."""
    return [json.loads(r.key)[0] for r in committed(read_partition(kafka.bootstrap, topic, 0, timeout=60))
            if r.key is not None and r.value is not None]



def test_a_standby_takes_over_a_kafka_feed_exactly_once(dbs: Dbs, tmp_path: Path, kafka: LocalKafka,
                                                      spark_server: str) -> None:
    money_tables(dbs, ACCOUNTS)
    sink, prefix, progress_topic = kafka_sink(kafka.bootstrap, 1)
    topic = f"{prefix}public.ledger"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    states = [tmp_path / "a", tmp_path / "b"]
    faults = tmp_path / "faults"
    written = [0]
    runners: list[subprocess.Popen[bytes]] = []
    first = changefeed_cli("run", "--name", dbs.name, "--state", str(states[0]), "--source", dbs.source, "--sink",
                           sink, "--tables", "public.ledger,public.accounts", "--available-now", "--master",
                           spark_server)  # the snapshot, before changes race it (messages of both would arrive)
    assert first.returncode == 0, first.stderr[-3000:]
    try:
        with writing(moving_money(ACCOUNTS), dbs.source, written):
            runners.append(start_changefeed("run", "--name", dbs.name, "--state", str(states[0]), log=logs[0],
                                            env=turn_env(KILLS, 0, faults)))
            wait_for("changes in Kafka", lambda: "changes in" in logs[0].read_text(), logs[0])

            standby = standby_starter(dbs.name, dbs.source, states, logs)
            runners.append(standby(1, turn_env(KILLS, 1, faults)))
            active = kill_turns(KILLS, runners, logs, faults, standby, lambda: max(_ids(kafka, topic), default=0),
                                written)
        wait_for("every row in Kafka", lambda: max(_ids(kafka, topic), default=0) >= written[0], logs[active])
        stop_both(runners, logs, active)
    finally:
        kill_running(runners)
    ids = sorted(_ids(kafka, topic))  # (snapshot rows arrive after the window they were read in)
    progress = [json.loads(r.value or b"") for r in committed(read_partition(kafka.bootstrap, progress_topic, 0))]
    trail = [(p["query"][:8], p["batch"], p.get("epoch"), p.get("claimed"), p["progress"]["end_lsn"]) for p in progress]
    assert ids == list(range(1, written[0] + 1)), \
        f"{len(ids)} ids for {written[0]} rows, {len(set(ids))} distinct; progress records: {trail}"
    for log in logs:
        assert_no_traceback(log.read_text())

    # The progress record carries the term of the runner that wrote it; a batch of an earlier term is refused.
    opts = KafkaOptions.parse(sink)
    last = committed_progress(opts, dbs.name)
    assert last is not None and last.epoch >= 7 and last.progress.offset is not None
    with pytest.raises(LeaseLost, match="was taken over"):
        KafkaBatch(opts, dbs.name, "an old query", 10_000, epoch=last.epoch - 1).open()
    claim(opts, dbs.name, last.epoch + 1)  # a claim re-states the last batch under the new term
    claimed = committed_progress(opts, dbs.name)
    assert claimed is not None and claimed.epoch == last.epoch + 1 and claimed.batch == last.batch
    assert claimed.progress == BatchProgress.from_json(last.progress.__dict__)

    # A feed with no batch yet is claimed too, again and again; an earlier term's claim changes nothing.
    fresh = f"fresh{uuid.uuid4().hex[:6]}"
    claim(opts, fresh, 1)
    claim(opts, fresh, 2)
    claim(opts, fresh, 1)
    got = committed_progress(opts, fresh)
    assert got is not None and (got.epoch, got.batch, got.progress.offset) == (2, -1, None)
