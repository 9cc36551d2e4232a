"""Option parsing that needs no server: sizes, durations, outbox options."""
from __future__ import annotations

from pathlib import Path

import pytest

from changefeed.config import FeedSpec, FeedState, parse_duration, parse_size
from changefeed.errors import ConfigError


@pytest.mark.parametrize("text, seconds", [("1s", 1.0), ("500ms", 0.5), ("2m", 120.0), ("1.5", 1.5), ("0", 0.0),
                                           (" 3 H ", 10800.0)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "-1s", "1 sec", "1s2"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="not a duration"):
        parse_duration(text)


@pytest.mark.parametrize("text, size", [("64MB", 64 << 20), ("1g", 1 << 30), ("1000", 1000), ("8kib", 8192)])
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


KAFKA = "kafka://127.0.0.1:9092"


def outbox_feed(**given: object) -> FeedSpec:
    base: dict[str, object] = {"name": "f", "source": "postgresql://h/db", "sink": KAFKA,
                               "tables": ("public.a", "public.outbox"), "outbox": "public.outbox"}
    return FeedSpec(**{**base, **given}).validate()  # type: ignore[arg-type]


def test_outbox_options_round_trip() -> None:
    spec = outbox_feed(outbox_columns="payload=body", outbox_topic="ev.{event_type}", outbox_ttl_s=60.0)
    assert FeedSpec.from_json(spec.to_json(), "test") == spec
    outbox = spec.outbox_spec
    assert outbox is not None and outbox.column("payload") == "body" and outbox.ttl_s == 60.0
    assert FeedSpec("f", "postgresql://h/db", KAFKA, ("public.a",)).validate().outbox_spec is None


@pytest.mark.parametrize("given, words", [
    ({"sink": "postgresql://h/replica"}, "needs a message sink"),
    ({"tables": ("public.a",)}, "not among the captured --tables"),
    ({"outbox": "outbox"}, "schema.table"),
    ({"outbox_topic": "ev.{table}"}, "unknown fields"),
    ({"outbox_columns": "id"}, "ROLE=COLUMN"),
    ({"outbox_ttl_s": -1.0}, "must not be negative"),
])
def test_outbox_options_refused(given: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        outbox_feed(**given)


def test_cli_captures_the_outbox_table(tmp_path: Path) -> None:
    from changefeed.cli import _spec_from_args, parser

    args = parser().parse_args(["run", "--name", "f", "--source", "postgresql://h/db", "--sink", KAFKA,
                                "--tables", "a", "--outbox", "outbox", "--outbox-ttl", "10m",
                                "--state", str(tmp_path)])
    spec = _spec_from_args(args, FeedState(tmp_path, "f"))
    assert spec.tables == ("public.a", "public.outbox") and spec.outbox == "public.outbox"
    assert spec.outbox_ttl_s == 600.0
