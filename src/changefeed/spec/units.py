"""Option values as people write them: tables, sizes, durations."""
from __future__ import annotations

import re

from changefeed.errors import ConfigError


def parse_tables(text: str) -> tuple[str, ...]:
    return tuple(t.strip() if "." in t else f"public.{t.strip()}" for t in text.split(",") if t.strip())


def parse_size(text: str) -> int:
    """'64MB', '1g', '1000' -> bytes."""
    m = re.match(r"^\s*(\d+)\s*([kmgt]?)i?b?\s*$", text.lower())
    if not m:
        raise ConfigError(f"not a size: {text!r}", "use e.g. 64MB, 1GB or a number of bytes")
    return int(m.group(1)) << (10 * " kmgt".index(m.group(2) or " "))  # x 1024 per unit step


def parse_duration(text: str) -> float:
    """'1s', '500ms', '2m', '1.5' (seconds) -> seconds."""
    m = re.match(r"^\s*(\d+(?:\.\d*)?)\s*(ms|s|m|h)?\s*$", text.lower())
    if not m:
        raise ConfigError(f"not a duration: {text!r}", "use e.g. 1s, 500ms, 2m or a number of seconds")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2) or "s"]


def parse_budget(text: str) -> tuple[float, int]:
    """'30s', '5m' (a duration) or '1GB', '512MB' (a size: it ends in B) -> (seconds, bytes), one of them 0."""
    if text.strip().lower().endswith("b"):
        return 0.0, parse_size(text)
    try:
        return parse_duration(text), 0
    except ConfigError:
        raise ConfigError(f"not a duration or a size: {text!r}",
                          "use e.g. 5m (how long a sink may stay behind) or 2GB (how much WAL the slot may keep "
                          "for it)") from None


def parse_snapshot_rate(text: str) -> tuple[int, int]:
    """'5000' (rows per second) or '20MB' (bytes per second: a size ends in B) -> (rows, bytes), one of them 0."""
    if text.strip().lower().endswith("b"):
        return 0, parse_size(text)
    if not text.strip().isdigit():
        raise ConfigError(f"not a rate: {text!r}", "use e.g. 5000 (rows per second) or 20MB (bytes per second)")
    return int(text), 0
