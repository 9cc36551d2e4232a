"""The marker reader: transaction outcomes from a real broker's control markers, the
backwards-growing tail window, every codec librdkafka writes, and the SASL/TLS settings it accepts."""
from __future__ import annotations

import uuid
from typing import Any

import pytest
from confluent_kafka import Producer

from changefeed.errors import AuthenticationFailed, ConfigError
from changefeed.sinks.kafka.log import PartitionReader, last_committed, read_partition, scram, unsupported_settings
from changefeed.sinks.kafka.options import KafkaOptions
from changefeed.sinks.kafka.records import CorruptLog, batches, decompress

pytestmark = pytest.mark.timeout(120)


def _config(kafka: Any) -> dict[str, str]:
    return {"bootstrap.servers": kafka.bootstrap, "log_level": "0"}


def _topic(kafka: Any) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    name = f"log-{uuid.uuid4().hex[:8]}"
    admin = AdminClient(_config(kafka))
    admin.create_topics([NewTopic(name, 1, -1)])[name].result()
    return name


def _txn_producer(kafka: Any, tid: str, **extra: Any) -> Producer:
    p = Producer({**_config(kafka), "transactional.id": tid, **extra})
    p.init_transactions(10)
    return p


def _txn(p: Producer, topic: str, items: list[tuple[bytes, bytes]], *, commit: bool) -> None:
    p.begin_transaction()
    for key, value in items:
        p.produce(topic, key=key, value=value)
    p.flush(10)
    (p.commit_transaction if commit else p.abort_transaction)(10)


def test_outcomes_follow_the_markers(kafka: Any) -> None:
    topic = _topic(kafka)
    p = _txn_producer(kafka, f"t-{topic}")
    _txn(p, topic, [(b"f", b"1"), (b"g", b"x")], commit=True)
    _txn(p, topic, [(b"f", b"2")], commit=False)
    p.begin_transaction()
    p.produce(topic, key=b"f", value=b"3")
    p.flush(10)  # left open
    records = read_partition(_config(kafka), topic)
    assert [(r.value, r.outcome) for r in records] == [(b"1", "committed"), (b"x", "committed"),
                                                       (b"2", "aborted"), (b"3", "open")]
    assert last_committed(_config(kafka), topic, 0, lambda r: r.key == b"f").value == b"1"  # type: ignore[union-attr]
    assert last_committed(_config(kafka), topic, 0, lambda r: r.key == b"nobody") is None
    p.abort_transaction(10)


def test_the_window_grows_back_until_a_match(kafka: Any) -> None:
    topic = _topic(kafka)
    p = _txn_producer(kafka, f"t-{topic}")
    _txn(p, topic, [(b"feed", b"old")], commit=True)
    for i in range(5):  # 25 records of other keys after it, some aborted
        _txn(p, topic, [(b"other", str(i).encode())] * 5, commit=i % 2 == 0)
    found = last_committed(_config(kafka), topic, 0, lambda r: r.key == b"feed", window=2)
    assert found is not None and found.value == b"old" and found.offset == 0
    # a match inside the first window wins over older ones, and an aborted one never does
    _txn(p, topic, [(b"feed", b"new")], commit=True)
    _txn(p, topic, [(b"feed", b"gone")], commit=False)
    assert last_committed(_config(kafka), topic, 0, lambda r: r.key == b"feed", window=3).value == b"new"  # type: ignore[union-attr]


def test_plain_records_and_gzip_batches(kafka: Any) -> None:
    topic = _topic(kafka)
    p = Producer({**_config(kafka), "compression.type": "gzip", "linger.ms": 50})
    for i in range(50):
        p.produce(topic, key=b"k", value=b"v%d" % i, headers=[("h", b"x")])
    p.flush(10)
    records = read_partition(_config(kafka), topic)
    assert [r.value for r in records] == [b"v%d" % i for i in range(50)]
    assert {r.outcome for r in records} == {"none"} and records[0].headers == [("h", b"x")]
    assert read_partition(_config(kafka), topic, start=48)[0].value == b"v48"


_CODECS = {"gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}


@pytest.mark.parametrize("codec", list(_CODECS))
def test_every_codec_librdkafka_writes_is_read_with_its_outcomes(kafka: Any, codec: str) -> None:
    """Batches as librdkafka compresses them (many records each), in committed and aborted
    transactions: the marker reader decodes them all and tells the outcomes apart."""
    topic = _topic(kafka)
    p = _txn_producer(kafka, f"t-{topic}", **{"compression.type": codec, "linger.ms": 20})
    big = [(b"k%d" % i, b"committed %d " % i * 40) for i in range(300)]
    _txn(p, topic, big, commit=True)
    _txn(p, topic, [(b"k", b"aborted %d " % i * 40) for i in range(50)], commit=False)
    _txn(p, topic, [(b"feed", b"last")], commit=True)
    records = read_partition(_config(kafka), topic)
    assert [(r.key, r.value) for r in records if r.outcome == "committed"] == big + [(b"feed", b"last")]
    assert [r.outcome for r in records if r.outcome != "committed"] == ["aborted"] * 50
    with PartitionReader(_config(kafka), topic) as reader:
        data = reader._fetch(0)[2]
    assert _CODECS[codec] in {attributes & 7 for _, _, attributes, *_ in batches(data)}  # compressed indeed
    found = last_committed(_config(kafka), topic, 0, lambda r: r.key == b"feed", window=3)
    assert found is not None and found.value == b"last"


def test_snappy_in_the_java_clients_xerial_framing() -> None:
    import cramjam

    data = b"".join(b"record %d;" % i for i in range(5000))
    blocks = [bytes(cramjam.snappy.compress_raw(data[i:i + 8192])) for i in range(0, len(data), 8192)]
    framed = b"\x82SNAPPY\x00" + bytes([0, 0, 0, 1, 0, 0, 0, 1]) + b"".join(
        len(b).to_bytes(4, "big") + b for b in blocks)
    assert decompress(2, framed) == data
    assert decompress(2, bytes(cramjam.snappy.compress_raw(data))) == data  # raw, as librdkafka writes


def test_a_damaged_or_unknown_batch_is_a_clear_error() -> None:
    import struct

    def batch(attributes: int, payload: bytes) -> bytes:
        body = struct.pack(">ibihiqqqhii", 0, 2, 0, attributes, 0, 0, 0, -1, -1, -1, 1) + payload
        return struct.pack(">qi", 7, len(body)) + body

    with pytest.raises(CorruptLog, match="offset 7 does not decode as lz4"):
        list(batches(batch(3, b"not lz4 at all")))
    with pytest.raises(CorruptLog, match="as 5"):
        list(batches(batch(5, b"")))


@pytest.mark.parametrize("settings, words", [
    ({"security.protocol": "SASL_SSL"}, "GSSAPI"),
    ({"security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER"}, "OAUTHBEARER"),
    ({"security.protocol": "SSL", "ssl.keystore.location": "/k.p12"}, "ssl.keystore.location"),
    ({"security.protocol": "kerberos"}, "PLAINTEXT"),
])
def test_settings_the_reader_cannot_use(settings: dict[str, str], words: str) -> None:
    """Refused with progress_reader=markers; accepted with auto (the probe decides at start) or consumer."""
    assert words in (unsupported_settings(settings) or "")
    query = "&".join(f"{k}={v}" for k, v in settings.items())
    with pytest.raises(ConfigError, match="progress_reader=markers") as e:
        KafkaOptions.parse(f"kafka://k:9092?{query}&progress_reader=markers")
    assert words in str(e.value) and "progress_reader=consumer" in e.value.hint and "at_least_once" in e.value.hint
    for accepted in ("", "&progress_reader=auto", "&progress_reader=consumer", "&delivery=at_least_once"):
        KafkaOptions.parse(f"kafka://k:9092?{query}{accepted}")  # librdkafka can


@pytest.mark.parametrize("settings", [
    {}, {"security.protocol": "SSL", "ssl.ca.location": "/ca.pem"},
    {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512"},
    {"security.protocol": "sasl_plaintext", "sasl.mechanisms": "PLAIN"},
    *({"compression.type": codec} for codec in _CODECS),
])
def test_settings_the_reader_can_use(settings: dict[str, str]) -> None:
    assert unsupported_settings(settings) is None
    query = "&".join(f"{k}={v}" for k, v in settings.items())
    KafkaOptions.parse(f"kafka://k:9092?{query}&progress_reader=markers")


# RFC 7677's SCRAM-SHA-256 example exchange (user "user", password "pencil")
_NONCE = "rOprNGfwEbeRWgbNEkqO"
_SERVER_FIRST = f"r={_NONCE}%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
_CLIENT_FINAL = f"c=biws,r={_NONCE}%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
_SERVER_FINAL = "v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="


def _server(final: str) -> tuple[list[bytes], Any]:
    sent: list[bytes] = []

    def exchange(data: bytes) -> bytes:
        sent.append(data)
        return (_SERVER_FIRST if len(sent) == 1 else final).encode()
    return sent, exchange


def test_scram_sha256_matches_the_rfc_example() -> None:
    sent, exchange = _server(_SERVER_FINAL)
    scram("SCRAM-SHA-256", "user", "pencil", exchange, nonce=_NONCE)
    assert sent == [f"n,,n=user,r={_NONCE}".encode(), _CLIENT_FINAL.encode()]


def test_scram_refuses_a_server_that_does_not_know_the_password() -> None:
    _, exchange = _server("v=AAAA" + _SERVER_FINAL[6:])
    with pytest.raises(AuthenticationFailed, match="signature"):
        scram("SCRAM-SHA-256", "user", "pencil", exchange, nonce=_NONCE)
    _, exchange = _server(_SERVER_FINAL)
    with pytest.raises(AuthenticationFailed, match="signature"):  # a wrong password changes the expected signature
        scram("SCRAM-SHA-256", "user", "pencil2", exchange, nonce=_NONCE)
