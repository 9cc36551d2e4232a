"""A running feed's lag, throughput, snapshot progress and state, for Prometheus.

The runner writes the latest values into a `FeedMetrics` at every progress report; a scrape reads
one frozen copy through a `prometheus_client` collector, so it never waits on the feed or sees half
an update. prometheus_client writes the text exposition format 0.0.4 (escaping, counters' `_total`);
the small HTTP server stays ours because it answers only /metrics (404 elsewhere) and turns a
taken port into a ConfigError. Pure Python: no Spark, no database.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from changefeed.errors import ConfigError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # what generate_latest writes
STATES = ("starting", "running", "retrying", "paused", "stopped", "failed")


@dataclass(frozen=True)
class TableSnapshot:
    """Snapshot progress of one table: chunks and rows applied, and whether reading goes on."""

    chunks: int = 0
    rows: int = 0
    pending: bool = False


@dataclass(frozen=True)
class NodeValues:
    """One source node of a feed of several nodes."""

    checkpoint_lsn: int = 0
    lag_bytes: int = 0
    checkpoint_lag_seconds: float = 0.0
    slot_retained_wal_bytes: int = 0
    slot_active: bool = False
    prepared_transactions: int = 0  # prepared there, not decided yet (their parts wait, see core.distributed)


@dataclass(frozen=True)
class SinkValues:
    """One sink of a feed of several sinks."""

    checkpoint_lag_seconds: float = 0.0
    resolved_lag_seconds: float = 0.0
    batches: int = 0  # recorded in its ledger
    changes_per_second: float = 0.0  # over its ledger's last minute
    retrying: bool = False  # the feed waits out a failure of this sink
    behind: bool = False  # the others go on without it (--sink-lag-budget), or it is being caught up


@dataclass(frozen=True)
class Values:
    """The latest gauge values; None where nothing was measured yet (the sample is left out)."""

    state: str = "starting"
    reason: str = ""  # why it failed (state failed), or what it waits out (state retrying)
    component: str = ""  # what is retried: source, sink, query
    checkpoint_lag_seconds: float | None = None
    resolved_lag_seconds: float | None = None
    slot_retained_wal_bytes: int | None = None
    changes_per_second: float | None = None
    batch_duration_seconds: float | None = None
    changes_total: int = 0
    batches_total: int = 0
    verify_mismatched_rows: int | None = None  # from the last `verify` (or run --every)
    verify_last_timestamp_seconds: float | None = None  # when it compared (Unix time)
    snapshot: Mapping[str, TableSnapshot] = field(default_factory=dict)
    nodes: Mapping[str, NodeValues] = field(default_factory=dict)  # a feed of several nodes: per node
    sinks: Mapping[str, SinkValues] = field(default_factory=dict)  # a feed of several sinks: per sink


class FeedMetrics:
    """Thread-safe holder of one feed's latest `Values`."""

    def __init__(self, feed: str) -> None:
        self.feed = feed
        self._lock = threading.Lock()
        self._values = Values()

    def update(self, **changed: Any) -> None:
        """Replace the given fields (names of `Values`), keep the others."""
        for name in ("snapshot", "nodes", "sinks"):
            if name in changed:
                changed[name] = dict(changed[name])  # the caller's dict may change later
        with self._lock:
            self._values = replace(self._values, **changed)

    def read(self) -> Values:
        with self._lock:
            return self._values


_Family = type[GaugeMetricFamily] | type[CounterMetricFamily]

# name, family, help, Values field
_SCALARS: tuple[tuple[str, _Family, str, str], ...] = (
    ("changefeed_checkpoint_lag_seconds", GaugeMetricFamily,
     "Age of the replica's last applied resolved timestamp on the source clock, 0 when it has applied all WAL "
     "(the RPO: changes committed that long ago may not be on the replica yet).", "checkpoint_lag_seconds"),
    ("changefeed_resolved_lag_seconds", GaugeMetricFamily,
     "Source clock now minus the last applied resolved timestamp, also while caught up.", "resolved_lag_seconds"),
    ("changefeed_slot_retained_wal_bytes", GaugeMetricFamily,
     "WAL the source keeps for the feed's replication slot (current flush LSN minus restart LSN).",
     "slot_retained_wal_bytes"),
    ("changefeed_changes_per_second", GaugeMetricFamily,
     "Changes applied per second over the last report interval.", "changes_per_second"),
    ("changefeed_batch_duration_seconds", GaugeMetricFamily,
     "Duration of the last completed micro-batch (plan, read, apply, commit).", "batch_duration_seconds"),
    ("changefeed_changes_total", CounterMetricFamily, "Changes applied since this runner started.", "changes_total"),
    ("changefeed_batches_total", CounterMetricFamily, "Batches applied since this runner started.", "batches_total"),
    ("changefeed_verify_mismatched_rows", GaugeMetricFamily,
     "Rows that differed between source and replica at the last verification (verify, run --every).",
     "verify_mismatched_rows"),
    ("changefeed_verify_last_timestamp_seconds", GaugeMetricFamily,
     "When the last verification compared (Unix time).", "verify_last_timestamp_seconds"),
)
_TABLES = (
    ("changefeed_snapshot_rows", "Snapshot rows of the table applied to the replica.", "rows"),
    ("changefeed_snapshot_chunks", "Snapshot chunks of the table applied to the replica.", "chunks"),
    ("changefeed_snapshot_pending", "1 while the table's existing rows are still being read, else 0.", "pending"),
)
_NODES = (
    ("changefeed_node_checkpoint_lsn", "The node's WAL position the replica has applied up to.", "checkpoint_lsn"),
    ("changefeed_node_lag_bytes", "The node's WAL past that position (0 when caught up).", "lag_bytes"),
    ("changefeed_node_checkpoint_lag_seconds", "The node's checkpoint lag (0 when the replica has applied all its "
     "WAL, else the age of the last applied resolved timestamp).", "checkpoint_lag_seconds"),
    ("changefeed_node_slot_retained_wal_bytes", "WAL the node keeps for the feed's slot there.",
     "slot_retained_wal_bytes"),
    ("changefeed_node_slot_active", "1 while a reader holds the node's slot, else 0.", "slot_active"),
    ("changefeed_node_prepared_transactions", "Transactions prepared on the node and not decided yet.",
     "prepared_transactions"),
)

_SINKS = (
    ("changefeed_sink_checkpoint_lag_seconds", "The sink's checkpoint lag (0 when it has all WAL there is, else "
     "the age of its last resolved timestamp): the feed's is the largest.", "checkpoint_lag_seconds"),
    ("changefeed_sink_resolved_lag_seconds", "Source clock now minus the sink's last resolved timestamp.",
     "resolved_lag_seconds"),
    ("changefeed_sink_batches", "Batches the sink's ledger holds.", "batches"),
    ("changefeed_sink_changes_per_second", "Changes the sink recorded per second over the last minute.",
     "changes_per_second"),
    ("changefeed_sink_retrying", "1 while the feed waits out a failure of the sink, else 0.", "retrying"),
    ("changefeed_sink_behind", "1 while the other sinks go on without the sink (--sink-lag-budget) or it is "
     "caught up, else 0.", "behind"),
)


class FeedCollector(Collector):
    """The feed's metric families, built from one `read()` per scrape: every sample of a scrape
    comes from the same update."""

    def __init__(self, metrics: FeedMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        feed, v = self.metrics.feed, self.metrics.read()
        yield _family(GaugeMetricFamily, "changefeed_up", "1 while the feed streams (state running), else 0.",
                      feed, [((), int(v.state == "running"))])
        yield _family(GaugeMetricFamily, "changefeed_state",
                      f"The feed's state: 1 for the current one of {', '.join(STATES)}.",
                      feed, [((s,), int(v.state == s)) for s in STATES], "state")
        yield _family(GaugeMetricFamily, "changefeed_failure_info", "Why the feed failed, while its state is failed.",
                      feed, [((v.reason,), 1)] if v.state == "failed" else [], "reason")
        yield _family(GaugeMetricFamily, "changefeed_retrying_info", "What a running feed waits out (the component "
                      "and the last failure), while its state is retrying.",
                      feed, [((v.component, v.reason), 1)] if v.state == "retrying" else [], "component", "reason")
        for name, kind, text, attr in _SCALARS:
            value = getattr(v, attr)
            yield _family(kind, name, text, feed, [] if value is None else [((), value)])
        tables = sorted(v.snapshot.items())
        for name, text, attr in _TABLES:
            yield _family(GaugeMetricFamily, name, text, feed,
                          [((t,), int(getattr(s, attr))) for t, s in tables], "table")
        nodes = sorted(v.nodes.items())
        for name, text, attr in _NODES if nodes else ():  # a feed of one node has none
            yield _family(GaugeMetricFamily, name, text, feed,
                          [((n,), float(getattr(s, attr))) for n, s in nodes], "node")
        sinks = sorted(v.sinks.items())
        for name, text, attr in _SINKS if sinks else ():  # a feed of one sink has none
            yield _family(GaugeMetricFamily, name, text, feed,
                          [((n,), float(getattr(s, attr))) for n, s in sinks], "sink")


def _family(kind: _Family, name: str, text: str, feed: str, samples: Iterable[tuple[Sequence[str], float]],
            *labels: str) -> Metric:
    """One family labelled `feed` and `labels`; no samples still writes its HELP and TYPE lines."""
    family = kind(name, text, labels=("feed", *labels))
    for values, value in samples:
        family.add_metric((feed, *values), value)
    return family


def feed_registry(metrics: FeedMetrics) -> CollectorRegistry:
    """A registry of `metrics` alone. Not prometheus_client's global default one: that also exports
    the Python process's own metrics, and would be shared by every server of the process."""
    r = CollectorRegistry(auto_describe=False)
    r.register(FeedCollector(metrics))
    return r


def render(metrics: FeedMetrics) -> str:
    """The metrics in Prometheus text exposition format 0.0.4."""
    return generate_latest(feed_registry(metrics)).decode()


def escape_label(value: str) -> str:
    """Label values escape backslash, double quote and newline (as prometheus_client writes them),
    for text that quotes a label outside the endpoint."""
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def format_value(value: float) -> str:
    """A sample value as the text format spells it; whole numbers without the `.0`."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class MetricsServer(ThreadingHTTPServer):
    """Answers GET /metrics from a daemon thread until `close()`, from a registry of its own."""

    daemon_threads = True

    def __init__(self, metrics: FeedMetrics, host: str, port: int) -> None:
        self.metrics = metrics
        self.registry = feed_registry(metrics)
        super().__init__((host, port), _Handler)
        self._thread = threading.Thread(target=self.serve_forever, name="changefeed-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]  # as server_address, but typed str (not str | bytes)
        return f"http://{host}:{port}/metrics"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join()


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer

    def do_GET(self) -> None:  # noqa: N802 (the http.server protocol)
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404, "only /metrics is served here")
            return
        body = generate_latest(self.server.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the name http.server gives it
        """Silent: a scrape every few seconds would drown the feed's own report lines."""


def serve(metrics: FeedMetrics, host: str, port: int) -> MetricsServer:
    """Serve `metrics` on http://HOST:PORT/metrics (port 0: any free one, see `.url`)."""
    try:
        return MetricsServer(metrics, host, port)
    except (OSError, OverflowError) as e:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {getattr(e, 'strerror', None) or e}",
                          "choose a free --metrics-port (0 to 65535; 0 picks a free one) and a --metrics-host "
                          "this machine has, or stop what listens there") from None
