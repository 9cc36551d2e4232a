"""The JVM class archive: built once with a real Spark driver JVM, checked before it is used, and a
truncated one (which crashes a JVM that maps it) refused."""
from __future__ import annotations

from pathlib import Path

import pytest

from changefeed.spark import jvm_archive

pytestmark = pytest.mark.timeout(600)


def test_a_built_archive_is_used_and_a_truncated_one_refused(tmp_path: Path) -> None:
    assert jvm_archive.java_options(tmp_path) == ""  # none yet: feeds start without one
    built = jvm_archive.build(tmp_path)
    assert built is not None and built.parent == tmp_path and built.stat().st_size > 10 << 20
    assert jvm_archive.java_options(tmp_path) == f"-XX:SharedArchiveFile={built}"
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no temporary file left
    assert jvm_archive.build(tmp_path) == built  # built once
    truncated = tmp_path / "truncated.jsa"
    with built.open("rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    assert not jvm_archive.usable(truncated)
