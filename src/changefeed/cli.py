"""Command line: `changefeed run | status | demo` (also `python -m changefeed`)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import DEFAULT_MAX_BYTES, DEFAULT_RESOLVED_S, FeedSpec, FeedState, parse_duration, parse_size, parse_tables
from .errors import ChangefeedError, ConfigError

DEFAULT_STATE = "./changefeed-state"


def _spec_from_args(args: argparse.Namespace, state: FeedState) -> FeedSpec:
    stored = state.load()
    given = {k: v for k, v in {
        "source": args.source, "sink": args.sink,
        "tables": parse_tables(args.tables) if args.tables else None,
        "max_bytes_per_batch": parse_size(args.max_bytes_per_batch) if args.max_bytes_per_batch else None,
        "max_changes_per_batch": args.max_changes_per_batch,
        "trigger_interval_s": args.trigger_interval,
        "resolved_interval_s": parse_duration(args.resolved) if args.resolved is not None else None,
    }.items() if v is not None}
    if stored is None:
        return FeedSpec(name=args.name, source=given.get("source", ""), sink=given.get("sink", ""),
                        tables=given.get("tables", ()),
                        max_bytes_per_batch=given.get("max_bytes_per_batch", DEFAULT_MAX_BYTES),
                        max_changes_per_batch=given.get("max_changes_per_batch", 0),
                        trigger_interval_s=given.get("trigger_interval_s", 0.0),
                        resolved_interval_s=given.get("resolved_interval_s", DEFAULT_RESOLVED_S)).validate()
    for key in ("source", "sink", "tables"):
        if key in given and given[key] != getattr(stored, key):
            raise ConfigError(f"feed {args.name} was created with a different --{key} ({state.spec_file})",
                              "omit the option to reuse the stored one, or choose another --name")
    return FeedSpec(**{**stored.__dict__, **given}).validate()


def cmd_run(args: argparse.Namespace) -> int:
    from .feed import run

    state = FeedState(args.state, args.name)
    spec = _spec_from_args(args, state)
    run(spec, state, available_now=args.available_now, master=args.master)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from .feed import status

    state = FeedState(args.state, args.name)
    spec = state.load()
    if spec is None:
        raise ConfigError(f"no feed named {args.name} under {state.dir.parent}", "check --name and --state")
    st = status(spec)
    print(json.dumps(st.__dict__, indent=2) if args.json else "\n".join(st.lines()))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import demo

    return demo(Path(args.workdir), seconds=args.seconds, master=args.master)


class _Parser(argparse.ArgumentParser):
    """Malformed options exit like every other bad input: typed message, hint, exit 64."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"changefeed: error: {message}\n  hint: see '{self.prog} --help'", file=sys.stderr)
        sys.exit(ConfigError.exit_code)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="changefeed", description="Change data capture for PostgreSQL on Spark.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run a feed until stopped (SIGINT/SIGTERM), or until caught up")
    run.add_argument("--name", required=True, help="feed name: lowercase letters, digits, _")
    run.add_argument("--source", help="source PostgreSQL URI (stored on first run)")
    run.add_argument("--sink", help="sink URI: postgresql://... for a replica (stored on first run)")
    run.add_argument("--tables", help="comma-separated schema.table list (stored on first run)")
    run.add_argument("--state", default=DEFAULT_STATE, help=f"state directory (default {DEFAULT_STATE})")
    run.add_argument("--available-now", action="store_true",
                     help="deliver everything committed before start, then exit 0")
    run.add_argument("--max-bytes-per-batch", help="most WAL bytes per batch, e.g. 64MB (default 64MB; 0 = no limit)")
    run.add_argument("--max-changes-per-batch", type=int,
                     help="most decoded messages per batch (exact, costs a server-side decode; 0 = off)")
    run.add_argument("--trigger-interval", type=float, help="seconds between batch starts (default 0: back to back)")
    run.add_argument("--resolved", help="close a resolved timestamp at least this often while the captured tables "
                                        "are idle, e.g. 1s, 500ms (default 1s; 0 = only when other WAL moves)")
    run.add_argument("--master", default="local[*]", help="Spark master (default local[*])")
    run.set_defaults(func=cmd_run)

    st = sub.add_parser("status", help="checkpoint, lag and slot state of a feed")
    st.add_argument("--name", required=True)
    st.add_argument("--state", default=DEFAULT_STATE)
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(func=cmd_status)

    demo = sub.add_parser("demo", help="two embedded PostgreSQL servers, a workload, a feed, and a check")
    demo.add_argument("--workdir", default="./changefeed-demo", help="where the demo keeps its servers and state")
    demo.add_argument("--seconds", type=float, default=45, help="how long the write workload runs")
    demo.add_argument("--master", default="local[*]")
    demo.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ChangefeedError as e:
        print(f"changefeed: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
