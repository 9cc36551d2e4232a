"""A DuckDB connection that reads Delta tables (`delta_scan`), with the extension from PyPI.

DuckDB downloads its extensions at first use; the `duckdb-ext-delta` wheel ships the delta one
instead, so reading a lake works without internet. Its folder is DuckDB's extension directory.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any


def connect() -> Any:
    import duckdb

    con = duckdb.connect()
    import duckdb_ext  # the namespace the extension wheels install into

    folder = Path(next(iter(duckdb_ext.__path__))) / "extensions"
    con.execute(f"SET extension_directory = '{folder}'")
    con.execute("LOAD delta")
    return con
