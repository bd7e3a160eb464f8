r"""Divergences between discrete distributions: the hockey-stick divergence and KL.

Both take probability vectors along the last axis and broadcast over the leading axes.
They compute in float64 whatever the global ``jax_enable_x64`` flag, validate concrete
inputs eagerly (``ValueError`` naming the parameter), and give NaN under ``jit`` for
invalid inputs (negative entries or vectors that do not sum to 1).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .. import _validate
from .._numerics import f64, float64

__all__ = ["hockey_stick_divergence", "kl_divergence"]

# Tolerance on Σp = 1 for inputs that arrive in float32 (rounding of a sum of n float32
# entries is ~n·6e-8; 1e-6 admits vectors of a few dozen entries without false alarms).
_SUM_ATOL = 1e-6


def _distributions(p, q):
    _validate.check_probability_vectors("p", p, atol=_SUM_ATOL)
    _validate.check_probability_vectors("p_prime", q, atol=_SUM_ATOL)
    p, q = f64(p), f64(q)
    p, q = jnp.broadcast_arrays(p, q)

    def ok(x):
        return jnp.all(x >= 0, axis=-1) & (jnp.abs(jnp.sum(x, axis=-1) - 1.0) <= _SUM_ATOL)

    return p, q, ok(p) & ok(q) & jnp.all(jnp.isfinite(p) & jnp.isfinite(q), axis=-1)


@float64
def hockey_stick_divergence(p, p_prime, epsilon) -> jax.Array:
    r"""Hockey-stick divergence :math:`E_{e^ε}(p\|q) = \sum_y (p(y) - e^ε q(y))_+` of discrete laws.

    It equals :math:`\sup_S p(S) - e^ε q(S)`, so a mechanism with output laws p, q on a pair
    of neighbouring datasets satisfies :math:`p(S) ≤ e^ε q(S) + δ` for all S exactly when
    δ ≥ this value (check both orders (p, q) and (q, p) for (ε, δ)-DP).

    Args:
      p: probability vectors, shape (..., n) (entries ≥ 0 summing to 1).
      p_prime: probability vectors q of the formula, broadcastable to ``p`` (not named
        ``q``, which is the sampling rate everywhere else).
      epsilon: ε ≥ 0 (``inf`` allowed: the divergence is then 0), broadcastable to the
        leading shape of p and q.

    Returns:
      Value in [0, 1], float64, the broadcast leading shape. NaN under ``jit`` for invalid
      inputs.

    References:
      G. Barthe, B. Köpf, F. Olmedo, S. Zanella-Béguelin, "Probabilistic relational
      reasoning for differential privacy", POPL 2012; the μ of the proof of Claim 10 in
      the blog post "A Tail of Two Densities" (2019).

    Examples:
      >>> import jaxdp
      >>> round(float(jaxdp.accounting.hockey_stick_divergence([0.4, 0.6], [0.6, 0.4], 0.0)), 12)
      0.2
    """
    _validate.check_in_range("epsilon", epsilon, 0.0, math.inf, allow_inf=True)
    p, q, valid = _distributions(p, p_prime)
    eps = f64(epsilon)
    valid = valid & (eps >= 0)
    eps_e = eps[..., None]
    # Where q = 0 the term is p whatever ε is; keep e^ε (possibly inf) out of that branch.
    pos = q > 0
    eps_s = jnp.where(pos, eps_e, 0.0)
    scaled = jnp.where(pos, jnp.exp(eps_s) * q, 0.0)
    out = jnp.sum(jnp.maximum(p - scaled, 0.0), axis=-1)
    return jnp.where(valid, out, jnp.nan)


@float64
def kl_divergence(p, p_prime) -> jax.Array:
    r"""Kullback-Leibler divergence :math:`D(p\|q) = \sum_y p(y)\log\frac{p(y)}{q(y)}` of discrete laws.

    Terms with p(y) = 0 are 0 (:math:`0 \log 0 = 0`); a p(y) > 0 with q(y) = 0 gives +inf.

    Args:
      p: probability vectors, shape (..., n).
      p_prime: probability vectors q of the formula, broadcastable to ``p``.

    Returns:
      D ≥ 0 (possibly +inf), in nats, float64, the broadcast leading shape. NaN under
      ``jit`` for invalid inputs.

    References:
      T. Cover, J. Thomas, "Elements of Information Theory" (2nd ed., 2006), Eq. (2.26).

    Examples:
      >>> import jaxdp
      >>> round(float(jaxdp.accounting.kl_divergence([0.5, 0.5, 0.0], [0.25, 0.25, 0.5])), 12)
      0.69314718056
    """
    p, q, valid = _distributions(p, p_prime)
    pos_p = p > 0
    both = pos_p & (q > 0)
    # Double where: the logs see 1 wherever their value is not used, so gradients stay finite.
    log_ratio = jnp.log(jnp.where(both, p, 1.0)) - jnp.log(jnp.where(both, q, 1.0))
    term = jnp.where(both, p * log_ratio, jnp.where(pos_p, jnp.inf, 0.0))
    return jnp.where(valid, jnp.sum(term, axis=-1), jnp.nan)
