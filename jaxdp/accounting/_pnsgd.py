r"""Per-record privacy of projected noisy SGD with hidden iterates: every analysis at once.

:func:`pnsgd_privacy` returns, for each record position i = 1..n, the ε (for a target δ)
given by the contraction-coefficient analysis (Asoodeh et al.), the amplification-by-
iteration analysis (Feldman et al.), its strongly convex refinement (Balle et al.), the
shifted-interpolation GDP analysis (Bok et al.), the composition baseline that releases
every iterate, and the best (smallest) of them.
:func:`calibrate_pnsgd_noise_std` finds the smallest noise meeting a target (ε, δ).
"""

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
from .._validate import check_integer, check_learning_rate, check_positions, is_int, learning_rate_valid, nan_unless
from ._contraction import (
    _SAFETY_REL,
    _batch_geometry,
    _eps_bracket,
    _log_delta_from,
    _pnsgd_setup,
    _safe_target,
    _solve_eps,
)
from ._hockey_stick import _LOG_SQRT_2PI, _log_theta_and_complement, _log_theta_impl, _log_theta_slope
from ._iteration import _linear_eps_masked, _pabi_coefficient, _sc_coefficient
from ._shifted import _log_contraction, _shifted_energy
from ._solve import implicit_root, search_decreasing

__all__ = ["PNSGDPrivacy", "pnsgd_privacy", "calibrate_pnsgd_noise_std"]

_ANALYSES = ("best", "contraction", "iteration", "strongly_convex", "shifted_gdp", "composition")
_SC_FORMS = ("proposition1", "shifted")
# Shared-grid inversion of the contraction bound (see _contraction_eps_grid): 2^15 + 1
# points, so the binary search takes 15 steps; the Hermite root is refined by 50 halvings
# of its cell; the candidate gets a relative margin of 1e-12 before its exact check.
_GRID = 2**15 + 1
_SEARCH_ITERS = 15
_REFINE_ITERS = 50
# Safeguarded Newton steps on the exact bound after the Hermite guess (see _contraction_eps_grid).
_NEWTON_ITERS = 6
# A Hermite candidate is accepted when its estimated distance to the root is below this
# (relative); otherwise the whole batch is polished by Newton steps.
_TIGHT_REL = 1e-10
_MARGIN_REL = 1e-12
_MARGIN_ABS = 1e-15
# Safeguarded Newton steps inverting the exact GDP δ(ε) (see _gdp_eps): quadratic
# convergence from the bracket's end; 16 steps reach float64 precision in every case tested
# (a step that would leave the bracket bisects it instead).
_GDP_NEWTON_ITERS = 16
# Bisection on log σ: the bracket spans 60 octaves and is halved 64 times.
_SIGMA_OCTAVES_BELOW = 40.0
_SIGMA_OCTAVES_ABOVE = 20.0
_SIGMA_ITERS = 64


class PNSGDPrivacy(NamedTuple):
    """ε per record position for each analysis (float64 arrays of the positions' shape).

    Attributes:
      positions: the 1-based record positions i.
      contraction: Theorem 4 of Asoodeh et al. (with the mini-batch / multi-pass extensions).
      iteration: Theorem 23 of Feldman et al. (with extensions), improved RDP conversion.
      strongly_convex: Balle et al. as quoted in Proposition 1 of Asoodeh et al.,
        improved RDP conversion (+inf for several passes: not derived).
      composition: every iterate released (no amplification): the exact ε of the
        composition of the record's k Gaussian steps.
      best: the element-wise minimum of the five (a minimum of valid bounds is valid).
      shifted_gdp: Bok, Su & Altschuler's shifted interpolation: the record is μ-GDP
        (:func:`pnsgd_shifted_gdp`), converted exactly (any number of passes, convex or
        strongly convex, with the start at the diameter when that is better).
    """

    positions: jax.Array
    contraction: jax.Array
    iteration: jax.Array
    strongly_convex: jax.Array
    composition: jax.Array
    best: jax.Array
    shifted_gdp: jax.Array


def _validate_run(lipschitz, smoothness, learning_rate, noise_std, diameter, strong_convexity, batch_size, passes) -> None:
    _validate.check_in_range("lipschitz", lipschitz, 0.0, math.inf)
    _validate.check_in_range("noise_std", noise_std, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("diameter", diameter, 0.0, math.inf, lo_open=True)
    check_learning_rate(learning_rate, smoothness, strong_convexity)
    check_integer("batch_size", batch_size)
    check_integer("passes", passes)


def _contraction_factor(learning_rate, smoothness, strong_convexity):
    eta, beta, rho = f64(learning_rate), f64(smoothness), f64(strong_convexity)
    valid = learning_rate_valid(eta, beta, rho)
    denom = jnp.where(valid, beta + rho, 1.0)
    m2 = jnp.maximum(1.0 - 2.0 * eta * beta * rho / denom, 0.0)
    m = jnp.where(m2 > 0, jnp.sqrt(jnp.where(m2 > 0, m2, 1.0)), 0.0)
    return valid, jnp.where(rho == 0, 1.0, m)


def _composition_r(pos, n, lip, sig, b, k):
    """r = 2L√k/(b_j σ): the record's k uses composed are one Gaussian mechanism with this ratio."""
    _, _, b_eff = _batch_geometry(pos, n, b)
    return 2.0 * lip * jnp.sqrt(k) / (b_eff * sig)


def _theta_partials(eps, r):
    """(log θ, ∂log θ/∂ε, ∂log θ/∂r) at stopped inputs, from one evaluation of θ.

    The derivatives are those of the rule of :func:`_log_theta_and_complement`
    (∂θ/∂ε = −e^ε Q(b), ∂θ/∂r = φ(a)). A solver that needs a value, its slope and its
    tangent at one point traces θ once instead of three times (compile time grows with
    every traced copy).
    """
    sg = jax.lax.stop_gradient
    eps, r = sg(eps), sg(r)
    lt, _, a, log_qb, ok = _log_theta_impl(eps, r)
    good = ok & jnp.isfinite(lt)
    lt_s = jnp.where(good, lt, 0.0)
    e_s = jnp.where(ok, eps, 0.0)
    d_eps = jnp.where(good, -jnp.exp(jnp.minimum(e_s + log_qb - lt_s, 700.0)), 0.0)
    d_r = jnp.where(good, jnp.exp(jnp.minimum(-0.5 * a * a - _LOG_SQRT_2PI - lt_s, 700.0)), 0.0)
    return lt, d_eps, d_r


def _tangent(x, d):
    """0 with the tangent d·dx (x's tangent times the partial derivative d)."""
    return jnp.where(jnp.isfinite(x), d * (x - jax.lax.stop_gradient(x)), 0.0)


@persistent("pnsgd_grid_table")
@jax.jit
def _grid_table(r_first2, rc, log_t):
    """The grid over [0, ε_hi] and log θ with its ε-slope there, at both first ratios and rc.

    A program of its own: it does not depend on the number of positions, so it is compiled
    once for every run size (and the per-position program compiles faster without it).
    """
    eps_hi = _eps_bracket(jnp.max(r_first2), log_t)
    grid = jnp.linspace(0.0, 1.0, _GRID) * eps_hi
    r3 = jnp.concatenate([r_first2, rc[None]])
    tab, dtab = _log_theta_slope(grid[None, :], r3[:, None])
    return grid, tab, dtab


def _contraction_eps_grid(r_first2, rc, later, sel, log_t):
    r"""ε per position for log δ(ε) = log θ(ε, r_first2[sel]) + later·log θ(ε, rc) ≤ log_t.

    The run parameters are scalars, so only the exponent ``later`` (and, for a last
    smaller batch, which of the two first-step ratios applies) varies with the position.
    Both log θ curves are tabulated once with their ε-derivatives on a grid of
    ``_GRID`` points over the certified bracket [0, ε_hi]. Each position then finds its
    grid cell by binary search (h is decreasing), and the root of the cubic Hermite
    interpolant in that cell. That candidate, plus a tiny margin, is certified with one
    exact evaluation; if the check fails, the upper end of the cell (certified by its
    exact tabulated value) is returned. Gradients come from the implicit function theorem
    at the candidate.
    """
    sg = jax.lax.stop_gradient
    lt_s = sg(_safe_target(log_t))
    grid, tab, dtab = _grid_table(sg(r_first2), sg(rc), sg(log_t))
    a_flat, da_flat = tab[:2].reshape(-1), dtab[:2].reshape(-1)
    b_tab, db_tab = tab[2], dtab[2]
    has_later = later > 0
    k_s = jnp.where(has_later, later, 0.0)
    base = sel * _GRID

    def h_at(idx):
        tail = jnp.where(has_later, k_s * b_tab[idx], 0.0)
        return a_flat[base + idx] + tail - lt_s

    def dh_at(idx):
        tail = jnp.where(has_later, k_s * db_tab[idx], 0.0)
        return da_flat[base + idx] + tail

    at_zero = h_at(jnp.zeros_like(sel)) <= 0

    def search(_, state):
        lo, hi = state
        mid = (lo + hi) // 2
        ok = h_at(mid) <= 0
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    lo, hi = jax.lax.fori_loop(0, _SEARCH_ITERS, search, (jnp.zeros_like(sel), jnp.full_like(sel, _GRID - 1)))
    e0, e1 = grid[lo], grid[hi]
    w = e1 - e0
    h0, h1 = h_at(lo), h_at(hi)
    d0, d1 = w * jnp.where(jnp.isfinite(dh_at(lo)), dh_at(lo), 0.0), w * jnp.where(jnp.isfinite(dh_at(hi)), dh_at(hi), 0.0)
    fin = jnp.isfinite(h0) & jnp.isfinite(h1)
    h0s, h1s = jnp.where(fin, h0, 1.0), jnp.where(fin, h1, -1.0)

    def hermite(t):
        t2, t3 = t * t, t * t * t
        return (2 * t3 - 3 * t2 + 1) * h0s + (t3 - 2 * t2 + t) * d0 + (-2 * t3 + 3 * t2) * h1s + (t3 - t2) * d1

    def refine(_, state):
        tl, th = state
        tm = 0.5 * (tl + th)
        ok = hermite(tm) <= 0
        return jnp.where(ok, tl, tm), jnp.where(ok, tm, th)

    _, t_hi = jax.lax.fori_loop(0, _REFINE_ITERS, refine, (jnp.zeros_like(e0), jnp.ones_like(e0)))
    # A select, not r_first2[sel]: a gather's transpose breaks reverse mode with x64 off.
    r_sel = jnp.where(sel == 1, r_first2[1], r_first2[0])
    r_pair = sg(jnp.stack([r_sel, jnp.broadcast_to(rc, r_sel.shape)], axis=-1))

    def exact(x):
        """(log δ(x), ∂_ε log δ(x), ∂_r1, ∂_rc) of the exact bound: one evaluation of both θ."""
        lt, d_e, d_r = _theta_partials(x[..., None], r_pair)
        tail = jnp.where(has_later, k_s * lt[..., 1], 0.0)
        dtail = jnp.where(has_later, k_s * d_e[..., 1], 0.0)
        return lt[..., 0] + tail, d_e[..., 0] + dtail, d_r[..., 0], jnp.where(has_later, k_s * d_r[..., 1], 0.0)

    # The Hermite root can be far off where log θ bends sharply inside one cell (e.g. a
    # large first ratio with several passes stretches the grid). Safeguarded Newton on
    # the exact bound, kept inside the bracket [lo, hi] (h(lo) > 0 ≥ h(hi)), makes the
    # result exact to float64 precision; a step leaving the bracket is a bisection. The
    # extra last pass only evaluates the final candidate (one traced copy of θ for both).
    def newton(i, state, final):
        x, lo_x, hi_x, _ = state
        last = i == _NEWTON_ITERS
        x = jnp.where(last, final(x, hi_x), x)
        v, dv, p1, pc = exact(x)
        h = v - lt_s
        pos_h = h > 0
        lo_n = jnp.where(pos_h, x, lo_x)
        hi_n = jnp.where(pos_h, hi_x, x)
        step = jnp.where(jnp.isfinite(dv) & (dv < 0) & jnp.isfinite(h), h / jnp.where(dv < 0, dv, -1.0), jnp.nan)
        nxt = x - step
        inside = (nxt > lo_n) & (nxt < hi_n)
        nxt = jnp.where(inside, nxt, 0.5 * (lo_n + hi_n))
        return jnp.where(last, x, nxt), jnp.where(last, lo_x, lo_n), jnp.where(last, hi_x, hi_n), (v, dv, p1, pc)

    # Common path: the Hermite root plus a margin, certified by one exact evaluation, and
    # its Hermite slope (for the tightness test and the implicit gradient only).
    t = t_hi
    dg = ((6 * t * t - 6 * t) * h0s + (3 * t * t - 4 * t + 1) * d0 + (-6 * t * t + 6 * t) * h1s
          + (3 * t * t - 2 * t) * d1) / jnp.where(w > 0, w, 1.0)
    x0 = sg(e0 + t_hi * w)
    cand = sg(jnp.minimum(x0 + _MARGIN_REL * x0 + _MARGIN_ABS, e1))
    v_c, _, p1, pc = exact(cand)
    certified = v_c <= lt_s
    # Not tight: not certified, or the Newton distance to the root exceeds the tolerance.
    dist = jnp.abs((v_c - lt_s) / jnp.where(dg < 0, sg(dg), -1.0))
    loose = (~at_zero) & ((~certified) | ~(dg < 0) | ~(dist <= _TIGHT_REL * cand + _MARGIN_ABS))

    def polish(args):
        # Safeguarded Newton on the exact bound from the Hermite guess, inside the cell; the
        # last pass evaluates the new candidate (the old one where the Hermite root was tight).
        def final(x_n, hi_n):
            return jnp.where(loose, jnp.minimum(x_n + _MARGIN_REL * x_n + _MARGIN_ABS, hi_n), cand)

        zero = jnp.zeros_like(x0)
        c2, _, hi_n, (v2, dv2, p1_2, pc_2) = jax.lax.fori_loop(
            0, _NEWTON_ITERS + 1, functools.partial(newton, final=final), (x0, sg(e0), sg(e1), (zero,) * 4))
        return c2, v2, jnp.where(loose, dv2, dg), v2 <= lt_s, jnp.where(loose, hi_n, e1), p1_2, pc_2

    cand, v_c, dg, certified, e1, p1, pc = jax.lax.cond(
        jnp.any(loose), polish, lambda args: args, (cand, v_c, dg, certified, sg(e1), p1, pc)
    )
    eps0 = sg(jnp.where(at_zero, 0.0, jnp.where(certified, cand, e1)))
    # g = log δ(cand) − log δ_t with its tangent in (r_sel, rc, log δ_t) at the candidate.
    g = v_c - log_t + (_tangent(r_sel, p1) + _tangent(jnp.broadcast_to(rc, r_sel.shape), pc))
    dg = sg(dg)
    use = (~at_zero) & jnp.isfinite(dg) & (dg < 0) & jnp.isfinite(g)
    corr = (jnp.where(use, g, 0.0) - sg(jnp.where(use, g, 0.0))) / jnp.where(use, dg, -1.0)
    return eps0 - jnp.where(use, corr, 0.0)


def _bucket(size: int) -> int:
    """The padded length for ``size`` positions, so that nearby sizes share compiled programs.

    At least 8; with P the next power of two, the next multiple of P/4 (one of 3P/4, P:
    at most 50% padding, for P ≤ 1024, where compiling dominates), or of P/16 beyond
    (at most 12.5% padding, where running dominates).
    """
    if size <= 8:
        return 8
    p = 1 << (size - 1).bit_length()
    step = p // 4 if p <= 1024 else p // 16
    return -(-size // step) * step


def _privacy_core(pos, n, lip, beta, rho, eta, sig, dia, b, k, dlt, sc_form, size=None, shape=None):
    """All analyses for scalar run parameters and a flat vector of positions.

    Several compiled programs, not one: the setup, the parts of the analyses, the minimum. XLA's
    compile time grows faster than the size of a program, so the parts compile in about
    half the time of the whole (and the composition's, which does not depend on the number
    of positions, is compiled once for all). Under a caller's ``jit`` they are inlined.
    The outputs are the first ``size`` entries reshaped to ``shape`` (default: all, flat).
    """
    st = _privacy_setup(pos, n, lip, beta, rho, eta, sig, dia, b, k, dlt)
    eps_c = _contraction_part(st["r_first2"], st["rc"], st["later"], st["sel"], st["log_t"])
    eps_i, eps_s = _rdp_part(st["pos_s"], st["n_s"], st["lip_s"], st["sig_s"], st["b_s"], st["k_s"], st["m_c"], dlt,
                             st["scal_ok"], sc_form=sc_form)
    eps_g2 = _composition_part(st["r_comp2"], st["log_t"])
    mu = _shifted_mu_part(st["pos_s"], st["n_s"], st["lip_s"], beta, rho, st["eta_s"], st["sig_s"], st["dia_s"],
                          st["b_s"], st["k_s"], st["scal_ok"])
    eps_sh = _gdp_part(mu, st["log_t"])
    size = pos.shape[0] if size is None else size
    shape = (size,) if shape is None else tuple(shape)
    return _combine(st["valid"], st["sel"], eps_c, eps_i, eps_s, eps_g2, eps_sh, size=size, shape=shape)


@persistent("pnsgd_setup")
@jax.jit
def _privacy_setup(pos, n, lip, beta, rho, eta, sig, dia, b, k, dlt):
    step_ok, m_c = _contraction_factor(eta, beta, rho)
    scal_ok = (
        step_ok
        & is_int(n)
        & (lip >= 0)
        & jnp.isfinite(lip)
        & (sig > 0)
        & jnp.isfinite(sig)
        & (dia > 0)
        & jnp.isfinite(dia)
        & is_int(b)
        & is_int(k)
        & (dlt > 0)
        & (dlt < 1)
    )
    valid = scal_ok & is_int(pos) & (pos <= n)
    sig_s = jnp.where(scal_ok, sig, 1.0)
    eta_s = jnp.where(scal_ok, eta, 1.0)
    dia_s = jnp.where(scal_ok, dia, 1.0)
    b_s = jnp.where(scal_ok, b, 1.0)
    k_s = jnp.where(scal_ok, k, 1.0)
    n_s = jnp.where(scal_ok, n, 1.0)
    lip_s = jnp.where(scal_ok, lip, 1.0)
    log_t = jnp.log(jnp.where(scal_ok, dlt, 0.5))
    pos_s = jnp.where(valid, pos, 1.0)
    # The two possible batch sizes: a full batch and the last batch.
    m = jnp.ceil(n_s / b_s)
    b_last = n_s - (m - 1.0) * b_s
    b2 = jnp.stack([b_s, b_last])
    r1 = 2.0 * lip_s / (b2 * sig_s)
    rc = m_c * dia_s / (eta_s * sig_s)
    r_first2 = jnp.where(k_s > 1, r1 + rc, r1)
    j = jnp.ceil(pos_s / b_s)
    sel = (j >= m).astype(jnp.int32)
    later = m - j
    # Composition: one Gaussian mechanism with r = 2L√k/(b_j σ); two values.
    r_comp2 = 2.0 * lip_s * jnp.sqrt(k_s) / (b2 * sig_s)
    return dict(scal_ok=scal_ok, valid=valid, sig_s=sig_s, eta_s=eta_s, dia_s=dia_s, b_s=b_s, k_s=k_s, n_s=n_s,
                lip_s=lip_s, log_t=log_t, pos_s=pos_s, m_c=m_c, rc=rc, r_first2=r_first2, sel=sel, later=later,
                r_comp2=r_comp2)


_contraction_part = persistent("pnsgd_contraction")(jax.jit(_contraction_eps_grid))


@persistent("pnsgd_rdp", static_argnames=("sc_form",))
@functools.partial(jax.jit, static_argnames=("sc_form",))
def _rdp_part(pos_s, n_s, lip_s, sig_s, b_s, k_s, m_c, dlt, scal_ok, sc_form):
    # Iteration (Feldman): valid for ρ ≥ 0 because η ≤ 2/(β+ρ) ≤ 2/β.
    v_i, c_i = _pabi_coefficient(pos_s, n_s, lip_s, sig_s, b_s, k_s)
    v_s, c_s = _sc_coefficient(pos_s, n_s, lip_s, sig_s, m_c, b_s, sc_form)
    # Both RDP coefficients converted in one call (one traced copy of the order search).
    eps_is = _linear_eps_masked(jnp.stack([c_i, c_s], -1), dlt, jnp.stack([v_i, v_s], -1) & scal_ok, "improved")
    eps_i, eps_s = eps_is[..., 0], eps_is[..., 1]
    return eps_i, jnp.where(k_s > 1, jnp.inf, eps_s)


@persistent("pnsgd_composition")
@jax.jit
def _composition_part(r_comp2, log_t):
    """The exact ε of the two possible composed Gaussian mechanisms (full and last batch)."""
    zero2 = jnp.zeros(2)
    return _solve_eps(
        lambda e, r_, lt_: _log_delta_from(e, r_, r_, zero2) - lt_,
        (r_comp2, log_t),
        zero2,
        _eps_bracket(r_comp2, log_t),
    )


# Shifted interpolation: μ-GDP per record, exact conversion δ(ε) = θ_{e^ε}(μ). Two
# programs: XLA compiles them in ~3 s apart, ~4.2 s as one.
_shifted_mu_part = persistent("pnsgd_shifted")(jax.jit(lambda *a: _shifted_mu(*a)))
_gdp_part = persistent("pnsgd_gdp")(jax.jit(lambda mu, log_t: _gdp_eps(mu, log_t)))


@persistent("pnsgd_combine", static_argnames=("size", "shape"))
@functools.partial(jax.jit, static_argnames=("size", "shape"))
def _combine(valid, sel, eps_c, eps_i, eps_s, eps_g2, eps_sh, size, shape):
    eps_g = jnp.where(sel == 1, eps_g2[1], eps_g2[0])
    best = jnp.minimum(jnp.minimum(jnp.minimum(eps_c, eps_i), jnp.minimum(eps_s, eps_g)), eps_sh)
    nan = lambda x: jnp.reshape(nan_unless(valid, x)[:size], shape)  # noqa: E731
    return nan(eps_c), nan(eps_i), nan(eps_s), nan(eps_g), nan(eps_sh), nan(best)


def _gdp_eps(mu, log_t):
    r"""Smallest ε (rounded up, certified) with :math:`\log θ_{e^ε}(μ) ≤ \log δ`: ε of μ-GDP.

    Safeguarded Newton on the exact log θ inside the certified bracket
    [0, μ√(2 log(1/δ)) + μ²/2] (:func:`_eps_bracket`): a step leaving the bracket is a
    bisection, and the bracket's upper end only ever moves to points where the bound
    holds. The final iterate plus a relative margin of 1e-12 is accepted when one exact
    evaluation certifies it, else the bracket's certified upper end is returned. About
    one tenth of the cost of a 64-step bisection per position; gradients by the implicit
    function theorem.
    """
    sg = jax.lax.stop_gradient
    lt_s = sg(_safe_target(log_t))
    mu_s = sg(mu)
    hi0 = sg(_eps_bracket(mu_s, log_t))

    # The extra last pass evaluates the candidate (the iterate plus a margin, inside the
    # bracket) and keeps the bracket's certified end: hi becomes the candidate where it is
    # certified. One traced copy of θ serves the iterations and the check.
    def newton(i, state):
        x, lo, hi = state
        last = i == _GDP_NEWTON_ITERS
        x = jnp.where(last, jnp.minimum(x + _MARGIN_REL * x + _MARGIN_ABS, hi), x)
        lt, dh, _ = _theta_partials(x, mu_s)
        h = lt - lt_s
        above = h > 0
        lo = jnp.where(above, x, lo)
        hi = jnp.where(last, jnp.where(h <= 0, x, hi), jnp.where(above, hi, x))
        ok = jnp.isfinite(h) & jnp.isfinite(dh) & (dh < 0)
        nxt = x - jnp.where(ok, h / jnp.where(ok, dh, -1.0), jnp.nan)
        inside = (nxt > lo) & (nxt < hi)
        return jnp.where(inside, nxt, 0.5 * (lo + hi)), lo, hi

    _, _, eps_c = jax.lax.fori_loop(0, _GDP_NEWTON_ITERS + 1, newton, (hi0, jnp.zeros_like(hi0), hi0))
    # One evaluation at (ε, 0): whether ε = 0 already meets the target, and the slope and
    # μ-derivative at ε for the implicit derivative dε = -(∂_μ log θ dμ - d log δ)/∂_ε log θ.
    lt2, d_e2, d_r2 = _theta_partials(jnp.stack([eps_c, jnp.zeros_like(eps_c)], -1), mu_s[..., None])
    at_zero = lt2[..., 1] - lt_s <= 0
    eps0 = sg(jnp.where(at_zero, 0.0, eps_c))
    g = lt2[..., 0] - log_t + _tangent(mu, d_r2[..., 0])
    dg = d_e2[..., 0]
    use = (~at_zero) & jnp.isfinite(dg) & (dg < 0) & jnp.isfinite(g)
    corr = (jnp.where(use, g, 0.0) - sg(jnp.where(use, g, 0.0))) / jnp.where(use, dg, -1.0)
    return eps0 - jnp.where(use, corr, 0.0)


def _shifted_mu(pos, n, lip, beta, rho, eta, sig, dia, b, k, ok):
    """μ of :func:`pnsgd_shifted_gdp` (safe stand-ins where ``ok`` is False)."""
    lc = _log_contraction(eta, jnp.where(ok, beta, 1.0), jnp.where(ok, rho, 0.0))
    shape = jnp.shape(pos)
    n, lip, eta, sig, dia, b, k, lc = (jnp.broadcast_to(x, shape) for x in (n, lip, eta, sig, dia, b, k, lc))
    energy = _shifted_energy(pos, n, lip, eta, dia, b, k, lc)
    pos_e = energy > 0
    return jnp.where(pos_e, jnp.sqrt(jnp.where(pos_e, energy, 1.0)), 0.0) / sig


@float64
def pnsgd_privacy(
    *,
    lipschitz,
    smoothness,
    learning_rate,
    noise_std,
    diameter,
    num_records,
    delta,
    strong_convexity=0.0,
    batch_size=1,
    passes=1,
    positions=None,
    strongly_convex_form: str = "proposition1",
) -> PNSGDPrivacy:
    r"""ε per record position of projected noisy SGD with hidden iterates, for every analysis.

    The run is :math:`Y ← Π_K(Y - η(\frac1b\sum_{x∈B}∇ℓ(Y, x) + Z))`, :math:`Z \sim N(0, σ^2 I)`,
    over n records in consecutive batches of b, for k passes in the same fixed order, and
    only the final iterate is released. For each position i it returns the ε at which the
    record is (ε, δ)-DP according to:

    * ``contraction``: :math:`δ = θ_{e^ε}(2L/(b_jσ))\,θ_{e^ε}(MD/(ησ))^{m-j}`
      (Asoodeh et al. Theorem 4; see :func:`pnsgd_contraction_delta` for the mini-batch and
      multi-pass extensions), inverted by bisection;
    * ``iteration``: :math:`(α, \frac{2αL^2}{b_j^2σ^2}(\frac{k-1}{m} + \frac1{m-j+1}))`-RDP
      (Feldman et al. Theorem 23 with extensions, :func:`pnsgd_iteration_rdp`);
    * ``strongly_convex``: Balle et al. as quoted in Proposition 1 of Asoodeh et al.
      (:func:`strongly_convex_iteration_rdp`; ``strongly_convex_form="shifted"`` uses our
      tighter derivation); +inf when k > 1 (not derived);
    * ``shifted_gdp``: the record is μ-GDP by shifted interpolation (Bok et al.;
      :func:`pnsgd_shifted_gdp`: the exact shift allocation with contraction
      :math:`c = \max(|1-ηρ|, |1-ηβ|)`, started at the run's start or, at distance D, at
      a later step), converted exactly: :math:`δ = θ_{e^ε}(μ)`; valid for any number of
      passes, convex or strongly convex;
    * ``composition``: every iterate released, i.e. the k Gaussian steps that use the
      record, composed exactly: :math:`δ = θ_{e^ε}(2L\sqrt k/(b_jσ))`;
    * ``best``: the minimum of the five. Each is a valid upper bound for the hidden-iterate
      run (the composition one too, by post-processing), so their minimum is valid.

    In the event algebra this run is ``PNSGD(...)``; ``epsilon(PNSGD(...), delta)`` is the
    worst record's ``best`` and ``pnsgd_record_epsilon`` the per-record vector (docs/events.md).

    RDP bounds are converted with the improved conversion optimised over continuous α
    (:func:`linear_rdp_epsilon`). The ε values are rounded up (bisection returns the
    certified end of its bracket). For the last record the best bound equals the exact
    ε of one Gaussian step (with one pass), and it never goes below it. ε is non-decreasing
    in the position (fewer later steps, less amplification) for every analysis.

    Assumptions (not checked by the library, which cannot verify convexity of a user's
    loss): for every record x, :math:`y ↦ ℓ(y, x)` is convex, L-Lipschitz, β-smooth and
    ρ-strongly convex on a compact convex set K of diameter D; the gradient noise is fresh,
    independent and isotropic Gaussian; the starting point is data-independent; only the
    final iterate is released; the order of the records is fixed in advance.

    Args:
      lipschitz: L ≥ 0.
      smoothness: β > 0.
      learning_rate: η with 0 < η ≤ 2/(β + ρ) (see :func:`step_contraction`).
      noise_std: σ > 0, noise standard deviation on the averaged gradient.
      diameter: D > 0.
      num_records: n ≥ 1, number of records (a Python int when ``positions`` is None: it fixes
        the output shape).
      delta: target δ in (0, 1).
      strong_convexity: ρ in [0, β].
      batch_size: b ≥ 1 (integer).
      passes: k ≥ 1 (integer).
      positions: record positions in 1..n (any shape); default all of 1..n.
      strongly_convex_form: ``"proposition1"`` (default, as the paper quotes Balle et al.)
        or ``"shifted"`` (static).

    Returns:
      :class:`PNSGDPrivacy` of float64 arrays shaped like ``positions``. Invalid inputs
      raise ``ValueError`` naming the parameter eagerly and give NaN under ``jit``.

    References:
      Asoodeh, Diaz, Calmon (arXiv:2001.06546), Theorems 4, Proposition 1; Feldman,
      Mironov, Talwar, Thakurta (arXiv:1808.06651), Theorems 22, 23, 35; Balle, Barthe,
      Gaboardi, Geumlek (NeurIPS 2019), Theorem 5; Bok, Su, Altschuler, "Shifted
      Interpolation for Differential Privacy" (ICML 2024), §3-4.

    Examples:
      >>> import jaxdp
      >>> out = jaxdp.accounting.pnsgd_privacy(lipschitz=1.0, smoothness=0.5, learning_rate=0.5, noise_std=2.0,
      ...                                      diameter=1.0, num_records=40, delta=1e-5)
      >>> [round(float(out.best[i]), 6) for i in (0, 38, 39)]
      [0.0, 2.754009, 4.377178]
      >>> bool(out.composition[0] == out.composition[39])
      True
    """
    _validate.check_static_choice("strongly_convex_form", strongly_convex_form, _SC_FORMS)
    _validate_run(lipschitz, smoothness, learning_rate, noise_std, diameter, strong_convexity, batch_size, passes)
    _validate.check_delta(delta)
    if positions is None:
        if not isinstance(num_records, (int, np.integer)) or isinstance(num_records, bool):
            if _validate.is_concrete(num_records) and np.ndim(num_records) == 0 and float(num_records) == int(float(num_records)):
                num_records = int(float(num_records))
            else:
                raise ValueError(
                    "num_records must be a Python int when positions is None (it fixes the output shape); "
                    f"got {num_records!r}. Pass positions explicitly to trace num_records."
                )
        check_integer("num_records", num_records)
        pos = jnp.asarray(np.arange(1, num_records + 1, dtype=np.float64))
    else:
        check_positions(positions, num_records)
        pos = f64(positions)
    _validate.check_not_above("batch_size", batch_size, "num_records", num_records)
    scalars = {}
    for name, value in (
        ("num_records", num_records),
        ("lipschitz", lipschitz),
        ("smoothness", smoothness),
        ("strong_convexity", strong_convexity),
        ("learning_rate", learning_rate),
        ("noise_std", noise_std),
        ("diameter", diameter),
        ("batch_size", batch_size),
        ("passes", passes),
        ("delta", delta),
    ):
        arr = f64(value)
        if arr.ndim != 0:
            raise ValueError(
                f"{name} must be a scalar in pnsgd_privacy (got shape {arr.shape}); use jax.vmap to "
                "evaluate several runs."
            )
        scalars[name] = arr
    shape = jnp.shape(pos)
    size = math.prod(shape)
    if _validate.is_concrete(pos):
        # Concrete positions are padded (with position 1) to a bucket size, so that runs of
        # nearby sizes reuse one compiled program; the padding is cut off in _combine.
        flat_np = np.asarray(pos, np.float64).reshape(-1)
        flat = jnp.asarray(np.concatenate([flat_np, np.ones(_bucket(size) - size)]))
    else:
        flat = jnp.reshape(pos, (-1,))
    s = scalars
    outs = _privacy_core(
        flat,
        s["num_records"],
        s["lipschitz"],
        s["smoothness"],
        s["strong_convexity"],
        s["learning_rate"],
        s["noise_std"],
        s["diameter"],
        s["batch_size"],
        s["passes"],
        s["delta"],
        sc_form=strongly_convex_form,
        size=size,
        shape=shape,
    )
    eps_c, eps_i, eps_s, eps_g, eps_sh, best = outs
    return PNSGDPrivacy(
        positions=pos,
        contraction=eps_c,
        iteration=eps_i,
        strongly_convex=eps_s,
        composition=eps_g,
        best=best,
        shifted_gdp=eps_sh,
    )


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

    Assumptions: as :func:`pnsgd_privacy` (convex, L-Lipschitz, β-smooth, ρ-strongly
    convex loss; η ≤ 2/(β+ρ); hidden intermediate iterates; fixed order).

    Args:
      epsilon: target ε > 0.
      delta: target δ in (0, 1).
      lipschitz: L > 0.
      smoothness: β > 0.
      learning_rate: η in (0, 2/(β+ρ)].
      diameter: D > 0.
      num_records: n ≥ 1.
      strong_convexity: ρ in [0, β].
      batch_size: b ≥ 1.
      passes: k ≥ 1.
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
      >>> s = jaxdp.accounting.calibrate_pnsgd_noise_std(1.0, 1e-5, lipschitz=1.0, smoothness=1.0, learning_rate=0.5,
      ...                                            diameter=1.0, num_records=1000)
      >>> round(float(s), 4)
      7.4613
    """
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
