r"""Per-instance Rényi DP of one Poisson-sampled Gaussian step, and the per-point result type.

The per-step quantity both per-instance analyses build on (:mod:`._per_instance`, Thudi et
al. 2024 composition; :mod:`._individual_filter`, Feldman and Zrnic 2021): the RDP of one
DP-SGD step for a point whose clipped gradient norm over the clipping norm is ``r``, and
:class:`PerInstancePrivacy`, the result both return.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._numerics import f64, float64
from .._pytree import register_dataclass
from ._rdp import sampled_gaussian_rdp

__all__ = ["PerInstancePrivacy", "per_instance_sampled_gaussian_rdp"]

# Below this r the value is taken at r = _R_FLOOR (the RDP is nondecreasing in r, so this
# is an upper bound). At r = 1e-6 the RDP is ~1e-17 or less in every setting where DP-SGD
# is used; beyond σ/r ≈ 1e6 the fractional-order series' certified rounding margin,
# which grows like (σ/r)², would dominate the value and could break monotonicity in r.
_R_FLOOR = 1e-6

@functools.partial(
    register_dataclass,  # not JAX's: see jaxdp/_pytree.py
    data_fields=["epsilon", "order", "rdp", "halt_step"],
    meta_fields=["analysis", "assumptions"],
)
@dataclasses.dataclass(frozen=True)
class PerInstancePrivacy:
    """Per-point privacy of a DP-SGD run: ε at δ, the analysis and what it assumes.

    A pytree: the numeric fields are leaves (it passes through ``jit`` and ``vmap``),
    ``analysis`` and ``assumptions`` are static strings carried alongside.

    Attributes:
      epsilon: ε at the requested δ per point, shape ``points``.
      order: the Rényi order attaining it, shape ``points``.
      rdp: the RDP curve per point, shape ``points + (k,)``. For the filter this is the
        individual RDP actually consumed (never above the budget; the guarantee itself
        is the budget).
      halt_step: filter only: number of steps the point took part in before the filter
        dropped it (``num_steps`` if never); ``None`` for the composition analysis.
      analysis: which analysis produced the numbers.
      assumptions: what the numbers assume, one sentence each; an estimate says so.
    """

    epsilon: jax.Array
    order: jax.Array
    rdp: jax.Array
    halt_step: jax.Array | None
    analysis: str
    assumptions: tuple[str, ...]


# --------------------------------------------------------------------------------------
# One step
# --------------------------------------------------------------------------------------


def _check_common(q, noise_multiplier, r):
    _validate.check_in_range("q", q, 0.0, 1.0)
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("r", r, 0.0, 1.0)


@float64
def per_instance_sampled_gaussian_rdp(orders, q, noise_multiplier, r) -> jax.Array:
    r"""Per-instance RDP of one Poisson-sampled Gaussian step for a point with norm ratio ``r``.

    DP-SGD with the sum rule adds :math:`N(0, σ^2C^2)` to the sum of clipped gradients. For
    the pair :math:`X, X' = X ∪ \{x^*\}` the sensitivity is the point's own clipped norm
    :math:`rC`, :math:`r = \min(\|∇ℓ(θ, x^*)\|_2, C)/C`, the same for every minibatch, so
    the step is the sampled Gaussian mechanism with noise multiplier :math:`σ/r`:

    .. math::
        ε(α) = \frac{1}{α-1}\log\sum_{k=0}^{α}\binom{α}{k}(1-q)^{α-k}q^k
               \exp\Big(\frac{r^2(k^2-k)}{2σ^2}\Big)

    for integer α (Thudi et al. 2024, Theorem 3.2, with the factor :math:`q^k` that its
    Eq. 21 drops), and in general
    :math:`ε(α) = D_α\big((1-q)N(0,σ^2) + qN(r,σ^2)\,\|\,N(0,σ^2)\big)`, which bounds the
    Rényi divergence in both directions (Mironov, Talwar, Zhang 2019, Theorem 5).

    Exactness: integer orders are the closed form above, summed in log space
    (:func:`sampled_gaussian_rdp` at σ/r). Fractional orders use the exact two-sided
    series of Mironov–Talwar–Zhang §3.3 with a certified error margin added, so the value
    is an **upper bound** within 2e-10 relative of the truth for σ/r ≤ 50, and more
    conservative (still above the truth) for larger σ/r. At r = 1 the value is the
    data-independent sampled-Gaussian RDP; r = 0 gives 0; for 0 < r < 1e-6 the value at
    r = 1e-6 is returned (an upper bound, ~1e-17 or less). The value is nondecreasing in r.

    Args:
      orders: Rényi orders α > 1 (static, a concrete 1-D sequence of length k; up to 65536).
      q: Poisson sampling rate in [0, 1].
      noise_multiplier: noise standard deviation over the clipping norm C, > 0.
      r: clipped gradient norm over C, in [0, 1]. ``q``, ``noise_multiplier`` and ``r``
        broadcast together (e.g. ``r`` of shape ``(num_points, num_steps)``).

    Returns:
      float64 array ``broadcast(q, noise_multiplier, r).shape + (k,)``. Under ``jit``,
      values out of range give NaN.

    Assumptions: add/remove-one neighbours; each point is sampled independently with
    probability q (the rate does not depend on the data set); r is computed at the model
    the step starts from. It is a per-instance bound for one fixed (X, x*), not DP.

    References:
      A. Thudi, H. Jia, C. Meehan, I. Shumailov, N. Papernot, "Gradients Look Alike:
      Sensitivity is Often Overestimated in DP-SGD", USENIX Security 2024
      (arXiv:2307.00310), Theorem 3.2. I. Mironov, K. Talwar, L. Zhang, "Rényi Differential
      Privacy of the Sampled Gaussian Mechanism", arXiv:1908.10530 (2019), Theorem 5, §3.3.

    Examples:
      >>> import jaxdp, numpy as np
      >>> e = jaxdp.accounting.per_instance_sampled_gaussian_rdp([2.0], 0.01, 1.0, 0.5)
      >>> bool(np.isclose(e[0], np.log1p(0.01**2 * np.expm1(0.25))))
      True
    """
    orders_np = _validate.concrete_orders(orders)
    _check_common(q, noise_multiplier, r)
    return _pi_rdp_jit(tuple(orders_np.tolist()), f64(q), f64(noise_multiplier), f64(r))


@functools.partial(jax.jit, static_argnums=0)
def _pi_rdp_jit(orders_key, q, noise_multiplier, r):
    return _pi_rdp(np.asarray(orders_key, dtype=np.float64), q, noise_multiplier, r)


def _pi_rdp(orders_np, q, noise_multiplier, r):
    q, noise_multiplier, r = jnp.broadcast_arrays(q, noise_multiplier, r)
    valid = (r >= 0) & (r <= 1)
    pos = valid & (r > 0)
    # Double-where: the sampled Gaussian is evaluated at r = 1 where its value is not used
    # (r = 0, invalid r), so the derivative stays finite there.
    r_eval = jnp.where(pos, jnp.maximum(r, _R_FLOOR), 1.0)
    out = sampled_gaussian_rdp(orders_np, q, noise_multiplier / r_eval)
    out = jnp.where(pos[..., None], out, 0.0)
    return jnp.where(valid[..., None], out, jnp.nan)
