"""A SPARK_HOME for pip-installed pyspark in which Spark's Python workers import pyspark with bytecode.

Spark puts `$SPARK_HOME/python/lib/pyspark.zip` first on the path of every Python process it
starts. Python keeps no compiled bytecode for modules imported from a zip, so each of them (a
dozen or so start one after another before a feed's first batch: planners, daemons, task workers)
compiled pyspark's modules again: measured here 0.9 s instead of 0.3 s to import a worker's
modules, and about 4-5 s of a feed's start. In a pip install that zip is a copy of the package it
sits in, so a home holding links to everything in the package except the zip runs the same code:
the workers find pyspark where the driver does, with its bytecode cache. A SPARK_HOME set by the
user (a Spark distribution) is left alone, and so is anything that does not look like a pip install.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

ZIP = Path("python", "lib", "pyspark.zip")


def use_linked_home(cache: Path | None = None) -> Path | None:
    """Point SPARK_HOME at the linked home of the installed pyspark (built once, under `cache`);
    the home, or None when SPARK_HOME is set already or pyspark is not a pip install."""
    if os.environ.get("SPARK_HOME"):
        return None
    import pyspark

    package = Path(pyspark.__file__).resolve().parent
    if not ((package / "jars").is_dir() and (package / ZIP).is_file()):
        return None
    try:
        home = linked_home(package, cache or default_cache(), pyspark.__version__)
    except OSError:
        return None  # no writable cache: keep Spark's own search
    os.environ["SPARK_HOME"] = str(home)
    return home


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "changefeed"


def linked_home(package: Path, cache: Path, version: str) -> Path:
    """The home for `package` under `cache`: one per package path and version, built in a temporary
    folder and renamed into place, so concurrent feeds never see half of one."""
    home = cache / f"spark-home-{version}-{hashlib.sha256(str(package).encode()).hexdigest()[:16]}"
    if (home / "jars").resolve() == package / "jars":
        return home
    cache.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=".spark-home-", dir=cache))
    building.chmod(0o755)
    try:
        _link_all_but_zip(package, building, ZIP.parts)
        try:
            os.rename(building, home)
        except OSError:
            if (home / "jars").resolve() != package / "jars":  # not a concurrent build of the same home
                shutil.rmtree(home)
                os.rename(building, home)
    finally:
        if building.exists():
            shutil.rmtree(building)
    return home


def _link_all_but_zip(source: Path, target: Path, zip_parts: tuple[str, ...]) -> None:
    """Link each entry of `source` into `target`, descending along the path to the zip to leave it out."""
    for entry in source.iterdir():
        if zip_parts and entry.name == zip_parts[0]:
            if len(zip_parts) > 1:
                (target / entry.name).mkdir()
                _link_all_but_zip(entry, target / entry.name, zip_parts[1:])
            continue
        (target / entry.name).symlink_to(entry)
