"""A standby runner (`run --standby`): it waits, with Spark started, until the feed's active runner
is gone, then runs the feed in a new lease term.

The active runner is gone when its sessions on the first source node are (the feed's session
lock there is free: a process killed, a host whose connections the server closed), or when its
lease ended unrenewed (a runner frozen or cut off from the source, whose sessions the server
still keeps): then the standby ends those sessions itself (`pg_terminate_backend`, which needs
the feed's user to be the same role or a member of `pg_signal_backend`) and the sinks' fences
keep the old runner from landing anything should it wake up. Several standbys may wait: the
first to take the session lock runs the feed, the others go on waiting.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg

from changefeed.errors import ConfigError
from changefeed.postgres import feed_record, lease
from changefeed.postgres import source as src
from changefeed.postgres.connect import connect, lost_connection
from changefeed.sinks.registry import sinks_of
from changefeed.spec.definition import FeedSpec

POLL_S = 0.2  # how often a standby looks at the lease: the takeover's share of its time
RELEASE_GRACE_S = 10.0  # how long a runner that released its lease (a clean stop) may take to close its sessions


def stored_definition(source: str, name: str) -> FeedSpec:
    """The definition of feed `name` as its runners stored it on `source` (a standby with no state
    folder of the feed); ConfigError if there is none."""
    with connect(source, "source") as conn, lost_connection("source"):
        stored = feed_record.load(conn, name)
    if stored is None:
        raise ConfigError(f"no feed named {name} on this source: a standby runs a feed some runner has run",
                          "check --name and --source, or start the feed first with changefeed run --name NAME "
                          "--source ... --sink ... --tables ...")
    spec = FeedSpec.from_json(stored.definition, f"the definition stored on the source by {stored.stored_by}")
    check_standby(spec)
    return spec


def check_standby(spec: FeedSpec) -> None:
    """ConfigError unless a runner of the feed can take it over without its checkpoint."""
    for target, one, sink in sinks_of(spec):
        if sink.resumable(one.sink):
            continue
        which = f"a {sink.name} sink" if target.bare else f"its sink {target.name} ({sink.name})"
        raise ConfigError(f"feed {spec.name} writes to {which}: a standby cannot take it over yet (its "
                          "position is kept with the runner's checkpoint, not in the sink)",
                          "run the feed without --standby; standbys take over feeds into a replica, Delta Lake, "
                          "a webhook, or Kafka with delivery=exactly_once (the default)")


def await_turn(spec: FeedSpec, stop: threading.Event, report: Callable[[str], None]) -> bool:
    """Wait until the feed's active runner is gone (see the module doc): True, or False when
    stopped meanwhile. Meanwhile this runner is listed as a standby."""
    me, told = lease.me(), ""
    with connect(spec.sources[0].uri, "source", autocommit=True) as conn, lost_connection("source"):
        conn.execute("SELECT set_config('application_name', %s, false)", (f"changefeed-standby:{spec.name}"[:63],))
        try:
            while not stop.is_set():
                feed_record.standing_by(conn, spec.name, me)
                held = lease.current(conn, spec.name)
                paused = feed_record.paused_by(conn, spec.name)
                if paused is not None:  # (its active runner stopped, or stops at its next report)
                    if told != "paused":
                        report(f"feed {spec.name}: standing by; the feed is paused (by {paused}) until changefeed "
                               "resume")
                        told = "paused"
                    stop.wait(POLL_S)
                    continue
                if src.feed_lock_free(conn, spec.name):
                    return True
                if held is not None and held.free and (not held.released or -held.remaining_s > RELEASE_GRACE_S):
                    _end_sessions(conn, spec)  # (a released lease: its runner is closing its sessions itself)
                    return True
                active = f"{held.holder} (term {held.epoch})" if held else "a runner of an older changefeed"
                if active != told:
                    report(f"feed {spec.name}: standing by; active: {active}")
                    told = active
                stop.wait(POLL_S)
            return False
        finally:
            if not conn.closed:
                feed_record.left(conn, spec.name, me)


def _end_sessions(conn: psycopg.Connection[Any], spec: FeedSpec) -> None:
    """End the sessions of a runner whose lease ended (it holds the feed's lock and reads the slots
    on every node): the servers would keep them until their TCP connections time out."""
    try:
        for i, node in enumerate(spec.sources):
            if i == 0:
                src.end_feed_sessions(conn, spec.name, [node.slot, node.prepare_slot])
                continue
            with connect(node.uri, spec.role(node.name), autocommit=True) as other:
                src.end_feed_sessions(other, spec.name, [node.slot, node.prepare_slot])
    except psycopg.errors.InsufficientPrivilege:
        raise ConfigError(f"feed {spec.name}: the active runner's lease ended, but its sessions on the source "
                          "cannot be ended by this user", "GRANT pg_signal_backend TO the feed's source user "
                          "(or use the same user as the other runner)") from None

