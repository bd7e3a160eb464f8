import jax
import pytest


@pytest.fixture(autouse=True)
def _x64():
    """Accountant tests run with float64 enabled for the test code's own arithmetic."""
    with jax.enable_x64(True):
        yield
