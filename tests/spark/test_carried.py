"""Errors raised inside Spark keep their type: `errors.carried` sends one marker line through
Spark's text-only error channel and `errors.carried_in` reads it back, whatever text surrounds it."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed import errors
from changefeed.control.retention import RetentionExceeded
from changefeed.errors import Carried, ChangefeedError, carried, carried_in
from changefeed.postgres.decode.pgoutput import DecodeError, decode

TYPES = sorted(errors._types().values(), key=lambda t: t.__name__)


def raised_through(error: BaseException, component: str = "source") -> str:
    with pytest.raises(Carried) as e, carried(component):
        raise error
    return str(e.value)


@given(st.sampled_from(TYPES), st.text(), st.text(), st.sampled_from(["", "source", "sink", "node-2"]),
       st.text(), st.text())
def test_every_type_arrives_whole_inside_any_surrounding_text(kind: type[ChangefeedError], message: str, hint: str,
                                                            component: str, before: str, after: str) -> None:
    marker = raised_through(kind(message, hint, component=component), "sink")
    # as Spark shows it: a JVM exception, the Python traceback, then what follows
    got = carried_in(f"org.apache.spark.SparkException: {before}\nTraceback ...\nchangefeed.errors.Carried: "
                     f"{marker}\n{after}")
    assert type(got) is kind
    assert got is not None and (got.message, got.hint, got.component) == (message, hint, component or "sink")
    assert isinstance(got, errors.TransientError) == issubclass(kind, errors.TransientError)


def test_types_outside_the_errors_module_are_known() -> None:
    assert RetentionExceeded in TYPES and DecodeError in TYPES


def test_undecodable_wal_stops_the_feed_with_a_report_hint() -> None:
    """Reading the same WAL again fails the same way: definite (exit 2), never retried as QueryFailed."""
    with pytest.raises(Carried) as raised, carried("source"):
        decode(b"Z")
    got = carried_in(str(raised.value))
    assert type(got) is DecodeError and isinstance(got, errors.DefiniteError) and got.exit_code == 2
    assert "unknown pgoutput message type 'Z'" in got.message and "report it" in got.hint


def test_an_unforeseen_error_arrives_as_query_failed_naming_its_part() -> None:
    got = carried_in(raised_through(KeyError("lsn"), "sink"))
    assert isinstance(got, errors.QueryFailed) and got.component == "sink"
    assert got.message == "sink: KeyError: 'lsn'" and got.max_attempts == 3


@pytest.mark.parametrize("text", [
    "", "Python worker exited unexpectedly (crashed)", errors.MARKER + "{torn",
    errors.MARKER + '{"type": "NoSuchError", "message": "", "hint": "", "component": ""}'])
def test_text_without_a_whole_marker_carries_nothing(text: str) -> None:
    assert carried_in(text) is None


def test_control_flow_passes_through() -> None:
    def gen():  # a generator closed early (Spark stops reading a task's output) is not an error
        with carried("source"):
            yield 1
            yield 2
    g = gen()
    next(g)
    g.close()
