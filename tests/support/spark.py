"""A Spark session and a Spark Connect server shared by the session's tests."""
from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def spark() -> object:
    from changefeed.spark.job import spark_session

    return spark_session("local[2]")


@pytest.fixture(scope="session")
def spark_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Spark Connect server for this test process's feeds, as `changefeed spark-server` starts
    one: a feed started on it pays no JVM start of its own. Its output goes to server.log."""
    from changefeed.spark.connect import start_server, stop_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(tmp_path_factory.mktemp("spark-server") / "server.log", "ab") as out:
        proc = start_server("127.0.0.1", port, "local[2]", out=out)
    yield f"sc://127.0.0.1:{port}"
    stop_server(proc)


@pytest.fixture
def warm_spark(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The feeds this test starts run on the shared Spark Connect server (CHANGEFEED_MASTER), not
    on a driver of their own. For tests that stop their feeds rather than SIGKILL them (a killed
    runner's query runs on) and set no fault points (the server's workers do not see them).
    CHANGEFEED_TEST_OWN_SPARK=1 runs them on drivers of their own, as without the fixture."""
    if not os.environ.get("CHANGEFEED_TEST_OWN_SPARK"):
        monkeypatch.setenv("CHANGEFEED_MASTER", request.getfixturevalue("spark_server"))
