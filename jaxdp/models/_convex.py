r"""Convex models (binary logistic and softmax regression) and the constants of common losses.

These are the models for which the amplification-by-iteration and contraction analyses
hold: the per-example loss is convex in the parameters, and with features bounded by
:math:`\lVert x\rVert \le X` it is :math:`L`-Lipschitz and :math:`\beta`-smooth with the
constants returned by :func:`logistic_loss_constants` and :func:`softmax_loss_constants`.
Setting the clip norm :math:`C \ge L` makes clipping inactive, so each PNSGD step is a
gradient step on the convex, smooth loss itself (a clipped gradient is in general not
the gradient of a convex function, and the analyses need one).

Parameters are initialised at zero: a data-independent start inside every ball
:math:`\{\lVert\theta\rVert \le R\}`, as the analyses require.

Conventions: ``x`` has shape ``(b, in_features)``; loss functions return per-example
losses of shape ``(b,)``; the parameter norm is the global L2 norm over kernel and bias.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from .. import _validate

__all__ = [
    "LossConstants",
    "LogisticRegression",
    "SoftmaxRegression",
    "binary_logistic_loss",
    "softmax_cross_entropy_loss",
    "logistic_loss_constants",
    "softmax_loss_constants",
    "squared_loss",
    "squared_loss_constants",
]


class LossConstants(NamedTuple):
    """What the hidden-state analyses need to know about a per-example loss.

    The constants hold for every admissible example (features with
    :math:`\\lVert x\rVert \\le X` for the stated feature bound, and whatever label bound the
    loss states) and every parameter :math:`\theta` with :math:`\\lVert\theta\rVert \\le`
    ``radius``. ``docs/lipschitz_constants.md`` derives them for the logistic, softmax
    cross-entropy and squared losses.

    Attributes:
      lipschitz: :math:`L` with :math:`\\lVert\nabla_\theta \\ell(\theta; x, y)\rVert \\le L`.
      smoothness: :math:`\beta` with
        :math:`\\lVert\nabla^2_\theta \\ell(\theta; x, y)\rVert_{op} \\le \beta`.
      strong_convexity: :math:`\rho \\ge 0` with
        :math:`\nabla^2_\theta \\ell \\succeq \rho I` (default 0).
      convex: whether :math:`\theta \\mapsto \\ell(\theta; x, y)` is convex (default
        ``True``). With ``False`` the constants only describe the loss; the hidden-state
        analyses do not apply and training reports composition.
      radius: the parameter radius :math:`R` within which the constants hold (default
        :math:`\\infty`: every :math:`\theta`). Training refuses the amplified analyses when
        its ball is larger.
    """

    lipschitz: float
    smoothness: float
    strong_convexity: float = 0.0
    convex: bool = True
    radius: float = math.inf


def logistic_loss_constants(feature_norm_bound) -> LossConstants:
    r"""Lipschitz constant and smoothness of the binary logistic loss with a bias.

    For :math:`\theta = (w, b)`, :math:`\tilde x = (x, 1)`, :math:`z = \theta^\top\tilde x`,
    :math:`y\in\{0,1\}`, :math:`p = \mathrm{sigmoid}(z)`,
    :math:`\ell = \log(1 + e^{z}) - yz`:

    .. math::

        \nabla_\theta \ell = (p - y)\tilde x, \quad |p - y| \le 1
        \;\Rightarrow\; L = \sqrt{X^2 + 1};

        \nabla^2_\theta \ell = p(1-p)\,\tilde x\tilde x^\top, \quad p(1-p) \le \tfrac14
        \;\Rightarrow\; \beta = \frac{X^2 + 1}{4}.

    Both hold for every :math:`\theta` (no constraint set needed).

    Args:
      feature_norm_bound: :math:`X \ge 0` with :math:`\lVert x\rVert \le X` for every example.

    Returns:
      :class:`LossConstants` with ``lipschitz`` and ``smoothness`` as Python floats (convex,
      :math:`\rho = 0`, every :math:`\theta`).

    Examples:
      >>> logistic_loss_constants(1.0)[:2]
      (1.4142135623730951, 0.5)
    """
    _validate.check_in_range("feature_norm_bound", feature_norm_bound, 0.0, math.inf)
    s = float(feature_norm_bound) ** 2 + 1.0
    return LossConstants(lipschitz=math.sqrt(s), smoothness=s / 4.0)


def softmax_loss_constants(feature_norm_bound) -> LossConstants:
    r"""Lipschitz constant and smoothness of softmax cross-entropy with a bias.

    For :math:`K` classes, :math:`\theta = (W, b)` with :math:`W\in\mathbb R^{d\times K}`,
    :math:`\tilde x = (x, 1)`, logits :math:`z = W^\top x + b`, :math:`p = \mathrm{softmax}(z)`,
    :math:`\ell = \log\sum_j e^{z_j} - z_y`:

    *Lipschitz.* :math:`\nabla_W \ell = x (p - e_y)^\top`, :math:`\nabla_b \ell = p - e_y`, so
    :math:`\lVert\nabla_\theta\ell\rVert^2 = (\lVert x\rVert^2 + 1)\lVert p - e_y\rVert^2`, and

    .. math::

        \lVert p - e_y\rVert^2 = (1 - p_y)^2 + \sum_{j\ne y} p_j^2
        \le (1 - p_y)^2 + \Bigl(\sum_{j\ne y} p_j\Bigr)^2 = 2(1 - p_y)^2 \le 2,

    giving :math:`L = \sqrt 2\,\sqrt{X^2 + 1}`.

    *Smoothness.* The logits are a linear map of :math:`\theta`, :math:`z = A\theta` with
    :math:`A = \tilde x^\top \otimes I_K`, whose operator norm is
    :math:`\lVert\tilde x\rVert`. The Hessian in the logits is
    :math:`H = \mathrm{diag}(p) - pp^\top`; for a unit vector :math:`v`,
    :math:`v^\top H v = \mathrm{Var}_{j\sim p}(v_j) \le (\max_j v_j - \min_j v_j)^2/4
    \le (\sqrt 2)^2/4 = 1/2` (Popoviciu's inequality, and
    :math:`|v_j - v_k| \le \sqrt{2(v_j^2 + v_k^2)} \le \sqrt 2`). Hence

    .. math::

        \lVert\nabla^2_\theta\ell\rVert_{op} = \lVert A^\top H A\rVert_{op}
        \le \tfrac12\lVert\tilde x\rVert^2 \le \beta = \frac{X^2 + 1}{2}.

    Both bounds are attained in the limit (:math:`p_y \to 0` with the mass on one other
    class; :math:`p = (\tfrac12, \tfrac12, 0, \dots)`), so they cannot be improved
    uniformly. Both hold for every :math:`\theta`.

    Args:
      feature_norm_bound: :math:`X \ge 0` with :math:`\lVert x\rVert \le X` for every example.

    Returns:
      :class:`LossConstants` with ``lipschitz`` and ``smoothness`` as Python floats (convex,
      :math:`\rho = 0`, every :math:`\theta`).

    Examples:
      >>> softmax_loss_constants(1.0)[:2]
      (2.0, 1.0)
    """
    _validate.check_in_range("feature_norm_bound", feature_norm_bound, 0.0, math.inf)
    s = float(feature_norm_bound) ** 2 + 1.0
    return LossConstants(lipschitz=math.sqrt(2.0 * s), smoothness=s / 2.0)


def squared_loss_constants(feature_norm_bound, label_bound, radius) -> LossConstants:
    r"""Lipschitz constant and smoothness of the squared loss of a linear model with a bias.

    For :math:`\theta = (w, b)`, :math:`\tilde x = (x, 1)`, prediction
    :math:`z = \theta^\top\tilde x`, :math:`\ell = \tfrac12 (z - y)^2`, on the domain
    :math:`\lVert x\rVert \le X`, :math:`|y| \le Y`, :math:`\lVert\theta\rVert \le R`:

    .. math::

        \nabla_\theta \ell = (z - y)\tilde x,\quad |z - y| \le R\sqrt{X^2+1} + Y
        \;\Rightarrow\; L = \bigl(R\sqrt{X^2+1} + Y\bigr)\sqrt{X^2+1};

        \nabla^2_\theta \ell = \tilde x\tilde x^\top
        \;\Rightarrow\; \beta = X^2 + 1,\ \rho = 0.

    Unlike the logistic and softmax losses, :math:`L` grows with the parameter radius: the
    constants hold only inside the ball of radius :math:`R` (training's ``radius`` must not
    exceed it; the returned ``radius`` field says so). Both bounds are attained
    (:math:`x` on the sphere, :math:`\theta` aligned with :math:`\tilde x`, :math:`y = -Y`).

    Args:
      feature_norm_bound: :math:`X \ge 0`.
      label_bound: :math:`Y \ge 0` with :math:`|y| \le Y` for every example.
      radius: :math:`R > 0`, the parameter ball of training.

    Returns:
      :class:`LossConstants` (convex, :math:`\rho = 0`, valid for
      :math:`\lVert\theta\rVert \le R`).

    Examples:
      >>> c = squared_loss_constants(1.0, label_bound=1.0, radius=2.0)
      >>> round(c.lipschitz, 6), c.smoothness, c.radius
      (5.414214, 2.0, 2.0)
    """
    _validate.check_in_range("feature_norm_bound", feature_norm_bound, 0.0, math.inf)
    _validate.check_in_range("label_bound", label_bound, 0.0, math.inf)
    _validate.check_in_range("radius", radius, 0.0, math.inf, lo_open=True)
    s = float(feature_norm_bound) ** 2 + 1.0
    lip = (float(radius) * math.sqrt(s) + float(label_bound)) * math.sqrt(s)
    return LossConstants(lipschitz=lip, smoothness=s, radius=float(radius))


class LogisticRegression(nnx.Module):
    """Binary logistic regression, ``logit = x·w + b`` (convex in ``(w, b)``).

    Use with :func:`binary_logistic_loss` and labels in ``{0, 1}``; the constants of that
    loss are :meth:`loss_constants`.

    Args:
      in_features: number of features ``d``.
      rngs: ``nnx.Rngs`` (the parameters start at zero, a data-independent point).
      param_dtype: parameter dtype (default float32); training keeps it.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> model = LogisticRegression(3, rngs=nnx.Rngs(0))
      >>> model(jnp.ones((2, 3))).shape
      (2,)
      >>> LogisticRegression.is_convex
      True
    """

    is_convex: bool = True

    def __init__(self, in_features: int, rngs: nnx.Rngs, *, param_dtype=jnp.float32):
        self.linear = nnx.Linear(
            in_features, 1, kernel_init=nnx.initializers.zeros_init(),
            bias_init=nnx.initializers.zeros_init(), param_dtype=param_dtype, rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Logits, shape ``(b,)`` for ``x`` of shape ``(b, d)``."""
        return self.linear(x)[..., 0]

    def loss(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """Per-example :func:`binary_logistic_loss`, shape ``(b,)`` (the loss training uses)."""
        return binary_logistic_loss(self, x, y)

    @staticmethod
    def loss_constants(feature_norm_bound) -> LossConstants:
        """Constants of :func:`binary_logistic_loss`; see :func:`logistic_loss_constants`."""
        return logistic_loss_constants(feature_norm_bound)


class SoftmaxRegression(nnx.Module):
    """Softmax (multinomial logistic) regression, ``logits = x W + b`` (convex in ``(W, b)``).

    Use with :func:`softmax_cross_entropy_loss` and integer labels in ``0..K-1``; the
    constants of that loss are :meth:`loss_constants`.

    Args:
      in_features: number of features ``d``.
      num_classes: number of classes ``K >= 2``.
      rngs: ``nnx.Rngs`` (the parameters start at zero, a data-independent point).
      param_dtype: parameter dtype (default float32); training keeps it.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> model = SoftmaxRegression(64, 10, rngs=nnx.Rngs(0))
      >>> model(jnp.ones((5, 64))).shape
      (5, 10)
    """

    is_convex: bool = True

    def __init__(self, in_features: int, num_classes: int, rngs: nnx.Rngs, *,
                 param_dtype=jnp.float32):
        if int(num_classes) < 2:
            raise ValueError(f"num_classes must be an integer >= 2; got {num_classes}.")
        self.linear = nnx.Linear(
            in_features, int(num_classes), kernel_init=nnx.initializers.zeros_init(),
            bias_init=nnx.initializers.zeros_init(), param_dtype=param_dtype, rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Logits, shape ``(b, K)`` for ``x`` of shape ``(b, d)``."""
        return self.linear(x)

    def loss(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """Per-example :func:`softmax_cross_entropy_loss`, shape ``(b,)`` (the loss training uses)."""
        return softmax_cross_entropy_loss(self, x, y)

    @staticmethod
    def loss_constants(feature_norm_bound) -> LossConstants:
        """Constants of :func:`softmax_cross_entropy_loss`; see :func:`softmax_loss_constants`."""
        return softmax_loss_constants(feature_norm_bound)


def binary_logistic_loss(model, x: jax.Array, y: jax.Array) -> jax.Array:
    r"""Per-example binary logistic loss :math:`\log(1 + e^{z}) - y z`, shape ``(b,)``.

    Computed as ``softplus(z) - y z``, stable for large :math:`|z|`.

    Args:
      model: callable returning logits of shape ``(b,)`` (e.g. :class:`LogisticRegression`).
      x: features, shape ``(b, d)``.
      y: labels in ``{0, 1}``, shape ``(b,)``.

    Returns:
      Per-example losses, shape ``(b,)``, in the logits' dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> m = LogisticRegression(2, rngs=nnx.Rngs(0))
      >>> round(float(binary_logistic_loss(m, jnp.ones((1, 2)), jnp.array([1]))[0]), 4)  # log 2
      0.6931
    """
    z = model(x)
    return jax.nn.softplus(z) - y.astype(z.dtype) * z


def softmax_cross_entropy_loss(model, x: jax.Array, y: jax.Array) -> jax.Array:
    r"""Per-example softmax cross-entropy :math:`\log\sum_j e^{z_j} - z_y`, shape ``(b,)``.

    Args:
      model: callable returning logits of shape ``(b, K)`` (e.g. :class:`SoftmaxRegression`
        or :class:`~jaxdp.models.MLP`).
      x: features, shape ``(b, d)``.
      y: integer labels in ``0..K-1``, shape ``(b,)``.

    Returns:
      Per-example losses, shape ``(b,)``, in the logits' dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> m = SoftmaxRegression(2, 4, rngs=nnx.Rngs(0))
      >>> round(float(softmax_cross_entropy_loss(m, jnp.ones((1, 2)), jnp.array([3]))[0]), 4)  # log 4
      1.3863
    """
    z = model(x)
    z_y = jnp.take_along_axis(z, y.astype(jnp.int32)[:, None], axis=-1)[:, 0]
    return jax.nn.logsumexp(z, axis=-1) - z_y


def squared_loss(model, x: jax.Array, y: jax.Array) -> jax.Array:
    r"""Per-example squared loss :math:`\tfrac12 (z - y)^2` of a scalar prediction, shape ``(b,)``.

    Args:
      model: callable returning predictions of shape ``(b,)``.
      x: features, shape ``(b, d)``.
      y: real targets, shape ``(b,)``.

    Returns:
      Per-example losses, shape ``(b,)``, in the predictions' dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> squared_loss(lambda x: x[:, 0], jnp.array([[3.0]]), jnp.array([1.0])).tolist()
      [2.0]
    """
    z = model(x)
    return 0.5 * jnp.square(z - y.astype(z.dtype))
