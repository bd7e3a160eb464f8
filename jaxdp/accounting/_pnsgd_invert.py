r"""Inverting PNSGD's (ε, δ) bounds per position: the contraction bound on a shared grid, μ-GDP by Newton.

Split out of ``_pnsgd.py`` (the analyses per record position): these are the two
inversions :func:`~jaxdp.accounting.pnsgd_privacy` runs per position, each certified by an
exact evaluation at the returned ε and differentiable by the implicit function theorem.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._numerics import one_output
from .._program_cache import persistent
from ._contraction import _eps_bracket, _safe_target
from ._hockey_stick import _LOG_SQRT_2PI, _log_theta_impl, _log_theta_slope

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
    return one_output(lt, d_eps, d_r)


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

    # Common path: the Hermite root plus a margin, certified by one exact evaluation, and
    # its Hermite slope (for the tightness test and the implicit gradient only).
    t = t_hi
    dg = ((6 * t * t - 6 * t) * h0s + (3 * t * t - 4 * t + 1) * d0 + (-6 * t * t + 6 * t) * h1s
          + (3 * t * t - 2 * t) * d1) / jnp.where(w > 0, w, 1.0)
    x0 = sg(e0 + t_hi * w)
    cand = sg(jnp.minimum(x0 + _MARGIN_REL * x0 + _MARGIN_ABS, e1))
    e1 = sg(e1)
    dg_s = jnp.where(dg < 0, sg(dg), -1.0)
    slope_ok = sg(dg) < 0

    # The Hermite root can be far off where log θ bends sharply inside one cell (e.g. a
    # large first ratio with several passes stretches the grid). Safeguarded Newton on
    # the exact bound, kept inside the bracket [lo, hi] (h(lo) > 0 ≥ h(hi)), makes the
    # result exact to float64 precision; a step leaving the bracket is a bisection.
    # One loop holds the only traced copy of the exact bound: pass 0 checks the Hermite
    # candidate and decides which positions are loose (not certified, or farther from the
    # root than the tolerance); only if any is, passes 1.._NEWTON_ITERS polish the whole
    # batch from the Hermite guess and the last pass evaluates the new candidate (the old
    # one where the Hermite root was tight).
    last_pass = _NEWTON_ITERS + 1

    def body(state):
        i, x, lo_x, hi_x, loose, _ = state
        first, last = i == 0, i == last_pass
        fin = jnp.where(loose, jnp.minimum(x + _MARGIN_REL * x + _MARGIN_ABS, hi_x), cand)
        xe = jnp.where(first, cand, jnp.where(last, fin, x))
        v, dv, p1, pc = exact(xe)
        h = v - lt_s
        pos_h = h > 0
        lo_n = jnp.where(pos_h, xe, lo_x)
        hi_n = jnp.where(pos_h, hi_x, xe)
        step = jnp.where(jnp.isfinite(dv) & (dv < 0) & jnp.isfinite(h), h / jnp.where(dv < 0, dv, -1.0), jnp.nan)
        nxt = xe - step
        inside = (nxt > lo_n) & (nxt < hi_n)
        nxt = jnp.where(inside, nxt, 0.5 * (lo_n + hi_n))
        dist = jnp.abs((v - lt_s) / dg_s)
        loose0 = (~at_zero) & ((~(v <= lt_s)) | ~slope_ok | ~(dist <= _TIGHT_REL * cand + _MARGIN_ABS))
        keep = first | last
        return (i + 1, jnp.where(first, x, jnp.where(last, xe, nxt)), jnp.where(keep, lo_x, lo_n),
                jnp.where(keep, hi_x, hi_n), jnp.where(first, loose0, loose), (xe, v, dv, p1, pc))

    def more(state):
        i, loose = state[0], state[4]
        return (i == 0) | ((i <= last_pass) & jnp.any(loose))

    zero = jnp.zeros_like(x0)
    n_pass, _, _, hi_n, loose, (cand, v_c, dv2, p1, pc) = jax.lax.while_loop(
        more, body, (jnp.int32(0), x0, sg(e0), e1, jnp.zeros(x0.shape, bool), (zero,) * 5))
    polished = n_pass > 1
    certified = v_c <= lt_s
    dg = jnp.where(polished & loose, dv2, dg)
    e1 = jnp.where(polished & loose, hi_n, e1)
    eps0 = sg(jnp.where(at_zero, 0.0, jnp.where(certified, cand, e1)))
    # g = log δ(cand) − log δ_t with its tangent in (r_sel, rc, log δ_t) at the candidate.
    g = v_c - log_t + (_tangent(r_sel, p1) + _tangent(jnp.broadcast_to(rc, r_sel.shape), pc))
    dg = sg(dg)
    use = (~at_zero) & jnp.isfinite(dg) & (dg < 0) & jnp.isfinite(g)
    corr = (jnp.where(use, g, 0.0) - sg(jnp.where(use, g, 0.0))) / jnp.where(use, dg, -1.0)
    return eps0 - jnp.where(use, corr, 0.0)


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

    # One loop holds the only traced copy of θ. Pass 0 evaluates at ε = 0 (whether ε = 0
    # already meets the target) and leaves the state as it is; passes 1.._GDP_NEWTON_ITERS
    # are the Newton steps; pass _GDP_NEWTON_ITERS + 1 evaluates the candidate (the iterate
    # plus a margin, inside the bracket) and keeps the bracket's certified end: hi becomes
    # the candidate where it is certified; the final pass evaluates at that end ε, for the
    # slope and μ-derivative of the implicit derivative
    # dε = -(∂_μ log θ dμ - d log δ)/∂_ε log θ.
    check, final = _GDP_NEWTON_ITERS + 1, _GDP_NEWTON_ITERS + 2

    def newton(i, state):
        x, lo, hi, at_zero, partials = state
        first, last = i == check, i == final
        xe = jnp.where(i == 0, 0.0, jnp.where(first, jnp.minimum(x + _MARGIN_REL * x + _MARGIN_ABS, hi),
                                              jnp.where(last, hi, x)))
        lt, dh, dr = _theta_partials(xe, mu_s)
        h = lt - lt_s
        above = h > 0
        lo_n = jnp.where(above, xe, lo)
        hi_n = jnp.where(first, jnp.where(h <= 0, xe, hi), jnp.where(above, hi, xe))
        ok = jnp.isfinite(h) & jnp.isfinite(dh) & (dh < 0)
        nxt = xe - jnp.where(ok, h / jnp.where(ok, dh, -1.0), jnp.nan)
        inside = (nxt > lo_n) & (nxt < hi_n)
        nxt = jnp.where(inside, nxt, 0.5 * (lo_n + hi_n))
        keep = (i == 0) | last
        return (jnp.where(keep, x, nxt), jnp.where(keep, lo, lo_n), jnp.where(keep, hi, hi_n),
                jnp.where(i == 0, h <= 0, at_zero), (lt, dh, dr))

    zero = jnp.zeros_like(hi0)
    _, _, eps_c, at_zero, (lt_c, dg, d_r) = jax.lax.fori_loop(
        0, final + 1, newton, (hi0, zero, hi0, jnp.zeros(hi0.shape, bool), (zero,) * 3))
    eps0 = sg(jnp.where(at_zero, 0.0, eps_c))
    g = lt_c - log_t + _tangent(mu, d_r)
    use = (~at_zero) & jnp.isfinite(dg) & (dg < 0) & jnp.isfinite(g)
    corr = (jnp.where(use, g, 0.0) - sg(jnp.where(use, g, 0.0))) / jnp.where(use, dg, -1.0)
    return eps0 - jnp.where(use, corr, 0.0)
