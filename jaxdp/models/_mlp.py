"""A small multi-layer perceptron (non-convex): trainable, but outside the convex analyses."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["MLP"]


class MLP(nnx.Module):
    """Multi-layer perceptron of ``nnx.Linear`` layers with an activation in between.

    ``features = (d, h_1, ..., h_m, K)`` builds ``m + 1`` dense layers
    ``d -> h_1 -> ... -> K``; the last layer has no activation (it returns logits, for
    :func:`~jaxdp.models.softmax_cross_entropy_loss`).

    The loss of an MLP is **not convex** in its parameters (``is_convex = False``): a
    gradient step is not a contraction, so the amplification-by-iteration and
    contraction guarantees do not apply to it; only composition over the released steps
    does. Because every parameter lives in an ``nnx.Linear`` applied to 2-D inputs,
    :func:`jaxdp.training.clipped_grad_sum` uses its fast path on it.

    Args:
      features: layer widths, at least two entries (input and output).
      rngs: ``nnx.Rngs`` for the (LeCun-normal) kernel initialisation.
      activation: elementwise nonlinearity between layers (default ``jax.nn.relu``).
      param_dtype: parameter dtype (default float32).

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> model = MLP((784, 256, 10), rngs=nnx.Rngs(0))
      >>> model(jnp.ones((3, 784))).shape
      (3, 10)
      >>> MLP.is_convex
      False
    """

    is_convex = False

    def __init__(self, features: Sequence[int], rngs: nnx.Rngs, *,
                 activation: Callable[[jax.Array], jax.Array] = jax.nn.relu,
                 param_dtype=jnp.float32):
        features = [int(f) for f in features]
        if len(features) < 2 or any(f < 1 for f in features):
            raise ValueError(
                f"features must list at least two positive layer widths (input, ..., output); "
                f"got {features}."
            )
        self.layers = nnx.List(
            [nnx.Linear(a, b, param_dtype=param_dtype, rngs=rngs)
             for a, b in zip(features[:-1], features[1:], strict=True)]
        )
        self.activation = activation

    def loss(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """Per-example softmax cross-entropy, shape ``(b,)`` (the loss training uses).

        The MLP declares no ``loss_constants``: its loss has no Lipschitz or smoothness
        constant that makes a gradient step a contraction.
        """
        from ._convex import softmax_cross_entropy_loss

        return softmax_cross_entropy_loss(self, x, y)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Logits, shape ``(b, K)`` for ``x`` of shape ``(b, d)``."""
        for layer in self.layers[:-1]:
            x = self.activation(layer(x))
        return self.layers[-1](x)
