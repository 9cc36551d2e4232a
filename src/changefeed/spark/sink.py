"""`changefeed-postgres` PySpark streaming sink: executors stage, the driver applies atomically."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter, WriterCommitMessage

from ..postgres.connect import connect
from ..sinks import postgres_replica as replica


class StagedMessage(WriterCommitMessage):
    def __init__(self, staged: replica.Staged) -> None:
        self.staged = staged


class PostgresReplicaSink(DataSource):
    """Options: uri, feed."""

    @classmethod
    def name(cls) -> str:
        return "changefeed-postgres"

    def streamWriter(self, schema: Any, overwrite: bool) -> "ReplicaStreamWriter":
        return ReplicaStreamWriter(dict(self.options))


class ReplicaStreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, options: dict[str, str]) -> None:
        self.uri = options["uri"]
        self.feed = options["feed"]

    def write(self, iterator: Iterator[Any]) -> StagedMessage:
        with connect(self.uri, "sink", autocommit=True) as conn:
            return StagedMessage(replica.stage(conn, self.feed, iterator))

    def commit(self, messages: list[StagedMessage | None], batchId: int) -> None:
        with connect(self.uri, "sink", autocommit=True) as conn:
            replica.apply_batch(conn, self.feed, batchId, [m.staged for m in messages if m is not None])

    def abort(self, messages: list[StagedMessage | None], batchId: int) -> None:
        with connect(self.uri, "sink", autocommit=True) as conn:
            replica.drop_staging(conn, [p for m in messages if m is not None for p in m.staged.parts])
