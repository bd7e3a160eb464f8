r"""The Laplace and Gaussian mechanisms: samplers, exact privacy curves and calibrations.

A mechanism :math:`M(x) = f(x) + Z` releases a query plus noise. Its guarantee depends on
the noise law and on the sensitivity of ``f`` under the neighbouring relation the user
states (add/remove or replace-one): the L1 sensitivity
:math:`Δ_1 = \sup \|f(x) - f(x')\|_1` for Laplace noise, the L2 sensitivity
:math:`Δ_2 = \sup \|f(x) - f(x')\|_2` for Gaussian noise, the supremum over neighbouring
datasets. The accountants below take the noise relative to that sensitivity
(``noise_multiplier`` = noise_std / Δ₂), so they hold for whichever relation Δ₂ was
computed under.

The samplers keep the user's dtype (they are part of a release, not an accountant); the
accountants compute in float64 whatever the global ``jax_enable_x64`` flag, broadcast their
arguments, validate concrete inputs eagerly (``ValueError`` naming the parameter) and give
NaN under ``jit`` for invalid inputs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from .. import _validate
from .._numerics import f64, float64
from .._validate import nan_unless as _nan_unless

# The one place this module takes the exact Gaussian hockey-stick divergence from.
from ._hockey_stick import log_gaussian_hockey_stick as _log_theta
from ._solve import solve_decreasing

__all__ = [
    "laplace_mechanism",
    "gaussian_mechanism",
    "calibrate_laplace_scale",
    "gaussian_mechanism_delta",
    "gaussian_mechanism_epsilon",
    "calibrate_gaussian_noise_multiplier",
    "GAUSSIAN_CALIBRATIONS",
]

# Bisection: the bracket halves 64 times, so its width ends below hi·5.5e-20, under the
# float64 resolution of any ε or noise multiplier of interest.
_BISECT_ITERS = 64
# Relative margin on log δ in every certified comparison: float64 log θ is accurate to a
# few 1e-15 relative, so a 1e-12 margin puts rounding on the safe side.
_SAFETY_REL = 1e-12

GAUSSIAN_CALIBRATIONS = ("analytic", "6.91", "6.81", "6.82", "6.83", "6.84", "dwork_roth")


# ---------------------------------------------------------------------------------------
# Samplers (user's dtype).
# ---------------------------------------------------------------------------------------


def _noise_dtype(value):
    dtype = jnp.result_type(value)
    return dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.result_type(value, float)


def laplace_mechanism(key: jax.Array, value, scale) -> jax.Array:
    r"""Release ``value + Z`` with i.i.d. Laplace noise :math:`Z_j \sim \mathrm{Lap}(b)`.

    The noise has density :math:`e^{-|z|/b}/(2b)`. With :math:`b ≥ Δ_1/ε`
    (:func:`calibrate_laplace_scale`) the release is ε-DP.

    Args:
      key: a PRNG key that protects privacy: use it once, never log it.
      value: the exact query result, any shape; floating dtypes are kept, integers are
        promoted to the default float dtype.
      scale: Laplace scale b ≥ 0 (finite), broadcastable to ``value``.

    Returns:
      Noisy value, shape and dtype of ``value`` (NaN under ``jit`` where ``scale`` is
      invalid).

    References:
      C. Dwork, F. McSherry, K. Nissim, A. Smith, "Calibrating noise to sensitivity in private
      data analysis", TCC 2006; C. Dwork, A. Roth, "The Algorithmic Foundations of
      Differential Privacy" (2014), Theorem 3.6.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxdp
      >>> y = jaxdp.accounting.laplace_mechanism(jax.random.key(0), jnp.zeros(3, jnp.float32), 1.0)
      >>> y.shape, y.dtype
      ((3,), dtype('float32'))
    """
    _validate.check_in_range("scale", scale, 0.0, math.inf)
    dtype = _noise_dtype(value)
    value = jnp.asarray(value, dtype)
    b = jnp.asarray(scale, dtype)
    noise = jax.random.laplace(key, value.shape, dtype)
    return _nan_unless((b >= 0) & jnp.isfinite(b), value + b * noise)


def gaussian_mechanism(key: jax.Array, value, noise_std) -> jax.Array:
    r"""Release ``value + Z`` with i.i.d. Gaussian noise :math:`Z_j \sim N(0, s^2)`.

    With ``noise_std`` = noise_multiplier · Δ₂ the release satisfies the guarantee of
    :func:`gaussian_mechanism_delta` for that noise multiplier.

    Args:
      key: a PRNG key that protects privacy: use it once, never log it.
      value: the exact query result, any shape; floating dtypes are kept, integers are
        promoted to the default float dtype.
      noise_std: standard deviation s ≥ 0 (finite), broadcastable to ``value``.

    Returns:
      Noisy value, shape and dtype of ``value`` (NaN under ``jit`` where ``noise_std`` is
      invalid).

    References:
      C. Dwork, A. Roth, "The Algorithmic Foundations of Differential Privacy" (2014),
      Section 3.5.3 and Appendix A.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxdp
      >>> y = jaxdp.accounting.gaussian_mechanism(jax.random.key(0), jnp.zeros((2, 2)), 0.5)
      >>> y.shape
      (2, 2)
    """
    _validate.check_in_range("noise_std", noise_std, 0.0, math.inf)
    dtype = _noise_dtype(value)
    value = jnp.asarray(value, dtype)
    s = jnp.asarray(noise_std, dtype)
    noise = jax.random.normal(key, value.shape, dtype)
    return _nan_unless((s >= 0) & jnp.isfinite(s), value + s * noise)


# ---------------------------------------------------------------------------------------
# Laplace calibration.
# ---------------------------------------------------------------------------------------


@float64
def calibrate_laplace_scale(epsilon, sensitivity=1.0) -> jax.Array:
    r"""Laplace scale for pure ε-DP: :math:`b = Δ_1 / ε`.

    The privacy loss of the Laplace mechanism is
    :math:`\log \frac{p(y)}{q(y)} = \frac{|y - f(x')| - |y - f(x)|}{b} ≤ \frac{Δ_1}{b}`,
    so :math:`b ≥ Δ_1/ε` gives ε-DP (δ = 0), and no smaller b does.

    Args:
      epsilon: target ε in (0, ∞].
      sensitivity: L1 sensitivity Δ₁ ≥ 0 of the query under the neighbouring relation used.

    Returns:
      Scale b (float64, broadcast shape); 0 for ε = ∞. NaN under ``jit`` for invalid inputs.

    References:
      Dwork, McSherry, Nissim, Smith (TCC 2006); Dwork and Roth (2014), Theorem 3.6;
      Claim 1.5 of the blog post "A Tail of Two Densities" (2019).

    Examples:
      >>> import jaxdp
      >>> float(jaxdp.accounting.calibrate_laplace_scale(0.5, 2.0))
      4.0
    """
    _validate.check_in_range("epsilon", epsilon, 0.0, math.inf, lo_open=True, allow_inf=True)
    _validate.check_in_range("sensitivity", sensitivity, 0.0, math.inf)
    eps, sens = f64(epsilon), f64(sensitivity)
    valid = (eps > 0) & (sens >= 0) & jnp.isfinite(sens)
    eps_s = jnp.where(valid, eps, 1.0)
    return _nan_unless(valid, sens / eps_s)


# ---------------------------------------------------------------------------------------
# The exact (analytic) Gaussian mechanism.
# ---------------------------------------------------------------------------------------


def _check_noise_multiplier(noise_multiplier) -> None:
    _validate.check_nonempty("noise_multiplier", noise_multiplier)
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True, allow_inf=True)


@float64
def gaussian_mechanism_delta(epsilon, noise_multiplier) -> jax.Array:
    r"""Exact δ(ε) of the Gaussian mechanism (the analytic Gaussian mechanism).

    With :math:`s` = noise_multiplier (noise std / L2 sensitivity),

    .. math::
        δ(ε) = Φ\Big(\frac{1}{2s} - εs\Big) - e^{ε}\, Φ\Big(-\frac{1}{2s} - εs\Big),

    the hockey-stick divergence between :math:`N(0, s^2)` and :math:`N(1, s^2)`. The
    mechanism is (ε, δ)-DP exactly when δ ≥ δ(ε); no smaller δ holds.

    Args:
      epsilon: ε ≥ 0 (``inf`` allowed).
      noise_multiplier: s > 0 (``inf`` allowed: δ = 0).

    Returns:
      δ in [0, 1], float64, broadcast shape (NaN under ``jit`` for invalid inputs).

    References:
      B. Balle, Y.-X. Wang, "Improving the Gaussian Mechanism for Differential Privacy:
      Analytical Calibration and Optimal Denoising", ICML 2018, Theorem 8.

    Examples:
      >>> import jaxdp
      >>> round(float(jaxdp.accounting.gaussian_mechanism_delta(1.0, 1.0)), 12)
      0.126936737507
    """
    _validate.check_in_range("epsilon", epsilon, 0.0, math.inf, allow_inf=True)
    _check_noise_multiplier(noise_multiplier)
    eps, s = f64(epsilon), f64(noise_multiplier)
    valid = (eps >= 0) & (s > 0)
    r = 1.0 / jnp.where(valid, s, 1.0)
    return _nan_unless(valid, jnp.exp(_log_theta(jnp.where(valid, eps, 0.0), r)))


def _bisect_smallest(residual, params, hi):
    """Smallest x in [0, hi] with residual(x, *params) ≤ 0, rounded up; implicit derivative.

    ``residual`` must be non-increasing in x with residual(hi) ≤ 0 (else +inf). The value
    is the upper end of the bracket after a fixed number of halvings (never below the true
    root: certified on the safe side), 0 when residual(0) ≤ 0; derivatives with respect to
    the parameters come from the implicit function theorem (:func:`solve_decreasing`).
    """
    hi = jax.lax.stop_gradient(hi)
    return solve_decreasing(residual, params, 0.0, jnp.zeros_like(hi), hi, _BISECT_ITERS)


def _safe_log(delta):
    """log δ lowered by a relative 1e-12, so that rounding cannot certify too small a value."""
    ld = jnp.log(delta)
    return ld - _SAFETY_REL * (1.0 + jnp.abs(ld))


@float64
def gaussian_mechanism_epsilon(delta, noise_multiplier) -> jax.Array:
    r"""Smallest ε with :func:`gaussian_mechanism_delta` (ε) ≤ δ: the exact ε of the Gaussian mechanism.

    δ(ε) is continuous and decreasing in ε, so the root is unique. It is found by bisection
    with a fixed number of iterations on :math:`[0,\ r\sqrt{2\log(1/δ)} + r^2/2]`,
    :math:`r = 1/s` (valid because :math:`δ(ε) ≤ Q(ε/r - r/2) ≤ e^{-(ε/r - r/2)^2/2}/2`),
    returning the upper end so the ε is never under-reported. Returns 0 when
    :math:`δ(0) = \mathrm{erf}(r/(2\sqrt2)) ≤ δ`. Gradients use the implicit function theorem.

    Args:
      delta: target δ in (0, 1).
      noise_multiplier: s > 0 (noise std / L2 sensitivity); ``inf`` gives ε = 0.

    Returns:
      ε ≥ 0, float64, broadcast shape (NaN under ``jit`` for invalid inputs).

    References:
      Balle and Wang, ICML 2018, Theorem 8 (the exact curve; the inverse by bisection).

    Examples:
      >>> import jaxdp
      >>> round(float(jaxdp.accounting.gaussian_mechanism_epsilon(1e-5, 1.0)), 6)
      4.377178
    """
    _validate.check_broadcastable(delta=delta, noise_multiplier=noise_multiplier)
    _validate.check_delta(delta)
    _check_noise_multiplier(noise_multiplier)
    return _gaussian_eps_core(f64(delta), f64(noise_multiplier))


@jax.jit
def _gaussian_eps_core(dlt, s):
    valid = (dlt > 0) & (dlt < 1) & (s > 0)
    d_s = jnp.where(valid, dlt, 0.5)
    r = 1.0 / jnp.where(valid, s, 1.0)
    r, d_s = jnp.broadcast_arrays(r, d_s)
    hi = r * jnp.sqrt(-2.0 * jnp.log(d_s)) + 0.5 * r**2

    def residual(eps, r_, d_):
        return _log_theta(eps, r_) - _safe_log(d_)

    return _nan_unless(valid, _bisect_smallest(residual, (r, d_s), hi))


# ---------------------------------------------------------------------------------------
# Gaussian calibrations.
# ---------------------------------------------------------------------------------------


def _sigma_tail_exact(eps, log_inv_delta):
    """(6.91): the root of εs - 1/(2s) = √(2 log(1/δ)) (Chernoff tail of the privacy loss)."""
    a = jnp.sqrt(2.0 * log_inv_delta)
    return (a + jnp.sqrt(a * a + 2.0 * eps)) / (2.0 * eps)


def _closed_form(method: str, eps, log_inv_delta):
    half = jnp.sqrt(0.5 / eps)  # (2ε)^{-1/2}
    log_2pi = math.log(2.0 * math.pi)
    if method == "6.91":
        return _sigma_tail_exact(eps, log_inv_delta)
    if method == "6.81":
        return jnp.sqrt(2.0 * log_inv_delta) / eps + half
    if method == "6.82":
        mills = jnp.sqrt(jnp.maximum(2.0 * log_inv_delta - log_2pi, 0.0))
        return jnp.maximum(1.0, mills) / eps + half
    if method == "6.83":
        return jnp.sqrt(eps + 2.0 * log_inv_delta) / eps
    if method == "6.84":
        mills = jnp.sqrt(jnp.maximum(eps - log_2pi + 2.0 * log_inv_delta, 0.0))
        return jnp.maximum(jnp.sqrt(1.0 + eps), mills) / eps
    if method == "dwork_roth":
        # c² > 2 log(1.25/δ); the proof also needs c ≥ 3/2 (it is implicit there).
        c = jnp.maximum(1.5, jnp.sqrt(2.0 * (math.log(1.25) + log_inv_delta)))
        return c / eps
    raise AssertionError(method)


@float64
def calibrate_gaussian_noise_multiplier(epsilon, delta, *, method: str = "analytic") -> jax.Array:
    r"""Noise multiplier s (noise std / L2 sensitivity) that makes the Gaussian mechanism (ε, δ)-DP.

    ``method`` (static) chooses the bound; all are sufficient, ``"analytic"`` is the smallest
    possible and the recommended one:

    * ``"analytic"``: the smallest s with :math:`Φ(\frac1{2s} - εs) - e^ε Φ(-\frac1{2s} - εs) ≤ δ`
      (Balle and Wang 2018, Theorem 8 and Algorithm 1), by bisection on
      :math:`[0, s_{6.91}]`, rounded up.
    * ``"6.91"``: :math:`s = \frac{\sqrt{2\log(1/δ)} + \sqrt{2\log(1/δ) + 2ε}}{2ε}`, the exact
      root of the Chernoff tail bound :math:`P(L > ε) ≤ e^{-(εs - 1/(2s))^2/2} = δ`.
    * ``"6.81"``: :math:`s = ε^{-1}\sqrt{2\log(1/δ)} + (2ε)^{-1/2}`.
    * ``"6.82"``: :math:`s = ε^{-1}\big(1 ∨ \sqrt{(\log(δ^{-2}/(2π)))_+}\big) + (2ε)^{-1/2}`.
    * ``"6.83"``: :math:`s = ε^{-1}\sqrt{\log(e^ε δ^{-2})}`.
    * ``"6.84"``: :math:`s = ε^{-1}\big(\sqrt{1+ε} ∨ \sqrt{(\log(e^ε δ^{-2}/(2π)))_+}\big)`.
    * ``"dwork_roth"``: :math:`s = c/ε`, :math:`c = \sqrt{2\log(1.25/δ)} ∨ 3/2`; valid only
      for ε < 1 (larger ε raise ``ValueError`` eagerly and give NaN under ``jit``).

    The tail bounds hold with strict inequality; the returned value is their boundary.

    Args:
      epsilon: ε > 0 (ε < 1 for ``"dwork_roth"``).
      delta: δ in (0, 1).
      method: one of :data:`GAUSSIAN_CALIBRATIONS`.

    Returns:
      s > 0, float64, broadcast shape; multiply by the L2 sensitivity (under the stated
      neighbouring relation) to get the noise std. NaN under ``jit`` for invalid inputs.

    References:
      Balle and Wang, ICML 2018, Theorem 8; Dwork and Roth (2014), Theorem A.1 (Theorem 3.22);
      equations (6.81)-(6.84) and (6.91) of the blog post "A Tail of Two Densities"
      (2019), from the tail bounds of Claim 9.

    Examples:
      >>> import jaxdp
      >>> round(float(jaxdp.accounting.calibrate_gaussian_noise_multiplier(1.0, 1e-5)), 6)
      3.730632
      >>> round(float(jaxdp.accounting.calibrate_gaussian_noise_multiplier(1.0, 1e-5, method="6.81")), 6)
      5.505633
    """
    _validate.check_static_choice("method", method, GAUSSIAN_CALIBRATIONS)
    eps_hi = 1.0 if method == "dwork_roth" else math.inf
    _validate.check_in_range("epsilon", epsilon, 0.0, eps_hi, lo_open=True, hi_open=method == "dwork_roth")
    _validate.check_delta(delta)
    return _calibrate_core(f64(epsilon), f64(delta), method)


@functools.partial(jax.jit, static_argnames="method")
def _calibrate_core(eps, dlt, method):
    valid = (eps > 0) & jnp.isfinite(eps) & (dlt > 0) & (dlt < 1)
    if method == "dwork_roth":
        valid = valid & (eps < 1)
    eps_s = jnp.where(valid, eps, 1.0)
    d_s = jnp.where(valid, dlt, 0.5)
    eps_s, d_s = jnp.broadcast_arrays(eps_s, d_s)
    log_inv = -jnp.log(d_s)
    if method != "analytic":
        return _nan_unless(valid, _closed_form(method, eps_s, log_inv))
    # δ(ε; s) ≤ Q(εs - 1/(2s)) ≤ e^{-(εs - 1/(2s))²/2}/2, so the (6.91) value is a valid bracket.
    hi = _sigma_tail_exact(eps_s, log_inv)

    def residual(s, e, d):
        r = 1.0 / jnp.where(s > 0, s, 1.0)
        lt = jnp.where(s > 0, _log_theta(e, r), 0.0)  # s = 0: no noise, δ = 1
        return lt - _safe_log(d)

    return _nan_unless(valid, _bisect_smallest(residual, (eps_s, d_s), hi))
