r"""What a model declares so that training can pick its loss and its privacy analysis.

:func:`jaxdp.training.train` does not recognise models by class. It reads two optional
methods:

* ``loss(x, y) -> (b,)``: the per-example loss training minimises (the default
  ``loss_fn``). A model without it needs ``loss_fn=`` and trains with DP-SGD, or with
  PNSGD reported by composition.
* ``loss_constants(feature_norm_bound) -> LossConstants``: the Lipschitz constant, smoothness,
  strong convexity and convexity of that loss for features with
  :math:`\lVert x\rVert \le X` (and parameters in the ball the constants state). With them
  PNSGD reports the hidden-state (per-record) guarantee; ``docs/lipschitz_constants.md``
  shows how to derive them.

A model declaring both is a :class:`HiddenStateModel`. The declaration is checked where it
can be: training clips at :math:`C = L` and verifies at run time that no per-example
gradient exceeded it, so a wrong Lipschitz constant demotes the report to composition with
the reason, never to a smaller ε. Convexity and smoothness cannot be checked by the
library: they are the model author's claim (test them as ``tests/models`` does).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax

from ._convex import LossConstants

__all__ = ["HiddenStateModel"]


@runtime_checkable
class HiddenStateModel(Protocol):
    r"""A model whose loss carries the constants the hidden-state analyses need.

    Implement both methods on a Flax NNX module (no base class needed; ``isinstance``
    works structurally):

    .. code-block:: python

        class LeastSquares(nnx.Module):
            def __init__(self, d, rngs):
                zeros = nnx.initializers.zeros_init()
                self.linear = nnx.Linear(d, 1, kernel_init=zeros, bias_init=zeros, rngs=rngs)
            def __call__(self, x):
                return self.linear(x)[:, 0]
            def loss(self, x, y):
                return jaxdp.models.squared_loss(self, x, y)
            def loss_constants(self, feature_norm_bound):
                return jaxdp.models.squared_loss_constants(feature_norm_bound, 1.0, radius=2.0)

    Examples:
      >>> from flax import nnx
      >>> from jaxdp.models import MLP, LogisticRegression
      >>> isinstance(LogisticRegression(3, rngs=nnx.Rngs(0)), HiddenStateModel)
      True
      >>> isinstance(MLP((3, 4, 2), rngs=nnx.Rngs(0)), HiddenStateModel)  # a loss, no constants
      False
    """

    def loss(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """Per-example losses, shape ``(b,)``, for features ``(b, d)`` and labels ``(b,)``."""
        ...

    def loss_constants(self, feature_norm_bound) -> LossConstants:
        """:class:`LossConstants` of :meth:`loss` for features with ``‖x‖ <= feature_norm_bound``."""
        ...
