"""A feed stopped by a signal sent to its whole process group, as a service manager does
(systemd's default `KillMode=control-group` sends SIGTERM to every process of the unit at once)
and as Ctrl-C in a terminal does (SIGINT to the foreground group): the driver JVM and its Python
workers get the signal too. The runner must still stop cleanly: exit 0, its `stopped cleanly`
line, no error and no traceback, and a replica equal to the source."""
from __future__ import annotations

import os
import signal
import time
from contextlib import suppress
from pathlib import Path

import pytest

from support.feeds import assert_no_traceback, changefeed_cli, process_tree, start_changefeed, wait_for
from support.servers import Dbs, fingerprint
from support.writers import money_tables, moving_money, replicated, writing

ACCOUNTS = 20


def signal_all(pid: int, sig: int, to: str) -> None:
    if to == "group":
        os.killpg(pid, sig)
        return
    for each in process_tree(pid):
        with suppress(ProcessLookupError):
            os.kill(each, sig)


@pytest.mark.parametrize(("sig", "to", "mode"), [(signal.SIGTERM, "group", []), (signal.SIGINT, "group", []),
                                                 (signal.SIGTERM, "group", ["--low-latency", "5s"]),
                                                 (signal.SIGTERM, "every process", [])])
def test_a_signal_to_the_whole_process_group_stops_the_feed_cleanly(dbs: Dbs, tmp_path: Path, sig: int, to: str,
                                                                    mode: list[str]) -> None:
    money_tables(dbs, ACCOUNTS)
    state = str(tmp_path / "state")
    base = ["run", "--name", dbs.name, "--state", state]
    log = tmp_path / "feed.log"
    written = [0]
    with writing(moving_money(ACCOUNTS), dbs.source, written):
        p = start_changefeed(*base, "--source", dbs.source, "--sink", dbs.sink,
                             "--tables", "public.ledger,public.accounts", *mode, log=log)
        try:
            wait_for("rows on the replica", lambda: replicated(dbs.sink) > 50, log)
            time.sleep(1.0)  # (in the middle of batches)
            signal_all(p.pid, sig, to)
            rc = p.wait(timeout=120)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "stopped cleanly" in text and "error" not in text.lower(), text[-3000:]
    assert_no_traceback(text)
    final = changefeed_cli(*base, "--available-now")
    assert final.returncode == 0, final.stderr[-3000:]
    for table in ("public.ledger", "public.accounts"):
        assert fingerprint(dbs.source, table) == fingerprint(dbs.sink, table), table
