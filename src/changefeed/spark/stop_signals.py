"""A stop signal sent to the runner's whole process group leaves the driver JVM to the runner.

A feed's runner stops cleanly on SIGINT or SIGTERM (control.runner): it stops the query at its
next step, then Spark. Such a signal often goes to every process of the runner's group at once:
Ctrl-C in a terminal, `kill %1` in a shell, a supervisor that stops a process group, systemd's
default `KillMode=control-group`. The driver JVM is in that group; a JVM stopped under the runner
leaves it a broken connection in the middle of its stop, and an "unexpected" error instead of
`stopped cleanly`. pyspark starts the JVM with SIGINT ignored; here SIGTERM is ignored too (a JVM
leaves a signal that was ignored when it started ignored). The JVM still ends with the runner:
it exits when its standard input, a pipe from the runner, closes, also when the runner is killed.

pyspark's SparkContext also takes SIGINT for itself (it cancels every job and raises
KeyboardInterrupt in the main thread): `handlers_kept` gives the runner's handlers back.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def jvm_ignores_stop_signals() -> Iterator[None]:
    """While the block starts the driver JVM (pyspark.java_gateway.launch_gateway), the JVM's
    process starts with SIGINT and SIGTERM ignored. Only the child's signals change: the runner's
    own handlers stay as they are, so a stop signal during the JVM's start is not lost."""
    from pyspark import java_gateway as imported

    java_gateway: Any = imported  # (its Popen, imported there from subprocess, is not its own to export)
    # pyspark's launcher sets the Popen's preexec_fn itself (SIGINT ignored) and takes no other:
    # its module's Popen is wrapped for the block, so that the child ignores SIGTERM as well.
    popen = java_gateway.Popen

    def ignoring(*args: Any, **kwargs: Any) -> Any:
        theirs: Callable[[], None] | None = kwargs.get("preexec_fn")

        def preexec() -> None:
            if theirs is not None:
                theirs()
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
        return popen(*args, **{**kwargs, "preexec_fn": preexec})

    java_gateway.Popen = ignoring
    try:
        yield
    finally:
        java_gateway.Popen = popen


@contextmanager
def handlers_kept() -> Iterator[None]:
    """The process's SIGINT and SIGTERM handlers as they were before the block (which makes a
    SparkContext), when it runs in the main thread (the only one that can set them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
