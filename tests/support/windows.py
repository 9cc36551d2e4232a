"""A followed batch's windows read from a slot, and change rows as two reads must agree on."""
from __future__ import annotations

import threading
import time
from typing import Any

import psycopg

from support.servers import Dbs


def decoded(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Change rows of a window as two reads of it must agree on: pgoutput sends a table's
    Relation message again, unchanged, after a relcache invalidation that reaches the decoding
    backend while it decodes (autovacuum's ANALYZE of the table, at any moment), so a second
    read may hold one more `R` row, which also takes a `seq` number in its transaction. Such
    repeats are dropped and `seq` left out; any changed shape stays."""
    out, shapes = [], {}
    for row in rows:
        if row["op"] == "R":
            table = (row["schema"], row["table"])
            if shapes.get(table) == row["meta"]:
                continue
            shapes[table] = row["meta"]
        out.append({k: v for k, v in row.items() if k != "seq"})
    return out


def followed_batches(dbs: Dbs, every: float, seconds: float = 3.0) -> tuple[list[Any], int]:
    """(A followed batch's record batches, postgres.follow, while a writer commits upserts and
    deletes to table t of publication p; the start of slot s, made at the first call)."""
    from changefeed.core.offsets import Offset
    from changefeed.postgres import slots
    from changefeed.postgres.connect import connect
    from changefeed.postgres.follow import Follower
    from changefeed.spec.definition import SourceNode

    with dbs.src() as c:
        c.execute("CREATE TABLE IF NOT EXISTS t (id bigint PRIMARY KEY, v text)")
        if c.execute("SELECT count(*) FROM pg_publication WHERE pubname = 'p'").fetchone() == (0,):
            c.execute("CREATE PUBLICATION p FOR TABLE t")
            slots.create_slot(c, "s")
        start = slots.slot_state(c, "s").confirmed_flush  # type: ignore[union-attr]
    stop = threading.Event()

    def write() -> None:
        with psycopg.connect(dbs.source, autocommit=True) as c:
            i = 0
            while not stop.is_set():
                i += 1
                c.execute("INSERT INTO t VALUES (%s, 'v') ON CONFLICT (id) DO UPDATE SET v = t.v || 'u'", (i % 300,))
                if i % 7 == 0:
                    c.execute("DELETE FROM t WHERE id = %s", ((i * 13) % 300,))
                time.sleep(0.002)

    writer = threading.Thread(target=write)
    writer.start()
    threading.Timer(seconds - 1.0, stop.set).start()  # (the follower then cuts the last commits too)
    try:
        with connect(dbs.source, "source") as conn:
            node = SourceNode("n1", dbs.source, "s", "p")
            follower = Follower(conn, node, "source", start, 0, every=every, rows_per_batch=200,
                                offset_at=lambda lsn, ts: Offset({"n1": lsn}, ts, follow=1).to_json())
            batches = list(follower.windows(until=time.monotonic() + seconds))
    finally:
        stop.set()
        writer.join()
    return batches, start


def sub_window_ends(batches: list[Any]) -> list[int]:
    """The end LSNs the `P` rows of `batches` name, in order."""
    import pyarrow.compute as pc

    from changefeed.core import change as ch

    return [ch.Progress.from_meta(m).end_lsn for rb in batches
            for m in rb.filter(pc.equal(rb.column("op"), ch.PROGRESS)).column("meta").to_pylist()]
