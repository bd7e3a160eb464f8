"""jaxdp: JAX-native differential-privacy accounting and private training.

Subpackages:
  accounting  pure, jittable accountants (imported eagerly; depends on jax only)
  training    optax transformations for projected noisy SGD, clipping (flax/optax)
  models      Flax NNX models (convex models with their Lipschitz and smoothness constants)
  data        bundled and local data sets (no downloads)
  audit       empirical lower bounds on epsilon (distinguishing experiments, one-run auditing)

``training``, ``models`` and ``data`` import flax/optax/scikit-learn, so they (and ``audit``) load on
first use (``jaxdp.training`` works as an attribute); the command line stays fast.

Guides and derivations cited as ``docs/NAME.md`` in docstrings and in the command's output are
installed with the package, as ``jaxdp/docs/NAME.md`` (start at ``jaxdp/docs/index.md``).
"""

import importlib as _importlib

from . import accounting as accounting

__version__ = "0.1.0"
__all__ = ["accounting", "audit", "data", "models", "training", "__version__"]

_LAZY = ("training", "models", "data", "audit")


def __getattr__(name):
    if name in _LAZY:
        module = _importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'jaxdp' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
