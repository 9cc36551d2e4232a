"""secrets.py: references resolved where used, literal secrets stored encrypted, errors that never show a value."""
from __future__ import annotations

import json
import stat
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.errors import ConfigError
from changefeed.spec import secrets


@pytest.fixture(autouse=True)
def key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "keys" / "secret.key"
    monkeypatch.setenv(secrets.KEY_FILE_ENV, str(path))
    monkeypatch.delenv(secrets.KEY_ENV, raising=False)
    return path


@settings(max_examples=60, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30))
def test_a_literal_password_is_stored_encrypted_and_comes_back_whole(password: str) -> None:
    uri = f"postgresql://app:{quote(password, safe='')}@db.example:5432/shop?sslmode=require"
    stored = secrets.protect_uri(uri, "--source")
    assert (urlsplit(stored).password or "").startswith("${enc.")
    assert stored.endswith("@db.example:5432/shop?sslmode=require")
    stored_password = stored.removeprefix("postgresql://app:").removesuffix("@db.example:5432/shop?sslmode=require")
    assert len(password) < 4 or password not in stored_password  # ("post" is in the scheme, not a leak)
    assert secrets.protect_uri(stored, "--source") == stored  # stored once, stays so
    back = urlsplit(secrets.resolve(stored, "--source", in_uri=True))
    assert unquote(back.password or "") == password
    assert back.hostname == "db.example" and back.query == "sslmode=require"


def test_the_key_file_is_made_once_for_its_owner_only(key_file: Path) -> None:
    secrets.protect_uri("postgresql://a:b@h/d", "--source")
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    before = key_file.read_text()
    secrets.protect_uri("postgresql://a:c@h/d", "--source")
    assert key_file.read_text() == before


def test_references_are_kept_and_resolved_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    uri = "postgresql://app:${PG_PASS}@h/d"
    assert secrets.protect_uri(uri, "--source") == uri and secrets.references(uri) == ["PG_PASS"]
    monkeypatch.setenv("PG_PASS", "p@ss:word/")
    assert urlsplit(secrets.resolve(uri, "--source", in_uri=True)).password == quote("p@ss:word/", safe="")
    assert secrets.resolve("Bearer ${PG_PASS}", "header") == "Bearer p@ss:word/"
    monkeypatch.delenv("PG_PASS")
    with pytest.raises(ConfigError, match=r"--source names the environment variable PG_PASS .*not set") as e:
        secrets.resolve(uri, "--source")
    assert "export PG_PASS" in e.value.hint


def test_secret_settings_of_every_sink_are_encrypted_and_the_rest_left_as_written() -> None:
    kafka = ("kafka://b:9092?topic_prefix=x.&sasl.password=hunter2&sasl.username=u&"
             'kafka_config={"ssl.key.password":"k3y","acks":"all"}')
    stored = secrets.protect_uri(kafka, "--sink")
    assert "hunter2" not in stored and "k3y" not in stored
    pairs = dict(parse_qsl(urlsplit(stored).query))
    assert pairs["sasl.username"] == "u" and pairs["topic_prefix"] == "x."
    assert secrets.resolve(pairs["sasl.password"], "x") == "hunter2"
    config = json.loads(pairs["kafka_config"])
    assert config["acks"] == "all" and secrets.resolve(config["ssl.key.password"], "x") == "k3y"
    hook = "webhook-https://u:pw@h/p?header=Authorization:Bearer%20t0k&signing_secret=whsec_abc&flush_messages=5"
    stored = secrets.protect_uri(hook, "--sink")
    # (the tokens are random base64: a short plain text may turn up in one by chance)
    assert urlsplit(stored).password not in (None, "pw") and "Bearer%20t0k" not in stored
    assert "Bearer t0k" not in unquote(stored) and "whsec_abc" not in stored
    assert "flush_messages=5" in stored
    plain = "kafka://b:9092?topic_prefix=a%2Eb&acks=all"
    assert secrets.protect_uri(plain, "--sink") == plain  # nothing secret: the text as given


def test_a_secret_encrypted_with_another_key_is_named_not_shown(key_file: Path) -> None:
    stored = secrets.protect_uri("postgresql://a:topsecret@h/d", "--source")
    key_file.unlink()
    with pytest.raises(ConfigError, match="missing") as missing:
        secrets.resolve(stored, "--source")
    secrets.encrypt("x")  # a new key
    with pytest.raises(ConfigError, match="encrypted with another key") as other:
        secrets.resolve(stored, "--source")
    assert "topsecret" not in str(missing.value) + str(other.value)


def test_a_uri_without_an_authority_keeps_its_shape() -> None:
    """`delta:///path` has an empty authority: storing the URI must not turn it into `delta:/path`."""
    plain = "delta:///tmp/lake?mode=mirror&buckets=4"
    assert secrets.protect_uri(plain, "--sink") == plain
    stored = secrets.protect_uri("delta:///tmp/lake?storage.AWS_SECRET_ACCESS_KEY=k3y&mode=mirror", "--sink")
    assert stored.startswith("delta:///tmp/lake?storage.AWS_SECRET_ACCESS_KEY=${enc.") and "k3y" not in stored
    assert secrets.resolve(stored, "--sink") == "delta:///tmp/lake?storage.AWS_SECRET_ACCESS_KEY=k3y&mode=mirror"


@settings(max_examples=60, deadline=None)
@given(value=st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=1, max_size=40))
def test_a_secret_query_setting_comes_back_whole(value: str) -> None:
    """Whatever the token's padding and the value's characters, the stored setting resolves to the value."""
    uri = "kafka://b:9092?" + urlencode({"sasl.password": value, "acks": "all"})
    stored = secrets.protect_uri(uri, "--sink")
    back = secrets.resolve(stored, "--sink", in_uri=True)
    assert parse_qsl(urlsplit(back).query) == [("sasl.password", value), ("acks", "all")]
