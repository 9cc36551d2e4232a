"""Pure-Python core: value types and logic with no I/O and no Spark."""
