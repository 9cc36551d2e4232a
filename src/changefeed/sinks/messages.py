"""Change rows as messages: what every message sink (webhook, later Kafka) delivers.

A batch's change rows arrive as Arrow record batches in stream order, with their control rows:
`R` rows describe a table for the rows after them, `P` rows carry the batch's progress. Each data
row becomes the `Record`s of the chosen envelope (core.envelope), in the same order, so per-key
order is the source's commit order. Pure: no I/O.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..core import change as ch
from ..core.envelope import Change, Formatter, Record
from ..errors import SinkError


class MessageStream:
    """Feed a batch's record batches in order; take the messages, then the batch's progress."""

    def __init__(self, formatter: Formatter) -> None:
        self.formatter = formatter
        self._shapes: dict[tuple[str, str], ch.TableShape] = {}
        self._progress: list[ch.Progress] = []

    def messages(self, rb: Any) -> Iterator[Record]:
        for row in rb.to_pylist():
            op = row["op"]
            if op == ch.RELATION:
                self._shapes[(row["schema"], row["table"])] = ch.TableShape.from_meta(
                    row["schema"], row["table"], row["meta"])
            elif op == ch.PROGRESS:
                self._progress.append(ch.Progress.from_meta(row["meta"]))
            elif op in ch.DATA_OPS:
                shape = None
                if op != "m":
                    shape = self._shapes.get((row["schema"], row["table"]))
                    if shape is None:
                        raise SinkError(f"change for {row['schema']}.{row['table']} before its description (R row)",
                                        "this is a bug in the change stream; report it")
                yield from self.formatter.records(Change.from_row(row, shape))

    def progress(self) -> ch.BatchProgress:
        if not self._progress:
            raise SinkError("the batch carries no progress row", "this is a bug in the change stream; report it")
        return ch.BatchProgress.of(self._progress)
