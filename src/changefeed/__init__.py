"""changefeed: change data capture for PostgreSQL, with its pipeline on PySpark Structured Streaming."""

__version__ = "0.1.0"
