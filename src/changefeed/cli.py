"""Command line: `changefeed run | create | list | pause | resume | remove | alter | snapshot | verify | status | demo`
(also `python -m changefeed`)."""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from changefeed.core.envelope import FORMATS
from changefeed.core.snapshot import MAX_AUTO_CHUNKS, PACED_BATCH_S, PARALLEL_CHUNKS
from changefeed.errors import UNEXPECTED_EXIT, ChangefeedError, ConfigError, unexpected
from changefeed.sinks.registry import sink_named, validated
from changefeed.spark.connect import DEFAULT_PORT
from changefeed.spec.column_lists import parse_columns
from changefeed.spec.definition import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_CHUNKS_PER_BATCH,
    DEFAULT_FOLLOW_S,
    DEFAULT_LEASE_S,
    MIN_LEASE_S,
    PARALLEL_READ_SLOTS,
    SNAPSHOT_MODES,
    SNAPSHOT_READS,
    WAL_READERS,
    FeedSpec,
    parse_node,
    parse_sources,
)
from changefeed.spec.row_filters import parse_where
from changefeed.spec.secrets import same
from changefeed.spec.sinks import parse_sinks
from changefeed.spec.state import FeedState
from changefeed.spec.units import parse_budget, parse_duration, parse_size, parse_snapshot_rate, parse_tables

DEFAULT_STATE = "./changefeed-state"


def _qualified(table: str) -> str:
    names = parse_tables(table)
    if len(names) != 1:
        raise ConfigError(f"--outbox names one table, got {table!r}", "e.g. --outbox public.outbox")
    return names[0]


def _option(option: str, parse: Callable[[str], Any], text: str | None) -> Any:
    """`parse(text)` of the value of --OPTION (None if not given); its error names the option."""
    if text is None:
        return None
    try:
        return parse(text)
    except ConfigError as e:
        raise ConfigError(f"--{option}: {e.message}", e.hint) from None


def _spec_from_args(args: argparse.Namespace, state: FeedState) -> FeedSpec:
    stored = state.load()
    source, nodes = parse_sources(args.source) if args.source else (None, None)
    sink, sinks = parse_sinks(args.sink) if args.sink else (None, None)
    given = {k: v for k, v in {
        "source": source, "nodes": nodes, "sink": sink, "sinks": sinks,
        "tables": parse_tables(args.tables) if args.tables else None,
        "where": parse_where(args.where) if args.where else None,
        "columns": parse_columns(args.columns) if args.columns else None,
        "max_bytes_per_batch": _option("max-bytes-per-batch", parse_size, args.max_bytes_per_batch),
        "max_changes_per_batch": args.max_changes_per_batch, "wal_reader": args.wal_reader,
        "trigger_interval_s": args.trigger_interval,
        "resolved_interval_s": _option("resolved", parse_duration, args.resolved),
        "snapshot": args.snapshot, "snapshot_chunk_rows": args.snapshot_chunk_rows,
        "snapshot_chunks_per_batch": args.snapshot_chunks_per_batch, "snapshot_reads": args.snapshot_reads,
        "retention_s": _option("retention", parse_duration, args.retention),
        "max_retained_wal": _option("max-retained-wal", parse_size, args.max_retained_wal),
        "max_clock_skew_s": _option("max-clock-skew", parse_duration, args.max_clock_skew),
        **_lag_budget(args.sink_lag_budget), **_rates(args),
        "lease_s": _option("lease", parse_duration, args.lease),
        "failover_slot": False if args.no_failover_slot else None,
        "format": args.format, "diff": args.diff,
        "outbox": _qualified(args.outbox) if args.outbox else None, "outbox_columns": args.outbox_columns,
        "outbox_topic": args.outbox_topic,
        "outbox_ttl_s": _option("outbox-ttl", parse_duration, args.outbox_ttl),
        "outbox_snapshot_events": args.outbox_snapshot_events or None,
        "capture_ddl": args.capture_ddl or None,
        "low_latency_s": _option("low-latency", parse_duration, args.low_latency),
    }.items() if v is not None}
    outbox = given.get("outbox") or (stored.outbox if stored else "")
    if outbox and "tables" in given and outbox not in given["tables"]:
        given["tables"] = (*given["tables"], outbox)  # the outbox is captured like any table
    if stored is None:  # what is not given takes FeedSpec's defaults
        return validated(FeedSpec(**{"name": args.name, "source": "", "sink": "", "tables": (), **given})).protected()
    for key in ("source", "nodes", "sink", "sinks", "tables", "where", "columns"):
        if key in given and not _same(key, given[key], getattr(stored, key)):
            option = {"nodes": "source", "sinks": "sink"}.get(key, key)
            raise ConfigError(f"feed {args.name} was created with a different --{option} ({state.spec_file})",
                              "omit the option to reuse the stored one, or choose another --name")
    return validated(FeedSpec(**{**stored.__dict__,
                                 **{k: v for k, v in given.items() if k not in ("source", "nodes", "sink", "sinks")}}))


def _lag_budget(text: str | None) -> dict[str, Any]:
    """--sink-lag-budget as the two fields it sets (a duration or a size; 0 takes it back)."""
    if text is None:
        return {}
    seconds, size = _option("sink-lag-budget", parse_budget, text)
    return {"sink_lag_budget_s": seconds, "sink_lag_budget_bytes": size}


def _rates(args: argparse.Namespace) -> dict[str, Any]:
    """--snapshot-rate and --max-rate as the fields they set (0 takes a limit back)."""
    out: dict[str, Any] = {}
    if args.snapshot_rate is not None:
        rows, size = _option("snapshot-rate", parse_snapshot_rate, args.snapshot_rate)
        out |= {"snapshot_rate_rows": rows, "snapshot_rate_bytes": size}
    if args.max_rate is not None:
        out["max_rate"] = args.max_rate
    return out


def _rate_text(rows: int, size: int) -> str:
    return f"{rows:,} rows/s" if rows else f"{size:,} bytes/s" if size else "none"


def _rate_options(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--snapshot-rate",
                     help="most the feed's snapshot reads take from the source per second, across all of them: "
                          "a number is rows, a size (e.g. 20MB) bytes (default 0: no limit; alter changes it on a "
                          "running feed, from its next batch)")
    cmd.add_argument("--max-rate", type=int,
                     help="most changes per second the stream delivers to the sinks (default 0: no limit; alter "
                          "changes it on a running feed, from its next batch)")


def _same(key: str, given: Any, stored: Any) -> bool:
    """Whether a --source/--sink given again names the stored one (its secrets may be stored encrypted)."""
    if key in ("tables", "where", "columns"):
        return bool(given == stored)
    if key in ("nodes", "sinks"):
        return len(given) == len(stored) and all(a[0] == b[0] and same(a[1], b[1], f"--{key[:-1]} {a[0]}")
                                                 for a, b in zip(given, stored))
    return same(given, stored, f"--{key}")


def cmd_run(args: argparse.Namespace) -> int:
    from changefeed.control.runner import run, stop_on_signals

    stop = stop_on_signals(threading.Event())  # first: a stop while the definition is read is clean too
    state = FeedState(args.state, args.name)
    if args.standby and state.load() is None and not (args.sink or args.tables):
        spec = _standing_by(args)
    else:
        spec = _spec_from_args(args, state)
    run(spec, state, standby=args.standby, stop_event=stop, **_running(args))
    return 0


def _standing_by(args: argparse.Namespace) -> FeedSpec:
    """A standby with no state folder of the feed: the definition its runners stored on the source,
    read through this host's --source."""
    from changefeed.control.standby import stored_definition

    if not args.source:
        raise ConfigError("run --standby without a state folder of the feed needs --source (the feed's first "
                          "source node)", "e.g. changefeed run --standby --name NAME --source postgresql://...")
    uri = parse_node(args.source[0], 1)[1]
    spec = stored_definition(uri, args.name)
    return spec if spec.multi_node else FeedSpec(**{**spec.__dict__, "source": uri}).protected()


def _running(args: argparse.Namespace) -> dict[str, Any]:
    """The options of `_running_args`, as keywords of control.runner.run."""
    give_up = _option("give-up-after", parse_duration, args.give_up_after)
    every = _option("every", parse_duration, args.every) or None
    return {"available_now": args.available_now, "master": args.master, "verbose": args.verbose,
            "metrics_port": args.metrics_port, "metrics_host": args.metrics_host,
            "retry_max_backoff_s": _option("retry-max-backoff", parse_duration, args.retry_max_backoff),
            "give_up_after_s": give_up or None,
            "alongside": _verifying_every(args.name, args.state, every) if every else None}


def _verifying_every(name: str, root: str, every_s: float) -> Callable[[threading.Event], None]:
    """`run --verify-every`: verification beside the run, until it stops."""
    from changefeed.control.verify import verify_every

    return lambda stop: verify_every(name, FeedState(root, name), every_s, stop, print)


def cmd_create(args: argparse.Namespace) -> int:
    from changefeed.control.lifecycle import create

    state = FeedState(args.state, args.name)
    spec = _spec_from_args(args, state)
    create(spec, state)
    print(f"feed {spec.name} created: slot and publication {spec.slot}, state in {state.dir}; "
          f"start it with changefeed run --name {spec.name}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from changefeed.control.lifecycle import list_feeds

    feeds = list_feeds(args.state)
    if args.json:
        print(json.dumps([f.__dict__ for f in feeds], indent=2))
    for f in [] if args.json else feeds:
        runners = f"; active {f.active}" if f.active else ""
        runners += "".join(f"; standby {who}" for who in f.standbys)
        print(f"{f.name}: {f.state}{runners}; tables {', '.join(f.tables)}; source {f.source}; sink {f.sink}")
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    from changefeed.control.lifecycle import pause

    spec, state = _stored(args)
    everywhere = pause(spec, state)
    print(f"feed {spec.name} paused: its runner stops at its next report, on any host, and standbys do not take "
          "it over; the slot keeps the WAL from the checkpoint on (watch the source's disk); changefeed resume "
          "catches up")
    if not everywhere:
        print("note: the source was out of reach: only a runner on this host sees the pause (run pause again "
              "once the source answers)", file=sys.stderr)
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    from changefeed.control.runner import run

    spec, state = _stored(args)
    state.paused_file.unlink(missing_ok=True)
    run(spec, state, resuming=True, **_running(args))  # (the pause on the source: taken back once it runs)
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    from changefeed.control.lifecycle import remove

    spec, state = _stored(args)
    for what in remove(spec, state):
        print(f"dropped {what}")
    return 0


def _stored(args: argparse.Namespace) -> tuple[FeedSpec, FeedState]:
    state = FeedState(args.state, args.name)
    spec = state.load()
    if spec is None:
        raise ConfigError(f"no feed named {args.name} under {state.dir.parent}", "check --name and --state")
    return spec, state


def cmd_alter(args: argparse.Namespace) -> int:
    from changefeed.control.lifecycle import add_node, add_tables, remove_node

    spec, state = _stored(args)
    rates = _rates(args)
    changes = (args.add_tables, args.add_node, args.remove_node, args.rename_table, args.capture_ddl,
               args.add_sink, args.remove_sink, rates, args.where)
    if sum(map(bool, changes)) != 1:
        raise ConfigError("alter takes one of --add-tables, --add-node, --remove-node, --rename-table, "
                          "--capture-ddl, --add-sink, --remove-sink, --where, or the rates (--snapshot-rate, "
                          "--max-rate)", "run one alter per change")
    if args.where:
        _alter_where(spec, state, args.where, snapshot=not args.no_snapshot)
    elif rates:
        from changefeed.control.lifecycle import set_rates

        changed = set_rates(spec, state, rates)
        print(f"feed {spec.name}: snapshot rate {_rate_text(changed.snapshot_rate_rows, changed.snapshot_rate_bytes)}, "
              f"max rate {f'{changed.max_rate:,} changes/s' if changed.max_rate else 'none'} (a running feed takes "
              "them in at its next batch)")
    elif args.add_sink or args.remove_sink:
        from changefeed.control.sink_changes import add_sink, remove_sink

        if args.add_sink:
            changed = add_sink(spec, state, args.add_sink, snapshot=not args.no_snapshot)
            follows = "its changes" if args.no_snapshot else "the tables' rows for it alone, then its changes"
        else:
            changed = remove_sink(spec, state, args.remove_sink)
            follows = "its ledger dropped; the slot no longer waits for it"
        print(f"feed {spec.name} now writes to sinks {', '.join(t.name for t in changed.sink_targets)}; "
              f"{follows} (a running feed restarts its query at its next report)")
    elif args.capture_ddl:
        from changefeed.control.lifecycle import capture_ddl

        capture_ddl(spec, state)
        print(f"feed {spec.name} now captures the schema changes of its tables (event triggers "
              f"changefeed_ddl_{spec.name} on its source)")
    elif args.rename_table:
        old, sep, new = args.rename_table.partition("=")
        pair = parse_tables(f"{old},{new}") if sep else ()
        if len(pair) != 2:
            raise ConfigError(f"--rename-table takes OLD=NEW, got {args.rename_table!r}",
                              "e.g. --rename-table public.orders=public.orders_v2")
        from changefeed.control.lifecycle import rename_table

        renamed = rename_table(spec, state, *pair)
        print(f"feed {spec.name} now captures {pair[1]} (was {pair[0]}); its tables: {', '.join(renamed.tables)}")
    elif args.add_tables:
        grown = add_tables(spec, state, parse_tables(args.add_tables), snapshot=not args.no_snapshot)
        print(f"feed {spec.name} now captures {', '.join(grown.tables)}"
              + ("" if args.no_snapshot else "; the new tables' existing rows follow (snapshot requested)"))
    elif args.add_node:
        name, uri = parse_node(args.add_node, len(spec.sources) + 1)
        grown = add_node(spec, state, name, uri)
        print(f"feed {spec.name} now reads nodes {', '.join(n.name for n in grown.sources)}; node {name}'s "
              "existing rows follow, then its changes (a running feed restarts its query to read it)")
    else:
        shrunk, gone = remove_node(spec, state, args.remove_node)
        print(f"feed {spec.name} now reads nodes {', '.join(n.name for n in shrunk.sources)}; dropped "
              f"{', '.join(gone) or 'nothing (node ' + args.remove_node + ' had no slot or publication)'}; "
              "its rows stay on the replica")
    return 0


def _alter_where(spec: FeedSpec, state: FeedState, given: list[str], *, snapshot: bool) -> None:
    from changefeed.control.filter_change import change_filter

    if len(given) != 1:
        raise ConfigError("alter takes one --where at a time", "run one alter per table")
    ((table, predicate),) = parse_where(given, removal=True)
    _, left = change_filter(spec, state, table, predicate, snapshot=snapshot)
    now = f"the row filter {predicate!r}" if predicate else "no row filter"
    gone = sum(left.values())
    print(f"feed {spec.name}: {table} now has {now}; {gone:,} row{'' if gone == 1 else 's'} that left it reach the "
          "sinks as deletes" + ("" if not snapshot or not left else "; the rows it lets in follow (snapshot "
                                "requested)") + " (a running feed restarts its query at its next report)")


def cmd_snapshot(args: argparse.Namespace) -> int:
    from changefeed.control.lifecycle import request_snapshot

    spec, state = _stored(args)
    no = request_snapshot(spec, state, parse_tables(args.tables))
    print(f"feed {spec.name}: snapshot request {no} queued; a running feed takes it in at its next batch")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit 0 when source and sink are equal, 1 when they differ, 2 when verifying failed."""
    from changefeed.control.verify import verify

    try:
        spec, state = _stored(args)
        if args.workers < 1 or args.chunk_rows < 1:
            raise ConfigError("--workers and --chunk-rows take a number >= 1", "e.g. --workers 4 --chunk-rows 1000")
        found = verify(spec, state, tables=parse_tables(args.tables) if args.tables else (), repair=args.repair,
                       workers=args.workers, chunk_rows=args.chunk_rows,
                       wait_s=_option("wait", parse_duration, args.wait), master=args.master,
                       report=lambda line: print(line, file=sys.stderr), sink=args.sink)
    except ChangefeedError as e:
        print(f"changefeed: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(found.to_json(), indent=2) if args.json else "\n".join(found.lines()))
    return 0 if found.equal else 1


def cmd_compact(args: argparse.Namespace) -> int:
    from changefeed.sinks.registry import sinks_of

    spec, _ = _stored(args)
    lakes = [view for _, view, sink in sinks_of(spec) if sink.name == "delta"]
    if not lakes:
        raise ConfigError(f"feed {spec.name} writes to no Delta sink; compact is for Delta sinks",
                          "nothing to do for this feed")
    from changefeed.sinks.delta.options import DeltaOptions
    from changefeed.sinks.delta.upkeep import compact

    tables = [(schema, name) for schema, _, name in (t.partition(".") for t in spec.tables)]
    for lake in lakes:
        compact(DeltaOptions.parse(lake.sink), lake.key, tables,
                target_size=_option("target-size", _size, args.target_size),
                vacuum_retain_h=_option("vacuum", parse_duration, args.vacuum) / 3600 if args.vacuum else None)
    return 0


def _size(text: str) -> int:
    """'128MB', '1GB', '500kB' or a number of bytes."""
    import re

    m = re.fullmatch(r"\s*([0-9]+)\s*(|b|kb|mb|gb)\s*", text.lower())
    if not m or int(m[1]) < 1:
        raise ConfigError(f"not a size: {text!r}", "e.g. 128MB")
    return int(m[1]) * {"": 1, "b": 1, "kb": 1024, "mb": 1024 ** 2, "gb": 1024 ** 3}[m[2]]


def cmd_status(args: argparse.Namespace) -> int:
    from changefeed.control.status import status

    spec, state = _stored(args)
    st = status(spec, state)
    print(json.dumps(st.__dict__, indent=2) if args.json else "\n".join(st.lines()))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.sink == "delta":
        from changefeed.demo.delta import demo_delta

        return demo_delta(Path(args.workdir), seconds=args.seconds, master=args.master)
    from changefeed.demo.replica import demo

    return demo(Path(args.workdir), seconds=args.seconds, master=args.master)


def cmd_spark_server(args: argparse.Namespace) -> int:
    from changefeed.spark.connect import serve

    return serve(args.host, args.port, args.master)


class _Parser(argparse.ArgumentParser):
    """Malformed options exit like every other bad input: typed message, hint, exit 64."""

    def error(self, message: str) -> NoReturn:
        print(f"changefeed: error: {message}\n  hint: see '{self.prog} --help'", file=sys.stderr)
        sys.exit(ConfigError.exit_code)


def _definition_args(cmd: argparse.ArgumentParser) -> None:
    """What defines a feed (stored on its first run or create; later runs may change the limits)."""
    cmd.add_argument("--name", required=True,
                     help="feed name: 1-40 lowercase letters, digits or _, starting with a letter")
    cmd.add_argument("--source", action="append",
                     help="source URI postgresql://USER:PASSWORD@HOST:PORT/DB; the user needs REPLICATION "
                          "(or superuser) and rights to create a publication (required on the first run, then "
                          "stored). Repeat it as --source NAME=URI for a feed over several nodes (servers "
                          "that together hold the tables; unnamed ones are n1, n2, ... in order)")
    cmd.add_argument("--sink", action="append",
                     help="sink URI: postgresql://... for a replica, kafka://HOST:PORT[,...]?options for Kafka, "
                          "webhook-https://... (or webhook-http://) for a webhook, delta:///PATH for Delta Lake "
                          "(required on the first run, then stored). Repeat it as --sink NAME=URI to feed several "
                          "sinks from one read of the slot, each exactly once on its own; a message sink's URI may "
                          "carry its own format=... and diff=true")
    cmd.add_argument("--tables", help="comma-separated schema.table list, each once (a bare name means public.NAME); "
                                      "each needs a primary key or replica identity index (required on the first "
                                      "run, then stored)")
    cmd.add_argument("--state", default=DEFAULT_STATE, help=f"state directory (default {DEFAULT_STATE})")
    cmd.add_argument("--max-bytes-per-batch", help="most WAL bytes per batch, e.g. 64MB (default 64MB; 0 = no limit)")
    cmd.add_argument("--max-changes-per-batch", type=int,
                     help="most decoded messages per batch, >= 0 (exact, costs a server-side decode; 0 = off)")
    cmd.add_argument("--wal-reader", choices=WAL_READERS,
                     help="how a batch's WAL is read from the slot: peek (the SQL function "
                          "pg_logical_slot_peek_binary_changes; default, measured faster) or stream (the streaming "
                          "replication protocol: the server never holds a whole window's output)")
    cmd.add_argument("--trigger-interval", type=float,
                     help="seconds between batch starts, >= 0 (default 0: back to back)")
    cmd.add_argument("--resolved", help="close a resolved timestamp at least this often while the captured tables "
                                        "are idle, e.g. 1s, 500ms (default 1s; 0 = only when other WAL moves)")
    cmd.add_argument("--snapshot", choices=SNAPSHOT_MODES,
                     help="initial: deliver the tables' existing rows, then stream (default); never: changes "
                          "only; only: stop once the existing rows are delivered (stored on first run)")
    cmd.add_argument("--snapshot-chunk-rows", type=int,
                     help=f"rows per snapshot chunk, a primary-key range, >= 1 (default {DEFAULT_CHUNK_ROWS})")
    cmd.add_argument("--snapshot-chunks-per-batch", type=int,
                     help="snapshot chunks per batch, each read by a Spark task of its own with parallel reads "
                          f"(default {DEFAULT_CHUNKS_PER_BATCH}: auto, {PARALLEL_CHUNKS} with parallel reads, else "
                          "as many as --max-bytes-per-batch holds at the table's row size (into a replica, "
                          f"{sink_named('replica').snapshot_budget} times that), at most {MAX_AUTO_CHUNKS} (times as "
                          f"many); under --snapshot-rate, no more than it reads in {PACED_BATCH_S:g} s)")
    cmd.add_argument("--snapshot-reads", choices=SNAPSHOT_READS,
                     help="how a batch's snapshot chunks are read: parallel (a Spark task each, shuffled to the "
                          "writer), sequential (by the writer's task, one after the other, no shuffle) or auto "
                          f"(default: parallel with {PARALLEL_READ_SLOTS} or more Spark task slots)")
    cmd.add_argument("--retention", help="stop when the checkpoint is older than this, e.g. 24h, 90m "
                                         "(default 24h; 0 = no limit)")
    cmd.add_argument("--max-retained-wal", help="stop when the slot holds more WAL than this, e.g. 10GB "
                                                "(default 0: no limit)")
    cmd.add_argument("--where", action="append",
                     help="SCHEMA.TABLE=PREDICATE (split at the first =): capture only the rows of the table the "
                          "SQL predicate lets through, in the stream (a publication row filter, PostgreSQL 15+), "
                          "every snapshot and verify; an UPDATE that moves a row out of it arrives as a delete, "
                          "one that moves it in as an insert; the predicate may use only the replica identity's "
                          "columns (the key); repeatable, one per table (stored on first run)")
    cmd.add_argument("--columns", action="append",
                     help="SCHEMA.TABLE=COLUMN,COLUMN,...: capture only these columns of the table (a publication "
                          "column list, PostgreSQL 15+), in the stream, every snapshot and verify; a replica's "
                          "target table gets only them, message sinks send only them; the list must hold the "
                          "table's key (its replica identity); repeatable, one per table (stored on first run)")
    _rate_options(cmd)
    cmd.add_argument("--sink-lag-budget",
                     help="a feed of several sinks: let the others go on while one fails, for at most this long "
                          "(e.g. 10m) or while the slot keeps at most this much WAL for it (e.g. 5GB, a size ends in "
                          "B); it is caught up from the slot once it answers, and past the budget the feed stops "
                          "naming it (default: every sink waits for a failing one; 0 takes a budget back)")
    cmd.add_argument("--max-clock-skew", help="a feed of several nodes: how far the nodes' clocks may disagree, "
                     "e.g. 500ms (default 500ms)")
    cmd.add_argument("--no-failover-slot", action="store_true",
                     help="create the feed's slots as plain slots (default on PostgreSQL 17+: failover slots, which "
                          "a standby with sync_replication_slots keeps, so the feed survives its promotion)")
    cmd.add_argument("--lease", help="how long the runner's lease on the feed lasts unrenewed, by the source's "
                     f"clock (renewed every third of it), e.g. 5s (default {DEFAULT_LEASE_S:g}s, at least "
                     f"{MIN_LEASE_S:g}s); each run takes it in a new term, and the replica and Kafka refuse batches of "
                     "earlier terms")
    cmd.add_argument("--format", choices=FORMATS,
                     help="message envelope of a Kafka or webhook sink: json (default), debezium, text")
    cmd.add_argument("--diff", action="store_true", default=None,
                     help="json envelope: also send the old row as `before`")
    cmd.add_argument("--outbox", help="SCHEMA.TABLE whose inserted rows are events (outbox pattern) for a Kafka "
                                      "or webhook sink; captured even if --tables leaves it out")
    cmd.add_argument("--outbox-columns", help="outbox column names by role, e.g. id=event_id,payload=body (roles: "
                                              "id, aggregate_type, aggregate_id, event_type, payload; default: "
                                              "the role names)")
    cmd.add_argument("--outbox-topic", help="topic of an outbox event, a template of {aggregate_type} and "
                                            "{event_type} (default outbox.event.{aggregate_type}; Kafka's "
                                            "topic_prefix goes in front)")
    cmd.add_argument("--outbox-ttl", help="delete outbox rows older than this, e.g. 1h, once the feed's checkpoint "
                                          "is past them (default 0: never)")
    cmd.add_argument("--capture-ddl", action="store_true",
                     help="install an event trigger on the source that sends each schema change of a captured "
                          "table through the slot, in order (needs a superuser; see Schema changes)")
    cmd.add_argument("--low-latency", nargs="?", const=f"{DEFAULT_FOLLOW_S:g}s", metavar="DURATION",
                     help="low-latency mode: each batch's one task follows the slot for DURATION (default "
                          f"{DEFAULT_FOLLOW_S:g}s) and commits each change on the sink within tens of "
                          "milliseconds, as exactly once as the sink is (a replica, Kafka or a webhook, one "
                          "node; 0 = off; see Running)")
    cmd.add_argument("--outbox-snapshot-events", action="store_true",
                     help="also send the rows a snapshot reads from the outbox as events (default: only inserts; "
                          "every re-snapshot then sends them again)")


def _default_master() -> str:
    """A team's Spark for every feed command, set once: CHANGEFEED_MASTER."""
    return os.environ.get("CHANGEFEED_MASTER") or "local[*]"


def _running_args(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--available-now", action="store_true",
                     help="deliver everything committed before start, then exit 0")
    cmd.add_argument("--master", default=_default_master(),
                     help="Spark master (default $CHANGEFEED_MASTER, else local[*]: Spark starts in the runner's "
                          "process); sc://HOST:PORT runs the feed on a Spark Connect server that stays up "
                          "(changefeed spark-server)")
    cmd.add_argument("--retry-max-backoff", default="30s",
                     help="longest wait between attempts while a fault lasts (source restarting, connection lost, "
                          "sink down), e.g. 30s (default 30s)")
    cmd.add_argument("--give-up-after", help="end the run (exit 75) when a fault lasts longer than this, e.g. 10m "
                                             "(default: never)")
    cmd.add_argument("--verbose", action="store_true",
                     help="show Spark's and the JVM's output on the console (default: in STATE/NAME/spark.log)")
    cmd.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port at /metrics while "
                                                      "running (0: any free port, printed at start)")
    cmd.add_argument("--every", help="verify the replica against the source this often while running, e.g. 10m "
                                     "(as changefeed verify; outcome in status and /metrics; default: never)")
    cmd.add_argument("--metrics-host", default="127.0.0.1",
                     help="address the metrics endpoint listens on (default 127.0.0.1; 0.0.0.0 for all)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="changefeed", description="Change data capture for PostgreSQL on Spark.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run a feed until stopped (SIGINT/SIGTERM), or until caught up")
    _definition_args(run)
    _running_args(run)
    run.add_argument("--standby", action="store_true",
                     help="if another runner runs the feed, wait (with Spark started) and take the feed over when "
                          "that runner is gone; needs only --name and --source when the feed has no state folder "
                          "here (it runs the definition stored on the source)")
    run.set_defaults(func=cmd_run)

    create = sub.add_parser("create", help="check and create a feed (slot, publication, target tables) without "
                                           "running it")
    _definition_args(create)
    create.set_defaults(func=cmd_create)

    ls = sub.add_parser("list", help="the feeds under the state directory, and whether they run")
    ls.add_argument("--state", default=DEFAULT_STATE)
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_list)

    for verb, fn, text in (("pause", cmd_pause, "stop a feed's runner and keep it from starting; the slot "
                                                 "keeps the WAL"),
                           ("remove", cmd_remove, "drop a stopped feed's slot, publication, sink bookkeeping "
                                                  "and state (the replica tables stay)")):
        cmd = sub.add_parser(verb, help=text)
        cmd.add_argument("--name", required=True)
        cmd.add_argument("--state", default=DEFAULT_STATE)
        cmd.set_defaults(func=fn)

    resume = sub.add_parser("resume", help="undo pause and run the feed (it catches up from its checkpoint)")
    resume.add_argument("--name", required=True)
    resume.add_argument("--state", default=DEFAULT_STATE)
    _running_args(resume)
    resume.set_defaults(func=cmd_resume)

    alter = sub.add_parser("alter", help="add tables or source nodes to a feed, running or not (their existing "
                           "rows follow), or remove a node from a stopped one, or follow a renamed table")
    alter.add_argument("--name", required=True)
    alter.add_argument("--state", default=DEFAULT_STATE)
    alter.add_argument("--add-tables", help="comma-separated schema.table list")
    alter.add_argument("--add-node", help="NAME=URI of one more source node (a feed of named nodes)")
    alter.add_argument("--remove-node", help="NAME of a node to stop reading: its slot and publication are dropped")
    alter.add_argument("--rename-table", help="OLD=NEW: follow a table renamed on the source (a stopped feed; "
                                              "a replica's table is renamed too)")
    alter.add_argument("--capture-ddl", action="store_true",
                       help="from now on, send the tables' schema changes through the slot (needs a superuser)")
    alter.add_argument("--add-sink", help="NAME=URI of one more sink: it gets the captured tables' existing rows "
                                          "for itself alone (unless --no-snapshot), then the stream; the others "
                                          "go on undisturbed")
    alter.add_argument("--remove-sink", help="NAME of a sink to stop writing to: its ledger is dropped, the slot no "
                                             "longer waits for it (its delivered data stays)")
    alter.add_argument("--where", action="append",
                       help="SCHEMA.TABLE=PREDICATE: change a captured table's row filter (SCHEMA.TABLE= removes "
                            "it), running or not: rows the new filter keeps out reach the sinks as deletes where "
                            "it changed, the rows it lets in with a snapshot of the table (not with --no-snapshot); "
                            "writers of the table wait while it changes; a table with a key only")
    alter.add_argument("--no-snapshot", action="store_true", help="changes only, not the existing rows")
    _rate_options(alter)
    alter.set_defaults(func=cmd_alter)

    snap = sub.add_parser("snapshot", help="read tables' existing rows again, without stopping the stream")
    snap.add_argument("--name", required=True)
    snap.add_argument("--state", default=DEFAULT_STATE)
    snap.add_argument("--tables", required=True, help="comma-separated schema.table list (tables of the feed)")
    snap.set_defaults(func=cmd_snapshot)

    ver = sub.add_parser("verify", help="compare a feed's source and sink (a replica, or Kafka topics) at one "
                                        "consistent point, running or not; exit 0 equal, 1 different, 2 error")
    ver.add_argument("--name", required=True)
    ver.add_argument("--state", default=DEFAULT_STATE)
    ver.add_argument("--tables", help="comma-separated schema.table list (default: all the feed's tables)")
    ver.add_argument("--sink", help="of a feed with several sinks, the NAME of the one to compare (required there)")
    ver.add_argument("--repair", action="store_true",
                     help="then write the source's rows of the keys that differ into the replica, at a new "
                          "consistent point while the feed waits there")
    ver.add_argument("--workers", type=int, default=2,
                     help="sessions per server reading block ranges of a table in parallel (default 2)")
    ver.add_argument("--chunk-rows", type=int, default=1000,
                     help="about this many rows per compared chunk (default 1000)")
    ver.add_argument("--wait", default="2m", help="how long the feed may take to reach the point (default 2m)")
    ver.add_argument("--master", default=_default_master(),
                     help="Spark master for running a stopped feed that is behind up to the point (default "
                          "$CHANGEFEED_MASTER, else local[*])")
    ver.add_argument("--json", action="store_true", help="machine-readable output")
    ver.set_defaults(func=cmd_verify)

    comp = sub.add_parser("compact", help="Delta sinks: merge each table's small files, write a Delta checkpoint, "
                                          "and with --vacuum delete files no kept version references")
    comp.add_argument("--name", required=True)
    comp.add_argument("--state", default=DEFAULT_STATE)
    comp.add_argument("--target-size", default="128MB", help="size of the merged files (default 128MB)")
    comp.add_argument("--vacuum", help="also delete unreferenced files older than this (at least 1h), e.g. 168h")
    comp.set_defaults(func=cmd_compact)

    st = sub.add_parser("status", help="checkpoint, lag and slot state of a feed")
    st.add_argument("--name", required=True)
    st.add_argument("--state", default=DEFAULT_STATE)
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=cmd_status)

    srv = sub.add_parser("spark-server", help="run a Spark Connect server (until SIGINT/SIGTERM) on which feeds "
                                              "start without a JVM of their own: run --master sc://HOST:PORT")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT})")
    srv.add_argument("--master", default="local[*]", help="the server's Spark master (default local[*])")
    srv.set_defaults(func=cmd_spark_server)

    demo = sub.add_parser("demo", help="two embedded PostgreSQL servers, a workload, a feed, and a check")
    demo.add_argument("--workdir", default="./changefeed-demo", help="where the demo keeps its servers and state")
    demo.add_argument("--seconds", type=float, default=45, help="how long the write workload runs")
    demo.add_argument("--master", default=_default_master())
    demo.add_argument("--sink", choices=("replica", "delta"), default="replica",
                      help="replica: a second PostgreSQL server (default); delta: a Delta lake (a mirror and a "
                           "change log) queried with DuckDB")
    demo.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    """`kill -USR1 PID` prints every thread's stack to stderr: how to see where a runner waits."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.umask(0o077)  # whatever changefeed (its JVM, its Python workers) writes is its owner's only
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ChangefeedError as e:
        print(f"changefeed: error: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:  # noqa: BLE001 - the CLI's edge: what no part of changefeed has a type for
        print(f"changefeed: error: {unexpected(e)}", file=sys.stderr)
        return UNEXPECTED_EXIT


if __name__ == "__main__":
    sys.exit(main())
