"""Rows that leave a feed when its row filter changes (`changefeed alter --where`), as they travel
in the WAL: transactional logical messages with prefix `changefeed.leave`, written in the very
transaction that changes the publication's filter (postgres.filter_switch).

PostgreSQL publishes no change for a row the new filter no longer lets through: the row did not
change. Without more, every sink would keep it. So the switch writes the old rows' replica identity
(each as the COPY line a DELETE's old tuple would decode to) into messages, and the decoder turns
each into a delete of the table, in the switch's own transaction: sinks see the rows go exactly
where the filter changed, in commit order, through the path every other delete takes.

A message names the publication it is for (other feeds on the server skip it) and carries the
table's Relation as pgoutput would send it, for a decoder that has not seen the table yet. Pure.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from changefeed.postgres.decode import pgoutput as po

PREFIX = "changefeed.leave"
LINES_PER_MESSAGE = 10_000  # a message's size stays well inside what one WAL record holds


@dataclass(frozen=True)
class Leaving:
    """One message: rows of `relation` that leave the feed reading `publication`."""

    publication: str
    relation: po.Relation
    lines: tuple[bytes, ...]  # each the COPY text line of a row's old tuple (identity columns, else \\N)

    def encode(self) -> bytes:
        rel = self.relation
        return json.dumps({
            "publication": self.publication,
            "relation": {"oid": rel.oid, "schema": rel.schema, "name": rel.name, "identity": rel.replica_identity,
                         "columns": [[c.name, c.type_oid, c.typmod, c.is_key] for c in rel.columns]},
            "lines": [line.decode("utf-8") for line in self.lines]}).encode("utf-8")

    @classmethod
    def decode(cls, content: bytes) -> "Leaving":
        try:
            d = json.loads(content)
            r = d["relation"]
            relation = po.Relation(int(r["oid"]), str(r["schema"]), str(r["name"]), str(r["identity"]),
                                   tuple(po.Column(str(n), int(t), int(m), bool(k)) for n, t, m, k in r["columns"]))
            return cls(str(d["publication"]), relation, tuple(str(line).encode("utf-8") for line in d["lines"]))
        except (ValueError, KeyError, TypeError) as e:
            raise po.DecodeError(f"a {PREFIX} message that does not parse: {e}") from None


def pieces(publication: str, relation: po.Relation, lines: list[bytes]) -> list[Leaving]:
    """`lines` in messages of at most LINES_PER_MESSAGE rows."""
    return [Leaving(publication, relation, tuple(lines[i:i + LINES_PER_MESSAGE]))
            for i in range(0, len(lines), LINES_PER_MESSAGE)]
