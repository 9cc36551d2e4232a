"""The Kafka sink's ledger: what the CLI reads (status, metrics, retention) is the feed's
`delivered.jsonl`, appended by the Spark driver after each batch committed, as for webhooks
(sinks.ledger.FileLedger). The progress topic is the truth the sink skips replayed batches by
(the file may trail it by the last batch before a crash, until that batch's replay records it),
and, exactly once, where a runner without the feed's checkpoint resumes and how runners of later
lease terms claim the sink (sinks.kafka.batch).
"""
from __future__ import annotations

from typing import Any

from changefeed.errors import SinkError
from changefeed.sinks.kafka.admin import check_cluster, check_transactions, create_topics
from changefeed.sinks.kafka.batch import claim, committed_progress
from changefeed.sinks.kafka.options import KafkaOptions
from changefeed.sinks.ledger import FileLedger


class KafkaLedger(FileLedger):
    """The file ledger, plus checking the cluster and creating the topics when the feed starts."""

    def __init__(self, path: str, opts: KafkaOptions, feed: str, *, outbox: str = "") -> None:
        super().__init__(path)
        self.opts, self.feed, self.outbox = opts, feed, outbox  # the outbox's events go to topics made on demand
        self._existing: set[str] | None = None
        self._notes: list[str] = []

    def check(self) -> None:
        self.opts.check_client(self.feed)
        self._existing = check_cluster(self.opts)
        if self.opts.delivery == "exactly_once":
            check_transactions(self.opts, self.feed)

    def prepare(self, tables: list[Any]) -> None:
        existing = self._existing if self._existing is not None else check_cluster(self.opts)
        topics = [self.opts.topic(t.schema, t.name) for t in tables if t.qualified != self.outbox]
        exactly_once = self.opts.delivery == "exactly_once"
        progress = [self.opts.progress_topic] if exactly_once else []
        if self.opts.create_topics:
            create_topics(self.opts, topics)
            create_topics(self.opts, progress, progress=True)
        else:
            missing = [t for t in topics + progress if t not in existing]
            if missing:
                raise SinkError(f"Kafka {self.opts.bootstrap} has no topic {', '.join(missing)} and "
                                "create_topics=false", "create them (the progress topic with one partition, "
                                "cleanup.policy=compact), or drop create_topics=false from the --sink URI")
        if exactly_once:  # the progress topic exists: decide how to read it (probed once per process)
            from changefeed.sinks.kafka.probe import resolve, verdict

            resolve(self.opts, self.feed)
            self._notes = [verdict(self.opts, self.feed).line()]

    def notes(self) -> list[str]:
        return list(self._notes)

    def resume_offset(self) -> dict[str, Any] | None:
        """Exactly once: the end offset in the feed's last committed progress record, which commits
        with its batch's messages (None if that record has none: written by an older changefeed)."""
        if self.opts.delivery != "exactly_once":
            return None
        last = committed_progress(self.opts, self.feed)
        return None if last is None else last.progress.offset

    def fence(self, epoch: int, holder: str) -> bool:
        """Exactly once: claim the sink for the term (sinks.kafka.batch.claim); at least once there
        is no transaction to fence with."""
        if self.opts.delivery != "exactly_once":
            return False
        claim(self.opts, self.feed, epoch)
        return True
