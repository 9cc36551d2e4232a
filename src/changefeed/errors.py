"""One root error for everything changefeed raises on purpose.

`TransientError`: retrying (or restarting from the checkpoint) may succeed. `DefiniteError`: it
will not, an operator must act; the message says what to do. The CLI maps both to a non-zero exit.
"""
from __future__ import annotations


class ChangefeedError(Exception):
    """Root of all changefeed errors. `hint` tells the operator what to do next."""

    exit_code = 2

    def __init__(self, message: str, hint: str = "", *, component: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.component = component  # source, sink, ...: which part failed, where known

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message


class TransientError(ChangefeedError):
    """The feed may succeed if retried: a network blip, a server restarting."""

    exit_code = 75  # EX_TEMPFAIL


class DefiniteError(ChangefeedError):
    """Retrying will not help; the operator must change something first."""


class ConfigError(DefiniteError):
    """Malformed options or feed definition."""

    exit_code = 64  # EX_USAGE


class ConnectionFailed(TransientError):
    """A server could not be reached."""


class AuthenticationFailed(DefiniteError):
    """The server refused the credentials."""


class SourceNotReady(DefiniteError):
    """The source database cannot be captured as configured (wal_level, tables, keys)."""


class FeedBusy(DefiniteError):
    """Another runner holds this feed."""


class SlotLost(DefiniteError):
    """The replication slot is missing or invalidated while a checkpoint depends on it."""


class IncompleteBatch(TransientError):
    """A sink's input lacks some of the batch's partitions: its task was cut short."""


class SinkError(DefiniteError):
    """The sink refused the data in a way that retrying will not fix."""


def start_over_hint(feed: str) -> str:
    """The way back when the WAL a feed needs is gone: give everything back, take a fresh snapshot."""
    return (f"changefeed remove --name {feed} (drops its slot and publication, forgets its checkpoint), truncate "
            f"its replica tables, then changefeed run --name {feed} --source ... --sink ... --tables ... "
            "(a fresh snapshot); changefeed never skips WAL and never re-creates a slot silently")
