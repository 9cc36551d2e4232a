"""Two runners of one feed, one active and one standing by, ended in turns."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.feeds import kill_group, start_changefeed, wait_for
from support.servers import Dbs


def taken_over_while_frozen(dbs: Dbs, frozen: subprocess.Popen[bytes], logs: list[Path], fault_dir: Path,
                            rows: Callable[[], int], fence: Callable[[], Any] | None = None) -> tuple[int, Any]:
    """Once the runner `frozen` (log logs[0]) froze at its armed CHANGEFEED_STOP_AT point: wait for
    the standby (log logs[1]) to take the feed over and apply `rows` more, then wake the frozen
    one, which must stop with exit 2 (its lease lost). Returns the sink's fence as `fence()` reads
    it, (epoch, where it stands); by default the replica's (epoch, raised_at)."""
    wait_for("the runner to freeze", lambda: (fault_dir / ".stopped-groups").exists(), logs[0])
    frozen_at = rows()  # its sessions stay open, it renews nothing
    wait_for("the standby to take over", lambda: "taking the feed over" in logs[1].read_text(), logs[1], timeout=60)
    wait_for("new rows from the standby", lambda: rows() > frozen_at + 20, logs[1])
    if fence is None:
        with dbs.dst() as d:
            claimed = d.execute("SELECT epoch, raised_at FROM changefeed.fences WHERE feed = %s",
                                (dbs.name,)).fetchone()
    else:
        claimed = fence()
    assert claimed is not None and claimed[0] >= 2
    for group in (fault_dir / ".stopped-groups").read_text().split():
        os.killpg(int(group), signal.SIGCONT)
    code = frozen.wait(timeout=120)
    assert code == 2, f"the woken runner exited {code}:\n{logs[0].read_text()[-3000:]}"
    return int(claimed[0]), claimed[1]


def stop_both(runners: list[subprocess.Popen[bytes]], logs: list[Path], active: int) -> None:
    """Stop the two runners of kill_turns cleanly (SIGTERM, exit 0): the standby first, else it takes
    over from the clean stop, and only once it stands by (a runner just restarted may not have
    reached its signal handlers yet, and would end by the signal)."""
    wait_for("the standby to wait", lambda: "standing by; active: pid " in logs[1 - active].read_text(),
             logs[1 - active])
    for i in (1 - active, active):
        runners[i].send_signal(signal.SIGTERM)
        assert runners[i].wait(timeout=120) == 0, logs[i].read_text()[-3000:]


def standby_starter(name: str, source: str, states: list[Path], logs: list[Path]
                    ) -> Callable[[int, dict[str, str]], subprocess.Popen[bytes]]:
    """kill_turns' `restart`: `run --standby` of feed `name` on host `host` (its own state folder
    and log), with only the name and the source."""
    def standby(host: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
        return start_changefeed("run", "--standby", "--name", name, "--state", str(states[host]), "--source", source,
                                log=logs[host], env=env)
    return standby


def turn_env(kills: list[str], turn: int, faults: Path) -> dict[str, str]:
    """The fault environment of the runner that is active in round `turn` of kill_turns: a
    "POINT:N" kills it there, armed once its round begins (a standby waiting); "random": none."""
    if turn >= len(kills) or kills[turn] == "random":
        return {}
    folder = faults / f"turn{turn}"
    folder.mkdir(parents=True, exist_ok=True)
    return {"CHANGEFEED_KILL_AT": kills[turn], "CHANGEFEED_FAULT_DIR": str(folder),
            "CHANGEFEED_FAULT_ARMED": str(folder / "armed")}


def kill_turns(kills: list[str], runners: list[subprocess.Popen[bytes]], logs: list[Path], faults: Path,
               restart: Callable[[int, dict[str, str]], subprocess.Popen[bytes]], landed: Callable[[], int],
               written: list[int], took_over: Callable[[int, str], None] | None = None) -> int:
    """Two runners of a feed, runners[0] active (started with turn_env(kills, 0, faults)) and
    runners[1] standing by (turn_env(kills, 1, faults)): end the active one once per round, at
    random (SIGKILL of its group) or at its round's fault point; each time the standby must take
    over and a row written after the end must land (landed() past written[0] at the end), then
    the ended host comes back as a standby (restart(host, env), its log emptied); took_over(turn,
    log text of the runner that took over) checks more. The index of the runner active at the end."""
    active = 0
    for turn, point in enumerate(kills):
        standby = 1 - active
        wait_for("the standby to wait", lambda: "standing by; active: pid " in logs[standby].read_text(),
                 logs[standby])
        if point == "random":
            time.sleep(random.uniform(0.5, 2.5))  # somewhere in its batches
            kill_group(runners[active])
        else:
            (faults / f"turn{turn}" / "armed").touch()
        assert runners[active].wait(timeout=180) == -signal.SIGKILL, (point, logs[active].read_text()[-3000:])
        at_end = written[0]
        wait_for("the standby to take over", lambda: "taking the feed over" in logs[standby].read_text(),
                 logs[standby], timeout=120)
        wait_for(f"rows written after end {turn + 1} ({point}) to land", lambda: landed() > at_end, logs[standby],
                 timeout=180)
        if took_over is not None:
            took_over(turn, logs[standby].read_text())
        logs[active].write_text("")  # the next standby's lines only
        runners[active] = restart(active, turn_env(kills, turn + 2, faults))
        active = standby
    return active
