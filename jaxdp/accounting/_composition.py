r"""Composition of (ε, δ)-DP mechanisms and amplification by subsampling.

Every public function computes in float64 whatever the global ``jax_enable_x64`` flag,
broadcasts its array arguments, validates concrete inputs eagerly (``ValueError`` naming
the parameter), and gives NaN under ``jit`` for invalid inputs. A bound that cannot be
certified (for example a total δ below what the steps already spend) is +inf.

These are the classic, mechanism-agnostic results: they only know that each step is
(ε, δ)-DP. When the steps are Gaussian mechanisms, the Rényi or hockey-stick accountants
(:func:`jaxdp.accounting.gaussian_rdp`, :func:`jaxdp.accounting.gaussian_mechanism_delta`)
are much tighter.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._numerics import f64, float64
from .._validate import nan_unless as _nan_unless

__all__ = [
    "basic_composition",
    "advanced_composition",
    "ADVANCED_COMPOSITION_FORMS",
    "optimal_homogeneous_composition",
    "amplify_by_poisson_sampling",
    "amplify_by_sampling_without_replacement",
]

ADVANCED_COMPOSITION_FORMS = ("dwork_roth", "tutorial_independent", "tutorial_adaptive")

# Optimal composition: δ_i is a difference of two prefix sums (see below). Their float64
# rounding is below 1e-16·(εk + k) relative to the larger sum A_i ≤ 1, plus 1e-12 from the
# log-binomials, which are common to both sums; we add 1e-11·A_i to δ_i so the error
# can only make the bound larger (valid for k up to ~1e4, above the default cap).
_KOV_ALLOWANCE = 1e-11
# Relative margin on the total δ target in certified comparisons.
_SAFETY_REL = 1e-12


def _check_eps_delta(epsilon, delta) -> None:
    _validate.check_in_range("epsilon", epsilon, 0.0, math.inf)
    _validate.check_in_range("delta", delta, 0.0, 1.0)


# ---------------------------------------------------------------------------------------
# Basic and advanced composition.
# ---------------------------------------------------------------------------------------


@float64
def basic_composition(epsilon, delta, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    r"""Basic composition: k adaptively chosen (ε_i, δ_i)-DP steps are (Σε_i, Σδ_i)-DP.

    Args:
      epsilon: per-step ε_i ≥ 0 (finite); the steps run along ``axis``.
      delta: per-step δ_i in [0, 1], broadcastable to ``epsilon``.
      axis: static axis holding the steps.

    Returns:
      ``(epsilon_total, delta_total)``, float64, the other axes kept (Σδ may exceed 1, which
      is a vacuous guarantee). NaN under ``jit`` for invalid inputs.

    References:
      C. Dwork, J. Lei, "Differential privacy and robust statistics", STOC 2009;
      Dwork and Roth (2014), Theorem 3.16; Claim 10 of the blog post "A Tail of Two
      Densities" (2019).

    Examples:
      >>> import jaxdp
      >>> e, d = jaxdp.accounting.basic_composition([0.1, 0.2, 0.3], [1e-6, 0.0, 1e-6])
      >>> round(float(e), 12), float(d)
      (0.6, 2e-06)
    """
    _check_eps_delta(epsilon, delta)
    eps, dlt = jnp.broadcast_arrays(f64(epsilon), f64(delta))
    valid = (eps >= 0) & jnp.isfinite(eps) & (dlt >= 0) & (dlt <= 1)
    eps = _nan_unless(valid, eps)
    dlt = _nan_unless(valid, dlt)
    return jnp.sum(eps, axis=axis), jnp.sum(dlt, axis=axis)


def _kl_bound(eps):
    """a(ε) = min(ε(e^ε - 1), ε): a bound on KL(P‖Q) for ε-indistinguishable P, Q."""
    return jnp.minimum(eps * jnp.expm1(eps), eps)


@float64
def advanced_composition(epsilon, delta, num_steps, total_delta, *, form: str = "dwork_roth") -> jax.Array:
    r"""Advanced composition: ε of k-fold (ε, δ)-DP at a target total δ.

    k steps, each (ε, δ)-DP, are :math:`(ε', kδ + δ')`-DP for every δ' in (0, 1) with

    * ``"dwork_roth"`` (adaptive composition):
      :math:`ε' = \sqrt{2k\log(1/δ')}\,ε + kε(e^ε - 1)`;
    * ``"tutorial_independent"`` (independent noises, non-adaptive queries only):
      :math:`ε' = k\,a(ε) + \sqrt{2k\log(1/δ')}\,ε`, :math:`a(ε) = \min(ε(e^ε-1), ε)`;
    * ``"tutorial_adaptive"`` (adaptive, Azuma with increments ε + a(ε)):
      :math:`ε' = k\,a(ε) + \sqrt{2k\log(1/δ')}\,(ε + a(ε))`.

    ε' decreases in δ', so for a target total δ the best choice is the whole remaining
    budget :math:`δ' = δ_{total} - kδ` (closed form: no search is needed). The result is
    the smaller of this and basic composition's kε (which needs only kδ ≤ δ_total); +inf
    when :math:`δ_{total} < kδ`.

    Args:
      epsilon: per-step ε ≥ 0 (finite).
      delta: per-step δ in [0, 1].
      num_steps: k, a whole number ≥ 1.
      total_delta: target total δ in (0, 1).
      form: static, one of :data:`ADVANCED_COMPOSITION_FORMS`.

    Returns:
      ε' ≥ 0, float64, broadcast shape. NaN under ``jit`` for invalid inputs.

    References:
      C. Dwork, G. Rothblum, S. Vadhan, "Boosting and Differential Privacy", FOCS 2010,
      Theorem III.3; Dwork and Roth (2014), Theorem 3.20; Claims 14, 16, 17 and 18 of the blog post
      "A Tail of Two Densities" (2019).

    Examples:
      >>> import jaxdp
      >>> e = jaxdp.accounting.advanced_composition(0.1, 0.0, 100, 1e-5, form="tutorial_independent")
      >>> round(float(e), 9)
      5.850235093
    """
    _validate.check_static_choice("form", form, ADVANCED_COMPOSITION_FORMS)
    _check_eps_delta(epsilon, delta)
    _validate.check_integer("num_steps", num_steps, 1.0)
    _validate.check_in_range("total_delta", total_delta, 0.0, 1.0, lo_open=True, hi_open=True)
    return _advanced_core(f64(epsilon), f64(delta), f64(num_steps), f64(total_delta), form)


@functools.partial(jax.jit, static_argnames="form")
def _advanced_core(eps, dlt, k, total, form):
    valid = (
        (eps >= 0) & jnp.isfinite(eps) & (dlt >= 0) & (dlt <= 1)
        & (k >= 1) & (k == jnp.floor(k)) & jnp.isfinite(k) & (total > 0) & (total < 1)
    )
    spare = total - k * dlt  # δ'
    pos = spare > 0
    log_inv = -jnp.log(jnp.where(pos, spare, 1.0))
    root = jnp.sqrt(2.0 * k * log_inv)
    if form == "dwork_roth":
        adv = root * eps + k * eps * jnp.expm1(eps)
    elif form == "tutorial_independent":
        adv = k * _kl_bound(eps) + root * eps
    else:
        a = _kl_bound(eps)
        adv = k * a + root * (eps + a)
    adv = jnp.where(pos, adv, jnp.inf)
    basic = jnp.where(spare >= 0, k * eps, jnp.inf)
    return _nan_unless(valid, jnp.minimum(basic, adv))


# ---------------------------------------------------------------------------------------
# Optimal homogeneous composition (Kairouz, Oh, Viswanath).
# ---------------------------------------------------------------------------------------


@float64
def optimal_homogeneous_composition(
    epsilon, delta, num_steps, total_delta, *, max_num_steps: int = 4096
) -> jax.Array:
    r"""Optimal ε of k-fold adaptive composition of (ε, δ)-DP mechanisms at a target total δ.

    For each :math:`i ∈ \{0, …, \lfloor k/2 \rfloor\}` the composition is
    :math:`\big((k - 2i)ε,\ 1 - (1-δ)^k (1 - δ_i)\big)`-DP, with

    .. math::
        δ_i = \frac{\sum_{l=0}^{i-1} \binom{k}{l}\big(e^{(k-l)ε} - e^{(k-2i+l)ε}\big)}{(1 + e^ε)^k},

    and these points are tight: no bound valid for all (ε, δ)-DP mechanisms is smaller. The
    result is :math:`(k - 2i^*)ε` for the largest :math:`i^*` whose total δ is ≤ ``total_delta``
    (the same grid as ``dp_accounting.pld.accountant.advanced_composition``), +inf if even
    :math:`1 - (1-δ)^k` exceeds it.

    The sums are evaluated in log space as differences of two prefix sums,
    :math:`δ_i = A_i - e^{(k-2i)ε} B_i` (O(k) work); a rounding allowance of
    :math:`10^{-11} A_i` is added to each δ_i, so a target below about 1e-11 is answered
    conservatively.

    Args:
      epsilon: per-step ε ≥ 0 (finite).
      delta: per-step δ in [0, 1).
      num_steps: k, a whole number in [1, max_num_steps].
      total_delta: target total δ in (0, 1).
      max_num_steps: static cap on k that fixes the array sizes (memory O(max_num_steps)).

    Returns:
      ε' ≥ 0, float64, broadcast shape (+inf if not certifiable; NaN under ``jit`` for invalid
      inputs, including k > max_num_steps).

    References:
      P. Kairouz, S. Oh, P. Viswanath, "The Composition Theorem for Differential Privacy",
      ICML 2015 / IEEE Trans. Inf. Theory 2017, Theorem 3.3.

    Examples:
      >>> import jaxdp
      >>> e = jaxdp.accounting.optimal_homogeneous_composition(0.1, 0.0, 100, 1e-5)
      >>> round(float(e), 9)
      4.4
    """
    _check_eps_delta(epsilon, delta)
    _validate.check_in_range("delta", delta, 0.0, 1.0, hi_open=True)
    _validate.check_integer("num_steps", num_steps, 1.0, float(max_num_steps))
    _validate.check_in_range("total_delta", total_delta, 0.0, 1.0, lo_open=True, hi_open=True)
    args = jnp.broadcast_arrays(f64(epsilon), f64(delta), f64(num_steps), f64(total_delta))
    flat = [a.reshape(-1) for a in args]
    out = jax.vmap(functools.partial(_kov_core, max_k=int(max_num_steps)))(*flat)
    return out.reshape(args[0].shape)


@functools.partial(jax.jit, static_argnames="max_k")
def _kov_core(eps, dlt, k, total, max_k):
    valid = (
        (eps >= 0) & jnp.isfinite(eps) & (dlt >= 0) & (dlt < 1)
        & (k >= 1) & (k <= max_k) & (k == jnp.floor(k)) & (total > 0) & (total < 1)
    )
    # Only the choice of i* depends on these sums, and i* is piecewise constant: no gradient.
    eps_s = jax.lax.stop_gradient(jnp.where(valid, eps, 0.0))
    k_s = jax.lax.stop_gradient(jnp.where(valid, k, 1.0))
    d_s = jax.lax.stop_gradient(jnp.where(valid, dlt, 0.0))
    l = jnp.arange(max_k + 1, dtype=jnp.float64)
    inside = l <= k_s
    l_s = jnp.where(inside, l, 0.0)
    gl = jax.scipy.special.gammaln
    log_binom = gl(k_s + 1.0) - gl(l_s + 1.0) - gl(k_s - l_s + 1.0)
    # Normalise by (1 + e^ε)^k inside each term, so every term is ≤ 1 and no sum overflows.
    common = jnp.where(inside, log_binom - k_s * jnp.logaddexp(0.0, eps_s), -jnp.inf)
    cum_a = jax.lax.cumlogsumexp(common + eps_s * (k_s - l_s))  # Σ_{l' ≤ l}
    cum_b = jax.lax.cumlogsumexp(common + eps_s * l_s)
    i = jnp.arange(max_k // 2 + 1, dtype=jnp.float64)
    # A_i, B_i sum over l < i: the prefix up to index i - 1 (empty for i = 0).
    prev = jnp.maximum(i.astype(jnp.int32) - 1, 0)
    log_a = jnp.where(i > 0, cum_a[prev], -jnp.inf)
    log_b = jnp.where(i > 0, cum_b[prev], -jnp.inf)
    log_s = eps_s * (k_s - 2.0 * i) + log_b
    diff = jnp.minimum(log_s - jnp.where(i > 0, log_a, 0.0), 0.0)
    # δ_i ≤ A_i (1 - e^{diff} + allowance); the allowance covers rounding in the difference.
    frac = -jnp.expm1(diff) + _KOV_ALLOWANCE
    log_delta_i = jnp.where(i > 0, log_a + jnp.log(frac), -jnp.inf)
    delta_i = jnp.minimum(jnp.exp(log_delta_i), 1.0)
    tot = -jnp.expm1(k_s * jnp.log1p(-d_s) + jnp.log1p(-delta_i))
    feasible = (tot <= total * (1.0 - _SAFETY_REL)) & (2.0 * i <= k_s)
    # The feasible i form a prefix (δ_i grows with i); counting the leading run keeps a
    # rounding glitch further on from being used.
    count = jnp.sum(jnp.cumprod(feasible.astype(jnp.int32)))
    eps_total = jnp.where(count > 0, eps * (k_s - 2.0 * (count - 1)), jnp.inf)
    return _nan_unless(valid, eps_total)


# ---------------------------------------------------------------------------------------
# Amplification by subsampling.
# ---------------------------------------------------------------------------------------


def _amplify(eps, dlt, rate):
    valid = (eps >= 0) & jnp.isfinite(eps) & (dlt >= 0) & (dlt <= 1) & (rate >= 0) & (rate <= 1)
    # log(1 + r(e^ε - 1)) with log1p/expm1: exact to rounding for small r and small ε.
    # Past ε = 700 e^ε overflows (inf, and 0·inf = NaN at r = 0): there the same value is
    # log((1 - r) + r e^ε) = logaddexp(log1p(-r), log r + ε), with no overflow at any r.
    small = eps <= 700.0
    e_small = jnp.log1p(rate * jnp.expm1(jnp.where(valid & small, eps, 0.0)))
    r_pos = jnp.where(rate > 0, rate, 1.0)
    log_r = jnp.where(rate > 0, jnp.log(r_pos), -jnp.inf)
    e_big = jnp.logaddexp(jnp.log1p(-jnp.where(rate < 1, rate, 0.0)) + jnp.where(rate < 1, 0.0, -jnp.inf),
                          log_r + jnp.where(valid & ~small, eps, 701.0))
    e = jnp.where(small, e_small, e_big)
    return _nan_unless(valid, e), _nan_unless(valid, rate * dlt)


@float64
def amplify_by_poisson_sampling(epsilon, delta, q) -> tuple[jax.Array, jax.Array]:
    r"""(ε, δ) of a mechanism run on a Poisson subsample, under the add/remove relation.

    Each record enters the subsample independently with probability q, and the mechanism
    is (ε, δ)-DP with respect to adding or removing one record of its input. Then the
    subsampled mechanism is, with respect to adding or removing one record,

    .. math:: \big(\log(1 + q(e^ε - 1)),\ qδ\big)\text{-DP}.

    Do not use it with the replace-one relation (which needs a different bound) or with
    fixed-size sampling (see :func:`amplify_by_sampling_without_replacement`).

    Args:
      epsilon: ε ≥ 0 (finite) of the mechanism on the subsample.
      delta: δ in [0, 1] of the mechanism on the subsample.
      q: Poisson sampling rate in [0, 1].

    Returns:
      ``(epsilon, delta)`` of the subsampled mechanism, float64, broadcast shape. NaN under
      ``jit`` for invalid inputs.

    References:
      N. Li, W. Qardaji, D. Su, "On sampling, anonymization, and differential privacy",
      ASIACCS 2012, Theorem 1; B. Balle, G. Barthe, M. Gaboardi, "Privacy amplification by
      subsampling: tight analyses via couplings and divergences", NeurIPS 2018, Section 5
      (Poisson subsampling, remove-one relation).

    Examples:
      >>> import jaxdp
      >>> e, d = jaxdp.accounting.amplify_by_poisson_sampling(1.0, 1e-6, 0.01)
      >>> round(float(e), 10), float(d)
      (0.0170368632, 1e-08)
    """
    _check_eps_delta(epsilon, delta)
    _validate.check_in_range("q", q, 0.0, 1.0)
    return _amplify(f64(epsilon), f64(delta), f64(q))


@float64
def amplify_by_sampling_without_replacement(
    epsilon, delta, batch_size, num_records
) -> tuple[jax.Array, jax.Array]:
    r"""(ε, δ) of a mechanism run on a uniform fixed-size subsample, under the replace-one relation.

    The subsample is a uniformly random subset of ``batch_size`` = n of the ``num_records``
    = m records (without replacement), and the mechanism is (ε, δ)-DP with respect to
    replacing one record of its size-n input. With r = n/m the subsampled mechanism is,
    with respect to replacing one of the m records,

    .. math:: \big(\log(1 + r(e^ε - 1)),\ rδ\big)\text{-DP}.

    Args:
      epsilon: ε ≥ 0 (finite) of the mechanism on the subsample.
      delta: δ in [0, 1] of the mechanism on the subsample.
      batch_size: n, a whole number in [1, num_records].
      num_records: m, a whole number ≥ 1.

    Returns:
      ``(epsilon, delta)`` of the subsampled mechanism, float64, broadcast shape. NaN under
      ``jit`` for invalid inputs.

    References:
      Balle, Barthe, Gaboardi, NeurIPS 2018, Section 5 (sampling without replacement,
      substitution relation); J. Ullman, CS7880 lecture notes (2017); Claim 19 of the blog post "A Tail of Two
      Densities" (2019).

    Examples:
      >>> import jaxdp
      >>> e, d = jaxdp.accounting.amplify_by_sampling_without_replacement(2.0, 0.0, 100, 1000)
      >>> round(float(e), 10)
      0.494028708
    """
    _check_eps_delta(epsilon, delta)
    _validate.check_integer("num_records", num_records, 1.0)
    _validate.check_integer("batch_size", batch_size, 1.0)
    if _validate.is_concrete(batch_size) and _validate.is_concrete(num_records):
        if np.any(np.asarray(batch_size, np.float64) > np.asarray(num_records, np.float64)):
            raise ValueError("batch_size must be at most num_records.")
    n, m = f64(batch_size), f64(num_records)
    ok = (n >= 1) & (n == jnp.floor(n)) & (m == jnp.floor(m)) & (n <= m)
    rate = jnp.where(ok, n / jnp.where(m >= 1, m, 1.0), jnp.nan)
    return _amplify(f64(epsilon), f64(delta), rate)
