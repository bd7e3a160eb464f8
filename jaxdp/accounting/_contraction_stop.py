r"""Contraction bound of PNSGD with a random stopping time (Asoodeh, Diaz, Calmon, Theorem 5).

The run stops after a step drawn uniformly from ``positions`` (the stopping time stays
secret), so a record's privacy loss is averaged over the later steps that may or may not
run. Conventions and assumptions as in :mod:`._contraction` (``epsilon`` is log γ;
``noise_std`` is the noise standard deviation on the gradient); the inverse ε(δ) is the
certified bisection of :mod:`._contraction_common`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .. import _validate
from .._numerics import f64, float64
from .._validate import check_integer, check_positions, is_int, nan_unless
from ._contraction_common import _check_pnsgd_constants, _check_delta_target, _eps_bracket, _run_valid, _solve_eps
from ._hockey_stick import _log_theta_and_complement

__all__ = ["stop_pnsgd_contraction_delta", "stop_pnsgd_contraction_epsilon"]


# ---------------------------------------------------------------------------------------
# Theorem 5 (random stopping).
# ---------------------------------------------------------------------------------------


def _stop_setup(num_records, lipschitz, noise_std, learning_rate, diameter, contraction, positions):
    n, lip, sig, eta, dia, m_c = (f64(x) for x in (num_records, lipschitz, noise_std, learning_rate, diameter, contraction))
    valid = is_int(n) & _run_valid(lip, sig, eta, dia, m_c)
    if positions is None:
        count = None
    else:
        pos = f64(positions)
        valid = valid & is_int(pos) & (pos <= n)
        count = jnp.where(valid, n - pos + 1.0, 1.0)
    sig_s = jnp.where(valid, sig, 1.0)
    eta_s = jnp.where(valid, eta, 1.0)
    r1 = 2.0 * lip / sig_s
    rc = m_c * dia / (eta_s * sig_s)
    n_s = jnp.where(valid, n, 1.0)
    return valid, r1, rc, n_s, count


def _log_geometric_sum(ltc, lcc, count):
    r"""``log Σ_{k<K} θ^k = log(1 − θ^K) − log(1 − θ)`` from ``ltc = log θ``, ``lcc = log(1 − θ)``.

    All in log space, because 1 − θ underflows as a number long before its log does (at
    r = 80, log(1 − θ(0, r)) ≈ −804 while θ rounds to 1 and log θ to −0.0). With
    u = 1 − θ and y = −K log θ: log(1 − θ^K) = log(−expm1(−y)), where
    log y = log K + log(−log θ), and log(−log θ) = log u + log1p(u/2 + u²/3 + …) is taken
    as log u + log1p(u/2) once u < e^{-30} (the dropped terms are below 1e-26 relative).
    For y < e^{-30}, log(−expm1(−y)) = log y − y/2 + O(y²). Limits: θ = 0 gives 0 (one
    term), θ = 1 exactly (r = ∞) gives log K. Derivation: docs/contraction.md.
    """
    fin_t = jnp.isfinite(ltc)  # θ > 0
    fin_c = jnp.isfinite(lcc)  # θ < 1
    ok = fin_t & fin_c
    ltc_s = jnp.where(ok, ltc, -1.0)  # double-where: keep unused branches finite
    lcc_s = jnp.where(ok, lcc, -1.0)
    small_u = lcc_s < -30.0
    neg_ltc = jnp.where(small_u, 1.0, -ltc_s)
    neg_ltc = jnp.where(neg_ltc > 0, neg_ltc, 1.0)
    log_neg_ltc = jnp.where(small_u, lcc_s + jnp.log1p(0.5 * jnp.exp(lcc_s)), jnp.log(neg_ltc))
    log_y = jnp.log(count) + log_neg_ltc
    small_y = log_y < -30.0
    y = jnp.exp(jnp.where(small_y, log_y, jnp.minimum(log_y, 700.0)))
    y_big = jnp.where(small_y, 1.0, y)
    log_num = jnp.where(small_y, log_y - 0.5 * y, jnp.log(-jnp.expm1(-y_big)))
    out = log_num - lcc_s
    return jnp.where(ok, out, jnp.where(fin_c, 0.0, jnp.log(count)))


def _stop_log_delta(eps, r1, rc, n, count):
    shape = jnp.broadcast_shapes(jnp.shape(eps), jnp.shape(r1), jnp.shape(rc))
    rr = jnp.stack([jnp.broadcast_to(r1, shape), jnp.broadcast_to(rc, shape)], axis=-1)
    lt, lc = _log_theta_and_complement(jnp.broadcast_to(eps, shape)[..., None], rr)
    lt1, ltc, lcc = lt[..., 0], lt[..., 1], lc[..., 1]
    log_d = lt1 - jnp.log(n) - lcc  # Eq. (16): θ1 / (n (1 − θc))
    if count is not None:
        log_d = lt1 - jnp.log(n) + _log_geometric_sum(ltc, lcc, count)
    return jnp.minimum(log_d, 0.0)  # E_γ ≤ 1 always: clipping at 1 is valid


@float64
def stop_pnsgd_contraction_delta(
    epsilon, num_records, lipschitz, noise_std, learning_rate, diameter, contraction=1.0, *, positions=None
) -> jax.Array:
    r"""δ(ε) of randomly stopped PNSGD (uniform stopping time on 1..n), Theorem 5.

    The algorithm draws T uniformly from {1, …, n}, runs T steps of PNSGD and releases
    :math:`Y_T`. By joint convexity of :math:`E_γ` and Theorem 4 for each stopping time,

    .. math::
        δ_i = \frac{θ_1}{n} \sum_{r=i}^{n} θ_c^{\,r-i} = \frac{θ_1 (1 - θ_c^{\,n-i+1})}{n (1 - θ_c)}
        ≤ \frac{θ_1}{n (1 - θ_c)},
        \qquad θ_1 = θ_{e^ε}(2L/σ),\ θ_c = θ_{e^ε}(MD/(ησ)).

    With ``positions=None`` this returns the uniform bound (16); with a position it returns
    the tighter exact sum for that record (worst case i = 1). Both are clipped at 1
    (:math:`E_γ ≤ 1`; the uniform bound exceeds 1 when σ is small, which is vacuous).
    Unlike the Rényi analysis of Stop-PNSGD, no condition on σ is needed.

    Assumptions (not checked): convex, L-Lipschitz, β-smooth, ρ-strongly convex loss on a
    compact convex set of diameter D; η ≤ 2/(β+ρ); the stopping time is uniform and
    hidden; only :math:`Y_T` is released; one pass in a fixed order; batch size 1.

    Args:
      epsilon: ε ≥ 0.
      num_records: n ≥ 1.
      lipschitz: L ≥ 0.
      noise_std: σ > 0 (gradient noise standard deviation).
      learning_rate: η > 0.
      diameter: D > 0.
      contraction: M in [0, 1].
      positions: ``None`` (uniform bound, Eq. (16)) or the record index in 1..n (exact sum).

    Returns:
      δ in [0, 1], float64 (NaN under ``jit`` for invalid inputs).

    References:
      Asoodeh, Diaz, Calmon (arXiv:2001.06546), Theorem 5, Eq. (16) and its proof.

    Examples:
      >>> import jaxdp
      >>> d = jaxdp.accounting.stop_pnsgd_contraction_delta(0.0, 40, 1.0, 2.0, 0.5, 1.0)
      >>> round(float(d), 12)
      0.015513708807
    """
    _validate.check_in_range("epsilon", epsilon, 0.0, math.inf, allow_inf=True)
    _check_stop(num_records, lipschitz, noise_std, learning_rate, diameter, contraction, positions)
    args = [f64(x) for x in (epsilon, num_records, lipschitz, noise_std, learning_rate, diameter, contraction)]
    return _stop_delta_core(*args, None if positions is None else f64(positions))


@jax.jit
def _stop_delta_core(eps, num_records, lipschitz, noise_std, learning_rate, diameter, contraction, positions):
    valid, r1, rc, n, count = _stop_setup(num_records, lipschitz, noise_std, learning_rate, diameter, contraction, positions)
    return nan_unless(valid & (eps >= 0), jnp.exp(_stop_log_delta(eps, r1, rc, n, count)))


def _check_stop(num_records, lipschitz, noise_std, learning_rate, diameter, contraction, positions) -> None:
    check_integer("num_records", num_records)
    if positions is not None:
        check_positions(positions, num_records)
    _check_pnsgd_constants(lipschitz, noise_std, learning_rate, diameter, contraction)


@float64
def stop_pnsgd_contraction_epsilon(
    delta, num_records, lipschitz, noise_std, learning_rate, diameter, contraction=1.0, *, positions=None
) -> jax.Array:
    r"""Smallest ε with :func:`stop_pnsgd_contraction_delta` (ε) ≤ δ (Theorem 5 inverted).

    Fixed-count bisection, rounded up. The bracket uses :math:`θ_c(ε) ≤ θ_c(0)`, so
    :math:`δ(ε) ≤ θ_{e^ε}(r_1)/(n(1 - θ_c(0)))`, and the bound of
    :func:`pnsgd_contraction_epsilon` applied to the target :math:`δ\, n (1 - θ_c(0))`.
    Returns +inf when :math:`1 - θ_c(0)` underflows (no certified ε).

    Args:
      delta: target δ in (0, 1).
      num_records, lipschitz, noise_std, learning_rate, diameter, contraction, positions: as in
        :func:`stop_pnsgd_contraction_delta` (same assumptions).

    Returns:
      ε ≥ 0, float64 (NaN under ``jit`` for invalid inputs).

    References:
      Asoodeh, Diaz, Calmon (arXiv:2001.06546), Theorem 5 (the inverse is not in the paper).

    Examples:
      >>> import jaxdp
      >>> e = jaxdp.accounting.stop_pnsgd_contraction_epsilon(1e-3, 40, 1.0, 2.0, 0.5, 1.0)
      >>> round(float(e), 9)
      1.706621948
    """
    _check_delta_target(delta)
    _check_stop(num_records, lipschitz, noise_std, learning_rate, diameter, contraction, positions)
    args = [f64(x) for x in (delta, num_records, lipschitz, noise_std, learning_rate, diameter, contraction)]
    return _stop_eps_core(*args, None if positions is None else f64(positions))


@jax.jit
def _stop_eps_core(dlt, num_records, lipschitz, noise_std, learning_rate, diameter, contraction, positions):
    valid, r1, rc, n, count = _stop_setup(num_records, lipschitz, noise_std, learning_rate, diameter, contraction, positions)
    valid = valid & (dlt > 0) & (dlt < 1)
    log_t = jnp.log(jnp.where(valid, dlt, 0.5))
    _, lcc0 = _log_theta_and_complement(jnp.zeros_like(rc), rc)
    shape = jnp.broadcast_shapes(log_t.shape, r1.shape, rc.shape, n.shape, () if count is None else count.shape)
    r1, rc, n, log_t, lcc0 = (jnp.broadcast_to(x, shape) for x in (r1, rc, n, log_t, lcc0))
    cnt = None if count is None else jnp.broadcast_to(count, shape)
    hi = _eps_bracket(r1, log_t + jnp.log(n) + jnp.where(jnp.isfinite(lcc0), lcc0, 0.0))
    eps = _solve_eps(
        lambda e, r1_, rc_, lt_: _stop_log_delta(e, r1_, rc_, n, cnt) - lt_, (r1, rc, log_t), jnp.zeros(shape), hi
    )
    eps = jnp.where(jnp.isfinite(lcc0), eps, jnp.inf)
    return nan_unless(valid, eps)
