r"""Inverting PNSGD's (ε, δ) bounds per position: the contraction bound on a shared grid, μ-GDP by Newton.

Split out of ``_pnsgd.py`` (the analyses per record position): these are the two
inversions :func:`~jaxdp.accounting.pnsgd_privacy` runs per position, each certified by an
exact evaluation at the returned ε and differentiable by the implicit function theorem.
Both run in one loop (:func:`_contraction_gdp_eps`), so the compiled program holds one
traced copy of the exact bound θ for the two.
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

    It does not depend on the number of positions; inside the inversion's program (where
    :func:`_contraction_gdp_eps` calls it) it is inlined.
    """
    eps_hi = _eps_bracket(jnp.max(r_first2), log_t)
    grid = jnp.linspace(0.0, 1.0, _GRID) * eps_hi
    r3 = jnp.concatenate([r_first2, rc[None]])
    tab, dtab = _log_theta_slope(grid[None, :], r3[:, None])
    return grid, tab, dtab


def _grid_candidates(r_first2, rc, later, sel, log_t):
    r"""The contraction bound's Hermite candidate per position, from the shared grid.

    log δ(ε) = log θ(ε, r_first2[sel]) + later·log θ(ε, rc) ≤ log_t. The run parameters are
    scalars, so only the exponent ``later`` (and, for a last smaller batch, which of the two
    first-step ratios applies) varies with the position. Both log θ curves are tabulated
    once with their ε-derivatives on a grid of ``_GRID`` points over the certified bracket
    [0, ε_hi]. Each position finds its grid cell by binary search (h is decreasing) and the
    root of the cubic Hermite interpolant in that cell; the candidate is that root plus a
    tiny margin (certified later by one exact evaluation, see :func:`_contraction_gdp_eps`).
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
    # The candidate's Hermite slope (for the tightness test and the implicit gradient only).
    t = t_hi
    dg = ((6 * t * t - 6 * t) * h0s + (3 * t * t - 4 * t + 1) * d0 + (-6 * t * t + 6 * t) * h1s
          + (3 * t * t - 2 * t) * d1) / jnp.where(w > 0, w, 1.0)
    x0 = sg(e0 + t_hi * w)
    cand = sg(jnp.minimum(x0 + _MARGIN_REL * x0 + _MARGIN_ABS, e1))
    return dict(at_zero=at_zero, e0=sg(e0), e1=sg(e1), x0=x0, cand=cand, dg=dg, has_later=has_later, k_s=k_s)


def _contraction_gdp_eps(r_first2, rc, later, sel, log_t, mu):
    r"""(ε of the contraction bound, ε of μ-GDP) per position, certified; one traced copy of θ.

    **Contraction** (log δ(ε) = log θ(ε, r_first2[sel]) + later·log θ(ε, rc) ≤ log_t): the
    Hermite candidate of :func:`_grid_candidates`, plus a tiny margin, is certified with one
    exact evaluation; if the check fails, the upper end of its grid cell (certified by its
    exact tabulated value) is returned. The Hermite root can be far off where log θ bends
    sharply inside one cell (e.g. a large first ratio with several passes stretches the
    grid); positions whose candidate is not certified or farther from the root than
    ``_TIGHT_REL`` are then polished by safeguarded Newton steps on the exact bound, kept
    inside the bracket [lo, hi] (h(lo) > 0 ≥ h(hi); a step leaving it is a bisection), which
    makes the result exact to float64 precision. Pass 0 checks the candidate and decides
    which positions are loose; only if any is, passes 1.._NEWTON_ITERS polish the whole
    batch from the Hermite guess and pass _NEWTON_ITERS + 1 evaluates the new candidate
    (the old one where the Hermite root was tight); later passes leave it as it is.

    **μ-GDP** (:math:`\log θ_{e^ε}(μ) ≤ \log δ`): safeguarded Newton on the exact log θ
    inside the certified bracket [0, μ√(2 log(1/δ)) + μ²/2] (:func:`_eps_bracket`): a step
    leaving the bracket is a bisection, and the bracket's upper end only ever moves to
    points where the bound holds. Pass 0 evaluates at ε = 0 (whether ε = 0 already meets the
    target); passes 1.._GDP_NEWTON_ITERS are the Newton steps; pass _GDP_NEWTON_ITERS + 1
    evaluates the candidate (the iterate plus a relative margin of 1e-12, inside the
    bracket) and keeps the bracket's certified end (the candidate where it is certified);
    the final pass evaluates at that end, for the slope and μ-derivative of the implicit
    derivative.

    Both run in one loop of _GDP_NEWTON_ITERS + 3 passes, each one evaluation of θ at the
    positions' three ratios (r_first2[sel], rc, μ): one compiled copy of the exact bound
    for both analyses (compile time grows with every traced copy). Gradients of both come
    from the implicit function theorem at the returned ε.
    """
    sg = jax.lax.stop_gradient
    lt_s = sg(_safe_target(log_t))
    c = _grid_candidates(r_first2, rc, later, sel, log_t)
    at_zero_c, cand, x0, e1, has_later, k_s = c["at_zero"], c["cand"], c["x0"], c["e1"], c["has_later"], c["k_s"]
    dg_c = c["dg"]
    dg_s = jnp.where(dg_c < 0, sg(dg_c), -1.0)
    slope_ok = sg(dg_c) < 0
    # A select, not r_first2[sel]: a gather's transpose breaks reverse mode with x64 off.
    r_sel = jnp.where(sel == 1, r_first2[1], r_first2[0])
    mu = jnp.broadcast_to(mu, r_sel.shape)
    mu_s = sg(mu)
    hi0 = sg(_eps_bracket(mu_s, log_t))
    last_pass = _NEWTON_ITERS + 1
    check, final = _GDP_NEWTON_ITERS + 1, _GDP_NEWTON_ITERS + 2
    rc_b = sg(jnp.broadcast_to(rc, r_sel.shape))
    r_sel_s = sg(r_sel)

    def body(state):
        s, c_slots, c_done, (x, lo_x, hi_x, loose, outs_c), (xg, lo_g, hi_g, at_zero_g, outs_g), kept = state
        # Slots 2p and 2p + 1 are the contraction's pass p (θ at r_first then at rc, one ratio
        # per slot); after its last pass, slots c_slots + i are the GDP's passes i.
        in_c = ~c_done
        p, half = s // 2, s % 2
        first, last = p == 0, p == last_pass
        fin = jnp.where(loose, jnp.minimum(x + _MARGIN_REL * x + _MARGIN_ABS, hi_x), cand)
        xe = jnp.where(first, cand, jnp.where(last, fin, x))
        i = s - c_slots
        g_first, g_last = i == check, i == final
        xg_e = jnp.where(i == 0, 0.0, jnp.where(g_first, jnp.minimum(xg + _MARGIN_REL * xg + _MARGIN_ABS, hi_g),
                                                jnp.where(g_last, hi_g, xg)))
        lt, d_e, d_r = _theta_partials(jnp.where(in_c, xe, xg_e),
                                       jnp.where(in_c, jnp.where(half == 0, r_sel_s, rc_b), mu_s))
        # Contraction, second slot of a pass: (log δ(xe), ∂_ε log δ, ∂_r1, ∂_rc) of the exact bound.
        lt0, de0, dr0 = kept
        v = lt0 + jnp.where(has_later, k_s * lt, 0.0)
        dv = de0 + jnp.where(has_later, k_s * d_e, 0.0)
        p1, pc = dr0, jnp.where(has_later, k_s * d_r, 0.0)
        h = v - lt_s
        pos_h = h > 0
        lo_n = jnp.where(pos_h, xe, lo_x)
        hi_n = jnp.where(pos_h, hi_x, xe)
        step = jnp.where(jnp.isfinite(dv) & (dv < 0) & jnp.isfinite(h), h / jnp.where(dv < 0, dv, -1.0), jnp.nan)
        nxt = xe - step
        inside = (nxt > lo_n) & (nxt < hi_n)
        nxt = jnp.where(inside, nxt, 0.5 * (lo_n + hi_n))
        dist = jnp.abs((v - lt_s) / dg_s)
        loose0 = (~at_zero_c) & ((~(v <= lt_s)) | ~slope_ok | ~(dist <= _TIGHT_REL * cand + _MARGIN_ABS))
        keep = first | last
        new_c = (jnp.where(first, x, jnp.where(last, xe, nxt)), jnp.where(keep, lo_x, lo_n),
                 jnp.where(keep, hi_x, hi_n), jnp.where(first, loose0, loose), (xe, v, dv, p1, pc))
        upd_c = in_c & (half == 1)
        state_c = jax.tree_util.tree_map(lambda n_, o_: jnp.where(upd_c, n_, o_), new_c, state[3])
        # The contraction goes on to pass p + 1 only if p < last_pass and a position is loose.
        ends = upd_c & ~((p + 1 <= last_pass) & jnp.any(state_c[3]))
        # μ-GDP pass i.
        hg = lt - lt_s
        above = hg > 0
        lo_gn = jnp.where(above, xg_e, lo_g)
        hi_gn = jnp.where(g_first, jnp.where(hg <= 0, xg_e, hi_g), jnp.where(above, hi_g, xg_e))
        ok = jnp.isfinite(hg) & jnp.isfinite(d_e) & (d_e < 0)
        nxt_g = xg_e - jnp.where(ok, hg / jnp.where(ok, d_e, -1.0), jnp.nan)
        inside_g = (nxt_g > lo_gn) & (nxt_g < hi_gn)
        nxt_g = jnp.where(inside_g, nxt_g, 0.5 * (lo_gn + hi_gn))
        keep_g = (i == 0) | g_last
        new_g = (jnp.where(keep_g, xg, nxt_g), jnp.where(keep_g, lo_g, lo_gn), jnp.where(keep_g, hi_g, hi_gn),
                 jnp.where(i == 0, hg <= 0, at_zero_g), (lt, d_e, d_r))
        state_g = jax.tree_util.tree_map(lambda n_, o_: jnp.where(in_c, o_, n_), new_g, state[4])
        kept = jax.tree_util.tree_map(lambda n_, o_: jnp.where(in_c & (half == 0), n_, o_), (lt, d_e, d_r), kept)
        return s + 1, jnp.where(ends, s + 1, c_slots), c_done | ends, state_c, state_g, kept

    def more(state):
        s, c_slots, c_done = state[:3]
        return ~c_done | (s - c_slots <= final)

    zero = jnp.zeros_like(x0)
    init_c = (x0, c["e0"], e1, jnp.zeros(x0.shape, bool), (zero,) * 5)
    init_g = (hi0, zero, hi0, jnp.zeros(hi0.shape, bool), (zero,) * 3)
    *_, (_, _, hi_n, loose, (cand, v_c, dv2, p1, pc)), (_, _, eps_g, at_zero_g, (lt_g, dg_g, d_rg)), _ = (
        jax.lax.while_loop(more, body, (jnp.int32(0), jnp.int32(0), jnp.bool_(False), init_c, init_g, (zero,) * 3)))

    # Contraction: the certified candidate (or its cell's end), with the implicit gradient.
    polished = jnp.any(loose)  # the polishing passes ran
    certified = v_c <= lt_s
    dg = jnp.where(polished & loose, dv2, dg_c)
    e1 = jnp.where(polished & loose, hi_n, e1)
    eps0 = sg(jnp.where(at_zero_c, 0.0, jnp.where(certified, cand, e1)))
    # g = log δ(cand) − log δ_t with its tangent in (r_sel, rc, log δ_t) at the candidate.
    g = v_c - log_t + (_tangent(r_sel, p1) + _tangent(jnp.broadcast_to(rc, r_sel.shape), pc))
    eps_c = _ift(eps0, g, sg(dg), at_zero_c)
    # μ-GDP: dε = -(∂_μ log θ dμ - d log δ)/∂_ε log θ at the bracket's certified end.
    eps0_g = sg(jnp.where(at_zero_g, 0.0, eps_g))
    return eps_c, _ift(eps0_g, lt_g - log_t + _tangent(mu, d_rg), dg_g, at_zero_g)


def _ift(eps0, g, dg, at_zero):
    """eps0 with the implicit tangent −dg⁻¹·(tangent of g) where it is defined."""
    use = (~at_zero) & jnp.isfinite(dg) & (dg < 0) & jnp.isfinite(g)
    corr = (jnp.where(use, g, 0.0) - jax.lax.stop_gradient(jnp.where(use, g, 0.0))) / jnp.where(use, dg, -1.0)
    return eps0 - jnp.where(use, corr, 0.0)
