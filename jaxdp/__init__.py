"""jaxdp: JAX-native differential-privacy accounting and private training.

Subpackages:
  accounting  pure, jittable accountants (depends on jax, numpy and scipy only)
  training    optax transformations for projected noisy SGD, clipping (flax/optax)
  models      Flax NNX models (convex models with their Lipschitz and smoothness constants)
  data        bundled and local data sets (no downloads)
  audit       empirical lower bounds on epsilon (distinguishing experiments, one-run auditing)

Every subpackage loads on first use (PEP 562): ``import jaxdp`` imports neither JAX nor
flax, and ``jaxdp.accounting`` imports JAX but not flax, optax, orbax or matplotlib, so the
command line parses its arguments before loading JAX. The accountants' public names load on
first use too (JAX with the first one): a first ``dpsgd_epsilon`` imports the few modules it
needs, not every accountant.

Guides and derivations cited as ``docs/NAME.md`` in docstrings and in the command's output are
installed with the package, as ``jaxdp/docs/NAME.md`` (start at ``jaxdp/docs/index.md``).
"""

import importlib as _importlib

__version__ = "0.1.0"
__all__ = ["accounting", "audit", "data", "models", "training", "__version__"]

_LAZY = ("accounting", "training", "models", "data", "audit")


def __getattr__(name):
    if name in _LAZY:
        module = _importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'jaxdp' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
