r"""What the contraction bounds of PNSGD share: traced validity and the certified ε search.

:mod:`._contraction` (Theorems 3 and 4 of Asoodeh, Diaz and Calmon, with the mini-batch and
multi-pass extensions) and :mod:`._contraction_stop` (Theorem 5, random stopping) both
check a run's constants under ``jit`` with :func:`_run_valid` and invert δ(ε) into ε(δ)
with :func:`_solve_eps`: a bisection on a bracket from :func:`_eps_bracket`, certified
against the target lowered by a relative 1e-12.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .. import _validate
from ._solve import solve_decreasing

# Bisection for ε(δ): the bracket [0, ε_hi] halves 64 times, so the width ends below
# ε_hi·5e-20, far under float64 resolution of any ε of interest.
_BISECT_ITERS = 64
# Relative margin on log δ in every certified comparison (float64 log θ is accurate to a
# few 1e-15 relative; the margin makes the rounding fall on the safe side).
_SAFETY_REL = 1e-12


# ---------------------------------------------------------------------------------------
# Traced validity shared by the PNSGD bounds.
# ---------------------------------------------------------------------------------------


def _run_valid(lip, sig, eta, dia, m_c):
    """Traced validity of the run parameters shared by every PNSGD bound (NaN otherwise)."""
    return (
        (lip >= 0)
        & jnp.isfinite(lip)
        & (sig > 0)
        & jnp.isfinite(sig)
        & (eta > 0)
        & jnp.isfinite(eta)
        & (dia > 0)
        & jnp.isfinite(dia)
        & (m_c >= 0)
        & (m_c <= 1)
    )


def _eps_bracket(r_first: jax.Array, log_target: jax.Array) -> jax.Array:
    r"""ε_hi with θ_{e^ε_hi}(r) ≤ target/2 ≤ target (so δ(ε_hi) ≤ target).

    θ(ε, r) ≤ Q(ε/r − r/2), and Q(x) ≤ e^{−x²/2}/2 for x ≥ 0, so
    ε_hi = r √(2 log(1/target)) + r²/2 works; for target ≥ 1 take r²/2 (Q(0) = 1/2).
    """
    log_inv = jnp.maximum(-log_target, 0.0)
    return r_first * jnp.sqrt(2.0 * log_inv) + 0.5 * r_first**2


def _safe_target(log_target):
    """Log target lowered by a relative 1e-12 so that rounding in log δ cannot certify too much."""
    return log_target - _SAFETY_REL * (1.0 + jnp.abs(log_target))


def _solve_eps(log_delta_fn, params, log_target: jax.Array, eps_hi: jax.Array, slope_fn=None) -> jax.Array:
    """Smallest ε ≥ 0 (up to bisection width, rounded up) with log_delta_fn(ε, *params) ≤ log_target.

    ``log_delta_fn`` must be non-increasing in ε, differentiable in ``params``, and satisfy
    log_delta_fn(eps_hi, *params) ≤ log_target (else +inf). The search is
    :func:`solve_decreasing` (bisection on [0, eps_hi], the upper end returned, so the ε is
    certified); acceptance uses the log target lowered by a relative 1e-12 against float64
    rounding in log δ, and the gradient with respect to the parameters comes from the
    implicit function theorem. ``slope_fn`` is unused (kept for callers; the derivative
    rule linearises ``log_delta_fn`` only when differentiating). The bracket ends are
    evaluated inside the search loop: one compiled copy of ``log_delta_fn``.
    """
    del slope_fn
    eps_hi = jax.lax.stop_gradient(eps_hi)
    return solve_decreasing(
        log_delta_fn, params, log_target, jnp.zeros_like(eps_hi), eps_hi, _BISECT_ITERS,
        accept_target=_safe_target(log_target), ends_in_loop=True,
    )


def _check_delta_target(delta) -> None:
    _validate.check_delta(delta)


def _check_pnsgd_constants(lipschitz, noise_std, learning_rate, diameter, contraction) -> None:
    """The run's constants, checked eagerly (Theorems 4 and 5 take the same ones)."""
    _validate.check_in_range("lipschitz", lipschitz, 0.0, math.inf)
    _validate.check_in_range("noise_std", noise_std, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("learning_rate", learning_rate, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("diameter", diameter, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("contraction", contraction, 0.0, 1.0)
