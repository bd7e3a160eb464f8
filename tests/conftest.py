import os

import pytest
from hypothesis import settings

# CI runs the property tests with a fixed seed so that a submission's result does not depend
# on the draw; locally they explore new examples every run.
# The command keeps compiled programs in a persistent cache; tests call it in-process,
# and must neither depend on nor write to the user's cache.
os.environ.setdefault("JAXDP_CACHE_DIR", "off")

settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_collection_modifyitems(config, items):
    """Tests marked slow (exhaustive or covered elsewhere) run only with JAXDP_SLOW=1."""
    if os.environ.get("JAXDP_SLOW"):
        return
    skip = pytest.mark.skip(reason="slow: covered elsewhere in CI; run with JAXDP_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
