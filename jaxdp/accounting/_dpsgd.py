r"""One-call DP-SGD accounting and noise calibration (Poisson sampling, add/remove-one)."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._numerics import f64, float64
from .._program_cache import persistent
from ._conversion import _IMPROVED_MIN_ORDER, rdp_to_epsilon
from ._rdp import DEFAULT_ORDERS, heterogeneous_rdp
from ._solve import implicit_root, search_certified, search_decreasing

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
    _validate.check_broadcastable(q=q, noise_multiplier=noise_multiplier, num_steps=num_steps, delta=delta)
    _validate.check_in_range("q", q, 0.0, 1.0)
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("num_steps", num_steps, 0.0, math.inf)
    _validate.check_delta(delta)
    _validate.check_static_choice("method", method, ("improved", "classic"))
    orders_key = tuple(_validate.concrete_orders(orders).tolist())
    return _dpsgd_epsilon_jit(orders_key, method, f64(q), f64(noise_multiplier), f64(num_steps), f64(delta))


@persistent("dpsgd_epsilon", static_argnums=(0, 1))
@functools.partial(jax.jit, static_argnums=(0, 1))
def _dpsgd_epsilon_jit(orders_key, method, q, sigma, steps, delta):
    # One compiled program for an eager call (validation above ran on the concrete values):
    # a first call compiles once instead of dispatching dozens of separately compiled ops.
    # Inside a caller's jit/vmap/grad this inner jit is inlined.
    q, sigma, steps, delta = jnp.broadcast_arrays(q, sigma, steps, delta)
    return _epsilon_of(orders_key, method, sigma, q, steps, delta)


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
    _validate.check_broadcastable(q=q, noise_multiplier=noise_multiplier, num_steps=num_steps)
    _validate.check_delta(delta)
    _validate.check_static_choice("method", method, ("improved", "classic"))
    # Validated eagerly (heterogeneous_rdp's checks see the concrete values), then one compiled program.
    for name, value, lo_open in (("q", q, False), ("noise_multiplier", noise_multiplier, True), ("num_steps", num_steps, False)):
        _validate.check_in_range(name, value, 0.0, 1.0 if name == "q" else math.inf, lo_open=lo_open)
    orders_key = tuple(_validate.concrete_orders(orders).tolist())
    return _schedule_epsilon_jit(orders_key, method, f64(q), f64(noise_multiplier), f64(num_steps), f64(delta))


@persistent("schedule_epsilon", static_argnums=(0, 1))
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
    solver_iterations: int | None = None,
    accountant: str = "rdp",
    grid_size: int | None = None,
    tail_bound: float | None = None,
) -> CalibrationResult:
    r"""Smallest noise multiplier σ whose DP-SGD ε is at most ``target_epsilon``.

    σ is relative to the L2 sensitivity C of the clipped sum (add/remove-one neighbours,
    as dp_accounting and Opacus): the noise added to the sum has standard deviation σC.

    ε(σ) is non-increasing in σ (each RDP order is), and ε(σ) ≤ target iff some order α
    has :math:`T r_α(σ) ≤ B_α` (what the conversion leaves of the target at that order), so
    σ* = min over α of the per-order roots. A certified search on log σ over
    ``noise_multiplier_bounds`` (it runs under ``jit`` and ``vmap``) evaluates the
    accountant once per step (all orders, one vectorised RDP evaluation) and probes the
    smallest per-order threshold of a two-term model of :math:`A_α - 1` (the k = 2 term of
    the binomial sum, exact, plus one exponential fitted to the rest), with bracketing
    safeguards. Every probe is checked with the real accountant (:func:`rdp_to_epsilon`,
    same method, in the result's shape), with a relative 1e-12 margin on the target, and
    the returned σ is the smallest accepted probe, its ε the value computed there: ε never
    exceeds the target (the margin covers the last-bit differences of a recomputation in
    another program). The search stops as soon as a rejected probe lies within 2e-10 in
    log σ below the accepted one (the threshold is then certified to within 2e-10
    relative; 2–13 steps, mean 6.6, on random configurations), or after
    ``solver_iterations`` steps.

    If even ``noise_multiplier_bounds[1]`` misses the target, σ = +inf (not achievable in range).
    If ``noise_multiplier_bounds[0]`` already meets it, that lower bound is returned with
    ``at_lower_bound`` set: every σ at or above it meets the target, and the smallest one
    may be lower (widen the bounds to find it).

    Derivatives (``jax.grad``, ``jax.jvp``) of σ with respect to the target, q, num_steps and δ
    come from the implicit function theorem on ε(σ*) = target:
    :math:`dσ^* = (d\,\text{target} - ∂_{q,T,δ}ε\cdot d(q,T,δ))/∂_σ ε`, with the slopes of ε
    taken at the returned σ, and the returned ε moves with the target. This is the derivative
    of the exact threshold; the returned σ is the accepted (upper, conservative) end of the
    search's final bracket, within 2e-10 relative of it. Where the target does not bind (σ
    at a bound, or +inf) σ is locally constant; where it binds but :math:`∂_σ ε` is 0 or not
    finite, the derivative is NaN. Differentiating never traces the search: the rule runs
    the calibration's own program and one forward-derivative program of ε at σ (both cached
    compiled programs when ``jax.grad`` is called eagerly), and a second derivative (x64 on)
    differentiates that rule again.

    Args:
      target_epsilon: ε target > 0.
      q: sampling rate in [0, 1].
      num_steps: number of steps ≥ 0.
      delta: δ in (0, 1).
      orders, method: as in :func:`dpsgd_epsilon`.
      noise_multiplier_bounds: search bracket (static), 0 < low < high.
      solver_iterations: cap on the search's evaluations (static; default 32 for
        ``"rdp"``, 24 bisection steps for ``"pld"``); the RDP search usually stops much
        earlier, once σ is certified to 2e-10 relative. Where the cap stops it first, σ is
        the smallest accepted probe (+inf if none was accepted).
      accountant: ``"rdp"`` (default, this function's search) or ``"pld"``: calibrate
        with the privacy loss distribution's certified upper bound instead: the
        RDP σ brackets a bisection on the PLD ε, every returned σ checked against the
        target (``orders``, ``method`` and ``noise_multiplier_bounds`` are then not used).
      grid_size, tail_bound: ``"pld"`` only, as in :func:`epsilon` (static; default
        :data:`PLD_GRID_SIZE`, :data:`PLD_TAIL_BOUND`).

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
        pld_options = {k: v for k, v in (("grid_size", grid_size), ("tail_bound", tail_bound),
                                         ("solver_iterations", solver_iterations)) if v is not None}
        return calibrate_pld_noise_multiplier(target_epsilon, q, num_steps, delta, **pld_options)
    for name, v in (("grid_size", grid_size), ("tail_bound", tail_bound)):
        if v is not None:
            raise ValueError(f"{name} is an option of accountant='pld'; accountant='rdp' does not take it.")
    solver_iterations = 32 if solver_iterations is None else solver_iterations
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
    return _calibrate(target, q, steps, delta, orders, method, float(lo_s), float(hi_s), int(solver_iterations))


# Jitted once per static configuration: called eagerly, a while_loop over a fresh closure
# would be traced and compiled again at every call.
@persistent("calibrate_noise_multiplier", static_argnames=("orders", "method", "lo_s", "hi_s", "iterations"))
@functools.partial(jax.jit, static_argnames=("orders", "method", "lo_s", "hi_s", "iterations"))
def _calibrate_core(target, q, steps, delta, orders, method, lo_s, hi_s, iterations):
    valid = (target > 0) & (q >= 0) & (q <= 1) & (steps >= 0) & (delta > 0) & (delta < 1)
    # Harmless stand-ins where invalid, so the search stays finite (result masked to NaN).
    target_s = jnp.where(valid, target, 1.0)
    q_s, steps_s, delta_s = (jnp.where(valid, x, 0.5) for x in (q, steps, delta))
    res = _search(target_s, q_s, steps_s, delta_s, orders, method, lo_s, hi_s, iterations)
    # σ the search evaluated (same exp of the same x), ε the value computed there.
    sigma, eps, found, at_low = jnp.exp(res.x), res.value, res.found, res.at_low
    eps = jnp.where(found, eps, jnp.inf)
    return CalibrationResult(jnp.where(valid, sigma, jnp.nan), jnp.where(valid, eps, jnp.nan), valid & at_low)


def _calibrate(target, q, steps, delta, orders, method, lo_s, hi_s, iterations):
    """The calibration's result; concrete calls go straight to the cached program, traced ones
    through :func:`_calibrated` (whose rule gives the derivatives)."""
    args = (target, q, steps, delta)
    static = (orders, method, lo_s, hi_s, iterations)
    if not any(isinstance(x, jax.core.Tracer) for x in args):
        return _calibrate_core(*args, orders=orders, method=method, lo_s=lo_s, hi_s=hi_s, iterations=iterations)
    sigma, eps, at_low = _calibrated(*args, *static)
    return CalibrationResult(sigma, eps, at_low > 0)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6, 7, 8))
def _calibrated(target, q, steps, delta, orders, method, lo_s, hi_s, iterations):
    """σ*, ε(σ*) and ``at_lower_bound`` as 0/1 (values; the derivatives are the rule below).

    The flag is a float with a zero tangent: boolean outputs of a custom_jvp (float0
    tangents) fail to transpose.
    """
    res = _calibrate_core(target, q, steps, delta, orders=orders, method=method, lo_s=lo_s, hi_s=hi_s,
                          iterations=iterations)
    return res.noise_multiplier, res.epsilon, res.at_lower_bound.astype(res.epsilon.dtype)


@_calibrated.defjvp
def _calibrated_jvp(orders, method, lo_s, hi_s, iterations, primals, tangents):
    r"""σ* moves by the implicit function theorem where the target binds.

    On ε(σ*, q, T, δ) = target: :math:`dσ^* = (d\,\text{target} - ∂_{q,T,δ}ε\cdot d(q,T,δ))/∂_σ ε`,
    and ε moves with the target. Where σ* is the lower bound (``at_low``) σ is constant
    and ε moves with the parameters; where nothing was found nothing moves; where the
    target binds but :math:`∂_σ ε` is zero or not finite the derivative is NaN (the
    implicit function theorem does not apply).

    The primal is the calibration's own (cached, compiled) program, called through
    :func:`_calibrated` so that a second derivative re-enters this rule; the slopes of ε at
    σ* are one small forward-derivative program of the accountant
    (:func:`_calibration_jacobian`), so differentiating never traces the search. Called
    eagerly (``jax.grad`` of an eager function), both programs run with concrete values
    through jaxdp's program cache; only the 2×4 linear map below is staged and transposed.
    """
    sigma, eps, at_low = _calibrated(*primals, orders, method, lo_s, hi_s, iterations)
    jac = _calibration_jacobian(orders, method, sigma, eps, at_low, *primals)
    out_tangents = _apply_jacobian(jac, *tangents)
    return (sigma, eps, at_low), (*out_tangents, jnp.zeros_like(at_low))


@jax.jit
def _apply_jacobian(jac, *tangents):
    """(dσ, dε) = J · d(target, q, T, δ), J of shape (..., 2, 4).

    A jit of its own (not inlined): reverse mode transposes it into one small compiled
    program instead of a dozen eager operations, each compiled on its own in a fresh process.
    """
    t = jnp.stack(jnp.broadcast_arrays(*tangents), axis=-1)[..., None, :]
    d = jnp.sum(jac * t, axis=-1)
    return d[..., 0], d[..., 1]


def _rdp_of(orders, sigma, q, steps):
    """The exact RDP curve of DP-SGD at (q, σ, T), orders on a trailing axis."""
    return heterogeneous_rdp(orders, q[..., None], sigma[..., None], steps[..., None])


def _epsilon_of(orders, method, sigma, q, steps, delta):
    """ε of DP-SGD at (q, σ, T, δ) by the exact RDP (the accountant the search accepts with)."""
    return rdp_to_epsilon(_rdp_of(orders, sigma, q, steps), orders, delta, method=method).epsilon


@persistent("calibration_jacobian", static_argnums=(0, 1))
@functools.partial(jax.jit, static_argnums=(0, 1))
def _calibration_jacobian(orders, method, sigma, eps, at_low, target, q, steps, delta):
    r"""J = ∂(σ*, ε*)/∂(target, q, T, δ), shape (..., 2, 4), from the slopes of ε at σ*.

    The slopes :math:`∂ε/∂(σ, q, T, δ)` are one forward derivative of the accountant
    batched over the four unit directions. Rows: :math:`dσ^* = (d\,\text{target} -
    ∂_{q,T,δ}ε\cdot d(q,T,δ))/∂_σ ε` and :math:`dε^* = d\,\text{target}` where the target
    binds (found and not at the lower bound); σ fixed and :math:`dε^* = ∂_{q,T,δ}ε\cdot
    d(q,T,δ)` at the lower bound; zero where nothing was found (ε = +inf) or the inputs are
    invalid (NaN); NaN where the target binds but :math:`∂_σ ε` is zero or not finite.
    """
    found = jnp.isfinite(eps)
    fixed = at_low > 0
    binds = found & ~fixed
    s = jnp.where(found, sigma, 1.0)
    primals = (s, q, steps, delta)

    def directional(unit):
        tangents = tuple(unit[i] * jnp.ones_like(p) for i, p in enumerate(primals))
        return jax.jvp(lambda *a: _epsilon_of(orders, method, *a), primals, tangents)[1]

    slope = jax.vmap(directional, out_axes=-1)(jnp.eye(4, dtype=s.dtype))
    slope = jnp.where(found[..., None], slope, 0.0)  # +inf where nothing was accepted (0·inf in reverse mode)
    df_ds = slope[..., 0]
    good = jnp.isfinite(df_ds) & (df_ds < 0)
    one = jnp.ones_like(df_ds)
    ift = jnp.stack([one, -slope[..., 1], -slope[..., 2], -slope[..., 3]], axis=-1) / jnp.where(good, df_ds, -1.0)[..., None]
    sigma_row = jnp.where(binds[..., None], jnp.where(good[..., None], ift, jnp.nan), 0.0)
    moves = jnp.concatenate([one[..., None], jnp.zeros_like(slope[..., 1:])], axis=-1)
    eps_row = jnp.where(binds[..., None], moves, jnp.where((fixed & ~binds)[..., None], slope.at[..., 0].set(0.0), 0.0))
    return jnp.stack([sigma_row, eps_row], axis=-2)


def _log_expm1(z):
    """log(e^z - 1) for z ≥ 0 (-inf at 0, NaN below): no overflow for large z."""
    big = z > 1.0
    return jnp.where(big, z + jnp.log1p(-jnp.exp(-jnp.where(big, z, 1.0))), jnp.log(jnp.expm1(jnp.where(big, 1.0, z))))


def _log_softplus(z):
    """log(log(1 + e^z)), accurate for very negative z."""
    return jnp.where(z < -30.0, z, jnp.log(jnp.logaddexp(0.0, jnp.maximum(z, -30.0))))


# Newton steps of the per-order model fits and roots (cheap elementwise work next to one
# RDP evaluation; the model only steers the search, acceptance is the accountant).
_MODEL_NEWTON = 8
_MODEL_ORDERS = 8
# Two points closer than this in log σ fit the model's rate; farther ones are stale.
_LOCAL = 0.2


def _fit_rate(u_h, u_l, d_lam):
    r"""κ with :math:`\log\frac{e^{κu_h}-1}{e^{κu_l}-1} = Δλ` (needs Δλ > log(u_h/u_l)).

    h(κ) is convex and increasing with :math:`h(κ) ≥ κ(u_h - u_l)`, so Newton from
    :math:`κ_0 = Δλ/(u_h - u_l)` decreases monotonically to the root.
    """
    du = u_h - u_l

    def step(_, kappa):
        h = kappa * du + jnp.log(-jnp.expm1(-kappa * u_h)) - jnp.log(-jnp.expm1(-kappa * u_l)) - d_lam
        dh = du + u_h / jnp.expm1(kappa * u_h) - u_l / jnp.expm1(kappa * u_l)
        dh = jnp.clip(jnp.where(jnp.isfinite(dh), dh, du), 0.5 * du, du)
        return jnp.maximum(kappa - h / dh, 1e-3 * kappa)

    # A rolled loop: a smaller program than unrolled steps (compile time).
    return jax.lax.fori_loop(0, _MODEL_NEWTON, step, d_lam / du)


def _two_term_root(log_limit, log_c2, log_beta, kappa):
    """u with c_2 (e^{2u} - 1) + β (e^{κu} - 1) = L, all in logs (-inf drops a term).

    Convex and increasing in u: Newton from the smaller one-term root (an upper bound)
    decreases monotonically to it.
    """
    u2 = jnp.exp(_log_softplus(log_limit - log_c2)) / 2.0
    uk = jnp.exp(_log_softplus(log_limit - log_beta)) / kappa

    def step(_, u):
        t2 = jnp.exp(log_c2 + _log_expm1(2.0 * u) - log_limit)
        tk = jnp.exp(log_beta + _log_expm1(kappa * u) - log_limit)
        g = t2 + tk - 1.0
        dg = jnp.exp(log_c2 + math.log(2.0) + 2.0 * u - log_limit) + jnp.exp(log_beta + jnp.log(kappa) + kappa * u - log_limit)
        return jnp.where(g > 0, u - g / dg, u)

    return jax.lax.fori_loop(0, _MODEL_NEWTON, step, jnp.minimum(u2, uk))


def _model_roots(x_prev, lam_prev, x_cur, lam_cur, two_points, log_limit, log_c2, rate):
    r"""Per-order predicted thresholds in x = log σ from a two-term model of :math:`A_α - 1`.

    With :math:`u = 1/(2σ^2)`, integer orders have :math:`A_α - 1 = \sum_{k=2}^{α} c_k
    (e^{k(k-1)u} - 1)`, :math:`c_k = \binom αk q^k (1-q)^{α-k}`; the exponents are convex
    in k, so the sum is dominated by k = 2 (large σ) or by k near α (below the order's
    "cliff"). The model keeps the k = 2 term exactly and fits the rest as one term
    :math:`β(e^{κu} - 1)`: κ from the last two points when they are close (the local
    rate), else κ = α(α-1); β from the current point. Where the rest is not positive
    (fractional orders, where signs alternate) one term :math:`β(e^{κu} - 1)` is fitted to
    the whole of :math:`A_α - 1`. The threshold solves model = :math:`L_α` by Newton from
    the right (the model is convex and increasing in u). Orders with a non-finite value
    give +inf (no candidate).
    """
    u_c = (0.5 * jnp.exp(-2.0 * x_cur))[..., None]
    u_p = (0.5 * jnp.exp(-2.0 * x_prev))[..., None]
    local = two_points[..., None] & (jnp.abs(x_cur - x_prev)[..., None] < _LOCAL) & (u_c != u_p)
    hi_is_c = u_c > u_p
    u_h, u_l = jnp.where(hi_is_c, u_c, u_p), jnp.where(hi_is_c, u_p, u_c)
    r = 2.0 * jnp.abs(x_cur - x_prev)[..., None]  # log(u_h/u_l)

    def rest(lam, u):  # log of A - 1 minus the k = 2 term, NaN where not positive
        frac = jnp.exp(log_c2 + _log_expm1(2.0 * u) - lam)
        return lam + jnp.log1p(-jnp.where(frac < 1.0, frac, 1.0))

    rho_c, rho_p = rest(lam_cur, u_c), rest(lam_prev, u_p)
    two_term = jnp.isfinite(rho_c) & (rho_c > lam_cur - 20.0)
    # Fit one exponential either to the rest (two-term model) or to the whole A - 1.
    y_c = jnp.where(two_term, rho_c, lam_cur)
    y_p = jnp.where(two_term, rho_p, lam_prev)
    y_h, y_l = jnp.where(hi_is_c, y_c, y_p), jnp.where(hi_is_c, y_p, y_c)
    d_y = y_h - y_l
    fit = local & jnp.isfinite(d_y) & (d_y > r)
    kappa = jnp.where(fit, _fit_rate(jnp.where(fit, u_h, 2.0), jnp.where(fit, u_l, 1.0), jnp.where(fit, d_y, 1.0)), rate)
    log_beta = y_c - _log_expm1(kappa * u_c)
    c2 = jnp.where(two_term, log_c2, -jnp.inf)
    u = _two_term_root(log_limit, c2, log_beta, kappa)
    x_root = -0.5 * jnp.log(2.0 * u)
    usable = jnp.isfinite(lam_cur) & (log_limit > -jnp.inf)
    x_root = jnp.where(usable, x_root, jnp.inf)
    x_root = jnp.where(log_limit == jnp.inf, -jnp.inf, x_root)
    return jnp.where(jnp.isnan(x_root), jnp.inf, x_root)


def _search(target, q, steps, delta, orders, method, lo_s, hi_s, iterations):
    r"""The certified model search on x = log σ (values only): a :class:`CertifiedResult`.

    ε(σ) ≤ t iff some order α has :math:`T r_α(σ) ≤ B_α`, where :math:`B_α` is what the
    conversion leaves of the target at that order (:func:`rdp_to_epsilon`'s
    order-dependent term, or the total-variation rule's bound :math:`-\log(1-δ^2)`),
    i.e. :math:`λ_α = \log(A_α - 1) ≤ \log L_α = \log(e^{(α-1)B_α/T} - 1)` with
    :math:`r_α = \log(A_α)/(α-1)`. Each step evaluates the accountant once at one σ (all
    orders, one vectorised RDP), fits every order's model (:func:`_model_roots`) to the last
    two points, and probes the smallest predicted threshold; the first probe is the k = 2
    term's threshold :math:`u = \tfrac12\log(1 + L_α/(\binom α2 q^2))`, maximised over α.
    Acceptance is the real accountant (:func:`rdp_to_epsilon` of the same method) with a
    relative 1e-12 margin under the target; the search stops once a rejected probe lies
    within ``_SEARCH_TOL`` below an accepted one (:func:`search_certified`).
    """
    orders_np = np.asarray(orders, dtype=np.float64)
    am1 = orders_np - 1.0
    d = delta[..., None]
    steps_eff = jnp.maximum(jnp.ceil(steps), 1.0)[..., None]
    # Accept with a relative 1e-12 margin: ε recomputed in another program may differ in the last bits.
    safe_target = target * (1.0 - _SAFETY_REL)
    if method == "classic":
        conv = -jnp.log(d) / am1
        budget = safe_target[..., None] - conv
    else:
        conv = jnp.log1p(-1.0 / orders_np) - jnp.log(d * orders_np) / am1
        conv = jnp.where(orders_np > _IMPROVED_MIN_ORDER, conv, jnp.inf)
        # Total-variation rule: ε = 0 at an order where r < -log(1 - δ²).
        budget = jnp.maximum(safe_target[..., None] - conv, -jnp.log1p(-(d**2)))
    pos = budget > 0
    log_limit = jnp.where(pos, _log_expm1(am1 * jnp.where(pos, budget, 1.0) / steps_eff), -jnp.inf)

    def evaluate(x):
        rdp = _rdp_of(orders, jnp.exp(x), q, steps)
        eps = rdp_to_epsilon(rdp, orders, delta, method=method).epsilon
        lam = _log_expm1(am1 * (rdp / steps_eff))
        return eps <= safe_target, eps, lam

    # k = 2 coefficient C(α, 2) q² (1-q)^(α-2) and the k = α rate α(α-1) of every order.
    log_q = jnp.log(jnp.where(q > 0, q, 1.0))[..., None]
    log_c2 = np.log(0.5 * orders_np * am1) + 2.0 * log_q + (orders_np - 2.0) * jnp.log1p(-jnp.where(q < 1, q, 0.0))[..., None]
    rate = orders_np * am1

    rate_b = jnp.broadcast_to(rate, log_limit.shape)

    def propose(x_prev, lam_prev, x_cur, lam_cur, two_points):
        two = jnp.broadcast_to(two_points, x_cur.shape)
        # Only the _MODEL_ORDERS orders closest to their limits at the current point are
        # modelled: the binding one is among them near σ*, and far-off orders' fits only
        # mislead (and the model would otherwise cost as much as the accountant).
        gap = lam_cur - log_limit
        gap = jnp.where(jnp.isnan(gap), jnp.inf, gap)
        _, idx = jax.lax.top_k(-gap, min(_MODEL_ORDERS, len(orders)))
        pick = [jnp.take_along_axis(a, idx, axis=-1) for a in (lam_prev, lam_cur, log_limit, log_c2, rate_b)]
        c = jnp.min(_model_roots(x_prev, pick[0], x_cur, pick[1], two, *pick[2:]), axis=-1)
        # A relative 2e-12 above the predicted threshold: a converged probe is accepted there
        # (σ within ~2e-12 of the threshold), and the next one, tol/2 below, certifies it.
        return c + _PROBE_BIAS * (1.0 + jnp.abs(c))

    # First probe: the k = 2 and k = α terms alone, C(α,2) q² (1-q)^(α-2) (e^{2u} - 1) +
    # q^α (e^{α(α-1)u} - 1) = L_α (a lower bound on A_α - 1 for integer α), maximised over α.
    u0 = _two_term_root(log_limit, log_c2, orders_np * log_q, rate)
    x0 = jnp.min(jnp.where(jnp.isnan(u0), jnp.inf, -0.5 * jnp.log(2.0 * u0)), axis=-1)
    x0 = jnp.where(q > 0, x0, -jnp.inf)
    start = jnp.where(jnp.isnan(x0), 0.0, jnp.clip(x0, math.log(lo_s), math.log(hi_s)))
    info_init = jnp.zeros(target.shape + (len(orders),))
    return search_certified(evaluate, propose, start, info_init, math.log(lo_s), math.log(hi_s), _SEARCH_TOL,
                            iterations)


# =======================================================================================
# calibrate_noise_multiplier(accountant="pld"): the PLD calibration (moved here from _pld.py
# so that _pld imports the event tree only).
# =======================================================================================


def _pld():
    """The PLD accountant's module, imported on first use: the RDP paths (a first ``dpsgd_epsilon``)
    do not load it (issue 21: a fresh process's imports)."""
    from . import _pld  # deliberate lazy loading (see the docstring)

    return _pld


def _dpsgd_pld_epsilon(x, q, steps, delta, *, grid_size, tail_bound):
    """PLD ε of DP-SGD at σ = e^x (no eager checks: the calibration's inner function)."""
    return _pld()._evaluate_jit(("sampled_gaussian",), (3,), grid_size, tail_bound, "upper", "epsilon",
                         q, jnp.exp(x), steps, delta)


@float64
def calibrate_pld_noise_multiplier(target_epsilon, q, num_steps, delta, *, grid_size: int | None = None,
                                   tail_bound: float | None = None, solver_iterations: int = 24):
    r"""Smallest DP-SGD noise multiplier whose PLD ε (upper bound) is at most ``target_epsilon``.

    The public door is ``calibrate_noise_multiplier(..., accountant="pld")``; the name
    ``jaxdp.accounting.calibrate_pld_noise_multiplier`` is deprecated and warns.

    The RDP calibration (:func:`calibrate_noise_multiplier`) gives :math:`σ_{RDP}`, which
    meets the target under the PLD accountant too (the PLD upper bound is below the RDP
    bound up to its certified error); the PLD root is searched by bisection on
    :math:`\log σ ∈ [\log σ_{RDP} - 1, \log σ_{RDP}]` (fixed steps, one PLD evaluation per step,
    so it runs under ``jit`` and ``vmap``). Every returned σ was checked:
    ``epsilon(dpsgd_event(q, σ, T), δ, accountant="pld") ≤ target``; where the PLD grid cannot certify
    the target at :math:`σ_{RDP}`, :math:`σ_{RDP}` itself (an RDP-certified answer) is
    returned. Derivatives with respect to the target, q, num_steps and δ come from the
    implicit function theorem. σ is relative to the clipped sum's L2 sensitivity
    (add/remove-one), as in :func:`calibrate_noise_multiplier`.

    Args:
      target_epsilon: ε target > 0.
      q: sampling rate in [0, 1].
      num_steps: number of steps ≥ 0.
      delta: δ in (0, 1).
      grid_size, tail_bound: as in :func:`epsilon` with ``accountant="pld"`` (static; None:
        :data:`PLD_GRID_SIZE`, :data:`PLD_TAIL_BOUND`).
      solver_iterations: bisection steps (static); the bracket is e wide, so 24 steps
        give σ within 6e-8 relative of the grid's threshold.

    Returns:
      ``CalibrationResult(noise_multiplier, epsilon, at_lower_bound)``, float64 (and a
      boolean flag), broadcast shape; the ε is the PLD upper bound at the returned σ;
      ``at_lower_bound`` is true where the target is met at the lower end of the search.

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> r = A.calibrate_noise_multiplier(1.0, 256 / 60000, 14040, 1e-5, accountant="pld", grid_size=2**13)
      >>> float(r.epsilon) <= 1.0, round(float(r.noise_multiplier), 2)
      (True, 2.03)
    """
    pld = _pld()
    grid_size = pld.PLD_GRID_SIZE if grid_size is None else grid_size
    tail_bound = pld.PLD_TAIL_BOUND if tail_bound is None else tail_bound
    pld._check_options(grid_size, tail_bound, "upper")
    _validate.check_in_range("target_epsilon", target_epsilon, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("q", q, 0.0, 1.0)
    _validate.check_in_range("num_steps", num_steps, 0.0, math.inf)
    _validate.check_delta(delta)
    if int(solver_iterations) < 1:
        raise ValueError(f"solver_iterations must be >= 1; got {solver_iterations!r}.")
    target, q, steps, delta = (f64(x) for x in (target_epsilon, q, num_steps, delta))
    target, q, steps, delta = jnp.broadcast_arrays(target, q, steps, delta)
    return _calibrate_pld_core(target, q, jnp.ceil(steps), delta, int(grid_size), float(tail_bound),
                           int(solver_iterations))


@persistent("calibrate_pld_noise_multiplier", static_argnums=(4, 5, 6))
@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _calibrate_pld_core(target, q, steps, delta, grid_size, tail_bound, iterations):
    rdp = calibrate_noise_multiplier(target, q, steps, delta)
    s_rdp = jax.lax.stop_gradient(rdp.noise_multiplier)
    ok = jnp.isfinite(s_rdp) & (s_rdp > 0)
    hi = jnp.log(jnp.where(ok, s_rdp, 1.0))
    lo = hi - 1.0
    fn = functools.partial(_dpsgd_pld_epsilon, grid_size=grid_size, tail_bound=tail_bound)
    params = (q, steps, delta)
    p_sg = jax.lax.stop_gradient(params)
    t_sg = jax.lax.stop_gradient(target)

    def accept(x):  # one evaluation site: the PLD program is large (see ends_in_loop)
        e = fn(x, *p_sg)
        return e <= t_sg, e

    res = search_decreasing(accept, lo, hi, iterations, ends_in_loop=True)
    found = res.found
    x, eps_x = implicit_root(fn, res.x, jnp.where(found, res.aux, 0.0), target, params, found & ~res.at_low,
                             res.at_low, closed=True)
    x_s = jnp.where(found, x, hi)
    sigma = jnp.where(found, jnp.exp(x_s), rdp.noise_multiplier)
    eps = jnp.where(found, eps_x, rdp.epsilon)
    sigma = jnp.where(ok, sigma, rdp.noise_multiplier)
    eps = jnp.where(ok, eps, rdp.epsilon)
    # The target already met at the lower end of a search (RDP's range, or the PLD bracket
    # below the RDP answer): the σ returned is that end, not the smallest σ that meets it.
    at_low = rdp.at_lower_bound | (ok & found & res.at_low)
    return CalibrationResult(sigma, eps, at_low)
