"""Ship changefeed's own code to a Spark cluster's executors.

A feed's reads and writes run in Python workers on the executors, which import changefeed's
modules. On a cluster (any master but `local`) the feed ships them itself: it zips the installed
package (once per content, in the cache) and adds it with `SparkContext.addPyFile`, so the workers
need only Python with changefeed's dependencies (pyspark's, plus psycopg and numpy), not
changefeed. On a local master the workers are the driver's Python, which has it already.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from changefeed.spark.spark_home import default_cache


def needs_shipping(master: str) -> bool:
    return not master.startswith("local")


def package_zip(cache: Path | None = None) -> Path:
    """A zip of the installed changefeed package, named by a hash of its sources."""
    import changefeed

    package = Path(changefeed.__file__).resolve().parent
    files = sorted(p for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    digest = hashlib.sha256()
    for p in files:
        digest.update(str(p.relative_to(package)).encode() + b"\0" + p.read_bytes())
    cache = cache or default_cache()
    target = cache / f"changefeed-{digest.hexdigest()[:16]}.zip"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".changefeed-", suffix=".zip", dir=cache)
    os.close(fd)
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for p in files:
            z.write(p, Path("changefeed", p.relative_to(package)))
    os.replace(tmp, target)  # whole or not at all, also with feeds starting at once
    return target


def ship(spark: Any, master: str) -> Path | None:
    """Add changefeed's code to what `spark`'s executors load, on a cluster; the zip shipped."""
    if not needs_shipping(master):
        return None
    path = package_zip()
    spark.sparkContext.addPyFile(str(path))
    return path
