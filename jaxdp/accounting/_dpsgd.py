r"""One-call DP-SGD accounting and noise calibration (Poisson sampling, add/remove-one)."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import _validate
from .._numerics import f64, float64
from ._conversion import _IMPROVED_MIN_ORDER, rdp_to_epsilon
from ._rdp import DEFAULT_ORDERS, heterogeneous_rdp
from ._solve import implicit_root, search_decreasing

__all__ = ["dpsgd_epsilon", "schedule_epsilon", "calibrate_noise_multiplier", "CalibrationResult"]

# The calibration's probe sits this much (relative, in log σ) above the extrapolated root,
# so that a converged search evaluates a point on the accepted side.
_PROBE_BIAS = 2e-12
_SAFETY_REL = 1e-12
# The search stops once the threshold is certified within this width in log σ (a rejected
# point at most this far below the accepted one): σ within 2e-10 relative of the exact
# threshold, five times inside the 1e-9 the tests require; ``solver_iterations`` is the cap.
_SEARCH_TOL = 2e-10


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
      delta: target δ in [2.2250738585072014e-308, 1) (subnormal δ is refused).
      orders: Rényi orders (static), default the 156 of dp_accounting.
      method: RDP → DP conversion, ``"improved"`` (default) or ``"classic"``.

    Returns:
      float64 ε with the broadcast shape of the arguments: → 0 as σ → ∞, +inf when σ is
      too small to certify (below 1e-100). Invalid values under ``jit`` give NaN; eagerly
      they (and empty arrays, strings) raise ``ValueError`` naming the parameter.

    Examples:
      >>> import jaxdp
      >>> round(float(jaxdp.accounting.dpsgd_epsilon(256 / 60000, 1.1, 14040, 1e-5)), 6)
      2.594363
    """
    for name, value in (("q", q), ("noise_multiplier", noise_multiplier), ("num_steps", num_steps), ("delta", delta)):
        _validate.check_nonempty(name, value)
    _validate.check_in_range("q", q, 0.0, 1.0)
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("num_steps", num_steps, 0.0, math.inf)
    _validate.check_delta(delta)
    _validate.check_static_choice("method", method, ("improved", "classic"))
    orders_key = tuple(_validate.concrete_orders(orders).tolist())
    return _dpsgd_epsilon_jit(orders_key, method, f64(q), f64(noise_multiplier), f64(num_steps), f64(delta))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _dpsgd_epsilon_jit(orders_key, method, q, sigma, steps, delta):
    # One compiled program for an eager call (validation above ran on the concrete values):
    # a first call compiles once instead of dispatching dozens of separately compiled ops.
    # Inside a caller's jit/vmap/grad this inner jit is inlined.
    q, sigma, steps, delta = jnp.broadcast_arrays(q, sigma, steps, delta)
    rdp = heterogeneous_rdp(orders_key, q[..., None], sigma[..., None], steps[..., None])
    return rdp_to_epsilon(rdp, orders_key, delta, method=method).epsilon


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
    for name, value in (("q", q), ("noise_multiplier", noise_multiplier), ("num_steps", num_steps)):
        _validate.check_nonempty(name, value)
    _validate.check_delta(delta)
    _validate.check_static_choice("method", method, ("improved", "classic"))
    # Validated eagerly (heterogeneous_rdp's checks see the concrete values), then one compiled program.
    for name, value, lo_open in (("q", q, False), ("noise_multiplier", noise_multiplier, True), ("num_steps", num_steps, False)):
        _validate.check_in_range(name, value, 0.0, 1.0 if name == "q" else math.inf, lo_open=lo_open)
    orders_key = tuple(_validate.concrete_orders(orders).tolist())
    return _schedule_epsilon_jit(orders_key, method, f64(q), f64(noise_multiplier), f64(num_steps), f64(delta))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _schedule_epsilon_jit(orders_key, method, q, sigma, steps, delta):
    rdp = heterogeneous_rdp(orders_key, q, sigma, steps)
    return rdp_to_epsilon(rdp, orders_key, delta, method=method).epsilon


class CalibrationResult(NamedTuple):
    """Calibrated noise multiplier and the ε it achieves (≤ the target when found).

    Attributes:
      noise_multiplier: the smallest σ found meeting the target; +inf where even the upper
        end of ``noise_multiplier_bounds`` misses it; NaN for invalid inputs under ``jit``.
      epsilon: ε of that σ, recomputed by :func:`dpsgd_epsilon` (≤ the target), +inf where
        not found.
      at_lower_bound: True where the target is already met at the lower end of
        ``noise_multiplier_bounds``: σ is that end, not a threshold; every σ at or above it
        meets the target and smaller ones were not searched.
    """

    noise_multiplier: jax.Array
    epsilon: jax.Array
    at_lower_bound: jax.Array


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
    solver_iterations: int = 32,
    accountant: str = "rdp",
) -> CalibrationResult:
    r"""Smallest noise multiplier σ whose DP-SGD ε is at most ``target_epsilon``.

    σ is relative to the L2 sensitivity C of the clipped sum (add/remove-one neighbours,
    as dp_accounting and Opacus): the noise added to the sum has standard deviation σC.

    ε(σ) is non-increasing in σ (each RDP order is), and ε(σ) ≤ target iff some order α
    has :math:`T r_α(σ) ≤ B_α` (what the conversion leaves of the target at that order), so
    σ* = min over α of the per-order roots. A bracketed search on log σ over
    ``noise_multiplier_bounds`` (it runs under ``jit`` and ``vmap``) probes, at each
    step, the smallest per-order false-position root (Illinois weights; all orders from
    one vectorised RDP evaluation), falling back to the midpoint. Every probe is checked
    with the real accountant (:func:`rdp_to_epsilon`, same method), with a relative 1e-12
    margin on the target, and the returned σ is the smallest accepted probe: ε never
    exceeds the target. The search stops as soon as a rejected probe lies within 2e-10 in
    log σ below the accepted one (the threshold is then certified to within 2e-10
    relative; about 11 steps on random configurations), or after ``solver_iterations``
    steps (at most 28 were needed on the same configurations).

    The returned σ is then checked once more: its ε recomputed by :func:`dpsgd_epsilon`
    in the result's shape must be at most the target itself (not only the margin), else σ
    steps up by a relative 1e-12, ..., 1e-7 (each step checked), then to the upper bound;
    the returned ε is that recomputed value.

    If even ``noise_multiplier_bounds[1]`` misses the target, σ = +inf (not achievable in range).
    If ``noise_multiplier_bounds[0]`` already meets it, that lower bound is returned with
    ``at_lower_bound`` set: every σ at or above it meets the target, and the smallest one
    may be lower (widen the bounds to find it).

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
      solver_iterations: cap on the search steps after the two end evaluations (static);
        the search usually stops earlier, once σ is certified to 2e-10 relative.
      accountant: ``"rdp"`` (default, this function's search) or ``"pld"``: calibrate
        with the privacy loss distribution's certified upper bound instead
        (:func:`calibrate_pld_noise_multiplier` at its default grid; ``orders``, ``method``,
        ``noise_multiplier_bounds`` and ``solver_iterations`` are then not used).

    Returns:
      ``CalibrationResult(noise_multiplier, epsilon, at_lower_bound)``: σ and ε float64,
      the flag boolean, all of the broadcast shape.

    Examples:
      >>> import jaxdp
      >>> r = jaxdp.accounting.calibrate_noise_multiplier(1.0, 256 / 60000, 14040, 1e-5)
      >>> float(r.epsilon) <= 1.0, round(float(r.noise_multiplier), 3), bool(r.at_lower_bound)
      (True, 2.178, False)
    """
    _validate.check_static_choice("accountant", accountant, ("rdp", "pld"))
    if accountant == "pld":
        from ._pld import calibrate_pld_noise_multiplier

        return calibrate_pld_noise_multiplier(target_epsilon, q, num_steps, delta)
    _validate.check_in_range("target_epsilon", target_epsilon, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("q", q, 0.0, 1.0)
    _validate.check_in_range("num_steps", num_steps, 0.0, math.inf)
    _validate.check_delta(delta)
    lo_s, hi_s = noise_multiplier_bounds
    if not (0 < lo_s < hi_s < math.inf):
        raise ValueError(
            f"noise_multiplier_bounds must satisfy 0 < low < high < inf; got {noise_multiplier_bounds!r}."
        )
    if int(solver_iterations) < 1:
        raise ValueError(f"solver_iterations must be >= 1; got {solver_iterations!r}.")
    orders = tuple(float(a) for a in _validate.concrete_orders(orders))
    target, q, steps, delta = (f64(x) for x in (target_epsilon, q, num_steps, delta))
    target, q, steps, delta = jnp.broadcast_arrays(target, q, steps, delta)
    return _calibrate_core(target, q, steps, delta, orders=orders, method=method, lo_s=float(lo_s),
                           hi_s=float(hi_s), iterations=int(solver_iterations))


# Jitted once per static configuration: called eagerly, a fori_loop over a fresh closure
# would be traced and compiled again at every call.
@functools.partial(jax.jit, static_argnames=("orders", "method", "lo_s", "hi_s", "iterations"))
def _calibrate_core(target, q, steps, delta, orders, method, lo_s, hi_s, iterations):
    valid = (target > 0) & (q >= 0) & (q <= 1) & (steps >= 0) & (delta > 0) & (delta < 1)
    # Harmless stand-ins where invalid, so the search stays finite (result masked to NaN).
    target_s = jnp.where(valid, target, 1.0)
    q_s, steps_s, delta_s = (jnp.where(valid, x, 0.5) for x in (q, steps, delta))
    res = _search(target_s, q_s, steps_s, delta_s, orders, method, lo_s, hi_s, iterations)
    sigma, eps = _verify(res.x, target_s, q_s, steps_s, delta_s, orders, method, hi_s)
    found = jnp.isfinite(sigma)
    at_low = res.at_low & (sigma == lo_s)
    # σ* moves by the implicit function theorem where the target binds (see implicit_root).
    sigma, eps = implicit_root(
        functools.partial(_eps_of_sigma, orders=orders, method=method),
        sigma,
        eps,
        target,
        (q, steps, delta),
        found & ~at_low,
        at_low,
    )
    eps = jnp.where(found, eps, jnp.inf)
    return CalibrationResult(jnp.where(valid, sigma, jnp.nan), jnp.where(valid, eps, jnp.nan), valid & at_low)


# Checks of the returned σ: the σ itself, then relative steps up of 1e-12, 1e-11, ..., 1e-7,
# then the upper end of the bracket.
_VERIFY_STEPS = 7


def _verify(sigma, target, q, steps, delta, orders, method, hi_s):
    r"""σ (values only) whose ε, recomputed by :func:`dpsgd_epsilon`, is at most the target.

    The search accepts a point with a relative 1e-12 margin under the target, in the batch
    shape of its probes; ε recomputed at the returned σ in another program can differ in
    the last bits. So the returned σ is checked once more with :func:`dpsgd_epsilon` itself
    in the result's shape against the target (no margin), and where that fails (not seen
    in practice) σ steps up by a relative 1e-12, 1e-11, ..., 1e-7, then to the upper end of
    the bracket, each step checked; +inf if nothing passes. One ``while_loop`` (one traced
    copy of the accountant): its first pass is the check, later passes run only while
    some element fails. Returns ``(σ, ε at σ)``.
    """
    sigma = jax.lax.stop_gradient(sigma)
    todo = jnp.isfinite(sigma)
    start = jnp.where(todo, sigma, hi_s)

    def cond(state):
        k, _, _, ok = state
        return (k <= _VERIFY_STEPS) & jnp.any(~ok)

    def body(state):
        k, s, e, ok = state
        trial = jnp.where(k == 0, start, jnp.where(k < _VERIFY_STEPS, start * (1.0 + 10.0 ** (k - 13.0)), hi_s))
        e_new = dpsgd_epsilon(q, trial, steps, delta, orders=orders, method=method)
        passed = ~ok & (e_new <= target)
        return k + 1, jnp.where(passed, trial, s), jnp.where(passed, e_new, e), ok | passed

    init = (jnp.asarray(0), jnp.full(sigma.shape, jnp.inf), jnp.full(sigma.shape, jnp.inf), ~todo)
    _, s, e, _ = jax.lax.while_loop(cond, body, init)
    return s, e


def _eps_of_sigma(sigma, q, steps, delta, *, orders, method):
    return dpsgd_epsilon(q, sigma, steps, delta, orders=orders, method=method)


def _search(target, q, steps, delta, orders, method, lo_s, hi_s, iterations):
    r"""The safeguarded secant search on x = log σ (values only): a :class:`SearchResult`.

    ε(σ) ≤ t iff some order α has :math:`T r_α(σ) ≤ B_α`, where :math:`B_α` is what the
    conversion leaves of the target at that order (:func:`rdp_to_epsilon`'s
    order-dependent term, or the total-variation rule's bound :math:`-\log(1-δ^2)`). Each
    :math:`g_α(x) = \log(T r_α(e^x)) - \log B_α` is smooth and decreasing, nearly linear
    (r_α ∝ σ^{-2} for large σ), so the root σ* = min_α of the per-order roots is
    extrapolated from the last two points for all orders at once (one vectorised RDP
    evaluation per step) and the smallest extrapolation is probed next, a relative 2e-12
    above, so that once converged the probe lands on the accepted side. Acceptance is the
    real accountant (:func:`rdp_to_epsilon` of the same method) at the probed σ. Once an
    accepted probe moves σ by less than the tolerance, the next probe is 1e-10 below it in
    log σ: rejected, it certifies the threshold and the search stops (``_SEARCH_TOL``).
    """
    orders_np = jnp.asarray(orders, dtype=jnp.float64)
    d = delta[..., None]
    # Accept with a relative 1e-12 margin: ε recomputed in another batch shape may differ in the last bits.
    safe_target = target * (1.0 - _SAFETY_REL)
    if method == "classic":
        conv = -jnp.log(d) / (orders_np - 1.0)
        budget = safe_target[..., None] - conv
    else:
        conv = jnp.log1p(-1.0 / orders_np) - jnp.log(d * orders_np) / (orders_np - 1.0)
        conv = jnp.where(orders_np > _IMPROVED_MIN_ORDER, conv, jnp.inf)
        # Total-variation rule: ε = 0 at an order where r < -log(1 - δ²).
        budget = jnp.maximum(safe_target[..., None] - conv, -jnp.log1p(-(d**2)))
    log_budget = jnp.log(jnp.where(budget > 0, budget, 1.0))
    log_budget = jnp.where(budget > 0, log_budget, -jnp.inf)

    def accept(x):
        sigma = jnp.exp(x)
        rdp = heterogeneous_rdp(orders, q[..., None], sigma[..., None], steps[..., None])
        eps = rdp_to_epsilon(rdp, orders, delta, method=method).epsilon
        return eps <= safe_target, (eps, jnp.log(rdp) - log_budget)

    def propose(a, aux_a, w_a, b, aux_b, w_b):
        # False position per order on the shared bracket, for the orders accepted at b
        # (the order that binds at σ* is among them); the smallest candidate is probed.
        g_a, g_b = aux_a[1] * w_a[..., None], aux_b[1] * w_b[..., None]
        ok = (g_b <= 0) & (g_a > 0) & jnp.isfinite(g_a) & jnp.isfinite(g_b)
        step = g_b * (b - a)[..., None] / jnp.where(ok, g_b - g_a, -1.0)
        c = jnp.min(jnp.where(ok, b[..., None] - step, jnp.inf), axis=-1)
        return c + _PROBE_BIAS * (1.0 + jnp.abs(c))

    lo = jnp.full(target.shape, math.log(lo_s))
    hi = jnp.full(target.shape, math.log(hi_s))
    res = search_decreasing(accept, lo, hi, iterations, propose=propose, tol=_SEARCH_TOL)
    return res._replace(x=jnp.exp(res.x), aux=jnp.where(res.found, res.aux[0], jnp.inf))
