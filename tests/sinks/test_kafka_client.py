"""The Kafka sink's client settings over the whole documented option space.

Every documented option with every documented value builds a producer (transactional for
exactly_once) and an admin client that librdkafka accepts: the derived timeouts never contradict
each other or a setting the user gave alone. At the range's edges the sink really delivers a batch
to a broker. What librdkafka still refuses (settings the user gave that contradict each other)
is a ConfigError that names the user's setting.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from changefeed.core.change import BatchProgress
from changefeed.core.envelope import Record
from changefeed.errors import ConfigError
from changefeed.local.kafka import LocalKafka, committed, read_partition
from changefeed.sinks.kafka.admin import check_transactions
from changefeed.sinks.kafka.batch import KafkaBatch
from changefeed.sinks.kafka.client import STEP_MAX_S, STEP_MIN_S, TXN_MAX_MS, Timeouts
from changefeed.sinks.kafka.options import KafkaOptions

pytestmark = pytest.mark.timeout(300)
CA = "/etc/ssl/certs/ca-certificates.crt"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A client certificate and key (PEM files) for the SSL settings librdkafka loads when it starts."""
    if not shutil.which("openssl"):
        pytest.skip("the openssl CLI is not installed")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=client"],
                   check=True, capture_output=True)
    ca = CA if Path(CA).exists() else str(cert)
    return {"ca": ca, "cert": str(cert), "key": str(key)}


def durations(low_ms: int, high_ms: int) -> st.SearchStrategy[str]:
    """A duration in ms written as the option parser takes it: 1500ms, 90s, 2m."""
    def write(ms: int, unit: str) -> str:
        if unit == "m" and ms % 60_000 == 0:
            return f"{ms // 60_000}m"
        if unit in ("s", "m") and ms % 1000 == 0:
            return f"{ms // 1000}s"
        return f"{ms}ms"
    return st.builds(write, st.integers(low_ms, high_ms) | st.sampled_from([low_ms, high_ms, 15_000, 16_000, 30_000]),
                     st.sampled_from(["ms", "s", "m"]))


def security(files: dict[str, str], mechanisms: list[str]) -> st.SearchStrategy[dict[str, str]]:
    """The documented ways to connect (the marker reader speaks all of them but OAUTHBEARER; this
    librdkafka build has no GSSAPI)."""
    sasl = st.fixed_dictionaries({"sasl.mechanism": st.sampled_from(mechanisms),
                                  "sasl.username": st.just("cdc"), "sasl.password": st.just("s3cret")})
    tls = st.fixed_dictionaries({"ssl.ca.location": st.just(files["ca"])}, optional={
        "ssl.endpoint.identification.algorithm": st.sampled_from(["none", "https"]),
        "enable.ssl.certificate.verification": st.sampled_from(["true", "false"])})
    client_cert = st.just({"ssl.certificate.location": files["cert"], "ssl.key.location": files["key"]})
    return st.one_of(
        st.just({}), st.just({"security.protocol": "PLAINTEXT"}),
        st.builds(lambda t, c: {"security.protocol": "SSL", **t, **c}, tls, st.just({}) | client_cert),
        st.builds(lambda s: {"security.protocol": "SASL_PLAINTEXT", **s}, sasl),
        st.builds(lambda s, t: {"security.protocol": "SASL_SSL", **s, **t}, sasl, tls))


def one_timeout_of_the_users() -> st.SearchStrategy[dict[str, str]]:
    """At most one client timeout the user sets himself, anywhere in librdkafka's range (or the broker's)."""
    return st.one_of(
        st.just({}),
        st.builds(lambda v: {"transaction.timeout.ms": str(v)}, st.integers(1000, TXN_MAX_MS)),
        st.builds(lambda k, v: {k: str(v)}, st.sampled_from(["message.timeout.ms", "delivery.timeout.ms"]),
                  st.integers(0, TXN_MAX_MS)),
        st.builds(lambda v: {"socket.timeout.ms": str(v)}, st.integers(10, 300_000)),
        st.builds(lambda k, v: {k: str(v)}, st.sampled_from(["linger.ms", "queue.buffering.max.ms"]),
                  st.integers(0, 300_000)))


@st.composite
def sink_uris(draw: st.DrawFn, files: dict[str, str], tmp: Path) -> str:
    """A Kafka --sink URI from the documented options and values, client settings passed every documented way."""
    delivery = draw(st.sampled_from(["exactly_once", "at_least_once"]))
    options: dict[str, str] = draw(st.fixed_dictionaries({}, optional={
        "topic_prefix": st.sampled_from(["", "cdc.", "prod-"]),
        "topic_name": st.sampled_from(["{schema}.{table}", "{table}", "db.{schema}-{table}"]),
        "tombstones": st.sampled_from(["true", "false"]), "resolved": st.sampled_from(["true", "false"]),
        "progress_topic": st.sampled_from(["_changefeed_progress", "cdc.progress"]),
        "create_topics": st.sampled_from(["true", "false"]),
        "topic_partitions": st.sampled_from(["-1", "1", "12"]), "replication_factor": st.sampled_from(["-1", "3"]),
        "timeout": durations(int(STEP_MIN_S * 1000), int(STEP_MAX_S * 1000))}))
    if delivery == "at_least_once" or draw(st.booleans()):  # exactly_once is the default
        options["delivery"] = delivery
    reader = draw(st.sampled_from(["", "auto", "consumer", "markers"]))
    if reader:
        options["progress_reader"] = reader
    mechanisms = ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]
    if reader != "markers" or delivery == "at_least_once":  # librdkafka alone reads the progress
        mechanisms.append("OAUTHBEARER")
    codecs = ["none", "gzip", "lz4", "snappy", "zstd"]
    client: dict[str, str] = {**draw(security(files, mechanisms)), **draw(one_timeout_of_the_users()),
                              **draw(st.fixed_dictionaries({}, optional={
                                  "compression.type": st.sampled_from(codecs),
                                  "log_level": st.integers(0, 7).map(str)}))}
    how = draw(st.sampled_from(["dotted", "kafka_config", "file"]))
    if how == "dotted":
        options.update(client)
    elif client:
        text = json.dumps(client)
        if how == "file":
            path = tmp / f"{uuid.uuid4().hex}.json"
            path.write_text(text)
            text = f"@{path}"
        options["kafka_config"] = text
    return "kafka://127.0.0.1:9092" + (f"?{urlencode(options)}" if options else "")


def test_every_documented_option_value_builds_a_client_librdkafka_accepts(tls_files: dict[str, str],
                                                                          tmp_path: Path) -> None:
    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(sink_uris(tls_files, tmp_path))
    def check(uri: str) -> None:
        opts = KafkaOptions.parse(uri)
        opts.check_client("feed_1")  # constructs the (transactional) producer and the admin client
        config = opts.producer_config("feed_1")
        t = opts.timeouts
        assert ("transactional.id" in config) == (opts.delivery == "exactly_once")
        if t.transaction_ms is not None:
            assert t.delivery_ms <= t.transaction_ms and t.socket_ms <= t.transaction_ms + 100
        assert t.delivery_ms == 0 or t.delivery_ms > t.linger_ms
        if not t.given:  # derived from timeout= alone: within the broker's default cap and the step
            assert t.socket_ms <= t.step_ms and (t.transaction_ms or 0) <= TXN_MAX_MS

    check()


@pytest.mark.parametrize("step_s", [STEP_MIN_S, 15, 16, 30, 225, 300, STEP_MAX_S])
def test_derived_timeouts_hold_librdkafkas_rules(step_s: float) -> None:
    for transactional in (True, False):
        t = Timeouts.derive(step_s, {}, transactional=transactional)
        assert t.delivery_ms > t.linger_ms and t.socket_ms <= min(t.step_ms, 300_000)
        if transactional:
            assert t.transaction_ms is not None and 60_000 <= t.transaction_ms <= TXN_MAX_MS
            assert t.delivery_ms == t.transaction_ms >= min(4 * t.step_ms, TXN_MAX_MS)


def test_the_default_options_build_a_transactional_producer() -> None:
    """The defect this guards: with no options, message.timeout.ms (4 x 30 s) exceeded the client's
    default transaction.timeout.ms (60 s), and librdkafka refused to create the producer."""
    opts = KafkaOptions.parse("kafka://127.0.0.1:9092")
    opts.check_client("f")
    config = opts.producer_config("f")
    assert config["message.timeout.ms"] <= config["transaction.timeout.ms"]


def progress(end_lsn: int) -> BatchProgress:
    return BatchProgress(end_lsn, end_lsn * 10, None, 1, ())


@pytest.mark.parametrize("timeout", ["1s", "15s", "16s", "30s", "4m", "15m"])
@pytest.mark.parametrize("delivery", ["exactly_once", "at_least_once"])
def test_the_edges_of_the_range_deliver_to_a_broker(kafka: LocalKafka, timeout: str, delivery: str) -> None:
    prefix = f"e{uuid.uuid4().hex[:8]}."
    opts = KafkaOptions.parse(f"kafka://{kafka.bootstrap}?timeout={timeout}&delivery={delivery}&topic_prefix={prefix}"
                              f"&topic_partitions=1&progress_topic={prefix}progress")
    if delivery == "exactly_once":
        check_transactions(opts, "edge")
    out = KafkaBatch(opts, "edge", "q", 0)
    assert out.open() is None
    out.send(opts.topic("public", "t"), Record(b"[1]", b'{"v":1}'))
    out.close(progress(100))
    records = read_partition(kafka.bootstrap, opts.topic("public", "t"))
    assert [r.value for r in committed(records)] == [b'{"v":1}']
    assert {r.outcome for r in records} == ({"committed"} if delivery == "exactly_once" else {"none"})


@pytest.mark.parametrize("query, named", [
    ('kafka_config={"acks":"1"}', "acks=1"),
    ("request.required.acks=0", "request.required.acks=0"),
    ("max.in.flight.requests.per.connection=6", "max.in.flight.requests.per.connection=6"),
    ("transaction.timeout.ms=20000&socket.timeout.ms=60000", "socket.timeout.ms=60000"),
    ("message.timeout.ms=300000&transaction.timeout.ms=60000", "message.timeout.ms=300000"),
    ("transaction.timeout.ms=1000&linger.ms=5000", "linger.ms=5000"),
    ("transaction.timeout.ms=10", "transaction.timeout.ms=10"),
    ("queuing.strategy=lifo", "queuing.strategy=lifo"),
    ("no.such.setting=1", "no.such.setting=1"),
])
def test_settings_the_client_refuses_are_named_as_the_user_gave_them(query: str, named: str) -> None:
    opts = KafkaOptions.parse(f"kafka://127.0.0.1:9092?{query}&sasl.password=hunter2")
    with pytest.raises(ConfigError) as e:
        opts.check_client("f")
    assert named in e.value.message and "hunter2" not in str(e.value)
    assert named.split("=")[0] in e.value.hint and "--sink URI" in e.value.hint


@pytest.mark.parametrize("query", ["timeout=0", "timeout=999ms", "timeout=16m", "timeout=soon"])
def test_timeout_outside_its_range_is_refused_when_parsed(query: str) -> None:
    with pytest.raises(ConfigError) as e:
        KafkaOptions.parse(f"kafka://k:9092?{query}")
    assert "timeout" in str(e.value)


def test_a_batch_time_refusal_names_the_users_setting() -> None:
    """Refusals are named the same way if they reach a writer task (run's checks come first)."""
    from confluent_kafka import KafkaError, KafkaException

    from changefeed.sinks.kafka.failures import kafka_error

    opts = KafkaOptions.parse('kafka://k:9092?kafka_config={"acks":"1"}')
    error: Any = kafka_error(KafkaException(KafkaError(KafkaError._INVALID_ARG, "`acks` must be set to `all` when "
                                                       "`enable.idempotence` is true")), "starting the producer", opts)
    assert isinstance(error, ConfigError) and "acks=1" in error.message
