r"""The smallest PNSGD noise σ meeting a target (ε, δ): :func:`calibrate_pnsgd_noise_std`.

Split out of ``_pnsgd.py``: a bracketed bisection on log σ over the analyses of
:func:`~jaxdp.accounting.pnsgd_privacy` (their union certifies a monotone set of σ), with
derivatives from the implicit function theorem on the binding analysis.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._deprecations import warn_old_signature
from .._numerics import f64, float64
from .._program_cache import persistent
from .._validate import check_integer, check_learning_rate, check_positions, is_int, nan_unless
from ._contraction import _SAFETY_REL, _batch_geometry, _pnsgd_setup, _safe_target
from . import _pnsgd_poisson
from ._events import PNSGD
from ._hockey_stick import _log_theta_and_complement
from ._iteration import _linear_eps_masked, _pabi_coefficient, _sc_coefficient
from ._pnsgd import _ANALYSES, _SC_FORMS, _composition_r, _contraction_factor, _shifted_mu
from ._rdp import DEFAULT_ORDERS
from ._solve import implicit_root, search_decreasing

DEFAULT_ORDERS_NP = np.asarray(DEFAULT_ORDERS, np.float64)

__all__ = ["calibrate_pnsgd_noise_std"]

# Bisection on log σ: the bracket spans 60 octaves and is halved 64 times.
_SIGMA_OCTAVES_BELOW = 40.0
_SIGMA_OCTAVES_ABOVE = 20.0
_SIGMA_ITERS = 64


def _constraints(sig, eps_t, log_dt, pos, n, lip, beta, rho, eta, dia, b, k, analysis, sc_form, with_h=True):
    """Per analysis: (certified at σ, h(σ)) with h ≤ 0 the plain constraint, decreasing in σ.

    The certification applies the safety margins (log target lowered by 1e-12 relative, ε
    target by 1e-12); h, used only for derivatives, does not (``with_h=False``: h is not
    computed, and is None). Every θ the analyses need (at the safe and, with h, the plain
    target) is evaluated in one stacked call, and both RDP coefficients are converted in
    one call: one traced copy of each (compile time grows with every copy).
    """
    _, m_c = _contraction_factor(eta, beta, rho)
    _, r_first, rc, later = _pnsgd_setup(pos, n, lip, sig, eta, dia, m_c, b, k)
    dt = jnp.exp(log_dt)
    safe_log_dt = _safe_target(log_dt)
    safe_eps_t = eps_t * (1.0 - _SAFETY_REL)  # RDP-based ε must beat the target with margin too
    use = {a: analysis in ("best", a) for a in ("contraction", "iteration", "strongly_convex", "shifted_gdp", "composition")}
    # θ columns: contraction (r_first, rc), shifted (μ), composition (2L√k/(b_j σ)).
    ratios = []
    if use["contraction"]:
        ratios += [r_first, rc]
    if use["shifted_gdp"]:
        ratios.append(_shifted_mu(pos, n, lip, beta, rho, eta, sig, dia, b, k, jnp.ones(jnp.shape(pos), bool)))
    if use["composition"]:
        ratios.append(_composition_r(pos, n, lip, sig, b, k))
    lt = {}
    if ratios:
        shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in ratios + [eps_t]))
        rr = jnp.stack([jnp.broadcast_to(x, shape) for x in ratios], -1)
        ee = jnp.stack([jnp.broadcast_to(x, shape) for x in ((safe_eps_t, eps_t) if with_h else (safe_eps_t,))], -1)
        ee, rr = jnp.broadcast_arrays(ee[..., :, None], rr[..., None, :])
        theta, _ = _log_theta_and_complement(ee, rr)
        for which, i in (("safe", 0), ("plain", 1)) if with_h else (("safe", 0),):
            cols = iter(range(len(ratios)))
            if use["contraction"]:
                lt[which, "contraction"] = (theta[..., i, next(cols)], theta[..., i, next(cols)])
            if use["shifted_gdp"]:
                lt[which, "shifted_gdp"] = theta[..., i, next(cols)]
            if use["composition"]:
                lt[which, "composition"] = theta[..., i, next(cols)]
    coef = []
    if use["iteration"]:
        coef.append(_pabi_coefficient(pos, n, lip, sig, b, k))
    if use["strongly_convex"]:
        coef.append(_sc_coefficient(pos, n, lip, sig, m_c, b, sc_form))
    if coef:
        shape = jnp.broadcast_shapes(*(jnp.shape(x) for vc in coef for x in vc), jnp.shape(dt))
        e_all = _linear_eps_masked(jnp.stack([jnp.broadcast_to(c, shape) for _, c in coef], -1), dt[..., None],
                                   jnp.stack([jnp.broadcast_to(v, shape) for v, _ in coef], -1), "improved")
        e_lin = iter([e_all[..., i] for i in range(len(coef))])

    def delta_of(t1, tc):  # log δ of the contraction bound from its two log θ (as _log_delta_from)
        has_later = later > 0
        return t1 + jnp.where(has_later, later * jnp.where(has_later, tc, 0.0), 0.0)

    def plain(key, fn):
        return fn(lt["plain", key]) - log_dt if with_h else None

    out = {}
    if use["contraction"]:
        out["contraction"] = (delta_of(*lt["safe", "contraction"]) <= safe_log_dt,
                              plain("contraction", lambda v: delta_of(*v)))
    if use["iteration"]:
        e = next(e_lin)
        out["iteration"] = (e <= safe_eps_t, e - eps_t)
    if use["strongly_convex"]:
        e = next(e_lin)
        out["strongly_convex"] = ((e <= safe_eps_t) & (k <= 1), e - eps_t)
    if use["shifted_gdp"]:
        out["shifted_gdp"] = (lt["safe", "shifted_gdp"] <= safe_log_dt, plain("shifted_gdp", lambda v: v))
    if use["composition"]:
        out["composition"] = (lt["safe", "composition"] <= safe_log_dt, plain("composition", lambda v: v))
    return out


def _feasible(log_sig, eps_t, log_dt, pos, n, lip, beta, rho, eta, dia, b, k, analysis, sc_form):
    """Whether the analysis certifies (ε_t, δ_t) at σ = exp(log_sig) (monotone in σ)."""
    out = _constraints(jnp.exp(log_sig), eps_t, log_dt, pos, n, lip, beta, rho, eta, dia, b, k, analysis, sc_form,
                       with_h=False)
    ok = None
    for v, _ in out.values():
        ok = v if ok is None else (ok | v)
    return ok


@float64
def calibrate_pnsgd_noise_std(
    epsilon,
    delta,
    event: PNSGD | None = None,
    *,
    positions=None,
    analysis: str = "best",
    strongly_convex_form: str = "proposition1",
    **old_keywords,
) -> jax.Array:
    r"""Smallest noise σ such that PNSGD meets (ε, δ) for every record (or for given positions).

    Each analysis of :func:`pnsgd_privacy` certifies (ε, δ) on a set of σ that is an
    interval :math:`[σ^*, ∞)` (δ(ε) decreases and the RDP coefficient decreases as σ
    grows), and so does their union (``analysis="best"``). σ* is found by bisection on
    log σ with a fixed number of iterations (64 halvings of a 60-octave bracket whose upper
    end is :math:`2^{20}` times the σ at which the composition baseline is certified), and
    the upper (certified) end is returned. +inf when no σ in the bracket works.

    ``positions=None`` calibrates the worst record, which is the last one: every
    analysis's ε is non-decreasing in the position (fewer later steps), so meeting the
    target at i = n meets it for all records. With one pass, the best bound at i = n is
    the exact one-step Gaussian mechanism, so σ* is then the analytic Gaussian calibration
    for sensitivity 2L/b_n.

    Derivatives of σ* with respect to ε, δ and the run's constants come from the implicit
    function theorem on the analysis that binds at σ* (the first certified one):
    :math:`dσ^* = -∂h\cdot d(\ldots)/∂_σ h` with h its constraint (log δ(ε) − log δ, or
    ε(σ) − ε).

    An event with ``sampling="poisson"`` or ``"shuffle"`` is calibrated on its own bound (every record alike,
    ``analysis="best"`` or ``"composition"``): eagerly, on geometric grids of σ, returning a
    σ at which ε was evaluated and met the target (values only; traced inputs raise).

    Assumptions: as :func:`pnsgd_privacy` (convex, L-Lipschitz, β-smooth, ρ-strongly
    convex loss; η ≤ 2/(β+ρ); hidden intermediate iterates; fixed order).

    Args:
      epsilon: target ε > 0.
      delta: target δ in (0, 1).
      event: the run's record, a :class:`~jaxdp.accounting.PNSGD` event with
        ``schedule="fixed"``: L > 0, β > 0, η in (0, 2/(β+ρ)], D > 0, ρ in [0, β], n ≥ 1,
        b ≥ 1, k ≥ 1. Its ``noise_std`` is what is solved for and is not read (give any
        positive value); ``event.hidden=False`` allows ``analysis="composition"`` only (the
        default ``"best"`` then means composition). The old keyword form
        ``calibrate_pnsgd_noise_std(epsilon, delta, lipschitz=..., ...)`` still answers for
        one release, with a ``DeprecationWarning``.
      positions: ``None`` (all records: the worst, i = n) or positions in 1..n (any shape;
        σ per position).
      analysis: ``"best"`` (default), ``"contraction"``, ``"iteration"``,
        ``"strongly_convex"``, ``"shifted_gdp"`` or ``"composition"`` (static).
      strongly_convex_form: ``"proposition1"`` or ``"shifted"`` (static).

    Returns:
      σ > 0, float64 (NaN under ``jit`` for invalid inputs).

    References:
      As :func:`pnsgd_privacy`; the calibration itself is not in the papers.

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> s = A.calibrate_pnsgd_noise_std(1.0, 1e-5, A.PNSGD(1.0, 1.0, 0.5, 1.0, 1.0, num_records=1000))
      >>> round(float(s), 4)
      7.4613
    """
    if not isinstance(event, PNSGD):
        if event is None and old_keywords:
            warn_old_signature(_OLD_SIGNATURE, stacklevel=_WARN_LEVEL)
            return _loose_calibrate(epsilon, delta, **old_keywords, positions=positions, analysis=analysis,
                                    strongly_convex_form=strongly_convex_form)
        raise TypeError("calibrate_pnsgd_noise_std(epsilon, delta, event) takes the run's record, a PNSGD event; got "
                        f"{type(event).__name__}.")
    if old_keywords:
        raise TypeError("calibrate_pnsgd_noise_std(epsilon, delta, event): the run's constants come from the record; "
                        f"got also {', '.join(sorted(old_keywords))}.")
    if event.sampling in ("poisson", "shuffle"):
        if analysis not in ("best", "composition") or positions is not None:
            raise ValueError(f"with sampling={event.sampling!r} every record alike: calibrate_pnsgd_noise_std takes "
                             f"analysis='best' or 'composition' and positions=None; got analysis={analysis!r}.")
        return _pnsgd_poisson.calibrate_event(epsilon, delta, event, DEFAULT_ORDERS_NP,
                                              analysis if event.hidden else "composition")
    if event.schedule != "fixed":
        raise ValueError("calibrate_pnsgd_noise_std covers schedule='fixed'; got schedule='random_stop' (calibrate "
                         "with pnsgd_privacy(event, delta) over the noise instead).")
    if not event.hidden:
        if analysis not in ("best", "composition"):
            raise ValueError(f"analysis={analysis!r} needs hidden iterates; with event.hidden=False only "
                             "'composition' holds.")
        analysis = "composition"
    return _loose_calibrate(epsilon, delta, lipschitz=event.lipschitz, smoothness=event.smoothness,
                            learning_rate=event.learning_rate, diameter=event.diameter, num_records=event.num_records,
                            strong_convexity=event.strong_convexity, batch_size=event.batch_size, passes=event.passes,
                            positions=positions, analysis=analysis, strongly_convex_form=strongly_convex_form)


_OLD_SIGNATURE = ("calibrate_pnsgd_noise_std(epsilon, delta, lipschitz=..., ...) is deprecated: pass the run's "
                  "record, calibrate_pnsgd_noise_std(epsilon, delta, PNSGD(lipschitz, smoothness, learning_rate, 1.0, "
                  "diameter, num_records=n, ...)) (its noise_std is not read); the keyword form goes in the next "
                  "release.")
_WARN_LEVEL = 4  # warn_old_signature <- calibrate_pnsgd_noise_std <- float64's wrapper <- caller


def _loose_calibrate(
    epsilon,
    delta,
    *,
    lipschitz,
    smoothness,
    learning_rate,
    diameter,
    num_records,
    strong_convexity=0.0,
    batch_size=1,
    passes=1,
    positions=None,
    analysis: str = "best",
    strongly_convex_form: str = "proposition1",
) -> jax.Array:
    """:func:`calibrate_pnsgd_noise_std` of a run given by its loose constants (the old signature)."""
    _validate.check_static_choice("analysis", analysis, _ANALYSES)
    _validate.check_static_choice("strongly_convex_form", strongly_convex_form, _SC_FORMS)
    _validate.check_in_range("epsilon", epsilon, 0.0, math.inf, lo_open=True)
    _validate.check_delta(delta)
    _validate.check_in_range("lipschitz", lipschitz, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("diameter", diameter, 0.0, math.inf, lo_open=True)
    check_learning_rate(learning_rate, smoothness, strong_convexity)
    check_integer("batch_size", batch_size)
    check_integer("passes", passes)
    if positions is None:
        check_integer("num_records", num_records)
        positions = num_records
    else:
        check_positions(positions, num_records)
    _validate.check_not_above("batch_size", batch_size, "num_records", num_records)
    args = [
        f64(x)
        for x in (epsilon, delta, positions, num_records, lipschitz, smoothness, strong_convexity, learning_rate, diameter, batch_size, passes)
    ]
    return _calibrate_core(*args, analysis=analysis, sc_form=strongly_convex_form)


@persistent("calibrate_pnsgd_noise_std", static_argnames=("analysis", "sc_form"))
@functools.partial(jax.jit, static_argnames=("analysis", "sc_form"))
def _calibrate_core(eps_t, dlt, pos, n, lip, beta, rho, eta, dia, b, k, analysis, sc_form):
    step_ok, _ = _contraction_factor(eta, beta, rho)
    valid = (
        step_ok
        & (eps_t > 0)
        & jnp.isfinite(eps_t)
        & (dlt > 0)
        & (dlt < 1)
        & is_int(pos)
        & is_int(n)
        & (pos <= n)
        & (lip > 0)
        & jnp.isfinite(lip)
        & (dia > 0)
        & jnp.isfinite(dia)
        & is_int(b)
        & is_int(k)
    )
    shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in (eps_t, dlt, pos, n, lip, beta, rho, eta, dia, b, k)))
    eps_t, dlt, pos, n, lip, beta, rho, eta, dia, b, k, valid = (
        jnp.broadcast_to(x, shape) for x in (eps_t, dlt, pos, n, lip, beta, rho, eta, dia, b, k, valid)
    )
    # Safe stand-ins where invalid, so the search stays finite (result masked to NaN).
    eps_t = jnp.where(valid, eps_t, 1.0)
    dlt = jnp.where(valid, dlt, 0.5)
    log_dt = jnp.log(dlt)
    # Composition is certified at r* = √(2 log(1/δ) + 2ε) − √(2 log(1/δ)) (see _eps_bracket),
    # i.e. σ_comp = 2L√k/(b_min r*), for every position: the search brackets it.
    a = jnp.sqrt(2.0 * -log_dt)
    r_star = jnp.sqrt(a**2 + 2.0 * eps_t) - a
    _, m_, _ = _batch_geometry(pos, n, b)
    b_min = jnp.minimum(b, jnp.where(valid, n - (m_ - 1.0) * b, 1.0))
    b_min = jnp.where(valid & (b_min >= 1), b_min, 1.0)
    centre = jax.lax.stop_gradient(jnp.log(2.0 * jnp.where(valid, lip, 1.0) * jnp.sqrt(k) / (b_min * r_star)))
    sig = _pnsgd_solve(eps_t, log_dt, pos, n, lip, beta, rho, eta, dia, b, k, centre, analysis, sc_form)
    return nan_unless(valid, sig)


def _pnsgd_solve(eps_t, log_dt, pos, n, lip, beta, rho, eta, dia, b, k, centre, analysis, sc_form):
    """σ*: the bracketed search on log σ around ``centre`` (log σ_comp), implicit derivative.

    :func:`search_decreasing` bisects the feasibility predicate (any analysis certifies the
    target, with its safety margins) over 60 octaves in 64 halvings and returns the upper
    end (certified). Derivatives come from the implicit function theorem on the first
    analysis certified at σ* (:func:`implicit_root`): h(σ*, ε_t, ...) = 0 up to the
    bisection's width, so dσ* = −(∂h/∂(ε_t, δ, L, η, D, ...)·d(...))/(∂h/∂σ); at the
    bracket's lower end σ is constant.
    """
    args = (eps_t, log_dt, pos, n, lip, beta, rho, eta, dia, b, k)
    a_sg = jax.lax.stop_gradient(args)
    centre = jax.lax.stop_gradient(centre)
    lo0 = centre - _SIGMA_OCTAVES_BELOW * math.log(2.0)
    hi0 = centre + _SIGMA_OCTAVES_ABOVE * math.log(2.0)

    def accept(log_sig):
        return _feasible(log_sig, *a_sg, analysis, sc_form), ()

    res = search_decreasing(accept, lo0, hi0, _SIGMA_ITERS, stack_ends=False)
    sig = jnp.exp(res.x)  # the σ the search evaluated at the returned end (+inf: not found)

    def binding_h(s, *a):
        cons = _constraints(s, *a, analysis, sc_form)
        h = jnp.zeros_like(s)
        taken = jnp.zeros(s.shape, bool)
        for ok, h_a in cons.values():  # the first certified analysis, by a select
            pick = ok & ~taken
            h = jnp.where(pick, h_a, h)
            taken = taken | pick
        return jnp.where(taken, h, jnp.nan)

    sig, _ = implicit_root(binding_h, sig, jnp.zeros_like(sig), 0.0, args, res.found & ~res.at_low, res.at_low)
    return sig
