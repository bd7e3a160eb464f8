r"""Lipschitz networks: bias-free dense layers with a bounded spectral norm, and ReLU MLPs of them.

A :class:`LipschitzDense` layer computes :math:`x \mapsto x W` with no bias. Its kernel is
kept at spectral norm (about) at most :math:`\rho` by the rescaling of Chen & Liu (2024),
eq. 2: power iteration estimates :math:`\tilde\lambda \approx \lVert W\rVert_2` and

.. math::

    W \leftarrow W \cdot \min(\rho / \tilde\lambda,\ 1).

The power-iteration vector is layer state (an ``nnx.BatchStat``) carried from one rescaling
to the next, so one iteration per training step tracks the top singular vector as the
weights move. Power iteration gives a **lower** estimate of :math:`\lVert W\rVert_2` (the
Rayleigh quotient of any unit vector is at most the top singular value), so after the
rescaling :math:`\lVert W\rVert_2` may exceed :math:`\rho` slightly. A guarantee must not
rest on it: :func:`lipschitz_upper_bound` certifies the network's Lipschitz constant from an
exact float64 singular-value computation of every kernel, rounded up.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["LipschitzDense", "LipschitzMLP", "lipschitz_upper_bound", "spectral_norms"]

# Relative margin added to float64 singular values. LAPACK's SVD is backward stable: the
# computed top singular value is within c·n·2^-52·‖W‖ of the true one (Demmel & Kahan
# 1990; Golub & Van Loan, Thm 8.6.2 with Weyl's inequality); for n ≤ 10^5 that is below
# 1e-10 relative, so 1e-9 covers it with room.
_SVD_RTOL = 1e-9
# Power iterations used when a layer is created (the initial kernel is rescaled once).
_INIT_POWER_ITERATIONS = 50


def _check_rho(value, name: str = "max_spectral_norm") -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive finite number (ρ > 0); got {value!r}.") from None
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a positive finite number (ρ > 0); got {value!r}.")
    return v


def _check_iterations(value, name: str = "power_iterations") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a Python int >= 1; got {value!r}.")
    return int(value)


@functools.partial(jax.jit, static_argnums=2)
def _power_iteration(kernel: jax.Array, u: jax.Array, iterations: int):
    """``iterations`` steps of power iteration on ``kernel`` (in, out) from ``u`` (in,).

    Returns ``(estimate, u_new)`` with ``estimate = ‖u_newᵀ W‖ ≤ ‖W‖₂``.
    """
    tiny = jnp.finfo(kernel.dtype).tiny

    def body(_, u):
        v = u @ kernel
        v = v / jnp.maximum(jnp.linalg.norm(v), tiny)
        u = kernel @ v
        return u / jnp.maximum(jnp.linalg.norm(u), tiny)

    u = jax.lax.fori_loop(0, iterations, body, u)
    return jnp.linalg.norm(u @ kernel), u


class LipschitzDense(nnx.Module):
    r"""Bias-free dense layer :math:`x \mapsto xW` whose kernel is rescaled to spectral norm ≤ ρ.

    :meth:`rescale` runs power iteration from the stored vector and applies
    :math:`W \leftarrow W \min(\rho/\tilde\lambda, 1)` (Chen & Liu 2024, eq. 2): the kernel is
    only ever scaled down, never normalised up. The kernel is rescaled at creation with
    enough iterations that the estimate has converged for a random Gaussian matrix; the
    exact norm is available from :func:`spectral_norms`.

    Args:
      in_features, out_features: input and output widths (≥ 1).
      rngs: ``nnx.Rngs`` (``params`` for the LeCun-normal kernel, the same stream for the
        initial power-iteration vector).
      max_spectral_norm: ρ > 0, the target bound on :math:`\lVert W\rVert_2`.
      power_iterations: power-iteration steps per :meth:`rescale` call (≥ 1; the vector is
        carried between calls, so one step per training step is the usual choice).
      param_dtype: kernel dtype (default float32).

    Raises:
      ValueError: ``max_spectral_norm`` not a positive finite number, or bad widths.

    References:
      C. Chen, D. Liu, "Differentially Private Neural Network Training under Hidden State
      Assumption", arXiv:2407.08233v1 (2024), eq. 2; H. Gouk et al., "Regularisation of
      neural networks by enforcing Lipschitz continuity", Machine Learning 110 (2021).

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> layer = LipschitzDense(5, 3, rngs=nnx.Rngs(0), max_spectral_norm=0.5)
      >>> layer(jnp.ones((2, 5))).shape
      (2, 3)
      >>> bool(spectral_norms(layer)[0] <= 0.5 * (1 + 1e-3))
      True
    """

    def __init__(self, in_features: int, out_features: int, rngs: nnx.Rngs, *, max_spectral_norm,
                 power_iterations: int = 1, param_dtype=jnp.float32):
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a Python int >= 1; got {v!r}.")
        self.max_spectral_norm = _check_rho(max_spectral_norm)
        self.power_iterations = _check_iterations(power_iterations)
        init = nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), param_dtype))
        u = jax.random.normal(rngs.params(), (in_features,), param_dtype)
        self.power_vector = nnx.BatchStat(u / jnp.linalg.norm(u))
        self.rescale(_INIT_POWER_ITERATIONS)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x @ W`` for ``x`` of shape ``(..., in_features)``."""
        return x @ self.kernel[...]

    def estimate(self, power_iterations: int | None = None) -> jax.Array:
        """Power-iteration estimate :math:`\\tilde\\lambda \\le \\lVert W\\rVert_2` (updates the vector)."""
        it = self.power_iterations if power_iterations is None else _check_iterations(power_iterations)
        lam, u = _power_iteration(self.kernel[...], self.power_vector[...], it)
        self.power_vector[...] = u
        return lam

    def rescale(self, power_iterations: int | None = None) -> jax.Array:
        r"""Apply eq. 2, :math:`W \leftarrow W \min(\rho/\tilde\lambda, 1)`; returns :math:`\tilde\lambda`."""
        lam = self.estimate(power_iterations)
        w = self.kernel[...]
        factor = jnp.minimum(self.max_spectral_norm / jnp.maximum(lam, jnp.finfo(w.dtype).tiny), 1.0)
        self.kernel[...] = w * factor.astype(w.dtype)
        return lam


class LipschitzMLP(nnx.Module):
    r"""Bias-free ReLU MLP of :class:`LipschitzDense` layers (the network of DP-SBCD).

    ``features = (d, h_1, ..., h_m, K)`` gives ``m + 1`` layers
    :math:`f(x) = W_m^\top \mathrm{relu}(\cdots \mathrm{relu}(W_0^\top x))`; the last layer
    has no activation. ReLU is 1-Lipschitz, so :math:`\mathrm{Lip}(f) \le \prod_d \lVert
    W_d\rVert_2` (:func:`lipschitz_upper_bound`). The loss is not convex in the parameters
    (``is_convex = False``).

    Args:
      features: layer widths, at least two entries.
      rngs: ``nnx.Rngs`` for the kernels.
      max_spectral_norm: ρ > 0 for every layer, or one value per layer.
      power_iterations: power-iteration steps per :meth:`rescale` (≥ 1).
      param_dtype: parameter dtype (default float32).

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> model = LipschitzMLP((4, 8, 3), rngs=nnx.Rngs(0), max_spectral_norm=2.0)
      >>> model(jnp.ones((5, 4))).shape
      (5, 3)
      >>> lipschitz_upper_bound(model) <= 4.0 * (1 + 1e-3)
      True
    """

    is_convex = False

    def __init__(self, features: Sequence[int], rngs: nnx.Rngs, *, max_spectral_norm,
                 power_iterations: int = 1, param_dtype=jnp.float32):
        features = [int(f) for f in features]
        if len(features) < 2 or any(f < 1 for f in features):
            raise ValueError(
                f"features must list at least two positive layer widths (input, ..., output); got {features}."
            )
        num_layers = len(features) - 1
        rhos = np.atleast_1d(np.asarray(max_spectral_norm, dtype=object))
        if rhos.size == 1:
            rhos = [rhos[0]] * num_layers
        elif rhos.size != num_layers:
            raise ValueError(
                f"max_spectral_norm must be one value or one per layer ({num_layers}); got {rhos.size} values."
            )
        self.layers = nnx.List([
            LipschitzDense(a, b, rngs, max_spectral_norm=_check_rho(r, f"max_spectral_norm[{i}]"),
                           power_iterations=power_iterations, param_dtype=param_dtype)
            for i, (a, b, r) in enumerate(zip(features[:-1], features[1:], rhos, strict=True))
        ])

    def __call__(self, x: jax.Array) -> jax.Array:
        """Outputs of shape ``(b, K)`` for ``x`` of shape ``(b, d)``."""
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)

    def rescale(self, power_iterations: int | None = None) -> list[jax.Array]:
        """Rescale every layer (eq. 2); returns the per-layer power-iteration estimates."""
        return [layer.rescale(power_iterations) for layer in self.layers]


def _dense_layers(model) -> list[LipschitzDense]:
    if isinstance(model, LipschitzDense):
        return [model]
    layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, LipschitzDense)]
    if not layers:
        raise ValueError(f"model has no LipschitzDense layer; got {type(model).__name__}.")
    return layers


def spectral_norms(model) -> np.ndarray:
    r"""Certified upper bounds on :math:`\lVert W_d\rVert_2` of every :class:`LipschitzDense` layer.

    Each is the largest singular value of the kernel computed in float64 by LAPACK's SVD
    (backward stable), times :math:`1 + 10^{-9}` to cover its rounding. Eager (host) only.

    Args:
      model: a :class:`LipschitzDense` layer or a module containing such layers.

    Returns:
      float64 NumPy array, one bound per layer (graph order).

    Examples:
      >>> from flax import nnx
      >>> m = LipschitzMLP((3, 3), rngs=nnx.Rngs(1), max_spectral_norm=1.0)
      >>> bool(spectral_norms(m)[0] <= 1.0 + 1e-3)
      True
    """
    out = []
    for layer in _dense_layers(model):
        w = np.asarray(jax.device_get(layer.kernel[...]), dtype=np.float64)
        if not np.all(np.isfinite(w)):
            out.append(math.inf)
            continue
        s = np.linalg.svd(w, compute_uv=False)
        out.append(float(s[0]) * (1.0 + _SVD_RTOL) if s.size else 0.0)
    return np.asarray(out, dtype=np.float64)


def lipschitz_upper_bound(model) -> float:
    r"""A certified upper bound on the L2 Lipschitz constant of a bias-free ReLU network.

    .. math::

        \mathrm{Lip}(f) \le \prod_d \lVert W_d\rVert_2,

    since ReLU is 1-Lipschitz and :math:`x\mapsto xW` has Lipschitz constant
    :math:`\lVert W\rVert_2`. Each factor is the exact float64 singular value rounded up
    (:func:`spectral_norms`), not the power-iteration estimate, which is a lower bound and
    could under-state the constant. The product is accumulated in float64 and rounded up by
    one more relative ``1e-9``. (The float32 forward pass itself is not part of the bound.)

    Args:
      model: a :class:`LipschitzMLP`, a :class:`LipschitzDense`, or any module whose layers
        are :class:`LipschitzDense` composed with 1-Lipschitz activations.

    Returns:
      Python float ≥ the network's Lipschitz constant (+inf for a non-finite kernel).

    Examples:
      >>> from flax import nnx
      >>> m = LipschitzMLP((6, 6, 2), rngs=nnx.Rngs(0), max_spectral_norm=0.9)
      >>> 0.0 < lipschitz_upper_bound(m) <= 0.81 * (1 + 1e-3)
      True
    """
    norms = spectral_norms(model)
    return float(np.prod(norms) * (1.0 + _SVD_RTOL))
