import atexit
import os
import shutil
import tempfile

import pytest
from hypothesis import settings

# CI runs the property tests with a fixed seed so that a submission's result does not depend
# on the draw; locally they explore new examples every run.
# The command keeps compiled programs in a persistent cache; tests call it in-process,
# and must neither depend on nor write to the user's cache.
os.environ.setdefault("JAXDP_CACHE_DIR", "off")

# One persistent XLA compilation cache for the whole run: the test workers (pytest-xdist)
# and the example and command subprocesses inherit it, so a program compiled in one process
# (the accountants take seconds each) is loaded, not recompiled, in the others. It lives in
# a fresh temporary folder, removed when the run ends: no test reads a previous run's cache.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxdp-tests-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

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
