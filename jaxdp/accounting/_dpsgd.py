r"""One-call DP-SGD accounting and noise calibration (Poisson sampling, add/remove-one)."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import _validate
from .._numerics import f64, float64
from ._conversion import rdp_to_epsilon
from ._rdp import DEFAULT_ORDERS, heterogeneous_rdp

__all__ = ["dpsgd_epsilon", "schedule_epsilon", "calibrate_noise_multiplier", "CalibrationResult"]


@float64
def dpsgd_epsilon(q, noise_multiplier, num_steps, delta, orders=DEFAULT_ORDERS, *, method: str = "improved") -> jax.Array:
    r"""ε of DP-SGD after ``num_steps`` Poisson-sampled Gaussian steps, at the target δ.

    :math:`ε = \min_α \mathrm{conv}_δ\big(T\,ε_{q,σ}(α)\big)` with the exact sampled-Gaussian
    RDP (:func:`sampled_gaussian_rdp`) composed over T steps and converted by
    :func:`rdp_to_epsilon`. Every argument broadcasts: a grid of 10^4 configurations is
    one call. Fractional step counts are rounded up.

    A shortcut for the event algebra: equal, bit for bit, to
    ``epsilon(dpsgd_event(q, noise_multiplier, num_steps), delta)`` (docs/events.md).

    Assumptions: each step samples every example independently with probability q
    (Poisson sampling), clips per-example gradients to norm C and adds N(0, σ²C²) noise
    to their sum; neighbouring data sets differ by adding or removing one example; the
    intermediate models may all be released.

    Args:
      q: Poisson sampling rate in [0, 1].
      noise_multiplier: σ > 0, noise standard deviation divided by the L2 sensitivity C of
        the clipped sum (add/remove-one neighbours, as dp_accounting and Opacus).
      num_steps: number of steps ≥ 0.
      delta: target δ in (0, 1).
      orders: Rényi orders (static), default the 156 of dp_accounting.
      method: RDP → DP conversion, ``"improved"`` (default) or ``"classic"``.

    Returns:
      float64 ε with the broadcast shape of the arguments. Invalid values under ``jit``
      give NaN.

    Examples:
      >>> import jaxdp
      >>> round(float(jaxdp.accounting.dpsgd_epsilon(256 / 60000, 1.1, 14040, 1e-5)), 6)
      2.594363
    """
    _validate.check_in_range("num_steps", num_steps, 0.0, math.inf)
    q, sigma, steps, delta = (f64(x) for x in (q, noise_multiplier, num_steps, delta))
    q, sigma, steps, delta = jnp.broadcast_arrays(q, sigma, steps, delta)
    rdp = heterogeneous_rdp(orders, q[..., None], sigma[..., None], steps[..., None])
    return rdp_to_epsilon(rdp, orders, delta, method=method).epsilon


@float64
def schedule_epsilon(q, noise_multiplier, num_steps, delta, orders=DEFAULT_ORDERS, *, method: str = "improved") -> jax.Array:
    r"""ε of a heterogeneous DP-SGD schedule: segments of (q_s, σ_s, T_s), last axis.

    RDP curves of the segments add up (:func:`heterogeneous_rdp`), then convert once. A
    shortcut for ``epsilon(Composed(tuple(dpsgd_event(q_s, σ_s, T_s) for each s)), delta)``.
    ``noise_multiplier`` is relative to the L2 sensitivity of the clipped sum
    (add/remove-one neighbours), as in :func:`dpsgd_epsilon`.

    Examples:
      >>> import jaxdp
      >>> e = jaxdp.accounting.schedule_epsilon([0.01, 0.02], [1.0, 2.0], [1000, 500], 1e-5)
      >>> float(e) > 0
      True
    """
    rdp = heterogeneous_rdp(orders, q, noise_multiplier, num_steps)
    return rdp_to_epsilon(rdp, orders, delta, method=method).epsilon


class CalibrationResult(NamedTuple):
    """Calibrated noise multiplier and the ε it achieves (≤ the target when found)."""

    noise_multiplier: jax.Array
    epsilon: jax.Array


@float64
def calibrate_noise_multiplier(
    target_epsilon,
    q,
    num_steps,
    delta,
    orders=DEFAULT_ORDERS,
    *,
    method: str = "improved",
    noise_multiplier_bounds: tuple[float, float] = (0.05, 1.0e4),
    iterations: int = 64,
) -> CalibrationResult:
    r"""Smallest noise multiplier σ whose DP-SGD ε is at most ``target_epsilon``.

    σ is relative to the L2 sensitivity C of the clipped sum (add/remove-one neighbours,
    as dp_accounting and Opacus): the noise added to the sum has standard deviation σC.

    ε(σ) is non-increasing in σ (each RDP order is), so a bracketed bisection on log σ
    over ``noise_multiplier_bounds`` with a fixed number of iterations finds the threshold; it runs
    under ``jit`` and ``vmap`` (no data-dependent loop). The returned σ is always the
    upper end of the final bracket, at which ε was evaluated and is ≤ the target: it
    never exceeds the target. After 64 halvings of a bracket of width log(2·10^5) the
    relative gap to the exact threshold is below 1e-15.

    If even ``noise_multiplier_bounds[1]`` misses the target, σ = +inf (not achievable in range).
    If ``noise_multiplier_bounds[0]`` already meets it, that lower bound is returned.

    Derivatives (``jax.grad``, ``jax.jvp``) of σ with respect to the target, q, num_steps and δ
    come from the implicit function theorem on ε(σ*) = target:
    :math:`dσ^* = (d\,\text{target} - ∂_{q,T,δ}ε\cdot d(q,T,δ))/∂_σ ε`, and the returned ε
    moves with the target. Where the target does not bind (σ at a bound, or +inf) σ is
    locally constant.

    Args:
      target_epsilon: ε target > 0.
      q: sampling rate in [0, 1].
      num_steps: number of steps ≥ 0.
      delta: δ in (0, 1).
      orders, method: as in :func:`dpsgd_epsilon`.
      noise_multiplier_bounds: search bracket (static), 0 < low < high.
      iterations: bisection steps (static).

    Returns:
      ``CalibrationResult(noise_multiplier, epsilon)``, float64, broadcast shape.

    Examples:
      >>> import jaxdp
      >>> r = jaxdp.accounting.calibrate_noise_multiplier(1.0, 256 / 60000, 14040, 1e-5)
      >>> float(r.epsilon) <= 1.0, round(float(r.noise_multiplier), 3)
      (True, 2.178)
    """
    _validate.check_in_range("target_epsilon", target_epsilon, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("q", q, 0.0, 1.0)
    _validate.check_in_range("num_steps", num_steps, 0.0, math.inf)
    _validate.check_in_range("delta", delta, 0.0, 1.0, lo_open=True, hi_open=True)
    lo_s, hi_s = noise_multiplier_bounds
    if not (0 < lo_s < hi_s < math.inf):
        raise ValueError(
            f"noise_multiplier_bounds must satisfy 0 < low < high < inf; got {noise_multiplier_bounds!r}."
        )
    if int(iterations) < 1:
        raise ValueError(f"iterations must be >= 1; got {iterations!r}.")
    orders = tuple(float(a) for a in _validate.concrete_orders(orders))
    target, q, steps, delta = (f64(x) for x in (target_epsilon, q, num_steps, delta))
    target, q, steps, delta = jnp.broadcast_arrays(target, q, steps, delta)
    return _calibrate_core(target, q, steps, delta, orders=orders, method=method, lo_s=float(lo_s),
                           hi_s=float(hi_s), iterations=int(iterations))


# Jitted once per static configuration: called eagerly, a fori_loop over a fresh closure
# would be traced and compiled again at every call (1.5 s each).
@functools.partial(jax.jit, static_argnames=("orders", "method", "lo_s", "hi_s", "iterations"))
def _calibrate_core(target, q, steps, delta, orders, method, lo_s, hi_s, iterations):
    sigma, eps = _calibrate_solve(target, q, steps, delta, orders, method, lo_s, hi_s, iterations)
    valid = (target > 0) & (q >= 0) & (q <= 1) & (steps >= 0) & (delta > 0) & (delta < 1)
    return CalibrationResult(jnp.where(valid, sigma, jnp.nan), jnp.where(valid, eps, jnp.nan))


def _bisect(target, q, steps, delta, orders, method, lo_s, hi_s, iterations):
    """(σ, ε(σ), binds, at_low): the bisection on log σ, on values only."""
    def eps_at(log_sigma):
        return dpsgd_epsilon(q, jnp.exp(log_sigma), steps, delta, orders=orders, method=method)

    lo = jnp.full(target.shape, math.log(lo_s))
    hi = jnp.full(target.shape, math.log(hi_s))
    ends = eps_at(jnp.stack([lo, hi]))  # both ends in one evaluation
    eps_lo, eps_hi = ends[0], ends[1]

    def body(_, carry):
        lo, hi, eps_hi = carry
        mid = 0.5 * (lo + hi)
        e = eps_at(mid)
        ok = e <= target
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi), jnp.where(ok, e, eps_hi)

    lo, hi, eps_hi_final = jax.lax.fori_loop(0, iterations, body, (lo, hi, eps_hi))
    found = eps_hi <= target
    at_low = eps_lo <= target
    sigma = jnp.where(at_low, math.exp(math.log(lo_s)), jnp.exp(hi))
    eps = jnp.where(at_low, eps_lo, eps_hi_final)
    sigma = jnp.where(found, sigma, jnp.inf)
    eps = jnp.where(found, eps, jnp.inf)
    return sigma, eps, found & ~at_low, found & at_low


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6, 7, 8))
def _calibrate_solve(target, q, steps, delta, orders, method, lo_s, hi_s, iterations):
    sigma, eps, _, _ = _bisect(target, q, steps, delta, orders, method, lo_s, hi_s, iterations)
    return sigma, eps


@_calibrate_solve.defjvp
def _calibrate_solve_jvp(orders, method, lo_s, hi_s, iterations, primals, tangents):
    # The implicit function theorem (the bisection itself has no derivative): where the
    # target binds, ε(σ*, q, T, δ) = target, so dσ* = (d target − ∂_{q,T,δ}ε·d(q,T,δ))/∂_σ ε
    # and the returned ε moves with the target. At the lower bound σ is constant and ε moves
    # with (q, T, δ); where σ = +inf nothing moves. Only traced when differentiating.
    target, q, steps, delta = primals
    d_target, d_q, d_steps, d_delta = tangents
    sigma, eps, binds, at_low = _bisect(target, q, steps, delta, orders, method, lo_s, hi_s, iterations)
    s_at = jnp.where(binds | at_low, sigma, 1.0)

    def eps_of(s, q_, t_, d_):
        return dpsgd_epsilon(q_, s, t_, d_, orders=orders, method=method)

    # One linearisation at σ*, applied to the σ direction and to the caller's tangents.
    _, lin = jax.linearize(eps_of, s_at, q, steps, delta)
    de_ds = lin(jnp.ones_like(s_at), jnp.zeros_like(q), jnp.zeros_like(steps), jnp.zeros_like(delta))
    de_dp = lin(jnp.zeros_like(s_at), d_q, d_steps, d_delta)
    use = binds & jnp.isfinite(de_ds) & (de_ds < 0)
    d_sigma = jnp.where(use, (d_target - de_dp) / jnp.where(use, de_ds, -1.0), 0.0)
    d_eps = jnp.where(use, d_target, jnp.where(at_low, de_dp, 0.0))  # masks on primal values only
    return (sigma, eps), (d_sigma, d_eps)
