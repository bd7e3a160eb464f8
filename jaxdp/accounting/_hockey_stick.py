r"""Hockey-stick divergences of the Gaussian and Laplace mechanisms (the primitives).

:math:`θ_{e^ε}(r) = E_{e^ε}(N(r, 1) \| N(0, 1))` in log space together with
:math:`\log(1 - θ)`, with analytic derivatives, and the Laplace analogue. The contraction
theorems built on them live in :mod:`jaxdp.accounting._contraction`.
Derivation of the log-space forms: docs/contraction.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .. import _validate
from .._numerics import f64, float64, log_ndtr, one_output
from .._validate import nan_unless

__all__ = [
    "gaussian_hockey_stick",
    "log_gaussian_hockey_stick",
    "gaussian_hockey_stick_complement",
    "laplace_hockey_stick",
]

_SQRT2 = math.sqrt(2.0)
_SQRT_PI = math.sqrt(math.pi)
_LOG_HALF = math.log(0.5)
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
# erfcx: jax.scipy.special.erfcx is accurate to ~1e-15 except that it returns 0 on
# [26.55, 26.64] in float64 (checked against mpmath). From 20 up we use the continued
# fraction erfcx(x) = 1/√π · 1/(x + (1/2)/(x + 1/(x + (3/2)/(x + …)))) evaluated bottom-up;
# with 10 terms it agrees with 60 terms to the last bit for x ≥ 20 (and 40 terms agree with
# mpmath to 5e-16 on [4, 1e8]).
_ERFCX_SWITCH = 20.0
_ERFCX_CF_TERMS = 10

# ---------------------------------------------------------------------------------------
# θ_γ(r) = E_γ(N(r, 1) ‖ N(0, 1)).
# ---------------------------------------------------------------------------------------


def _erfcx(x: jax.Array) -> jax.Array:
    """Scaled complementary error function e^{x²} erfc(x) for x ≥ 0 (see constants above)."""
    small = x < _ERFCX_SWITCH
    x_small = jnp.where(small, x, 0.0)
    x_big = jnp.where(small, _ERFCX_SWITCH, x)
    t = jnp.zeros_like(x_big)
    for k in range(_ERFCX_CF_TERMS, 0, -1):
        t = (0.5 * k) / (x_big + t)
    cf = 1.0 / (_SQRT_PI * (x_big + t))
    return jnp.where(small, jax.scipy.special.erfcx(x_small), cf)


def _log_theta_impl(eps: jax.Array, r: jax.Array):
    r"""``(log θ, log(1 − θ))`` with θ = θ_{e^ε}(r), for ε ∈ [0, ∞], r ∈ [0, ∞].

    With a = ε/r − r/2 and b = ε/r + r/2 (note b² − a² = 2ε, so e^ε φ(b) = φ(a)):

    * a < 0: θ = P(a < Z < b) − (e^ε − 1) Q(b), where P(a < Z < b) = (erf(b/√2) + erf(−a/√2))/2
      is a sum of two non-negative terms. The subtraction cannot cancel badly here: near
      a = 0 the subtracted term is a fraction O(r) of the first.
    * a ≥ 0: θ = Q(a) (1 − R(b)/R(a)) with the Mills ratio R(x) = Q(x)/φ(x) = √(π/2)
      erfcx(x/√2), because e^ε Q(b)/Q(a) = R(b)/R(a). Written in logs, this stays finite
      deep in the tail where θ underflows (e.g. log θ(ε=1, r=0.01) ≈ −5014).
    * θ > 1/2: log θ = log1p(−(1 − θ)), with 1 − θ = Φ(a) + e^ε Q(b) (no cancellation).
    """
    pos = r > 0
    r_fin = jnp.isfinite(r)
    e_fin = jnp.isfinite(eps)
    ok = pos & r_fin & e_fin
    r_s = jnp.where(ok, r, 1.0)  # double-where: r = 0 would divide by zero
    e_s = jnp.where(ok, eps, 0.0)
    a = e_s / r_s - 0.5 * r_s
    b = e_s / r_s + 0.5 * r_s
    # Each special function is traced once on stacked arguments (elementwise, so the
    # values are the same): this halves the compiled program and its compile time.
    log_qb, log_qa, log_pa = log_ndtr(jnp.stack([-b, -a, a]))
    # log(1 − θ) = log(Φ(a) + e^ε Q(b)).
    log_comp = jnp.logaddexp(log_pa, e_s + log_qb)
    # a < 0 branch.
    neg = a < 0
    a_n = jnp.where(neg, a, -1.0)
    b_n = jnp.where(neg, b, 1.0)
    e_n = jnp.where(neg, e_s, 0.0)
    erf_b, erf_ma = jax.scipy.special.erf(jnp.stack([b_n, -a_n]) / _SQRT2)
    mass = 0.5 * (erf_b + erf_ma)
    theta_n = mass - jnp.expm1(e_n) * jnp.exp(jnp.where(neg, log_qb, 0.0))
    log_theta_n = jnp.log(jnp.where(neg & (theta_n > 0), theta_n, 1.0))
    log_theta_n = jnp.where(theta_n > 0, log_theta_n, -jnp.inf)
    # a ≥ 0 branch.
    a_p = jnp.where(neg, 0.0, a)
    b_p = jnp.where(neg, 1.0, b)
    ra, rb = _erfcx(jnp.stack([a_p, b_p]) / _SQRT2)
    diff = ra - rb
    log_theta_p = jnp.where(neg, 0.0, log_qa) + jnp.log(jnp.where(diff > 0, diff, 1.0)) - jnp.log(ra)
    log_theta_p = jnp.where(diff > 0, log_theta_p, -jnp.inf)
    # θ > 1/2 branch.
    big = log_comp < _LOG_HALF
    log_theta_c = jnp.log1p(-jnp.exp(jnp.where(big, log_comp, _LOG_HALF)))
    log_theta = jnp.where(big, log_theta_c, jnp.where(neg, log_theta_n, log_theta_p))
    # Limits: θ(ε, 0) = 0, θ(∞, r) = 0, θ(ε, ∞) = 1 (for finite ε).
    zero = (~pos) | (~e_fin)
    one = (~r_fin) & e_fin & pos
    log_theta = jnp.where(zero, -jnp.inf, jnp.where(one, 0.0, log_theta))
    log_comp = jnp.where(zero, 0.0, jnp.where(one, -jnp.inf, log_comp))
    return log_theta, log_comp, a, log_qb, ok


@jax.custom_jvp
def _log_theta_and_complement(eps: jax.Array, r: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(log θ_{e^ε}(r), log(1 − θ_{e^ε}(r)))``; see :func:`_log_theta_impl`.

    Differentiated with the analytic derivatives (which also keeps compile times short):
    ∂θ/∂ε = −e^ε Q(b) and ∂θ/∂r = φ(a), so ∂log θ/∂ε = −exp(ε + log Q(b) − log θ) and
    ∂log θ/∂r = exp(log φ(a) − log θ); ∂log(1−θ) = −(θ/(1−θ)) ∂log θ. Tangents are 0 at the
    limits (θ = 0 or 1, infinite inputs), so gradients stay finite there.
    """
    lt, lc, _, _, _ = _log_theta_impl(eps, r)
    return one_output(lt, lc)


@_log_theta_and_complement.defjvp
def _log_theta_jvp(primals, tangents):
    eps, r = primals
    eps_dot, r_dot = tangents
    # One stacked output stops XLA from splitting or duplicating the (large) primal
    # computation into each consumer fusion (compile times grew steeply with the uses).
    lt, lc, a, log_qb, ok = _log_theta_impl(eps, r)
    lt, lc, a, log_qb = one_output(lt, lc, a, log_qb)
    e_s = jnp.where(ok, eps, 0.0)
    good = ok & jnp.isfinite(lt)
    lt_s = jnp.where(good, lt, 0.0)
    d_eps = jnp.where(good, -jnp.exp(jnp.minimum(e_s + log_qb - lt_s, 700.0)), 0.0)
    d_r = jnp.where(good, jnp.exp(jnp.minimum(-0.5 * a * a - _LOG_SQRT_2PI - lt_s, 700.0)), 0.0)
    dlt = d_eps * eps_dot + d_r * r_dot
    lc_ok = good & jnp.isfinite(lc)
    ratio = jnp.exp(jnp.minimum(lt_s - jnp.where(lc_ok, lc, 0.0), 700.0))
    dlc = jnp.where(lc_ok, -ratio * dlt, 0.0)
    return (lt, lc), (dlt, dlc)


_theta_core = jax.jit(_log_theta_and_complement)


def _check_eps_r(epsilon, r) -> None:
    _validate.check_in_range("epsilon", epsilon, 0.0, math.inf, allow_inf=True)
    _validate.check_in_range("r", r, 0.0, math.inf, allow_inf=True)


@float64
def log_gaussian_hockey_stick(epsilon, r) -> jax.Array:
    r"""Logarithm of :math:`θ_{e^ε}(r)`, finite and accurate where θ underflows.

    .. math::
        θ_{e^ε}(r) = E_{e^ε}\big(N(r u, I) \,\|\, N(0, I)\big)
                  = Q\Big(\frac{ε}{r} - \frac r2\Big) - e^{ε}\, Q\Big(\frac{ε}{r} + \frac r2\Big),
        \qquad \|u\| = 1,

    computed in log space: for :math:`a = ε/r - r/2 ≥ 0` as
    :math:`\log Q(a) + \log(1 - \mathrm{erfcx}(b/\sqrt2)/\mathrm{erfcx}(a/\sqrt2))`
    (:math:`b = ε/r + r/2`), which holds because :math:`e^ε φ(b) = φ(a)`.

    Args:
      epsilon: ε = log γ ≥ 0 (``inf`` allowed: θ = 0).
      r: distance between the means in units of the standard deviation, ≥ 0 (``inf``
        allowed: θ = 1).

    Returns:
      float64 array, broadcast shape; ``-inf`` where θ = 0 (r = 0). NaN under ``jit`` for
      invalid inputs.

    References:
      S. Asoodeh, M. Diaz, F. Calmon, "Privacy Amplification of Iterative Algorithms via
      Contraction Coefficients", ISIT 2020 (arXiv:2001.06546), Lemma 2 and Definition 1.

    Examples:
      >>> import jaxdp
      >>> round(float(jaxdp.accounting.log_gaussian_hockey_stick(1.0, 0.01)), 6)
      -5014.234761
    """
    _check_eps_r(epsilon, r)
    eps = f64(epsilon)
    r = f64(r)
    lt, _ = _theta_core(eps, r)
    return nan_unless((eps >= 0) & (r >= 0), lt)


@float64
def gaussian_hockey_stick(epsilon, r) -> jax.Array:
    r"""Hockey-stick divergence between unit-variance Gaussians, :math:`θ_{e^ε}(r)`.

    .. math::
        θ_{e^ε}(r) = E_{e^ε}\big(N(m_1, σ^2 I) \,\|\, N(m_2, σ^2 I)\big)
                  = Q\Big(\frac{ε}{r} - \frac r2\Big) - e^{ε}\, Q\Big(\frac{ε}{r} + \frac r2\Big),
        \qquad r = \|m_1 - m_2\|/σ,

    with :math:`Q = 1 - Φ`. It is the exact δ(ε) of the Gaussian mechanism with
    sensitivity-to-noise ratio r, increasing in r and decreasing in ε;
    :math:`θ(ε, 0) = 0`, :math:`θ_1(r) = \mathrm{erf}(r / (2\sqrt2))` (total variation),
    :math:`θ → 1` as r → ∞. Gradients are finite at r = 0 and ε = 0
    (:math:`∂θ/∂r = φ(ε/r - r/2)`, :math:`∂θ/∂ε = -e^ε Q(ε/r + r/2)`); at ε = r = 0,
    :math:`∂θ/∂r` is the one-sided slope :math:`φ(0) = 1/\sqrt{2π}`.

    Args:
      epsilon: ε = log γ ≥ 0.
      r: normalised distance ≥ 0.

    Returns:
      θ in [0, 1], float64, broadcast shape (NaN under ``jit`` for invalid inputs).

    References:
      Asoodeh, Diaz, Calmon (arXiv:2001.06546), Lemma 2, Definition 1, Eq. (10)–(11).

    Examples:
      >>> import jaxdp
      >>> round(float(jaxdp.accounting.gaussian_hockey_stick(1.0, 1.0)), 12)
      0.126936737507
    """
    _check_eps_r(epsilon, r)
    eps = f64(epsilon)
    r = f64(r)
    lt, _ = _theta_core(eps, r)
    # At ε = 0, r = 0 the chain rule through log θ = −∞ gives 0, but θ(0, r) =
    # erf(r/(2√2)) has the one-sided slope φ(0) = 1/√(2π) there (for ε > 0, θ is flat at
    # r = 0). The term below is 0 in value and carries that slope.
    origin = (eps == 0) & (r == 0)
    slope = jnp.where(origin, math.exp(-_LOG_SQRT_2PI) * (r - jax.lax.stop_gradient(r)), 0.0)
    return nan_unless((eps >= 0) & (r >= 0), jnp.exp(lt) + slope)


@float64
def gaussian_hockey_stick_complement(epsilon, r) -> jax.Array:
    r""":math:`1 - θ_{e^ε}(r)` without cancellation, accurate when θ is close to 1.

    .. math:: 1 - θ_{e^ε}(r) = Φ\Big(\frac{ε}{r} - \frac r2\Big) + e^{ε}\, Q\Big(\frac{ε}{r} + \frac r2\Big).

    Needed by the random-stopping bound (Theorem 5), whose denominator is :math:`1 - θ`.
    For example at ε = 0, r = 20 it is 1.52e-23 while θ rounds to 1.

    Args:
      epsilon: ε ≥ 0.
      r: normalised distance ≥ 0.

    Returns:
      1 − θ in [0, 1], float64 (NaN under ``jit`` for invalid inputs).

    References:
      Asoodeh, Diaz, Calmon (arXiv:2001.06546), Definition 1 and Theorem 5.

    Examples:
      >>> import jaxdp
      >>> float(jaxdp.accounting.gaussian_hockey_stick_complement(0.0, 20.0)) < 1e-22
      True
    """
    _check_eps_r(epsilon, r)
    eps = f64(epsilon)
    r = f64(r)
    _, lc = _theta_core(eps, r)
    return nan_unless((eps >= 0) & (r >= 0), jnp.exp(lc))


def _log_laplace(eps: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    """log [1 − exp(ε/2 − Δ/(2v))]_+, −inf where it is 0."""
    x = 0.5 * eps - 0.5 * shift / scale
    neg = x < 0
    x_s = jnp.where(neg, x, -1.0)
    return jnp.where(neg, jnp.log(-jnp.expm1(x_s)), -jnp.inf)


@float64
def laplace_hockey_stick(epsilon, shift, scale) -> jax.Array:
    r"""Hockey-stick divergence between two Laplace laws with the same scale (1-D).

    .. math::
        E_{e^ε}\big(\mathcal L(m_1, v) \,\|\, \mathcal L(m_2, v)\big)
          = \Big[1 - \exp\Big(\frac ε2 - \frac{|m_1 - m_2|}{2v}\Big)\Big]_+,

    where :math:`\mathcal L(m, v)` has density :math:`e^{-|t-m|/v}/(2v)`. It is 0 exactly
    when ε ≥ Δ/v (the Laplace mechanism is then ε-DP).

    Args:
      epsilon: ε ≥ 0.
      shift: Δ = |m₁ − m₂| ≥ 0.
      scale: Laplace scale v > 0.

    Returns:
      Value in [0, 1), float64 (NaN under ``jit`` for invalid inputs).

    References:
      Asoodeh, Diaz, Calmon (arXiv:2001.06546), Lemma 1, Eq. (9).

    Examples:
      >>> import jaxdp
      >>> round(float(jaxdp.accounting.laplace_hockey_stick(0.5, 1.0, 1.0)), 12)
      0.221199216929
    """
    _validate.check_in_range("epsilon", epsilon, 0.0, math.inf, allow_inf=True)
    _validate.check_in_range("shift", shift, 0.0, math.inf)
    _validate.check_in_range("scale", scale, 0.0, math.inf, lo_open=True)
    eps, shift, scale = f64(epsilon), f64(shift), f64(scale)
    valid = (eps >= 0) & (shift >= 0) & (scale > 0) & jnp.isfinite(scale) & jnp.isfinite(shift)
    scale_s = jnp.where(valid, scale, 1.0)
    return nan_unless(valid, jnp.exp(_log_laplace(eps, shift, scale_s)))



def _log_theta_slope(eps, r):
    """(log θ, ∂log θ/∂ε) from one primal evaluation, without autodiff (no gradient flows)."""
    eps, r = jax.lax.stop_gradient(eps), jax.lax.stop_gradient(r)
    lt, _, a, log_qb, ok = _log_theta_impl(eps, r)
    good = ok & jnp.isfinite(lt)
    lt_s = jnp.where(good, lt, 0.0)
    e_s = jnp.where(ok, eps, 0.0)
    slope = jnp.where(good, -jnp.exp(jnp.minimum(e_s + log_qb - lt_s, 700.0)), 0.0)
    return one_output(lt, slope)
