"""Lag you can see: a running feed (its own process) serves /metrics and `status --json` reports
the lags, rate and batch duration, with sane values; SIGTERM still stops it cleanly."""
from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.feeds import changefeed_cli, start_changefeed, wait_for
from support.servers import Dbs, free_port

pytestmark = pytest.mark.timeout(300)


def scrape(port: int) -> dict[tuple[str, str], float]:
    """(sample name, its table or state label) -> value; empty while nothing answers yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return {}
    return {(s.name, s.labels.get("table") or s.labels.get("state", "")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def scraped(what: str, port: int, ok: Callable[[dict[tuple[str, str], float]], bool], log: Path,
            timeout: float = 180) -> dict[tuple[str, str], float]:
    """The first scrape for which `ok` holds."""
    return wait_for(what, lambda: (m := scrape(port)) and ok(m) and m, log, timeout)  # type: ignore[no-any-return]


@pytest.mark.usefixtures("warm_spark")
def test_metrics_endpoint_and_status_show_the_lag(dbs: Dbs, tmp_path: Path) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        c.execute("INSERT INTO t SELECT g, 'old' FROM generate_series(1, 500) g")
    port, state, log = free_port(), str(tmp_path / "state"), tmp_path / "run.log"
    p = start_changefeed("run", "--name", dbs.name, "--state", state, "--source", dbs.source, "--sink", dbs.sink,
                         "--tables", "public.t", "--resolved", "500ms", "--metrics-port", str(port), log=log)
    try:
        m0 = scraped("the snapshot done", port, lambda m: m.get(("changefeed_snapshot_rows", "public.t")) == 500
                     and m[("changefeed_snapshot_pending", "public.t")] == 0, log)
        assert m0[("changefeed_snapshot_chunks", "public.t")] >= 1
        with dbs.src() as c:
            c.execute("INSERT INTO t SELECT g, 'new' FROM generate_series(501, 1500) g")
            c.execute("UPDATE t SET v = 'changed' WHERE id <= 100")
        m = scraped("1,100 more changes and a batch duration", port,
                    lambda m: m[("changefeed_changes_total", "")] >= m0[("changefeed_changes_total", "")] + 1100
                    and ("changefeed_batch_duration_seconds", "") in m, log)
        assert m[("changefeed_state", "running")] == 1
        assert m[("changefeed_up", "")] == 1
        assert m[("changefeed_batches_total", "")] >= 1
        assert 0 <= m[("changefeed_checkpoint_lag_seconds", "")] < 60
        assert 0 <= m[("changefeed_resolved_lag_seconds", "")] < 60
        assert m[("changefeed_slot_retained_wal_bytes", "")] > 0
        assert m[("changefeed_changes_per_second", "")] >= 0
        assert 0 < m[("changefeed_batch_duration_seconds", "")] < 60

        out = changefeed_cli("status", "--name", dbs.name, "--state", state, "--json", timeout=60)
        assert out.returncode == 0, out.stderr
        st = json.loads(out.stdout)
        assert st["state"].startswith("running (pid ")
        assert 0 <= st["lag_seconds"] <= st["resolved_lag_seconds"] < 60
        assert st["changes_per_second_last_minute"] > 0  # 1,600 changes within the last minute
        assert 0 <= st["last_batch_apply_seconds"] < 60
        table = changefeed_cli("status", "--name", dbs.name, "--state", state, timeout=60).stdout
        for line in ("resolved lag seconds: ", "changes per second last minute: ", "last batch apply seconds: "):
            assert line in table, table
    finally:
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=120)
    assert rc == 0, log.read_text()[-3000:]
    assert f"metrics on http://127.0.0.1:{port}/metrics" in log.read_text()
    assert scrape(port) == {}  # the endpoint closed with the feed
