"""The linked SPARK_HOME: Spark's Python workers import pip-installed pyspark from its package
directory (bytecode cached), not from pyspark.zip (compiled again in every worker)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyspark
import pytest

from changefeed.spark import spark_home


def _fake_package(root: Path) -> Path:
    package = root / "site-packages" / "pyspark"
    for d in ("jars", "bin", "python/lib", "python/pyspark"):
        (package / d).mkdir(parents=True)
    for f in ("jars/spark-core.jar", "bin/spark-submit", "python/lib/pyspark.zip", "python/lib/py4j-src.zip",
              "__init__.py"):
        (package / f).write_text(f)
    return package


def _tree(home: Path) -> dict[str, str]:
    """Each entry under `home` (not following links) -> the path it links to, or "dir"."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(home):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            out[str(p.relative_to(home))] = os.readlink(p) if p.is_symlink() else "dir"
    return out


def test_home_links_everything_but_the_zip(tmp_path: Path) -> None:
    package = _fake_package(tmp_path)
    home = spark_home.linked_home(package, tmp_path / "cache", "9.9")
    assert _tree(home) == {
        "jars": str(package / "jars"), "bin": str(package / "bin"), "__init__.py": str(package / "__init__.py"),
        "python": "dir", "python/pyspark": str(package / "python/pyspark"),
        "python/lib": "dir", "python/lib/py4j-src.zip": str(package / "python/lib/py4j-src.zip")}
    assert spark_home.linked_home(package, tmp_path / "cache", "9.9") == home  # built once
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [home.name]  # no leftover build folder


def test_a_stale_home_is_rebuilt_and_another_version_gets_its_own(tmp_path: Path) -> None:
    package = _fake_package(tmp_path)
    home = spark_home.linked_home(package, tmp_path / "cache", "9.9")
    (home / "jars").unlink()
    (home / "jars").symlink_to(tmp_path / "elsewhere")
    assert spark_home.linked_home(package, tmp_path / "cache", "9.9") == home
    assert os.readlink(home / "jars") == str(package / "jars")
    assert spark_home.linked_home(package, tmp_path / "cache", "10.0") != home


def test_a_users_spark_home_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "spark-4.3.0-bin"))
    assert spark_home.use_linked_home(tmp_path / "cache") is None
    assert os.environ["SPARK_HOME"] == str(tmp_path / "spark-4.3.0-bin")
    assert not (tmp_path / "cache").exists()


def test_spark_workers_import_pyspark_from_its_package(spark: Any) -> None:
    """The session's workers (started with the linked home) import the driver's pyspark files."""
    worker_file = spark.sparkContext.parallelize([0], 1).map(lambda _: __import__("pyspark").__file__).collect()[0]
    assert ".zip" not in worker_file and Path(worker_file) == Path(pyspark.__file__)
    assert not (Path(os.environ["SPARK_HOME"]) / spark_home.ZIP).exists()
