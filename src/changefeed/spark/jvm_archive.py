"""A class-data-sharing archive of the Spark driver JVM's classes: a feed's JVM starts faster.

Starting the JVM and a SparkSession, most of it loading and verifying Spark's classes, is the
biggest part of a feed's start on a small machine. A dynamic CDS archive (`-XX:SharedArchiveFile`)
holds those classes ready to map (figures in bench/README.md). `python -m changefeed.spark.jvm_archive` (which
`make install` runs) builds it once per JVM, pyspark and Spark home; a feed uses it when it is
there and starts as before when it is not.

The JVM maps the archive without checking all of it, and a truncated archive crashes the JVM
(SIGBUS, seen here). So an archive is written to a temporary name, then a second JVM must start
with it under `-Xshare:on` (which refuses any archive it cannot use) before it is renamed into place.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from changefeed.spark.spark_home import default_cache, use_linked_home


def archive_path(cache: Path | None = None) -> Path | None:
    """Where the archive for this JVM, pyspark and Spark home lives; None without a java."""
    java_home = os.environ.get("JAVA_HOME")  # the java that Spark's launcher runs
    java = shutil.which("java", path=os.path.join(java_home, "bin") if java_home else None)
    if java is None:
        return None
    import pyspark

    java = os.path.realpath(java)
    jars = Path(os.environ.get("SPARK_HOME") or Path(pyspark.__file__).parent, "jars")  # the class path
    key = "|".join([java, str(os.stat(java).st_mtime_ns), pyspark.__version__, str(jars),
                    str(jars.resolve().stat().st_mtime_ns) if jars.is_dir() else "-"])
    return (cache or default_cache()) / f"jvm-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsa"


def java_options(cache: Path | None = None) -> str:
    """The driver JVM options that use the archive, or "" when there is none."""
    path = archive_path(cache)
    return f"-XX:SharedArchiveFile={path}" if path is not None and path.is_file() else ""


def build(cache: Path | None = None) -> Path | None:
    """Build the archive (about a minute) unless it is there; the archive, or None if this JVM cannot."""
    use_linked_home()  # the archive records the class path: build it with the one feeds use
    path = archive_path(cache)
    if path is None or path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        if _jvm_runs(f"-XX:ArchiveClassesAtExit={tmp}") and tmp.is_file() and usable(tmp):
            os.rename(tmp, path)
            return path
        return None
    finally:
        tmp.unlink(missing_ok=True)


def usable(archive: Path) -> bool:
    """Whether a driver JVM starts and works with `archive` under `-Xshare:on`, which refuses (or
    crashes on) an archive it cannot use."""
    return _jvm_runs(f"-Xshare:on -XX:SharedArchiveFile={archive}")


def _jvm_runs(option: str) -> bool:
    # In a folder of its own: a JVM that crashes on the archive leaves its hs_err_pid*.log there.
    with tempfile.TemporaryDirectory(prefix="changefeed-jvm-") as folder:
        done = subprocess.run([sys.executable, "-m", f"{__package__}.jvm_exercise", option],
                              capture_output=True, text=True, timeout=600, cwd=folder)
    return done.returncode == 0


if __name__ == "__main__":
    built = build()
    print(f"JVM class archive: {built}" if built else "JVM class archive: not built (this JVM cannot)")
