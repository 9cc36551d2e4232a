"""A warm Spark for feeds: a Spark Connect server that stays up, on which a runner opens a session
(`run --master sc://HOST:PORT`) instead of starting a driver JVM of its own.

A feed started on it pays neither the JVM's start nor its Python workers' (the server keeps
them), only its own connection and planning (figures in bench/README.md). What differs from a
feed's own driver:

* the server's Python workers run the feed's reads and writes: they import changefeed and see
  the server's environment, not the runner's (the variables a feed's URIs name, the key of its
  stored secrets, must be set where the server runs). Every feed on the server shares them
  (spark.connect_driver says why), so a changefeed upgraded where the server runs is taken up
  once the server is started again;
* Spark's log is the server's, not the state folder's spark.log;
* a runner killed without stopping its query (SIGKILL) leaves the query running on the server,
  still delivering exactly once from its checkpoint but with no runner to report, retry or stop
  it, until the feed starts again on that server (Spark stops the old run of a checkpoint when a
  new one starts) or the server stops. An expired session does not stop it (measured).

`changefeed spark-server` starts one from the installed pyspark, with the driver settings a feed's
own driver has (spark.settings).
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from changefeed.errors import ConnectionFailed
from changefeed.spark import settings
from changefeed.spark.spark_log import SparkDidNotStart

SCHEME = "sc://"
DEFAULT_PORT = 15002  # Spark Connect's own default
PLUGIN = "org.apache.spark.sql.connect.SparkConnectPlugin"
RPC_RETRIES = 4  # pyspark's backoff: ~3 s of retries for a call before the runner sees the fault


def is_remote(master: str) -> bool:
    return master.startswith(SCHEME)


def session(master: str) -> Any:
    """A new session on the server at `master` (each runner its own: its queries and settings are
    its own), with the session settings every feed needs."""
    from pyspark.sql import SparkSession
    from pyspark.sql.connect.client.retries import DefaultPolicy

    # the console keeps changefeed's own lines: a failed call is reported once, as ConnectionFailed
    warnings.filterwarnings("ignore", message=r"\[RETRIES_EXCEEDED\]")
    spark = SparkSession.builder.remote(master).create()
    # pyspark's client retries a call for up to 10 minutes; the runner's own retry (its backoff,
    # status, --give-up-after) is the one to govern a server out of reach
    spark.client.set_retry_policies([DefaultPolicy(max_retries=RPC_RETRIES)])
    try:
        with server_reached(master):
            for name, value in settings.SESSION.items():
                spark.conf.set(name, value)
    except ConnectionFailed:
        discard(spark)
        raise
    return spark


@contextmanager
def server_reached(master: str) -> Iterator[None]:
    """A Spark Connect server that does not answer (down, restarted: its sessions are gone) is
    ConnectionFailed of the component "Spark Connect server": the runner waits and opens a new
    session. A failed query is not (pyspark's StreamingQueryException passes)."""
    from pyspark.errors import StreamingQueryException
    from pyspark.errors.exceptions.connect import SparkConnectGrpcException

    try:
        yield
    except StreamingQueryException:
        raise
    except SparkConnectGrpcException as e:
        raise ConnectionFailed(f"the Spark Connect server at {master} did not answer ({_why(e)})",
                               "start it (changefeed spark-server, docs/running.md), or run without "
                               "--master to start Spark in the runner's own process",
                               component="Spark Connect server") from None


class Held:
    """The runner's Spark session: made when first needed, made again after a Spark Connect server
    went away (ConnectionFailed of this component), and on a server closed when the run ends."""

    def __init__(self, master: str, make: Callable[[], Any]) -> None:
        self.master, self._make = master, make
        self._spark: Any = None

    def get(self) -> Any:
        if self._spark is None:
            self._spark = self._make()
        return self._spark

    @contextmanager
    def reached(self) -> Iterator[None]:
        """On a Spark Connect server, one out of reach is ConnectionFailed and its session dropped."""
        if not is_remote(self.master):
            yield
            return
        try:
            with server_reached(self.master):
                yield
        except ConnectionFailed:
            self.close()
            raise

    def close(self) -> None:
        if self._spark is not None and is_remote(self.master):
            discard(self._spark)
        self._spark = None


def discard(spark: Any) -> None:
    """Close a session now, the runner's when it ends and one whose server went away. Left to the
    garbage collector (at exit at the latest), pyspark closes its gRPC channel there, which can
    wait for ever (seen as a runner that never exits after a server went away)."""
    with suppress(Exception):  # best effort: the server is gone, its session with it
        spark.stop()


def _why(e: Exception) -> str:
    """gRPC's status and details out of pyspark's wrapping of them."""
    text = str(e)
    status = re.search(r"StatusCode\.(\w+)", text)
    details = re.search(r'details = "([^"]*)"', text)
    if status or details:
        return ": ".join(m.group(1) for m in (status, details) if m)
    return (text.strip().splitlines() or [type(e).__name__])[0][:300]


def server_command(host: str, port: int, master: str = "local[*]") -> list[str]:
    """spark-submit of the installed pyspark starting a Spark Connect server on HOST:PORT: a
    pyspark driver (spark.connect_driver) whose Spark runs Spark Connect as a plugin."""
    settings.python_env(loopback=host in ("127.0.0.1", "localhost", "::1"))
    home = os.environ.get("SPARK_HOME")
    if not home:
        import pyspark

        home = str(Path(pyspark.__file__).resolve().parent)
    conf = {**settings.driver(""), "spark.plugins": PLUGIN, "spark.connect.grpc.binding.address": host,
            "spark.connect.grpc.binding.port": str(port),
            # one pool of Python workers for every session (spark.connect_driver)
            "spark.sql.artifact.isolation.enabled": "false",
            "spark.sql.artifact.isolation.alwaysApplyClassloader": "false",
            "spark.log.level": os.environ.get("CHANGEFEED_SPARK_LOG_LEVEL", "WARN")}
    command = [str(Path(home, "bin", "spark-submit")), "--name", "changefeed-spark-server", "--master", master]
    for name, value in conf.items():
        command += ["--conf", f"{name}={value}"]
    return [*command, str(Path(__file__).with_name("connect_driver.py"))]


def start_server(host: str, port: int, master: str = "local[*]", out: IO[bytes] | int | None = None,
                 timeout_s: float = 120) -> subprocess.Popen[bytes]:
    """Start a server in its own process group and return once it accepts connections."""
    proc = subprocess.Popen(server_command(host, port, master), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while not _answers(host, port):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise SparkDidNotStart(f"the Spark Connect server did not start on {host}:{port} "
                                   f"(exit {proc.returncode})",
                                   "its output says why; check that Java 17+ is installed and the port is free")
        time.sleep(0.2)
    return proc


def stop_server(proc: subprocess.Popen[bytes], timeout_s: float = 30) -> int:
    """Stop the server (SIGTERM, then SIGKILL of its group) and return its exit code."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait()


def serve(host: str, port: int, master: str, report: Any = print) -> int:
    """`changefeed spark-server`: run a server in the foreground until SIGINT/SIGTERM."""
    stopping: list[int] = []

    def handle(sig: int, _frame: Any) -> None:
        stopping.append(sig)

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        proc = start_server(host, port, master)
        report(f"Spark Connect server ready: run feeds with --master {SCHEME}{host}:{port} (pid {proc.pid})")
        while proc.poll() is None and not stopping:
            time.sleep(0.2)
        stop_server(proc)
        return 0 if stopping else proc.returncode
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False
