"""The metrics endpoint without a feed: rendering (checked by Prometheus' own parser), escaping,
consistency under concurrent updates, and the HTTP server (port 0, 404, typed bind errors)."""
from __future__ import annotations

import math
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from changefeed.control.metrics import (
    STATES,
    FeedMetrics,
    MetricsServer,
    NodeValues,
    SinkValues,
    TableSnapshot,
    escape_label,
    format_value,
    render,
    serve,
)
from changefeed.errors import ConfigError


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, as Prometheus reads the text."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, tuple(sorted({"feed": "orders", **labels}.items())))]


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    s = serve(FeedMetrics("orders"), "127.0.0.1", 0)
    yield s
    s.close()


def test_a_new_feed_renders_starting_and_no_measurements() -> None:
    text = render(FeedMetrics("orders"))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert value(text, "changefeed_up") == 0
    assert {s.labels["state"]: s.value for s in families["changefeed_state"].samples} == \
           {s: float(s == "starting") for s in STATES}
    assert families["changefeed_checkpoint_lag_seconds"].samples == []  # not measured yet: no sample, no 0
    assert families["changefeed_failure_info"].samples == []
    assert value(text, "changefeed_changes_total") == 0
    for line in text.splitlines():
        assert line.startswith(("# HELP changefeed_", "# TYPE changefeed_", "changefeed_")), line


def test_renders_every_value_with_its_type() -> None:
    m = FeedMetrics("orders")
    m.update(state="running", checkpoint_lag_seconds=1.25, resolved_lag_seconds=0.5, slot_retained_wal_bytes=123456,
             changes_per_second=1500.0, batch_duration_seconds=0.75, changes_total=42, batches_total=7,
             snapshot={"public.a": TableSnapshot(3, 150_000, True), "public.b": TableSnapshot(1, 10, False)})
    text = render(m)
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert families["changefeed_changes"] == "counter" and families["changefeed_batches"] == "counter"
    assert families["changefeed_checkpoint_lag_seconds"] == "gauge"
    assert value(text, "changefeed_up") == 1
    assert value(text, "changefeed_state", state="running") == 1
    assert value(text, "changefeed_state", state="failed") == 0
    assert value(text, "changefeed_checkpoint_lag_seconds") == 1.25
    assert value(text, "changefeed_resolved_lag_seconds") == 0.5
    assert value(text, "changefeed_slot_retained_wal_bytes") == 123456
    assert value(text, "changefeed_changes_per_second") == 1500
    assert value(text, "changefeed_batch_duration_seconds") == 0.75
    assert value(text, "changefeed_changes_total") == 42
    assert value(text, "changefeed_batches_total") == 7
    assert value(text, "changefeed_snapshot_rows", table="public.a") == 150_000
    assert value(text, "changefeed_snapshot_chunks", table="public.a") == 3
    assert value(text, "changefeed_snapshot_pending", table="public.a") == 1
    assert value(text, "changefeed_snapshot_pending", table="public.b") == 0
    assert "# TYPE changefeed_changes_total counter\n" in text  # 0.0.4: the TYPE line names the sample


def test_label_values_and_reasons_are_escaped() -> None:
    odd = 'sch"ema.ta\\ble\nnext'
    reason = 'replication slot "changefeed_orders" was invalidated\nC:\\wal'
    m = FeedMetrics("orders")
    m.update(state="failed", reason=reason, snapshot={odd: TableSnapshot(1, 2)})
    text = render(m)
    assert 'table="sch\\"ema.ta\\\\ble\\nnext"' in text
    assert value(text, "changefeed_snapshot_rows", table=odd) == 2  # the parser reads back the original
    assert value(text, "changefeed_failure_info", reason=reason) == 1
    assert value(text, "changefeed_state", state="failed") == 1 and value(text, "changefeed_up") == 0


def test_escape_label_and_format_value() -> None:
    assert escape_label('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    assert escape_label("plain") == "plain"
    assert [format_value(v) for v in (3, 0.1, math.nan, math.inf, -math.inf)] == ["3", "0.1", "NaN", "+Inf", "-Inf"]


def test_a_scrape_never_sees_half_an_update() -> None:
    m = FeedMetrics("orders")
    stop = threading.Event()

    def writer() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            m.update(changes_total=2 * n, batches_total=n, snapshot={f"public.t{n % 3}": TableSnapshot(n, n)})

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(300):
            text = render(m)
            assert value(text, "changefeed_changes_total") == 2 * value(text, "changefeed_batches_total")
    finally:
        stop.set()
        t.join()


def test_serves_metrics_on_a_free_port(server: MetricsServer) -> None:
    server.metrics.update(state="running", changes_total=5)
    assert server.server_address[1] > 0 and server.url.endswith(f":{server.server_address[1]}/metrics")
    with urllib.request.urlopen(server.url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        body = r.read().decode()
    assert body == render(server.metrics)
    assert value(body, "changefeed_changes_total") == 5


@pytest.mark.parametrize("path", ["/", "/metricsx", "/favicon.ico"])
def test_other_paths_are_404(server: MetricsServer, path: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(server.url.replace("/metrics", path), timeout=10)
    assert e.value.code == 404


def test_close_stops_listening() -> None:
    s = serve(FeedMetrics("orders"), "127.0.0.1", 0)
    port = s.server_address[1]
    s.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_taken_port_is_a_config_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as e:
            serve(FeedMetrics("orders"), "127.0.0.1", port)
    assert f"127.0.0.1:{port}" in e.value.message and "--metrics-port" in e.value.hint


@pytest.mark.parametrize("host,port", [("127.0.0.1", 70000), ("127.0.0.1", -1), ("no-such-host.invalid", 0)])
def test_an_invalid_port_or_host_is_a_config_error(host: str, port: int) -> None:
    with pytest.raises(ConfigError) as e:
        serve(FeedMetrics("orders"), host, port)
    assert f"{host}:{port}" in e.value.message


def test_a_feed_of_several_nodes_reports_each_node() -> None:
    m = FeedMetrics("orders")
    assert "changefeed_node_" not in render(m)  # a one-node feed has none
    m.update(nodes={"east": NodeValues(1000, 24, 1.5, 4096, True, 2), "west": NodeValues(900, 0, 0.0, 0, False, 0)})
    text = render(m)
    assert value(text, "changefeed_node_lag_bytes", node="east") == 24
    assert value(text, "changefeed_node_checkpoint_lag_seconds", node="east") == 1.5
    assert value(text, "changefeed_node_slot_active", node="west") == 0
    assert value(text, "changefeed_node_prepared_transactions", node="east") == 2
    assert value(text, "changefeed_node_checkpoint_lsn", node="west") == 900


def test_a_feed_of_several_sinks_renders_each_sink_by_label() -> None:
    m = FeedMetrics("orders")
    text = render(m)
    assert not any(name.startswith("changefeed_sink_") for name, _ in samples(text))  # one sink: none
    m.update(sinks={"dr": SinkValues(0.0, 0.4, 12, 250.5), "events": SinkValues(3.5, 3.5, 9, 0.0, retrying=True)})
    text = render(m)
    assert value(text, "changefeed_sink_checkpoint_lag_seconds", sink="events") == 3.5
    assert value(text, "changefeed_sink_resolved_lag_seconds", sink="dr") == 0.4
    assert value(text, "changefeed_sink_batches", sink="dr") == 12
    assert value(text, "changefeed_sink_changes_per_second", sink="dr") == 250.5
    assert (value(text, "changefeed_sink_retrying", sink="events"), value(text, "changefeed_sink_retrying",
                                                                         sink="dr")) == (1, 0)
