r"""Contraction-coefficient bounds for projected noisy SGD (Asoodeh, Diaz, Calmon).

The privacy of a mechanism is a bound on the hockey-stick (:math:`E_γ`) divergence of its
output distributions, :math:`E_{e^ε}(P\|Q) = \sup_A P(A) - e^ε Q(A) ≤ δ`. Asoodeh, Diaz and
Calmon bound it for projected noisy SGD (PNSGD) whose intermediate iterates stay hidden,
through the contraction coefficients of the later (noisy, projected) steps. This module
holds, on top of the hockey-stick primitives of :mod:`._hockey_stick`, the step
contraction of a smooth strongly convex gradient step, Theorems 3 and 4 of the paper, the
mini-batch and multi-pass extensions derived here, and the inverse ε for a target δ
(bisection with a fixed iteration count, so it is jit/vmap-able; shared with Theorem 5 in
:mod:`._contraction_common`). Theorem 5 (random stopping) is :mod:`._contraction_stop`,
whose two functions are imported here so that every contraction bound has one address.

Every public function computes in float64 whatever the global ``jax_enable_x64`` flag,
broadcasts its array arguments, validates concrete inputs eagerly (``ValueError`` naming
the parameter), and gives NaN under ``jit`` for invalid inputs.

Conventions: ``epsilon`` is :math:`ε = \log γ` (never γ, which overflows). The PNSGD update
is :math:`Y ← Π_K(Y - η(∇ℓ(Y, x) + Z))`, :math:`Z \sim N(0, σ^2 I)`, so ``noise_std`` is the
noise standard deviation on the gradient and :math:`ησ` the one on the parameters.
``positions`` is the 1-based index i of the record in the (fixed) processing order.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .. import _validate
from .._numerics import f64, float64
from .._validate import check_integer, check_learning_rate, check_positions, is_int, learning_rate_valid, nan_unless
from ._contraction_common import _SAFETY_REL as _SAFETY_REL  # re-exported: _pnsgd imports it from here
from ._contraction_common import _check_delta_target, _check_pnsgd_constants, _eps_bracket, _run_valid, _solve_eps
from ._contraction_common import _safe_target as _safe_target  # re-exported: _pnsgd imports it from here
from ._contraction_stop import stop_pnsgd_contraction_delta as stop_pnsgd_contraction_delta  # Theorem 5
from ._contraction_stop import stop_pnsgd_contraction_epsilon as stop_pnsgd_contraction_epsilon  # Theorem 5
from ._hockey_stick import _log_laplace, _log_theta_and_complement, _log_theta_slope

__all__ = [
    "step_contraction",
    "pnsgd_contraction_delta",
    "log_pnsgd_contraction_delta",
    "pnsgd_contraction_epsilon",
    "pnsgd_laplace_delta",
    "stop_pnsgd_contraction_delta",
    "stop_pnsgd_contraction_epsilon",
]



# ---------------------------------------------------------------------------------------
# Step contraction of a gradient step.
# ---------------------------------------------------------------------------------------


@float64
def step_contraction(learning_rate, smoothness, strong_convexity=0.0) -> jax.Array:
    r"""Lipschitz constant M of the gradient step :math:`ψ(y) = y - η∇ℓ(y, x)`.

    .. math:: M = \sqrt{1 - \frac{2ηβρ}{β + ρ}}, \qquad 0 < η ≤ \frac{2}{β + ρ},\ 0 ≤ ρ ≤ β.

    M = 1 exactly when ρ = 0 (the step is then non-expansive); M ∈ [0, 1) when ρ > 0.

    Assumptions: :math:`y ↦ ℓ(y, x)` is β-smooth and ρ-strongly convex on the convex
    constraint set for every record x. The library cannot check convexity of a user's loss.

    Args:
      learning_rate: learning rate η, with 0 < η ≤ 2/(β + ρ). This is the library's one
        step-size rule (``jaxdp._validate.check_learning_rate``, shared with training): by
        Bubeck's Lemma 3.11, :math:`\|ψ(x)-ψ(y)\|^2 ≤ M^2\|x-y\|^2 + η(η - \frac{2}{β+ρ})\|∇ℓ(x)-∇ℓ(y)\|^2`,
        so M holds up to and including the boundary (the paper's Lemma 4 states the
        strict inequality; its proof does not need it). With ρ = 0 it is η ≤ 2/β.
      smoothness: β > 0.
      strong_convexity: ρ in [0, β].

    Returns:
      M in [0, 1], float64. Raises ``ValueError`` naming ``learning_rate``, ``smoothness`` or
      ``strong_convexity`` for concrete invalid values; NaN under ``jit``.

    References:
      Asoodeh, Diaz, Calmon (arXiv:2001.06546), Eq. (14) and Lemma 4; S. Bubeck, "Convex
      Optimization: Algorithms and Complexity", Lemma 3.11.

    Examples:
      >>> import jaxdp
      >>> round(float(jaxdp.accounting.step_contraction(0.5, 1.0, 0.5)), 12)
      0.816496580928
    """
    check_learning_rate(learning_rate, smoothness, strong_convexity)
    eta, beta, rho = f64(learning_rate), f64(smoothness), f64(strong_convexity)
    valid = learning_rate_valid(eta, beta, rho)
    denom = jnp.where(valid, beta + rho, 1.0)
    m2 = jnp.maximum(1.0 - 2.0 * eta * beta * rho / denom, 0.0)  # clamp rounding below 0
    m = jnp.sqrt(jnp.where(m2 > 0, m2, 1.0))
    m = jnp.where(m2 > 0, m, 0.0)
    return nan_unless(valid, jnp.where(rho == 0, 1.0, m))


# ---------------------------------------------------------------------------------------
# Theorem 4 (Gaussian PNSGD) with mini-batch and multi-pass extensions.
# ---------------------------------------------------------------------------------------


def _check_pnsgd(positions, num_records, lipschitz, noise_std, learning_rate, diameter, contraction, batch_size, passes) -> None:
    check_positions(positions, num_records)
    _check_pnsgd_constants(lipschitz, noise_std, learning_rate, diameter, contraction)
    check_integer("batch_size", batch_size)
    _validate.check_not_above("batch_size", batch_size, "num_records", num_records)
    check_integer("passes", passes)


def _batch_geometry(positions, num_records, batch_size):
    """(j, m, b_eff): batch index of the record, number of batches per pass, its batch size.

    Batches are consecutive blocks of ``batch_size`` records in the fixed order; when
    ``num_records`` is not a multiple, the last batch holds the remaining records and its averaged
    gradient has the larger sensitivity 2L/b_last (taken into account, conservatively exact).
    """
    j = jnp.ceil(positions / batch_size)
    m = jnp.ceil(num_records / batch_size)
    b_last = num_records - (m - 1.0) * batch_size
    b_eff = jnp.where(j >= m, b_last, batch_size)
    return j, m, b_eff


def _pnsgd_setup(positions, num_records, lipschitz, noise_std, learning_rate, diameter, contraction, batch_size, passes):
    """Float64 arrays, validity mask, and (r_first, r_c, K): log δ = log θ(r_first) + K log θ(r_c)."""
    pos, n, lip, sig, eta, dia, m_c, b, k = (
        f64(x) for x in (positions, num_records, lipschitz, noise_std, learning_rate, diameter, contraction, batch_size, passes)
    )
    valid = is_int(pos) & is_int(n) & (pos <= n) & _run_valid(lip, sig, eta, dia, m_c) & is_int(b) & is_int(k)
    j, m, b_eff = _batch_geometry(pos, n, b)
    sig_s = jnp.where(valid, sig, 1.0)
    eta_s = jnp.where(valid, eta, 1.0)
    b_s = jnp.where(valid, b_eff, 1.0)
    r1 = 2.0 * lip / (b_s * sig_s)
    rc = m_c * dia / (eta_s * sig_s)
    # One pass: Theorem 4 (the record's step sees the same input law on both sides).
    # Several passes: the law before the record's last use differs; see the docstring.
    r_first = jnp.where(k > 1, r1 + rc, r1)
    later = jnp.where(valid, m - j, 0.0)
    return valid, r_first, rc, later


def _log_delta_from(eps, r_first, rc, later):
    # One stacked evaluation of log θ at both ratios (one traced copy: faster compiles).
    shape = jnp.broadcast_shapes(jnp.shape(eps), jnp.shape(r_first), jnp.shape(rc))
    rr = jnp.stack([jnp.broadcast_to(r_first, shape), jnp.broadcast_to(rc, shape)], axis=-1)
    lt, _ = _log_theta_and_complement(jnp.broadcast_to(eps, shape)[..., None], rr)
    lt1, ltc = lt[..., 0], lt[..., 1]
    # Convention 0·log 0 = 0 (0^0 = 1): with no later step the factor is 1 even if θc = 0.
    has_later = later > 0
    tail = jnp.where(has_later, later * jnp.where(has_later, ltc, 0.0), 0.0)
    return lt1 + tail


def _log_delta_slope(eps, r_first, rc, later):
    """∂ log δ/∂ε of :func:`_log_delta_from` (no gradient flows)."""
    shape = jnp.broadcast_shapes(jnp.shape(eps), jnp.shape(r_first), jnp.shape(rc), jnp.shape(later))
    rr = jnp.stack([jnp.broadcast_to(r_first, shape), jnp.broadcast_to(rc, shape)], axis=-1)
    _, sl = _log_theta_slope(jnp.broadcast_to(eps, shape)[..., None], rr)
    later = jnp.broadcast_to(jax.lax.stop_gradient(later), shape)
    return sl[..., 0] + jnp.where(later > 0, later * sl[..., 1], 0.0)


_PNSGD_DOC_ASSUMPTIONS = """
    Assumptions (not checked by the library): for every record x, :math:`y ↦ ℓ(y, x)` is
    convex, L-Lipschitz (:math:`\\|∇ℓ\\| ≤ L`), β-smooth and ρ-strongly convex on the
    compact convex set K of diameter D; η ≤ 2/(β + ρ) so that each gradient step is
    M-Lipschitz (see :func:`step_contraction`); the Gaussian noise is fresh and
    independent at every step; only the final iterate is released (intermediate iterates
    stay hidden); the records are processed in a fixed, data-independent order."""


@float64
def log_pnsgd_contraction_delta(
    epsilon, positions, num_records, lipschitz, noise_std, learning_rate, diameter, contraction=1.0, *, batch_size=1, passes=1
) -> jax.Array:
    r"""log δ of :func:`pnsgd_contraction_delta` (finite when δ underflows).

    .. math:: \log δ = \log θ_{e^ε}(r_1) + (m - j)\,\log θ_{e^ε}(r_c)

    with the convention 0·log 0 = 0. Arguments as in :func:`pnsgd_contraction_delta`.

    Examples:
      >>> import jaxdp
      >>> round(float(jaxdp.accounting.log_pnsgd_contraction_delta(0.5, 1, 200, 1.0, 4.0, 0.1, 0.1)), 4)
      -1179.2808
    """
    _validate.check_in_range("epsilon", epsilon, 0.0, math.inf, allow_inf=True)
    _check_pnsgd(positions, num_records, lipschitz, noise_std, learning_rate, diameter, contraction, batch_size, passes)
    args = (f64(x) for x in (epsilon, positions, num_records, lipschitz, noise_std, learning_rate, diameter, contraction, batch_size, passes))
    return _log_delta_core(*args)


@jax.jit
def _log_delta_core(eps, positions, num_records, lipschitz, noise_std, learning_rate, diameter, contraction, batch_size, passes):
    valid, r_first, rc, later = _pnsgd_setup(
        positions, num_records, lipschitz, noise_std, learning_rate, diameter, contraction, batch_size, passes
    )
    return nan_unless(valid & (eps >= 0), _log_delta_from(eps, r_first, rc, later))


@float64
def pnsgd_contraction_delta(
    epsilon, positions, num_records, lipschitz, noise_std, learning_rate, diameter, contraction=1.0, *, batch_size=1, passes=1
) -> jax.Array:
    r"""δ(ε) of projected noisy SGD for the record at ``positions`` (Theorem 4 and extensions).

    One pass, batch size 1 (Theorem 4 of Asoodeh et al.): the record processed at step i of
    n is (ε, δ)-DP with

    .. math::
        δ = θ_{e^ε}\Big(\frac{2L}{σ}\Big)\; θ_{e^ε}\Big(\frac{M D}{ησ}\Big)^{n - i}.

    The first factor is the hockey-stick divergence of the record's own step (its gradient
    moves the mean by at most 2ηL and the noise has standard deviation ησ); each later
    step contracts it by at most :math:`θ_{e^ε}(MD/(ησ))`, the :math:`E_γ` contraction
    coefficient of a projected Gaussian kernel whose inputs lie within D of each other.

    **Extensions (derived here).** Consecutive batches of b records (m = ⌈n/b⌉ steps per
    pass, the record in batch j = ⌈i/b⌉ of size :math:`b_j`):
    :math:`δ = θ(2L/(b_j σ))\, θ(MD/(ησ))^{m - j}`. k ≥ 2 passes in the same order:
    :math:`δ = θ(MD/(ησ) + 2L/(b_j σ))\, θ(MD/(ησ))^{m - j}`.
    Derivation: docs/contraction.md (sections 3 and 4).

    Assumptions (not checked by the library): for every record x, :math:`y ↦ ℓ(y, x)` is
    convex, L-Lipschitz (:math:`\|∇ℓ\| ≤ L`), β-smooth and ρ-strongly convex on the
    compact convex set K of diameter D; η ≤ 2/(β + ρ) so that each gradient step is
    M-Lipschitz (see :func:`step_contraction`); the Gaussian noise is fresh and
    independent at every step; only the final iterate is released (intermediate iterates
    stay hidden); the records are processed in a fixed, data-independent order.

    Args:
      epsilon: ε ≥ 0.
      positions: 1-based index i of the record, integer in 1..``num_records``.
      num_records: number n of records (one pass has n records; with batch size 1, n steps).
      lipschitz: L ≥ 0, bound on every per-record gradient norm.
      noise_std: σ > 0, standard deviation of the Gaussian noise added to the (averaged)
        gradient (the parameter noise is ησ).
      learning_rate: learning rate η > 0.
      diameter: D > 0, diameter of the constraint set.
      contraction: M in [0, 1], from :func:`step_contraction` (1 for convex losses).
      batch_size: records per step b ≥ 1 (integer).
      passes: number k ≥ 1 of passes over the data in the same order (integer).

    Returns:
      δ in [0, 1], float64, broadcast shape of the inputs. NaN under ``jit`` for invalid
      inputs.

    References:
      Asoodeh, Diaz, Calmon (arXiv:2001.06546), Theorem 4, Lemma 3 and Eq. (22)–(24).

    Examples:
      >>> import jaxdp
      >>> d = jaxdp.accounting.pnsgd_contraction_delta(1.0, 20, 40, 1.0, 1.0, 0.7, 1.0, 0.8717797887)
      >>> f"{float(d):.6e}"
      '3.347619e-14'
    """
    return jnp.exp(
        log_pnsgd_contraction_delta(
            epsilon, positions, num_records, lipschitz, noise_std, learning_rate, diameter, contraction, batch_size=batch_size, passes=passes
        )
    )


@float64
def pnsgd_contraction_epsilon(
    delta, positions, num_records, lipschitz, noise_std, learning_rate, diameter, contraction=1.0, *, batch_size=1, passes=1
) -> jax.Array:
    r"""Smallest ε with :func:`pnsgd_contraction_delta` (ε) ≤ δ, per position.

    Solves :math:`\log θ_{e^ε}(r_1) + (m - j)\log θ_{e^ε}(r_c) = \log δ` by bisection with a
    fixed number of iterations (64 halvings of the bracket
    :math:`[0,\ r_1\sqrt{2\log(1/δ)} + r_1^2/2]`, valid because
    :math:`δ(ε) ≤ θ_{e^ε}(r_1) ≤ Q(ε/r_1 - r_1/2)`), returning the upper end of the final
    bracket so the ε is certified (rounded up, never down). Returns 0 when δ(0) ≤ δ.
    δ(ε) is non-increasing in ε, so the solution is unique. Gradients with respect to the
    parameters use the implicit function theorem.

    Args:
      delta: target δ in (0, 1).
      positions, num_records, lipschitz, noise_std, learning_rate, diameter, contraction, batch_size, passes:
        as in :func:`pnsgd_contraction_delta` (same assumptions: convex, L-Lipschitz,
        β-smooth, ρ-strongly convex loss, η ≤ 2/(β+ρ), hidden iterates, fixed order).

    Returns:
      ε ≥ 0, float64, broadcast shape. NaN under ``jit`` for invalid inputs.

    References:
      Asoodeh, Diaz, Calmon (arXiv:2001.06546), Theorem 4 (the inverse is not in the paper).

    Examples:
      >>> import jaxdp
      >>> e = jaxdp.accounting.pnsgd_contraction_epsilon(1e-5, 39, 40, 1.0, 2.0, 0.5, 1.0)
      >>> round(float(e), 9)
      2.754009076
    """
    _check_delta_target(delta)
    _check_pnsgd(positions, num_records, lipschitz, noise_std, learning_rate, diameter, contraction, batch_size, passes)
    args = (f64(x) for x in (delta, positions, num_records, lipschitz, noise_std, learning_rate, diameter, contraction, batch_size, passes))
    return _pnsgd_eps_core(*args)


@jax.jit
def _pnsgd_eps_core(dlt, positions, num_records, lipschitz, noise_std, learning_rate, diameter, contraction, batch_size, passes):
    valid, r_first, rc, later = _pnsgd_setup(
        positions, num_records, lipschitz, noise_std, learning_rate, diameter, contraction, batch_size, passes
    )
    valid = valid & (dlt > 0) & (dlt < 1)
    log_t = jnp.log(jnp.where(valid, dlt, 0.5))
    shape = jnp.broadcast_shapes(log_t.shape, r_first.shape, rc.shape, later.shape)
    r_first, rc, later, log_t = (jnp.broadcast_to(x, shape) for x in (r_first, rc, later, log_t))
    eps = _solve_eps(
        lambda e, r1_, rc_, lt_: _log_delta_from(e, r1_, rc_, later) - lt_,
        (r_first, rc, log_t),
        jnp.zeros(shape),
        _eps_bracket(r_first, log_t),
        slope_fn=lambda e, r1_, rc_, lt_: _log_delta_slope(e, r1_, rc_, later),
    )
    return nan_unless(valid, eps)


# ---------------------------------------------------------------------------------------
# Theorem 3 (Laplace noise, 1-D).
# ---------------------------------------------------------------------------------------


@float64
def pnsgd_laplace_delta(epsilon, positions, num_records, lipschitz, scale, learning_rate, interval_length, contraction=1.0) -> jax.Array:
    r"""δ(ε) of 1-D projected noisy SGD with Laplace noise, for the record at ``positions``.

    .. math::
        δ = \Big[1 - e^{ε/2 - L/v}\Big]_+ \Big[1 - e^{ε/2 - M(b-a)/(2ηv)}\Big]_+^{\,n-i},

    with the convention :math:`0^0 = 1`. Hence δ = 0 when ε ≥ 2L/v, and, **only for
    i < n**, when ε ≥ M(b−a)/(ηv). (The paper states "δ = 0 if ε ≥ min{2L/v, M(b−a)/(ηv)}"
    without excluding i = n; for the last record the second factor is 1, so only the
    first threshold applies. This function follows the formula, which is correct.)

    Assumptions (not checked): the constraint set is the interval [a, b] (1-D); for every
    record the loss is convex, L-Lipschitz, β-smooth and ρ-strongly convex; η ≤ 2/(β+ρ);
    the noise :math:`Z \sim \mathcal L(0, v)` is added to the gradient (parameter noise
    scale ηv); hidden intermediate iterates; one pass in a fixed order.

    Args:
      epsilon: ε ≥ 0.
      positions: i in 1..``num_records``.
      num_records: n ≥ 1.
      lipschitz: L ≥ 0.
      scale: Laplace scale v > 0 (variance 2v²).
      learning_rate: η > 0.
      interval_length: b − a > 0.
      contraction: M in [0, 1] (:func:`step_contraction`).

    Returns:
      δ in [0, 1], float64 (NaN under ``jit`` for invalid inputs).

    References:
      Asoodeh, Diaz, Calmon (arXiv:2001.06546), Theorem 3, Eq. (19)–(21), Lemma 1.

    Examples:
      >>> import jaxdp
      >>> round(float(jaxdp.accounting.pnsgd_laplace_delta(0.5, 1, 10, 1.0, 2.0, 0.25, 1.0)), 12)
      0.000701091091
    """
    _validate.check_in_range("epsilon", epsilon, 0.0, math.inf, allow_inf=True)
    check_positions(positions, num_records)
    _validate.check_in_range("lipschitz", lipschitz, 0.0, math.inf)
    _validate.check_in_range("scale", scale, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("learning_rate", learning_rate, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("interval_length", interval_length, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("contraction", contraction, 0.0, 1.0)
    eps, pos, n, lip, v, eta, width, m_c = (
        f64(x) for x in (epsilon, positions, num_records, lipschitz, scale, learning_rate, interval_length, contraction)
    )
    valid = (
        (eps >= 0)
        & is_int(pos)
        & is_int(n)
        & (pos <= n)
        & (lip >= 0)
        & jnp.isfinite(lip)
        & (v > 0)
        & jnp.isfinite(v)
        & (eta > 0)
        & jnp.isfinite(eta)
        & (width > 0)
        & jnp.isfinite(width)
        & (m_c >= 0)
        & (m_c <= 1)
    )
    v_s = jnp.where(valid, v, 1.0)
    eta_s = jnp.where(valid, eta, 1.0)
    # Lemma 1 with shift 2ηL and scale ηv (first factor), shift M(b−a) and scale ηv (later).
    l1 = _log_laplace(eps, 2.0 * lip, v_s)  # = ε/2 − L/v
    lc = _log_laplace(eps, m_c * width / eta_s, v_s)  # = ε/2 − M(b−a)/(2ηv)
    later = jnp.where(valid, n - pos, 0.0)
    has_later = later > 0
    log_d = l1 + jnp.where(has_later, later * jnp.where(has_later, lc, 0.0), 0.0)
    return nan_unless(valid, jnp.exp(log_d))
