"""The suite's own settings: the Hypothesis profile, the order tests run in, and the support
modules (tests/support) loaded as plugins, whose fixtures every test can take."""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = [f"support.{m}" for m in ("servers", "spark", "feeds", "writers", "kafka", "webhooks", "standby",
                                            "windows")]

# Hypothesis: `ci` (set by CI=true, as .ci/run does) prints the blob that reproduces a failure and
# does not fail a pure property on a slow, busy machine's timing; a test's own @settings (the ones
# that start servers) still sets its number of examples.
settings.register_profile("ci", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "default"))

# The longest tests first (`make test` runs two pytest-xdist workers; one that runs dry takes the
# end of the other's queue, so short tests at the end even the two out): the end-to-end feeds, then
# those that start a Spark session, then the rest; in each, the tests marked slow first. Only the
# order changes; every test still runs.
_FIRST = ("tests/e2e/", "tests/spark/")
# Each test's tier, a marker by its folder (registered in pyproject.toml): `-m "pure or server"`
# is the inner loop (`make test-fast`), `-m e2e` the feeds run as users run them.
_TIERS = {"core": "pure", "spec": "pure", "postgres": "server", "sinks": "server", "control": "server",
          "local": "server", "spark": "spark", "cli": "e2e", "e2e": "e2e", "cli/test_docs_links.py": "pure"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> tuple[int, bool]:
        path = item.nodeid
        first = next((i for i, prefix in enumerate(_FIRST) if path.startswith(prefix)), len(_FIRST))
        return first, item.get_closest_marker("slow") is None  # the slow ones (a minute or more) first

    for item in items:
        parts = item.nodeid.split("::")[0].split("/")
        tier = _TIERS.get("/".join(parts[1:3])) or _TIERS.get(parts[1]) if parts[0] == "tests" else None
        if tier:
            item.add_marker(tier)
    items.sort(key=rank)
