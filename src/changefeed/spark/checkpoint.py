"""What Spark's checkpoint says about the feed: the last batch it planned (its offset log) and
whether it was committed downstream (its commit log), read as files by the driver. Spark writes
these; changefeed reads them (to tell whether snapshot chunks are still to be read), and at a
start compares them with the sink's ledger (`resume`): a checkpoint missing or behind the sink is
replaced by a new query that starts where the sink's last batch ended.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from changefeed.core import snapshot
from changefeed.core.offsets import Offset
from changefeed.core.requests import Requests
from changefeed.errors import CheckpointLost
from changefeed.sinks.ledger import Ledger
from changefeed.spec.definition import FeedSpec
from changefeed.spec.state import FeedState


def logged_end(state: FeedState) -> tuple[Offset | None, bool]:
    """(The end offset of the last batch in the checkpoint's offset log, None before the first;
    whether Spark logged that batch as committed downstream too)."""
    logged = _batches(state.checkpoint)
    if not logged:
        return None, False
    last = logged[-1]
    return _end_of(state, last), (state.checkpoint / "commits" / str(last)).exists()


def committed_end(state: FeedState) -> Offset | None:
    """The end of the last batch Spark logged as committed downstream (every sink of its query had
    it then); None before the first."""
    done = [n for n in _batches(state.checkpoint) if (state.checkpoint / "commits" / str(n)).exists()]
    return _end_of(state, done[-1]) if done else None


def planned_ends(state: FeedState, after: Offset) -> list[Offset]:
    """The ends of the batches in the checkpoint's offset log past `after`, in order: the bounds a
    sink that lacks them is given them by (control.lag_budget), so that each batch it gets is one
    the other sinks recorded, with the same timestamps."""
    ends = (_end_of(state, n) for n in _batches(state.checkpoint))
    return [e for e in ends if e is not None and e.order > after.order]


START_FILE = "changefeed-start.json"  # in the checkpoint folder: moved aside or deleted with it


def recorded_start(checkpoint: Path) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """The start of a query's first batch and where that batch ends (or None), as `record_start`
    kept them in its checkpoint; None while no batch is in its offset log (the first one is then
    planned anew, from where the runner says).

    Spark logs each batch's end, never the first batch's start: run again before that batch was
    logged as committed, it asks the source's initialOffset anew. A query started from a sink's
    ledger (spark.checkpoint.resume) or behind the others (control.lag_budget) must then start
    where it did, not at its slot with no timestamp and its snapshot ahead: the batch's commit
    timestamps count from its start's, and a table without a key waits for a snapshot to come."""
    if not _batches(checkpoint):
        return None
    try:
        found = json.loads((checkpoint / START_FILE).read_text())
    except FileNotFoundError:
        return None
    return found["start"], found.get("until")


def record_start(checkpoint: Path, start: dict[str, Any], until: dict[str, Any] | None) -> None:
    checkpoint.mkdir(parents=True, exist_ok=True)
    tmp = checkpoint / f".{START_FILE}.tmp"
    tmp.write_text(json.dumps({"start": start, "until": until}))
    tmp.replace(checkpoint / START_FILE)


def replay_ends(path: Path) -> list[Offset]:
    """The batch ends in a replay file (control.lag_budget, read by spark.source), none if it is gone."""
    try:
        return [Offset.from_json(o) for o in json.loads(path.read_text())]
    except FileNotFoundError:
        return []


def _batches(checkpoint: Path) -> list[int]:
    """The batch numbers in `checkpoint`'s offset log, in order."""
    return sorted(int(p.name) for p in (checkpoint / "offsets").glob("*") if p.name.isdigit())


def _end_of(state: FeedState, batch: int) -> Offset | None:
    lines = (state.checkpoint / "offsets" / str(batch)).read_text().splitlines()
    return Offset.from_json(lines[-1]) if len(lines) > 2 else None


def chunks_to_read(spec: FeedSpec, state: FeedState, requests: Requests) -> bool:
    """Whether the last batch Spark planned carries snapshot chunks and may still run (it is not
    logged as committed), or chunks are pending after it, or requested (`requests`, the feed's);
    a fresh checkpoint has its initial snapshot ahead."""
    end, committed = logged_end(state)
    tables = () if spec.snapshot == "never" else spec.tables
    cursor = end.cursor if end else snapshot.Cursor(pending=snapshot.entries(tables, [n.name for n in spec.sources]))
    running_chunks = end is not None and bool(end.chunks) and not committed
    return running_chunks or bool(cursor.pending or requests.after(cursor.requests))


def resyncing(state: FeedState, requests: Requests) -> tuple[str, ...]:
    """Tables of snapshot requests the feed has not taken in yet: until then a replica table
    follows any schema change, as its rows are read again next (see core.schema_change)."""
    end, _ = logged_end(state)
    taken = end.cursor.requests if end else 0
    return tuple(sorted({t for r in requests.after(taken) for t in r.tables}))


def _judged_unrecorded(state: FeedState, ledger: Ledger, recorded: dict[str, Any] | None, end: Offset | None,
                       committed: bool) -> bool:
    """Whether the checkpoint's last batch is in flight, reads snapshot chunks in an export that its
    offset records (core.judge), and no sink recorded it (nor, without a sink's offset, any batch)."""
    if end is None or committed or not end.exports:
        return False
    offsets = _each_offset(ledger)
    furthest = offsets[-1][1] if offsets else Offset.from_json(recorded) if recorded is not None else None
    if furthest is None:
        return ledger.checkpoint() is None and committed_end(state) is None
    return furthest.order < end.order


def _each_offset(ledger: Ledger) -> list[tuple[str, Offset]]:
    """Each sink's position, least far first, for a feed of several sinks (sinks.ledgers); none else."""
    from changefeed.sinks.ledgers import SinkLedgers  # (the sinks' package: not in the planner's imports)

    return ledger.offsets() if isinstance(ledger, SinkLedgers) else []  # (each sink's ledger asked once)


def _drop_last_batch(state: FeedState) -> None:
    """Take the last batch (in flight, not the first) out of the checkpoint's offset log: Spark
    then plans it anew from the end of the one before, under the same query and batch id. Its
    checksum goes first: a crash between the two leaves the batch without one, which Spark reads."""
    last = str(_batches(state.checkpoint)[-1])
    (state.checkpoint / "offsets" / f".{last}.crc").unlink(missing_ok=True)
    (state.checkpoint / "offsets" / last).unlink()


def _move_aside(state: FeedState) -> Path:
    """Move the checkpoint to `checkpoint.replaced` (the one before it dropped)."""
    aside = state.checkpoint.with_name("checkpoint.replaced")
    shutil.rmtree(aside, ignore_errors=True)
    state.checkpoint.rename(aside)
    return aside


def resume_until(state: FeedState, ledger: Ledger, report: Callable[[str], None]) -> Offset | None:
    """Where the first batch of a query that starts from the sinks' ledgers (`resume`) ends: the
    furthest sink's position, when a feed's several sinks disagree (sinks.ledgers), else None."""
    offsets = _each_offset(ledger)
    if len(offsets) < 2 or offsets[-1][1].order <= offsets[0][1].order:
        return None
    end = offsets[-1][1]
    behind = [name for name, offset in offsets if offset.order < end.order]
    report(f"feed {state.dir.name}: sink{'s' if len(behind) > 1 else ''} {', '.join(behind)} lack the last batch "
           "the others recorded: the first batch is planned up to exactly its end, and only they take it")
    return end


def resume(state: FeedState, ledger: Ledger, report: Callable[[str], None], *, in_parts: bool = False
           ) -> Offset | None:
    """Where a new query of the feed starts when this state folder's Spark checkpoint is missing
    (a new host, a standby, a deleted or damaged folder) or older than the sink (another runner
    of the feed moved it on since): the end offset of the last batch the sink recorded, None when
    the checkpoint is current (Spark carries on from it) or the sink has no batch yet (a new feed
    starts from its slot and its snapshot).

    `in_parts`: the sink shows a batch in parts before it records it (webhook requests). A batch
    the checkpoint planned and did not finish is then planned anew from the sink, not replayed as
    planned: a runner that took the feed over meanwhile may have sent more of it than this plan
    holds (its plan was made later, over more WAL), and a smaller replay would cut that part into
    other requests, under other idempotency keys. Planned anew, the batch holds at least as much.

    A batch in flight whose snapshot reads are judged (core.judge) and that no sink recorded is
    planned anew too: replayed as planned, its reads would each take a snapshot of their own (the
    planner's export is gone with its process), later than the one its plan recorded, and a change
    only the new read saw would reach the sinks twice; planned anew, it is read in a fresh export
    that its offset records. It is taken out of the offset log (Spark plans it again from the batch
    before, same query, same batch id); a query's first batch is planned anew by a new query from
    where the sinks stand (the checkpoint moved aside). A batch a sink recorded is replayed as
    planned: that sink holds the rows of the earlier read, and the recorded snapshot, earlier
    still, drops nothing they lack.

    A stale checkpoint is moved aside to `checkpoint.replaced` (a copy for inspection; the one
    before it is dropped). A sink that does not record its batches' offsets with the batch itself
    cannot say where the feed stands: CheckpointLost, nothing changed."""
    recorded = ledger.resume_offset()
    end, committed = logged_end(state)
    reread = not in_parts and _judged_unrecorded(state, ledger, recorded, end, committed)
    if reread and _batches(state.checkpoint)[-1] > 0:
        _drop_last_batch(state)
        report(f"feed {state.dir.name}: the checkpoint's last batch was in flight with snapshot reads no sink "
               "recorded; it is planned anew")
        return None
    if reread and recorded is None:
        aside = _move_aside(state)
        report(f"feed {state.dir.name}: the checkpoint's first batch was in flight with snapshot reads no sink "
               f"recorded; it is planned anew (the checkpoint moved aside to {aside})")
        return None
    if recorded is None:
        delivered = ledger.checkpoint()
        if delivered is not None and (end is None or any(lsn > end.lsns.get(node, 0) for node, lsn in
                                                         delivered.items())):
            where = "has no checkpoint" if end is None else "has a checkpoint older than the sink's last batch"
            raise CheckpointLost(
                f"the feed's state folder {state.dir} {where}, and its sink does not record where each batch "
                "ended: starting over would deliver changes again, or skip some",
                "restore the state folder from the runner that ran the feed last (or point --state at it); "
                "to start the feed over, changefeed remove --name NAME and create it again")
        return None
    offset = Offset.from_json(recorded)
    in_flight = (in_parts or reread) and end is not None and not committed and offset.order < end.order
    if end is not None and offset.order <= end.order and not in_flight:
        return None
    if end is not None:
        aside = _move_aside(state)
        # (a batch that follows the slot, low-latency mode, is logged with where it starts, and its
        # sink records its sub-windows as it goes: a sink ahead within that batch is its own work)
        own = end.follow > 0 and offset.follow == end.follow
        why = ("its last batch was in flight with snapshot reads no sink recorded" if in_flight and reread
               else "its last batch was in flight (parts of it may have been sent by another runner since)" if in_flight
               else "its last batch followed the slot, and the sink recorded more of it than Spark logged" if own
               else "older than the sink (another runner moved the feed on)")
        report(f"feed {state.dir.name}: the checkpoint in {state.checkpoint}: {why}; moved aside to {aside}, "
               "resuming from the sink's last batch")
    else:
        report(f"feed {state.dir.name}: no checkpoint in {state.checkpoint}; resuming from the sink's last batch")
    return offset
