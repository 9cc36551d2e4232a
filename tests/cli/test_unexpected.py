"""An error no part of changefeed has a type for (a bug, a database answer nobody foresaw) ends the
command with exit 70, one `changefeed: error:` line naming it and a hint: no traceback on the
console, the traceback kept in a file the hint names."""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import psycopg
import pytest

from changefeed import cli
from changefeed.errors import UNEXPECTED_EXIT
from support.feeds import changefeed_cli
from support.servers import Dbs


def _trace_file(stderr: str) -> Path:
    found = re.search(r"its traceback is in (\S+)", stderr)
    assert found, stderr
    return Path(found.group(1))


def test_a_database_error_nobody_foresaw_is_one_line_and_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    def failing(_args: object) -> int:
        raise psycopg.errors.UniqueViolation('duplicate key value violates unique constraint "pg_namespace"\nDETAIL: x')

    monkeypatch.setattr(cli, "cmd_list", failing)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert cli.main(["list", "--state", str(tmp_path)]) == UNEXPECTED_EXIT
    err = capfd.readouterr().err
    assert err.startswith("changefeed: error: unexpected psycopg.errors.UniqueViolation: duplicate key value"), err
    assert "DETAIL" not in err and "Traceback" not in err and "  hint: " in err
    trace = _trace_file(err)
    assert trace.parent == tmp_path and "Traceback" in trace.read_text() and "in failing" in trace.read_text()


def test_a_run_failing_where_nobody_foresaw_exits_70_without_a_traceback(dbs: Dbs, tmp_path: Path) -> None:
    with dbs.src() as c:
        c.execute("CREATE TABLE t (id int PRIMARY KEY)")
    got = changefeed_cli("run", "--name", dbs.name, "--state", str(tmp_path / "state"), "--source", dbs.source,
                         "--sink", dbs.sink, "--tables", "public.t", "--available-now",
                         env={**os.environ, "CHANGEFEED_FAIL_AT": "node_created",
                              "CHANGEFEED_FAULT_DIR": str(tmp_path), "TMPDIR": str(tmp_path)})
    assert got.returncode == UNEXPECTED_EXIT, got.stderr[-3000:]
    assert "changefeed: error: unexpected changefeed.faults.InjectedFault" in got.stderr, got.stderr[-3000:]
    assert "Traceback" not in got.stderr
    assert "InjectedFault" in _trace_file(got.stderr).read_text()
