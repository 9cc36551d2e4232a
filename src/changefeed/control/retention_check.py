"""The runner's checks of its slots against the retention budget (control.retention): at every
report while the feed runs, and while a fault lasts, from whatever nodes answer."""
from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import suppress

from changefeed.control import retention
from changefeed.control.attach import Prepared, about, lost_connections
from changefeed.control.retry import Retrying
from changefeed.core.hlc import physical_ms
from changefeed.errors import ChangefeedError, DefiniteError
from changefeed.postgres import slots
from changefeed.postgres import source as src
from changefeed.postgres.connect import connect, lost_connection
from changefeed.spec.definition import FeedSpec
from changefeed.spec.state import FeedState


def check(prepared: Prepared, report: Callable[[str], None]) -> None:
    """Stop (typed error, recorded) when PostgreSQL invalidated a node's slot or past the
    retention budget on a node; warn near the budget. A connection lost meanwhile is
    ConnectionFailed."""
    spec = prepared.spec
    try:
        with lost_connections(prepared):
            checkpoint = prepared.ledger.checkpoint() or {}
            resolved = prepared.ledger.last_resolved_ts()
        for node in spec.sources:
            conn = prepared.sources[node.name]
            with about(spec, node):
                slot = slots.slot_state(conn, node.slot)
                slots.check_slot_usable(slot, node.slot, checkpoint.get(node.name), spec.name)
                if spec.multi_node:
                    slots.check_slot_usable(slots.slot_state(conn, node.prepare_slot), node.prepare_slot, None,
                                            spec.name)
                assert slot is not None
                if slot.restart_lsn is None:
                    continue
                current, now_ms = src.flush_lsn(conn)
            held = retention.Holding(node.slot, slot.restart_lsn, max(0, current - slot.restart_lsn),
                                     None if resolved is None else max(0.0, (now_ms - physical_ms(resolved)) / 1000),
                                     node.name if spec.multi_node else "")
            warning = retention.check(held, spec.name, spec.retention_s, spec.max_retained_wal)
            if warning:
                report(warning)
    except DefiniteError as e:
        prepared.state.record_failure(e)
        raise


def meanwhile(spec: FeedSpec, state: FeedState, fault: Retrying) -> None:
    """The retention budget while a fault lasts: nothing was delivered since it began, so the
    checkpoint is at least that old; the WAL each node's slot holds is asked of the nodes that
    answer. Past a budget the run ends (RetentionExceeded, recorded)."""
    try:
        for node in spec.sources:
            retained, restart = 0, 0
            if spec.max_retained_wal:
                with suppress(ChangefeedError), connect(node.uri, "source") as conn, lost_connection("source"):
                    slot = slots.slot_state(conn, node.slot)
                    if slot is not None and slot.restart_lsn is not None:
                        restart, retained = slot.restart_lsn, max(0, src.flush_lsn(conn)[0] - slot.restart_lsn)
            retention.check(retention.Holding(node.slot, restart, retained, time.time() - fault.since,
                                              node.name if spec.multi_node else ""),
                            spec.name, spec.retention_s, spec.max_retained_wal)
    except ChangefeedError as e:
        state.record_failure(e)
        raise
