"""Spark imports the data source modules in each Python process it starts to plan a query, one
after another at a feed's start; the decoder's and the applier's numpy/Arrow stay out of them."""
import subprocess
import sys

import pytest

HEAVY = ("numpy", "pyarrow")


@pytest.mark.parametrize("module", ["changefeed.spark.source", "changefeed.spark.reads", "changefeed.spark.writer",
                                    "changefeed.sinks.registry", "changefeed.spark.warm_up"])
def test_data_source_module_imports_no_numpy_or_arrow(module: str) -> None:
    code = f"import sys, {module}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "", f"{module} imports {out.strip()} at import time"
