"""Truncated Poisson sampling's RDP (the analysis behind :class:`TruncatedPoissonSampled`).

Split out of ``_sampling.py`` (the events and the other schemes live there); the derivation
is in that module's docstring and in docs/batch_schemes.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

try:  # a private JAX function (see _betainc64); a JAX without it uses the public primitive
    from jax._src.lax.special import regularized_incomplete_beta_impl as _betainc_impl
except ImportError:  # pragma: no cover - depends on the installed JAX
    _betainc_impl = None

from .. import _validate
from .._numerics import f64, float64
from ._rdp import sampled_gaussian_rdp

__all__ = ["truncated_poisson_rdp"]

# Relative margin on binomial masses from betainc (its own error is ~1e-14 relative).
_TAU_MARGIN = 1e-9


# =======================================================================================
# Truncated Poisson: reveal the number of other records drawn.
# =======================================================================================

# Buckets of k ≥ B (the others' count): B + offsets, linear then geometric, up to c + 1.
_TP_LINEAR = 32
_TP_GEOMETRIC = 40


def _tp_offsets() -> np.ndarray:
    lin = np.arange(_TP_LINEAR, dtype=np.float64)
    geo = np.unique(np.floor(_TP_LINEAR * 1.35 ** np.arange(1, _TP_GEOMETRIC + 1)))
    return np.concatenate([lin, geo])


@jax.custom_jvp
def _betainc64(a, b, x):
    """The regularised incomplete beta I_x(a, b), traced as ordinary float64 operations.

    ``jax.scipy.special.betainc`` is a primitive that XLA lowers when the caller's program
    is compiled, outside jaxdp's float64 scope (it fails with x64 off); its implementation
    function is called here directly instead. Derivative in x only (a and b are counts).
    """
    a, b, x = jnp.broadcast_arrays(a, b, x)
    if _betainc_impl is None:  # needs x64 on where XLA lowers it; values are the same
        return jax.scipy.special.betainc(a, b, x)
    return _betainc_impl(a, b, x, dtype=np.float64)


@_betainc64.defjvp
def _betainc64_jvp(primals, tangents):
    a, b, x = primals
    out = _betainc64(a, b, x)
    lbeta = jax.scipy.special.gammaln(a) + jax.scipy.special.gammaln(b) - jax.scipy.special.gammaln(a + b)
    xs = jnp.clip(x, 1e-300, 1.0 - 1e-16)
    dfdx = jnp.exp((b - 1.0) * jnp.log1p(-xs) + (a - 1.0) * jnp.log(xs) - lbeta)
    return out, dfdx * tangents[2]


def _binom_tail(k, c, q):
    """Pr[Bin(c, q) ≥ k] for real k (0 for k > c, 1 for k ≤ 0)."""
    kk = jnp.clip(k, 1.0, jnp.maximum(c, 1.0))
    t = _betainc64(kk, jnp.maximum(c - kk + 1.0, 1.0), q)
    t = jnp.where(q >= 1, 1.0, jnp.where(q <= 0, 0.0, t))
    return jnp.where(k <= 0, 1.0, jnp.where(k > c, 0.0, t))


def _tp_curve(orders_np, q, c, b, sigma):
    """log E_N e^{(α-1)ε_N(α)} / (α - 1) for N ~ Bin(c, q) (shapes: batch -> batch + (k,))."""
    orders = f64(orders_np)
    am1 = orders - 1.0
    edges = b[..., None] + f64(_tp_offsets())  # (..., J) left edges of the buckets k ≥ B
    right = jnp.concatenate([edges[..., 1:], jnp.full(edges.shape[:-1] + (1,), jnp.inf)], axis=-1)
    cc, qq = c[..., None], q[..., None]
    mass_hi = _binom_tail(edges, cc, qq) - jnp.where(jnp.isfinite(right), _binom_tail(right, cc, qq), 0.0)
    mass_hi = jnp.maximum(mass_hi, 0.0) * (1.0 + _TAU_MARGIN)
    # Pr[N < B] = Pr[Bin(c, 1 - q) ≥ c - B + 1], without the cancellation of 1 - Pr[N ≥ B].
    mass_lo = jnp.where(b <= 0, 0.0, jnp.minimum(_binom_tail(c - b + 1.0, c, 1.0 - q) * (1.0 + _TAU_MARGIN), 1.0))
    q_hi = q[..., None] * b[..., None] / (edges + 1.0)
    eps_hi = sampled_gaussian_rdp(orders_np, q_hi, 0.5 * sigma[..., None])  # (..., J, k)
    eps_lo = sampled_gaussian_rdp(orders_np, q, sigma)  # (..., k)
    log_terms = jnp.concatenate(
        [(jnp.log(jnp.where(mass_lo > 0, mass_lo, 1.0)) + jnp.where(mass_lo > 0, 0.0, -jnp.inf))[..., None, None]
         + am1 * eps_lo[..., None, :],
         (jnp.log(jnp.where(mass_hi > 0, mass_hi, 1.0)) + jnp.where(mass_hi > 0, 0.0, -jnp.inf))[..., None]
         + am1 * eps_hi], axis=-2)
    return jnp.maximum(jax.nn.logsumexp(log_terms, axis=-2) / am1, 0.0)


@float64
def truncated_poisson_rdp(orders, q, num_records, max_batch_size, noise_multiplier) -> jax.Array:
    r"""RDP of the Gaussian mechanism on a Poisson sample cut to at most B records (add/remove-one).

    With N ~ Bin(c, q) the number of the c common records drawn,
    :math:`ε(α) = \frac{1}{α-1}\log \mathbb{E}_N e^{(α-1)ε_N(α)}` where
    :math:`ε_k = ε_{\mathrm{SGM}}(q, σ)` for k < B and
    :math:`ε_k = ε_{\mathrm{SGM}}(qB/(k+1), σ/2)` for k ≥ B (:func:`sampled_gaussian_rdp`);
    the larger curve over c ∈ {n − 1, n}. Over k ≥ B the expectation is taken on buckets
    (32 single values, then geometric), each charged its largest ε_k (its left edge), so the
    value is an upper bound. With B ≥ n + 1 it is the Poisson-sampled Gaussian's curve.

    Derivation: releasing N (same law on both data sets) is post-processing in reverse, so
    the divergence is at most the N-average (joint convexity). For N = k ≥ B the added
    record is kept with probability B/(k+1) when drawn, and a kept record takes the place
    of a uniformly random other one (a uniform B-subset is a uniform (B−1)-subset plus one
    more); releasing that (B−1)-subset and the displaced record leaves the pair
    ((1−q')N(0, σ²) + q'N(v, σ²), N(0, σ²)) with ‖v‖ ≤ 2 (two clipped records).

    Args:
      orders: Rényi orders > 1 (static).
      q: rate in [0, 1]; num_records: n ≥ 1; max_batch_size: B ≥ 0; noise_multiplier:
        σ > 0 over the add/remove sensitivity (the clipping norm). Broadcast together.

    Returns:
      float64 ``batch + (k,)`` (NaN under ``jit`` for invalid inputs).

    Examples:
      >>> import jaxdp, numpy as np
      >>> A = jaxdp.accounting
      >>> a = A.truncated_poisson_rdp([2.0, 8.0], 0.01, 1000, 1001, 1.0)  # B > n: never truncates
      >>> b = A.sampled_gaussian_rdp([2.0, 8.0], 0.01, 1.0)
      >>> bool(np.max(np.abs(np.asarray(a) - np.asarray(b))) < 1e-12)
      True
    """
    orders_np = _validate.concrete_orders(orders)
    _validate.check_in_range("q", q, 0.0, 1.0)
    _validate.check_in_range("num_records", num_records, 1.0, math.inf)
    _validate.check_in_range("max_batch_size", max_batch_size, 0.0, math.inf)
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    _validate.check_broadcastable(q=q, num_records=num_records, max_batch_size=max_batch_size,
                                  noise_multiplier=noise_multiplier)
    return _tp_rdp(orders_np, f64(q), f64(num_records), f64(max_batch_size), f64(noise_multiplier))


def _tp_rdp(orders_np, q, n, b, sigma):
    shape = jnp.broadcast_shapes(q.shape, n.shape, b.shape, sigma.shape)
    q, n, b, sigma = (jnp.broadcast_to(x, shape) for x in (q, n, b, sigma))
    valid = (q >= 0) & (q <= 1) & (n >= 1) & (b >= 0) & (sigma > 0) & jnp.isfinite(sigma) & jnp.isfinite(n)
    q_s = jnp.where(valid, q, 0.5)
    n_s = jnp.where(valid, n, 1.0)
    b_s = jnp.floor(jnp.where(valid, b, 0.0))
    s_s = jnp.where(valid, sigma, 1.0)
    out = jnp.maximum(_tp_curve(orders_np, q_s, n_s - 1.0, b_s, s_s), _tp_curve(orders_np, q_s, n_s, b_s, s_s))
    return jnp.where(valid[..., None], out, jnp.nan)
