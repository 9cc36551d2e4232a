"""The partitions of the partitioned tables a feed captures, watched while it runs.

A partitioned table is published by its root (postgres.source.ensure_publication), so changes to
any partition, also one created later, arrive as the root's. Two changes of the partition set
move rows without a DELETE or INSERT in the WAL: ATTACH PARTITION brings a table's rows into the
root, DETACH PARTITION (or DROP of a partition) takes them out. The runner looks at each node's
partitions at its reports: a new partition holding rows gets a snapshot request of its root (the
rows arrive as a re-snapshot of the table, consistent with the stream); a partition gone stops
the feed with UnfollowableChange, since the sinks still hold its rows and no change says so. The
partition sets last seen are kept in the state folder, so a run notices what changed while the
feed was stopped; a runner without it (a new host) starts from what it first sees.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from psycopg import sql

from changefeed.control.attach import Prepared
from changefeed.errors import UnfollowableChange
from changefeed.postgres.source import describe_tables, partitioned, split_table

Leaves = dict[str, dict[str, list[str]]]  # node -> partitioned table -> its leaf partitions, schema.name

_LEAVES = """
SELECT n.nspname || '.' || c.relname FROM pg_partition_tree(
    (SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s)
) t JOIN pg_class c ON c.oid = t.relid JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE t.isleaf ORDER BY 1
"""


class PartitionWatch:
    """`look()` at each report; cheap when the feed captures no partitioned table."""

    def __init__(self, prepared: Prepared) -> None:
        self.prepared = prepared
        self.file = prepared.state.dir / "partitions.json"
        self.roots = {node: partitioned(conn, list(prepared.spec.tables)) for node, conn in prepared.sources.items()}

    def look(self, report: Callable[[str], None]) -> None:
        if not any(self.roots.values()):
            return
        now = self._leaves()
        known: Leaves = json.loads(self.file.read_text()) if self.file.exists() else now
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(now))
        tmp.replace(self.file)  # (saved first: a stop below is said once, the next run goes on)
        gone, joined = [], set()
        for node, roots in now.items():
            for root, leaves in roots.items():
                before = known.get(node, {}).get(root)
                if before is None:  # newly captured: its snapshot reads every partition
                    continue
                gone += [(node, root, leaf) for leaf in before if leaf not in leaves]
                if any(self._has_rows(node, leaf) for leaf in leaves if leaf not in before):
                    joined.add(root)
        keyless = sorted(r for r in joined if not self._keyed(r))
        if keyless:
            raise UnfollowableChange(
                f"a partition holding rows joined {', '.join(keyless)}, a table without a key: its rows arrived "
                "without INSERTs in the WAL, and reading the table again would repeat the rows the sinks hold",
                "send the partition's rows to the sinks yourself, or capture the table in a new feed; the feed "
                "has taken note of the partitions it has now and goes on when run again")
        if joined:
            self.prepared.requests.add(sorted(joined))
            report(f"feed {self.prepared.spec.name}: a partition holding rows joined {', '.join(sorted(joined))}; "
                   "a snapshot of it is requested (its rows arrive as that table's)")
        if gone:
            named = ", ".join(f"{leaf} (of {root}{'' if len(now) == 1 else ' on node ' + node})"
                              for node, root, leaf in gone)
            raise UnfollowableChange(
                f"partition {named} left the captured table on the source (DETACH or DROP): its rows left "
                "without DELETEs in the WAL, so the sinks still hold them",
                "delete them on the sinks (a replica: changefeed verify --name "
                f"{self.prepared.spec.name} --tables {', '.join(sorted({r for _, r, _ in gone}))} --repair), "
                "then run the feed again: it has taken note of the partitions it has now")

    def _keyed(self, root: str) -> bool:
        conn = next(iter(self.prepared.sources.values()))
        return bool(describe_tables(conn, [root], self.prepared.spec.column_lists)[0].key)

    def _leaves(self) -> Leaves:
        return {node: {root: [r[0] for r in self.prepared.sources[node].execute(_LEAVES, split_table(root))]
                       for root in roots}
                for node, roots in self.roots.items()}

    def _has_rows(self, node: str, leaf: str) -> bool:
        conn: Any = self.prepared.sources[node]
        return bool(conn.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM ONLY {})").format(
            sql.Identifier(*split_table(leaf)))).fetchone()[0])
