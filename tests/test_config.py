"""Option parsing that needs no server: sizes and durations."""
from __future__ import annotations

import pytest

from changefeed.config import parse_duration, parse_size
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
