"""One root error for everything changefeed raises on purpose.

`TransientError`: retrying (or restarting from the checkpoint) may succeed. `DefiniteError`: it
will not, an operator must act; the message says what to do. The CLI maps both to a non-zero exit.
Which of the two an error is, is its type, never its text: an error raised inside Spark (a task,
a data source callback) reaches the driver as text only, so it travels as one marker line that
`carried_in` turns back into the same type.
"""
from __future__ import annotations

import json
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

UNEXPECTED_EXIT = 70  # EX_SOFTWARE: an error no part of changefeed has a type for


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
    max_attempts: int | None = None  # failed attempts in a row after which retrying stops (None: never)


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


class UnfollowableChange(DefiniteError):
    """The source made a change the sink cannot follow faithfully: the feed stops before it."""


class FeedBusy(DefiniteError):
    """Another runner holds this feed."""


class LeaseLost(DefiniteError):
    """Another runner took the feed's lease: this one must write nothing more (the sinks' fences
    refuse its batches) and stops."""


class CheckpointLost(DefiniteError):
    """The feed's Spark checkpoint is missing or older than its sink, and the sink cannot say
    exactly where the feed stands (see sinks.ledger.Ledger.resume_offset)."""


class SinkLagExceeded(DefiniteError):
    """A sink of several stayed behind the others longer (or by more WAL) than --sink-lag-budget."""


class SlotLost(DefiniteError):
    """The replication slot is missing or invalidated while a checkpoint depends on it."""


class TornTransaction(DefiniteError):
    """A distributed transaction would reach the sink in part (or a planned part of it is not in
    the WAL where the plan saw it): the feed stops before delivering any of the batch."""


class TransactionInDoubt(TransientError):
    """A distributed transaction is committed on some nodes and still prepared on others: what was
    committed after it on those nodes cannot be delivered before it is decided."""


class IncompleteBatch(TransientError):
    """A sink's input lacks some of the batch's partitions: its task was cut short."""


class QueryFailed(TransientError):
    """The streaming query failed with an error changefeed has no type for (a Python worker
    crashed, an executor was lost, an unexpected exception): restarting from the checkpoint is
    safe and often enough, but an error that comes back every time needs a human."""

    max_attempts = 3


class SinkError(DefiniteError):
    """The sink refused the data in a way that retrying will not fix."""


def start_over_hint(feed: str) -> str:
    """The way back when the WAL a feed needs is gone: give everything back, take a fresh snapshot."""
    return (f"changefeed remove --name {feed} (drops its slot and publication, forgets its checkpoint), truncate "
            f"its replica tables, then changefeed run --name {feed} --source ... --sink ... --tables ... "
            "(a fresh snapshot); changefeed never skips WAL and never re-creates a slot silently")


MARKER = "changefeed-error:"


class Carried(Exception):
    """A ChangefeedError on its way out of Spark: its text is the marker line."""


@contextmanager
def carried(component: str) -> Iterator[None]:
    """Code that Spark runs (a task, a data source callback): an error leaves as one marker line
    naming its type, message, hint and component (`component` if it names none). An error that is
    not ours becomes QueryFailed, its traceback printed first (to the worker's log)."""
    try:
        yield
    except Carried:  # (from code inside that ran as another component)
        raise
    except ChangefeedError as e:
        raise Carried(_marker(e, component)) from None
    except Exception as e:  # noqa: BLE001 - anything else is a failure nobody foresaw
        traceback.print_exc()
        failed = QueryFailed(f"{component}: {type(e).__name__}: {e}".splitlines()[0],
                             "the feed restarts from its checkpoint; if the error comes back, see Spark's log")
        raise Carried(_marker(failed, component)) from None


def _marker(e: ChangefeedError, component: str) -> str:
    return MARKER + json.dumps({"type": type(e).__name__, "message": e.message, "hint": e.hint,
                                "component": e.component or component})


def carried_in(text: str) -> ChangefeedError | None:
    """The error a `carried` marker in `text` (a failed query's message) stands for, if any."""
    at = text.find(MARKER)
    if at < 0:
        return None
    try:
        fields, _ = json.JSONDecoder().raw_decode(text, at + len(MARKER))
        kind = _types()[fields["type"]]
        return kind(fields["message"], fields["hint"], component=fields["component"])
    except (ValueError, KeyError, TypeError):
        return None


def _types() -> dict[str, type[ChangefeedError]]:
    found: dict[str, type[ChangefeedError]] = {}
    todo: list[type[ChangefeedError]] = [ChangefeedError]
    while todo:
        kind = todo.pop()
        found[kind.__name__] = kind
        todo += kind.__subclasses__()
    return found


def unexpected(error: BaseException) -> str:
    """What the CLI says of an error no part of changefeed has a type for (a bug, or a database
    answer nobody foresaw): its type and text, and the file its traceback went to, so that the
    console gets no stray traceback and a report loses nothing."""
    name = f"{type(error).__module__}.{type(error).__qualname__}".removeprefix("builtins.")
    trace = "".join(traceback.format_exception(error))
    try:
        with tempfile.NamedTemporaryFile("w", prefix=f"changefeed-error-{time.strftime('%Y%m%d-%H%M%S')}-",
                                         suffix=".txt", delete=False) as f:
            f.write(trace)
        where = f"its traceback is in {f.name}"
    except OSError:  # (no writable temporary folder: the trace goes with the message)
        where, trace = f"its traceback:\n{trace}", ""
    text = str(error).strip().splitlines()[0] if str(error).strip() else "(no message)"
    return (f"unexpected {name}: {text}\n  hint: changefeed has no remedy of its own for this error; what the "
            f"feed committed is safe and `run` resumes from it; if it comes again, report it with {where}")
