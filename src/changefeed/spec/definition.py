"""Feed definitions: what to capture, where to deliver, and how big a batch may be."""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, fields

from changefeed.core.nodes import DEFAULT_NODE, classic
from changefeed.core.outbox import DEFAULT_TOPIC, OutboxSpec, check_topic_template, parse_columns
from changefeed.errors import ConfigError
from changefeed.spec.column_lists import check_columns
from changefeed.spec.row_filters import check_where
from changefeed.spec.sinks import SinkTarget, check_names, envelope_of, kind_of, targets

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
_TABLE = re.compile(r"^[^.\s]+\.[^.\s]+$")
# A node name goes into its slot's name (at most 63 bytes with the feed's): short, lowercase.
_NODE = re.compile(r"^[a-z][a-z0-9_]{0,10}$")
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_RESOLVED_S = 1.0
SNAPSHOT_MODES = ("initial", "never", "only")
DEFAULT_CHUNK_ROWS = 50_000
DEFAULT_CHUNKS_PER_BATCH = 0  # auto: by how chunks are read and how big the rows are (core.snapshot.auto_chunks)
# How a batch's snapshot chunks are read: `auto` reads them in parallel tasks (shuffled to the
# writer) when Spark has at least PARALLEL_READ_SLOTS task slots, else in the writer's task one
# after the other (measured faster with 2: bench/snapshot_throughput.py).
SNAPSHOT_READS = ("auto", "parallel", "sequential")
PARALLEL_READ_SLOTS = 4
DEFAULT_RETENTION_S = 24 * 3600.0
DEFAULT_MAX_CLOCK_SKEW_S = 0.5
# --low-latency: a followed batch's length. Each batch boundary holds what commits meanwhile for a
# micro-batch's cycle, so longer batches pay it less often (snapshot requests and verify's barriers
# end a followed batch early: spark.follow.Wanted); but Spark stops a Python worker idle for a
# minute, and the driver's sink commit then starts one anew at the boundary, which holds changes
# three times as long (bench/README.md, "The batch boundary"): the default stays under that minute.
DEFAULT_FOLLOW_S, MIN_FOLLOW_S = 45.0, 1.0
# The runner renews its lease a third of it apart (control.lease_keeper): shorter leases would
# end under a busy machine's scheduling pauses alone.
DEFAULT_LEASE_S, MIN_LEASE_S = 5.0, 2.0  # the default: bench/README.md, takeover
WAL_READERS = ("peek", "stream")  # how windows are read: SQL peek (default: measured faster), replication protocol


@dataclass(frozen=True)
class SourceNode:
    """One PostgreSQL server (node) a feed reads, with the slot and publication it has there."""

    name: str
    uri: str
    slot: str
    publication: str

    @property
    def prepare_slot(self) -> str:
        """The node's prepare slot on a feed of several nodes (postgres/twophase.py), beside `slot`."""
        return "cf2pc_" + self.slot.removeprefix("changefeed_")

    @property
    def lag_slot(self) -> str:
        """A copy of `slot` that keeps the WAL of a sink the others went on without (control.lag_budget)."""
        return "cflag_" + self.slot.removeprefix("changefeed_")


def node_role(node: str, multi_node: bool) -> str:
    """How messages name a source node: just "source" on a one-node feed."""
    return f"source node {node}" if multi_node else "source"


@dataclass(frozen=True)
class FeedSpec:
    """One named changefeed. Slot and publication names derive from the feed name (and, but for
    node n1, the node's: `changefeed_FEED_NODE`, so that two nodes may share a server).

    A feed of one node named n1 keeps its URI in `source` (the shape every feed had before nodes
    existed); any other feed lists its nodes in `nodes` as (name, URI) pairs and leaves `source`
    empty."""

    name: str
    source: str
    sink: str
    tables: tuple[str, ...]
    max_bytes_per_batch: int = DEFAULT_MAX_BYTES
    max_changes_per_batch: int = 0
    trigger_interval_s: float = 0.0
    resolved_interval_s: float = DEFAULT_RESOLVED_S
    snapshot: str = "initial"  # existing rows first (initial), not at all (never), or only them (only)
    snapshot_chunk_rows: int = DEFAULT_CHUNK_ROWS
    snapshot_chunks_per_batch: int = DEFAULT_CHUNKS_PER_BATCH
    snapshot_reads: str = SNAPSHOT_READS[0]
    retention_s: float = DEFAULT_RETENTION_S  # most checkpoint age the slot may hold WAL for; 0 = no limit
    max_retained_wal: int = 0  # most WAL bytes the slot may hold; 0 = no limit
    format: str = "json"  # envelope of a message sink (core.envelope.FORMATS)
    diff: bool = False  # json envelope: also the old row (`before`)
    outbox: str = ""  # schema.table whose rows are events (core.outbox); "" = none
    outbox_columns: str = ""  # role=column,... (core.outbox.parse_columns); "" = the default names
    outbox_topic: str = DEFAULT_TOPIC
    outbox_ttl_s: float = 0.0  # delete outbox rows this old once delivered; 0 = never
    outbox_snapshot_events: bool = False  # a snapshot's reads of the outbox are events too (core.outbox)
    nodes: tuple[tuple[str, str], ...] = ()  # (name, URI) of each node; () = one node, n1, at `source`
    renamed: tuple[tuple[str, str], ...] = ()  # (old, new) schema.table renamed on the source (alter --rename-table)
    capture_ddl: bool = False  # DDL of captured tables as messages in the stream (postgres.ddl_capture)
    wal_reader: str = WAL_READERS[0]
    max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S  # how far the nodes' clocks may disagree (core.distributed)
    lease_s: float = DEFAULT_LEASE_S  # how long a runner's lease lasts unrenewed (postgres.lease)
    failover_slot: bool = True  # PostgreSQL 17+: slots made as failover slots (kept on a synchronized standby)
    sinks: tuple[tuple[str, str], ...] = ()  # (name, URI) of each named sink (spec.sinks); () = the bare `sink`
    sink_key: str = ""  # the feed as one of its sinks sees it (for_sink): that sink's ledger key
    sink_lag_budget_s: float = 0.0  # how long a failing sink may stay behind the others (control.lag_budget)
    sink_lag_budget_bytes: int = 0  # how much WAL the slot may keep for a sink behind the others; 0, 0 = wait for it
    where: tuple[tuple[str, str], ...] = ()  # (schema.table, predicate): row filters (spec.row_filters)
    columns: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (schema.table, columns): column lists (spec.column_lists)
    snapshot_rate_rows: int = 0  # --snapshot-rate: rows per second across the snapshot reads (core.rate); 0 = none
    snapshot_rate_bytes: int = 0  # --snapshot-rate given as a size: bytes per second
    max_rate: int = 0  # --max-rate: changes per second the stream delivers (core.rate); 0 = no limit
    low_latency_s: float = 0.0  # --low-latency: how long a followed batch follows the slot (core.followed); 0 = off

    @property
    def sink_targets(self) -> tuple[SinkTarget, ...]:
        """The feed's sinks, the bare one first (spec.sinks)."""
        return targets(self.name, self.sink, self.sinks)

    @property
    def row_filters(self) -> dict[str, str]:
        """Per filtered table, its predicate."""
        return dict(self.where)

    @property
    def column_lists(self) -> dict[str, tuple[str, ...]]:
        """Per table captured with a column list, its columns."""
        return dict(self.columns)

    @property
    def sink_lag_budget(self) -> bool:
        """Whether the other sinks go on without a failing one (control.lag_budget)."""
        return bool(self.sink_lag_budget_s or self.sink_lag_budget_bytes)

    def without_sinks(self, names: set[str]) -> "FeedSpec":
        """The feed as its query runs while sinks `names` are behind (control.lag_budget): the others only."""
        bare = self.sink if self.sink and kind_of(self.sink) not in names else ""
        return FeedSpec(**{**self.__dict__, "sink": bare, "sinks": tuple((n, u) for n, u in self.sinks
                                                                           if n not in names)})

    @property
    def several_sinks(self) -> bool:
        return len(self.sink_targets) > 1

    @property
    def key(self) -> str:
        """The key this feed's (only) sink keeps its ledger under: the feed's name, or in a view for
        one of several sinks (for_sink) that sink's."""
        return self.sink_key or self.name

    def for_sink(self, target: SinkTarget) -> "FeedSpec":
        """The feed as sink `target` sees it: its URI as the only sink (without the envelope keys,
        which override --format and --diff for it), its ledger key."""
        uri, envelope = envelope_of(target.uri)
        return FeedSpec(**{**self.__dict__, "sink": uri, "sinks": (), "sink_key": target.key,
                           "format": envelope.get("format", self.format),
                           "diff": envelope.get("diff", str(self.diff).lower()) == "true"})

    def sink_named(self, name: str) -> SinkTarget:
        """The sink named `name` (ConfigError naming the feed's sinks if none is)."""
        found = [t for t in self.sink_targets if t.name == name]
        if not found:
            raise ConfigError(f"feed {self.name} has no sink named {name!r}",
                              f"its sinks are {', '.join(t.name for t in self.sink_targets)}")
        return found[0]

    @property
    def sources(self) -> tuple[SourceNode, ...]:
        """The nodes the feed reads, in the order they were named."""
        pairs = self.nodes or ((DEFAULT_NODE, self.source),)
        return tuple(SourceNode(n, uri, *(2 * (self.slot if n == DEFAULT_NODE else f"{self.slot}_{n}",)))
                     for n, uri in pairs)

    def protected(self) -> "FeedSpec":
        """This feed as it may be stored and handed on: literal secrets in its URIs encrypted (see
        secrets.py; references stay as they are)."""
        from changefeed.spec.secrets import protect_uri

        return FeedSpec(**{**self.__dict__, "source": protect_uri(self.source, "--source") if self.source else "",
                           "nodes": tuple((n, protect_uri(u, f"--source {n}")) for n, u in self.nodes),
                           "sink": protect_uri(self.sink, "--sink") if self.sink else "",
                           "sinks": tuple((n, protect_uri(u, f"--sink {n}")) for n, u in self.sinks)})

    def check_secrets(self) -> None:
        """ConfigError unless every reference in the URIs can be resolved here, and a password file
        named for the URIs without a password can be used (before anything is created)."""
        from urllib.parse import urlsplit

        from changefeed.spec.secrets import check, passfile_problem

        uris = [(n.uri, f"--source {n.name}" if self.multi_node else "--source") for n in self.sources]
        for uri, option in [*uris, *((t.uri, t.option) for t in self.sink_targets)]:
            check(uri, option)
            postgres = uri.startswith(("postgresql://", "postgres://"))
            if postgres and urlsplit(uri).password is None and os.environ.get("PGPASSFILE") and \
                    (why := passfile_problem()):
                raise ConfigError(f"{option} has no password and {why}",
                                  "fix the file (mode 0600, readable by this user) or give the password by "
                                  "reference, postgresql://USER:${VAR}@HOST/DB")

    def role(self, node: str) -> str:
        """How messages name source node `node` of this feed (see node_role)."""
        return node_role(node, self.multi_node)

    @property
    def multi_node(self) -> bool:
        """Whether the feed is not the classic one-node feed (see core.nodes)."""
        return not classic(n.name for n in self.sources)

    @property
    def outbox_spec(self) -> OutboxSpec | None:
        if not self.outbox:
            return None
        return OutboxSpec(self.outbox, parse_columns(self.outbox_columns), self.outbox_topic, self.outbox_ttl_s,
                          self.outbox_snapshot_events)

    @property
    def slot(self) -> str:
        return f"changefeed_{self.name}"

    @property
    def publication(self) -> str:
        return f"changefeed_{self.name}"

    def validate(self) -> "FeedSpec":
        """ConfigError for what is wrong with the definition itself; what the sink says of it is
        checked by sinks.registry.validated."""
        if not _NAME.match(self.name):
            raise ConfigError(f"feed name {self.name!r} is not allowed",
                              "use 1-40 lowercase letters, digits or _, starting with a letter")
        required = (("source", self.source or self.nodes), ("sink", self.sink or self.sinks), ("tables", self.tables))
        missing = [f"--{option}" for option, value in required if not value]
        if missing:
            raise ConfigError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required for a new feed",
                              "e.g. --source postgresql://USER:PASSWORD@HOST:5432/DB --sink "
                              "postgresql://USER:PASSWORD@REPLICA:5432/DB --tables public.accounts")
        self._validate_nodes()
        from changefeed.core.envelope import FORMATS

        check_names(self.sink_targets)
        check_where(self.where, self.tables)
        check_columns(self.columns, self.tables)
        if self.format not in FORMATS:
            raise ConfigError(f"--format must be one of {', '.join(FORMATS)}, got {self.format!r}",
                              "json (default), debezium (Debezium's change event), text (test_decoding's lines)")
        for t in self.sink_targets:
            own = envelope_of(t.uri)[1]
            if own.get("format", self.format) not in FORMATS or own.get("diff", "false") not in ("true", "false"):
                raise ConfigError(f"{t.option}: format must be one of {', '.join(FORMATS)} and diff true or false, "
                                  f"got {own}", "e.g. ?format=debezium or ?diff=true in the sink's URI")
        bad = [t for t in self.tables if not _TABLE.match(t)]
        if bad:
            raise ConfigError(f"table names must be schema.table: {', '.join(bad)}", "e.g. public.accounts")
        if len(set(self.tables)) != len(self.tables):
            raise ConfigError("--tables lists a table twice", "list each table once")
        negative = [o for o, v in (("max-bytes-per-batch", self.max_bytes_per_batch),
                                   ("max-changes-per-batch", self.max_changes_per_batch),
                                   ("trigger-interval", self.trigger_interval_s),
                                   ("resolved", self.resolved_interval_s), ("retention", self.retention_s),
                                   ("max-retained-wal", self.max_retained_wal),
                                   ("max-clock-skew", self.max_clock_skew_s),
                                   ("sink-lag-budget", self.sink_lag_budget_s),
                                   ("sink-lag-budget", self.sink_lag_budget_bytes),
                                   ("snapshot-rate", self.snapshot_rate_rows),
                                   ("snapshot-rate", self.snapshot_rate_bytes), ("max-rate", self.max_rate),
                                   ("low-latency", self.low_latency_s)) if v < 0]
        if negative:
            raise ConfigError(f"--{negative[0]} must not be negative", "use 0 for no limit")
        if self.max_rate and self.multi_node:
            raise ConfigError("--max-rate is not available on a feed of several nodes yet (its batches are cut at "
                              "a point in commit time, not after a number of changes)",
                              "leave it out, or limit each batch with --max-bytes-per-batch")
        if self.sink_lag_budget and self.multi_node:
            raise ConfigError("--sink-lag-budget is not available on a feed of several nodes yet",
                              "leave it out: every sink then waits for a failing one")
        if self.sink_lag_budget and not self.several_sinks:
            raise ConfigError("--sink-lag-budget lets a feed's other sinks go on without one that fails: this feed "
                              "has one sink", "leave --sink-lag-budget out, or give the feed several --sink NAME=URI")
        if self.low_latency_s:
            self._validate_low_latency()
        if self.lease_s < MIN_LEASE_S:
            raise ConfigError(f"--lease must be at least {MIN_LEASE_S:g}s, got {self.lease_s:g}s",
                              f"the runner renews it every third of it; the default is {DEFAULT_LEASE_S:g}s")
        if self.wal_reader not in WAL_READERS:
            raise ConfigError(f"--wal-reader must be one of {', '.join(WAL_READERS)}, got {self.wal_reader!r}",
                              "peek: the SQL function (default); stream: the streaming replication protocol")
        if self.snapshot not in SNAPSHOT_MODES:
            raise ConfigError(f"--snapshot must be one of {', '.join(SNAPSHOT_MODES)}, got {self.snapshot!r}",
                              "initial: existing rows, then changes; never: changes only; only: existing rows")
        if self.snapshot_chunk_rows < 1:
            raise ConfigError(f"--snapshot-chunk-rows must be at least 1, got {self.snapshot_chunk_rows}",
                              f"the default is {DEFAULT_CHUNK_ROWS}")
        if self.snapshot_reads not in SNAPSHOT_READS:
            raise ConfigError(f"--snapshot-reads must be one of {', '.join(SNAPSHOT_READS)}, "
                              f"got {self.snapshot_reads!r}",
                              f"auto: parallel with {PARALLEL_READ_SLOTS} or more Spark task slots, else sequential")
        if self.snapshot_chunks_per_batch < 0:
            raise ConfigError(f"--snapshot-chunks-per-batch must be 0 (auto) or more, got "
                              f"{self.snapshot_chunks_per_batch}",
                              "the default, 0, reads 4 at once with parallel reads, else as many as "
                              "--max-bytes-per-batch holds")
        if self.outbox:
            self._validate_outbox()
        return self

    def _validate_low_latency(self) -> None:
        """What low-latency mode (core.followed) cannot do yet, refused before anything is created."""
        from changefeed.spec.sinks import kind_of

        refused = ("a feed of several nodes (its batches are cut at a point in commit time)" if self.multi_node else
                   "a feed of several sinks" if self.several_sinks else
                   "--max-rate (a followed batch delivers what is committed as it comes)" if self.max_rate else
                   "a sink that is not a PostgreSQL replica, Kafka or a webhook"
                   if kind_of(self.sink) not in ("replica", "kafka", "webhook")
                else None)
        if refused:
            raise ConfigError(f"--low-latency is not available on {refused} yet",
                              "leave --low-latency out (or set it to 0): the feed then runs in micro-batches")
        if self.low_latency_s < MIN_FOLLOW_S:
            raise ConfigError(f"--low-latency must be at least {MIN_FOLLOW_S:g}s, got {self.low_latency_s:g}s",
                              f"it is how long one batch follows the slot; the default is {DEFAULT_FOLLOW_S:g}s")

    def _validate_nodes(self) -> None:
        if self.source and self.nodes:
            raise ConfigError("a feed has either one source URI or named nodes, not both",
                              "list every node as --source NAME=URI")
        for node in self.sources:
            if not _NODE.match(node.name):
                raise ConfigError(f"node name {node.name!r} is not allowed",
                                  "use 1-11 lowercase letters, digits or _, starting with a letter")
            if not node.uri.startswith(("postgresql://", "postgres://")):
                scheme = node.uri.split("://")[0] if "://" in node.uri else "<no scheme>"
                raise ConfigError(f"--source {node.name} must be a postgresql:// URI, got scheme {scheme!r}",
                                  "e.g. postgresql://USER:PASSWORD@HOST:5432/DB")
        for what, values in (("name", [n.name for n in self.sources]), ("URI", [n.uri for n in self.sources])):
            twice = sorted({v for v in values if values.count(v) > 1})
            if twice:
                shown = twice[0] if what == "name" else "a URI"
                raise ConfigError(f"two nodes have the same {what} ({shown})", "name each node once, each with "
                                  "its own server or database")
        if self.multi_node and self.outbox:
            raise ConfigError("a feed with named nodes (--source NAME=URI) has no --outbox (this version)",
                              "run one feed per node for its outbox events")

    def _validate_outbox(self) -> None:
        if not _TABLE.match(self.outbox):
            raise ConfigError(f"--outbox must be schema.table, got {self.outbox!r}", "e.g. --outbox public.outbox")
        if self.outbox not in self.tables:
            raise ConfigError(f"--outbox {self.outbox} is not among the captured --tables",
                              "add it to --tables")
        if self.outbox_ttl_s < 0:
            raise ConfigError("--outbox-ttl must not be negative", "e.g. 1h; 0 keeps outbox rows")
        check_topic_template(self.outbox_topic)
        assert self.outbox_spec is not None  # parses the columns

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if k != "sink_key"}, indent=2)

    @classmethod
    def from_json(cls, text: str, origin: str) -> "FeedSpec":
        try:
            data = json.loads(text)
            known = {f.name for f in fields(cls)}
            unknown = set(data) - known
            if unknown:
                raise ConfigError(f"{origin}: unknown keys {sorted(unknown)}", f"known keys: {sorted(known)}")
            data["tables"] = tuple(data["tables"])
            data["nodes"] = tuple((str(n), str(u)) for n, u in data.get("nodes", ()))
            data["renamed"] = tuple((str(a), str(b)) for a, b in data.get("renamed", ()))
            data["sinks"] = tuple((str(n), str(u)) for n, u in data.get("sinks", ()))
            data["where"] = tuple((str(t), str(p)) for t, p in data.get("where", ()))
            data["columns"] = tuple((str(t), tuple(map(str, c))) for t, c in data.get("columns", ()))
            return cls(**data).validate()
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"{origin} is not a valid feed definition: {e}", "fix or remove the file") from None


def parse_sources(given: list[str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """`--source` values (`URI` or `NAME=URI`, in order) -> FeedSpec's (source, nodes): one
    unnamed or n1 URI is a plain `source`; unnamed nodes are n1, n2, ... by position."""
    pairs = [parse_node(text, i) for i, text in enumerate(given, 1)]
    if len(pairs) == 1 and pairs[0][0] == DEFAULT_NODE:
        return pairs[0][1], ()
    return "", tuple(pairs)


def parse_node(text: str, position: int) -> tuple[str, str]:
    """One `--source` value -> (name, URI); unnamed, the node at `position` (1-based) is n<position>."""
    name, sep, uri = text.partition("=")
    named = bool(sep) and "://" not in name and "/" not in name
    return (name.strip(), uri.strip()) if named else (f"n{position}", text.strip())
