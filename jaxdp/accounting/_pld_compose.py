r"""PLD composition in the exponentially tilted domain, and the δ(ε) / ε(δ) read-outs.

:func:`compose` takes mechanisms as ``(kind, params, count)`` (see ``_pld_curves``), plans a
window and a tilt from the event and the query (:func:`_plan`), composes by FFT into a
:class:`Composed` per direction (masses on loss bins plus the mass counted at +∞) and returns
a read-out of each: :func:`delta_read` and :func:`epsilon_read` answer from it. This is the
internal API a new event's PLD calls: build its components, then ``compose(kinds, params,
counts, n, tau, estimate, query, what, stages, read)``. Where both add/remove directions are
needed, one traced body serves both (``lax.scan`` over the direction's sign, ±1; the curves
of ``_pld_curves`` take the sign), for the plan and for the upper bound's composition with
its read-out: XLA compiles each once. Proof sketch: the module docstring of ``_pld.py`` and docs/pld.md.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._numerics import at_min, f64, where
from ._pld_curves import by_direction, directions, fft_passes, lse, masses, sign_of, tilted_fft
from ._pld_stages import block_plan, blocks

_U = float(np.finfo(np.float64).eps)
# The plan's coarse pass: bins per mechanism, and the ladder of tilts θ (times 1/span).
_COARSE = 1024
_THETAS = 2.0 ** (np.arange(-6, 37) / 2.0)
# Chernoff exponents for the certified tail masses, as multiples of the tilt λ.
_THETA_FACTORS = np.array([1.0, 1.5, 2.0, 3.0])
# Mass the plan leaves to the certified tail bounds, relative to δ (the window's top, each
# mechanism's +∞ mass summed over the composition).
_ETA = 1e-4
# The window's bottom: this many tilted standard deviations below the estimated answer.
_Z_BOTTOM = 2.0
_TINY = float(np.finfo(np.float64).tiny)
# The window is at least (this - log δ)/λ wide: what the circular convolution folds up from
# below (at most e^{-λW}) stays below δ·e^{-9}.
_FOLD_LOG = 9.0
# Extensions of the window below the answer's estimate, in units of its span (the plan).
_EXTEND = np.concatenate([[0.0], 2.0 ** (np.arange(0, 47) / 4.0) - 0.75])
_EXTEND_ATOMS = np.concatenate([[0.0], 2.0 ** (np.arange(0, 24) / 2.0) - 0.75])  # (kinds with atoms)
_FOLD_LOG_LOWER = 4.6
# (The s12 plan) it widens the Chernoff plan's window at most this many times.
_MAX_WIDEN = 4.0
# Kinds whose plan minimises the estimated error (the round-off estimate assumes a smooth
# composed law); for the others (atoms: Laplace, (ε, δ)) the window is the narrowest whose
# folds are below δe^{-9} and worst-case round-off below δe^{-7} (_FOLD_LOG, the s12 plan).
_SMOOTH = ("gaussian", "sampled_gaussian")
# (Smooth kinds) the error-minimising plan is used where the estimated round-off bound per bin
# is below δe^{_ROUND_LOG}; elsewhere (for ε(δ)) the s12 plan (see _plan).
_ROUND_LOG = 3.0
# (ε(δ), upper bound, Poisson-sampled Gaussian) the fine grids end at the sharp tops (see
# _single_range) where the estimated round-off bound per bin is below δe^{-_SHARP_LOG}.
_SHARP_LOG = 4.0


class Composed(NamedTuple):
    probs: jax.Array  # (n,) masses on bins (A + j) h
    losses: jax.Array  # (n,) the bin losses
    extra: jax.Array  # mass counted as +∞ (upper: ∞-mass + tail) or subtracted (lower)
    fold: object = None  # lower bound: ε ↦ bound on the mass folded down onto losses > ε
    # upper bound: bin indices j ↦ m₂·e^{Λ-λℓ_j}·G ≥ m₂‖(w_i e^{Λ-λℓ_i})_{i≥j}‖₂ (the normwise
    # round-off read out by Cauchy–Schwarz, docs/pld.md "Round-off"), added to δ at ε ∈ (ε_{j-1}, ε_j];
    # nonincreasing in j
    l2: object = None


def _single_range(kind, params, direction, z, sharp=False):
    """Loss range [b, t] of one mechanism outside which each tail has mass ≤ Φ̄(z) (a placement).

    Gaussian (μ = 1/σ): L ~ N(μ²/2, μ²). Laplace: L ∈ [-1/b, 1/b]; (ε, δ) pair: ±ε (and
    +∞). Poisson sampling of an inner loss range [lo, hi]: remove, L = log(1 - q + q e^g)
    with g in the inner range (or below: log(1 - q) bounds it); add, L = -log(1 - q + q e^g).
    Mass below b is moved up to the grid (the chord), mass above t goes to +∞ (exactly,
    δ(top)): the range only places the grid, it certifies nothing. ``sharp`` (Poisson-sampled
    Gaussian, remove direction): under P = (1 - q)N(0, 1) + qN(μ, 1) the mass above x is
    qΦ̄(x - μ) + (1 - q)Φ̄(x), so the top x_t = max(z_q + μ, z), z_q² = z² + 2 log q, leaves
    about 2Φ̄(z) above it where x = z + μ leaves Φ̄(z): a lower top for small q (issue 27's
    q = 0.001, σ = 0.8: 3.21 → 2.06). With ``sharp`` the triple (b, t, sharp top).
    """
    return _pick(_range_pairs(kind, params, z, sharp), direction)


def _pick(pairs, direction):
    """One direction's values of :func:`_range_pairs` (a pair is (remove, add))."""
    sign = sign_of(direction)
    out = tuple(by_direction(sign, *v) if isinstance(v, tuple) else v for v in pairs)
    return out if pairs[2] is not None else out[:2]


def _range_pairs(kind, params, z, sharp=False):
    """(b, t, sharp top or None) of :func:`_single_range`, each a (remove, add) pair for the
    Poisson-sampled kinds: traced once for both directions and both tops (shared terms once)."""
    if kind == "laplace":
        inv = 1.0 / params[0]
        return -inv, inv, (inv if sharp else None)
    if kind == "approx_dp":
        return -params[0], params[0], (params[0] if sharp else None)
    if kind == "gaussian":
        mu = 1.0 / params[-1]
        t = 0.5 * mu * mu + z * mu
        return 0.5 * mu * mu - z * mu, t, (t if sharp else None)
    q = jnp.clip(params[0], 1e-300, 1.0)
    lq = jnp.log1p(-jnp.minimum(q, 1.0 - 1e-16))
    lq = where(q < 1.0, lq, -1e300)
    logq = jnp.log(q)
    if kind == "sampled_gaussian":
        mu = 1.0 / params[-1]
        b = (jnp.maximum(lq, logq - 0.5 * mu * mu - z * mu), -jnp.logaddexp(lq, logq + mu * z - 0.5 * mu * mu))
        top_rm = logq + mu * z + 0.5 * mu * mu
        t = (jnp.logaddexp(lq, top_rm), jnp.minimum(-lq, -logq + 0.5 * mu * mu + z * mu))
        t_sharp = None
        if sharp:
            # Remove direction: the mass above x is qΦ̄(x - μ) + (1 - q)Φ̄(x), so x_t =
            # max(z_q + μ, z) with z_q² = z² + 2 log q leaves about Φ̄(z) above it, as x = z + μ does.
            top_s = logq + (mu * jnp.maximum(jnp.sqrt(jnp.maximum(z * z + 2.0 * logq, 0.0)) + mu, z) - 0.5 * mu * mu)
            t_sharp = (jnp.logaddexp(lq, top_s), t[1])
        return b, t, t_sharp
    if kind == "sampled_laplace":
        lo, hi = -1.0 / params[1], 1.0 / params[1]
    else:  # sampled_approx_dp: ±ε (the point only Q charges, mass ≤ δ, is left off the grid)
        lo, hi = -params[1], params[1]
    lo_s = jnp.logaddexp(lq, logq + lo)
    hi_s = jnp.logaddexp(lq, logq + hi)
    t = (hi_s, -lo_s)
    return (lo_s, -hi_s), t, (t if sharp else None)





def _cut(o, t, h, n):
    """The grid point (o + i)h, i < n, at or just above the loss t (the grid's end)."""
    i = jnp.clip(jnp.ceil(t / h - o), 1.0, n - 1.0)
    return (o + i) * h


def _between_rungs(thetas, *mgfs):
    """The ladder θ with the geometric midpoints of its rungs, and each Λ there by its chord."""
    mid = jnp.sqrt(thetas[1:] * thetas[:-1])
    t = (mid - thetas[:-1]) / (thetas[1:] - thetas[:-1])
    out = [jnp.stack([thetas[:-1], mid], axis=1).reshape(-1)]
    for g in mgfs:
        chord = where(jnp.isfinite(g[1:]) & jnp.isfinite(g[:-1]), g[:-1] + t * (g[1:] - g[:-1]),
                          jnp.maximum(g[1:], g[:-1]))
        out.append(jnp.stack([g[:-1], chord], axis=1).reshape(-1))
    return tuple(jnp.concatenate([o, x[-1:]]) for o, x in zip(out, (thetas,) + mgfs))


def _min_and_theta(obj, thetas):
    """(min of ``obj`` over the θ ladder, the largest θ attaining it): within 8 ulps (see
    :func:`jaxdp._numerics.at_min`), and no argmin (see :func:`epsilon_read`)."""
    best = jnp.min(obj)
    return best, jnp.max(where(at_min(obj, best), thetas, 0.0))


def _plan(kinds, params, counts, direction_list, query, what, tau, n, objective=True, sharp=False):
    """The grid spacing, and per direction the tilt λ and the window's top (all estimates).

    A coarse pass (``_COARSE`` bins per mechanism) gives the discrete log moment generating
    function Λ(θ) = Σ_c k_c log Σ_i p_{c,i} e^{θ ℓ_i} on a ladder of θ. For ε(δ) the
    Chernoff point ε_ch = min_θ (Λ(θ) - log δ)/θ and its θ are the tilt's centre; the
    answer lies a little below (saddle point, ε_ch - log(λ s √(2π))/λ, s² the tilted
    variance); the window covers [answer - 2 s, Chernoff point at δ·η], extended downwards
    and tilted so as to minimise the estimated error in δ (folds, round-off and
    discretisation; see the comment at the choice). For δ(ε) the window starts just below ε. The spacing is the larger of that span and every
    mechanism's own range over n - 2 bins. With ``sharp`` (one-stage upper ε(δ) of events with
    Poisson-sampled Gaussians) each direction whose estimated round-off per bin is below
    δe^{-_SHARP_LOG} ends its sampled steps' fine grids at the sharp top of
    :func:`_single_range`: their span sets the spacing, and the window's top and the fold-down
    estimate take Λ of the coarse steps cut there (the law the fine grids compose; the
    coarse pass, its tilt and the window's bottom keep the wide ranges). Nothing here needs to be exact: the result is
    certified for any plan (see :func:`compose`); the plan only makes it tight.
    """
    ks = [where(jnp.isfinite(k) & (k >= 0), k, 0.0) for k in counts]
    k_tot = jnp.maximum(sum(ks), 1.0)
    if what == "epsilon":
        log_dt = jnp.log(jnp.clip(query, 1e-300, 1.0))
    else:
        log_dt = None
    log_tau = jnp.log(tau)

    def z_of(log_dt_):
        log_t1 = jnp.minimum(log_tau, log_dt_ + math.log(_ETA)) - jnp.log(k_tot)
        return jnp.sqrt(2.0 * jnp.maximum(-log_t1, 1.0))

    # Single ranges, with the tail mass from δ (for δ(ε) from a first guess at ε: tail_bound).
    z = z_of(log_dt) if log_dt is not None else z_of(log_tau - math.log(_ETA))
    # (Both directions' ranges and tops traced once per mechanism.)
    pairs = [_range_pairs(kd, p, z, sharp) for kd, p in zip(kinds, params)]
    ranges = {d: [_pick(pp, d)[:2] for pp in pairs] for d in direction_list}
    span_s = jnp.max(jnp.stack([t - b for d in direction_list for b, t in ranges[d]]))
    span_s = where(jnp.isfinite(span_s) & (span_s > 0), span_s, 1.0)
    # The fine grids' ranges (``sharp``: the sampled Gaussian's tighter top, see _single_range);
    # the coarse pass keeps the wider ones.
    span_f = span_s
    tops_f = {d: [t for _, t in ranges[d]] for d in direction_list}
    if sharp:
        tops_f = {d: [_pick(pp, d)[2] for pp in pairs] for d in direction_list}
        span_f = jnp.max(jnp.stack([t - b for d in direction_list for (b, _), t in zip(ranges[d], tops_f[d])]))
        span_f = where(jnp.isfinite(span_f) & (span_f > 0), jnp.minimum(span_f, span_s), span_s)
    n1 = _COARSE
    h1 = span_s / (n1 - 2)
    j1 = jnp.arange(n1, dtype=jnp.float64)
    thetas = f64(_THETAS) / span_s
    # (``objective=False``: the s12 plan, kept for the two-stage composition, whose block plan
    # was tuned on it.)
    smooth = objective and all(kd in _SMOOTH for kd in kinds)
    log_m_worst = math.log(8.0 * _U * (fft_passes(n) + 2.0) * (math.sqrt(2.0 * n) + 1.0) + 4.0 * n * _U) + jnp.log1p(k_tot)

    def per_direction(d, rng, log_dt, tops_d):
        """The plan of one direction (``d`` a string or a traced sign, ``rng`` its mechanisms' ranges)."""
        lam_mgf = jnp.zeros(thetas.shape)
        top_mgf = jnp.zeros(thetas.shape)
        neg_mgf = jnp.zeros(thetas.shape)
        parts, one_mgf = [], []
        for kd, p_, k, (b, _) in zip(kinds, params, ks, rng):
            o1 = jnp.floor(b / h1)
            grid = (o1 + j1) * h1
            p, p_inf = masses(kd, p_, grid, h1, d, "upper", _cut(o1, rng[len(parts)][1], h1, n1))
            # (Compile time only: p_inf, a δ clipped to [0, 1], is never above 1, so p is unchanged.)
            # A second consumer of the curve makes XLA keep the coarse hockey-stick values as an
            # array, as it does in compose; with none, it fused the curve into the masses' kernel
            # and re-emitted it (special functions and all) for every neighbour the masses read:
            # one kernel of 14,261 LLVM IR lines, a fifth of the program's, 18 % of its compile.
            p = where(p_inf > 1.0, jnp.nan, p)
            logp = where(p > 0, jnp.log(where(p > 0, p, 1.0)), -jnp.inf)
            pos_c = lse(logp[None, :], thetas[:, None] * grid[None, :])
            neg_c = lse(logp[None, :], -thetas[:, None] * grid[None, :])
            lam_mgf = lam_mgf + k * pos_c
            if sharp and kd == "sampled_gaussian":
                # The fine grid's step ends at its sharp top (the mass above goes to +∞).
                cut_f = _cut(o1, tops_d[len(parts)], h1, n1)
                top_mgf = top_mgf + k * lse(where(grid <= cut_f, logp, -jnp.inf)[None, :],
                                            thetas[:, None] * grid[None, :])
            elif sharp:
                top_mgf = top_mgf + k * pos_c
            neg_mgf = neg_mgf + k * neg_c
            parts.append((logp, grid, k))
            one_mgf.append((pos_c, neg_c))
        if what == "epsilon":
            obj = (lam_mgf - log_dt) / thetas
        else:
            obj = lam_mgf - thetas * query
        best, lam = _min_and_theta(obj, thetas)
        # The round-off's reference loss: the Chernoff point (above the answer), or ε itself.
        ref = best if what == "epsilon" else query
        if what == "delta":
            log_dt = jnp.minimum(best, 0.0)
        # Tilted variance at λ, and the tilted steps' 2-norms (the round-off estimate below).
        var = jnp.zeros(())
        norm_sum, young = jnp.zeros(()), jnp.ones(())
        tilted = []
        for logp, grid, k in parts:
            a = lse(logp, lam * grid)
            w = jnp.exp(where(jnp.isfinite(logp), logp + lam * grid - a, -jnp.inf))
            m = jnp.sum(w * grid)
            v1 = jnp.sum(w * (grid - m) ** 2)
            var = var + k * v1
            sq = jnp.sum(w * w)
            norm_sum = norm_sum + k * jnp.sqrt(sq)
            young = jnp.minimum(young, sq)
            tilted.append((m, v1))
        s = jnp.sqrt(jnp.maximum(var, 0.0))
        # Top: the Chernoff point at δ·η (mass above it is certified and negligible).
        top_obj = (lam_mgf - (log_dt + math.log(_ETA))) / thetas
        top, th_top = _min_and_theta(top_obj, thetas)
        top_old, th_top_old = top, th_top
        if what == "epsilon":
            centre = best - jnp.log(jnp.maximum(lam * s * math.sqrt(2.0 * math.pi), 1.0)) / lam
            bottom = centre - _Z_BOTTOM * s
        else:
            bottom = query - 2.0 * h1
            centre = bottom
        lam0 = lam

        def log_m_of(h_c):
            # The round-off bound m of tilted_fft, estimated: 8u(P + 2)(1 + Σ_c k_c‖p̃_c‖₂)
            # (‖Ĉ‖₂ + 1) + 4nu (P = fft_passes(n)), the steps' norms from the coarse pass (at least the fine grid's),
            # ‖Ĉ‖₂² ≈ 2n‖C‖₂², ‖C‖₂² ≤ min_c ‖p̃_c‖₂² (Young) and about h/(2√π s) for a smooth
            # composed law of spread s (Gaussian and Poisson-sampled Gaussian compositions).
            c2 = jnp.minimum(young, jnp.maximum(h_c / (2.0 * math.sqrt(math.pi) * jnp.maximum(s, _TINY)),
                                                young / k_tot))
            return jnp.log(8.0 * _U * (fft_passes(n) + 2.0) * (1.0 + norm_sum) * (jnp.sqrt(2.0 * n * c2) + 1.0)
                           + 4.0 * n * _U)

        # The sharp tops (see the docstring) where round-off is estimated far below δ: there the
        # spacing sets the error. (Where round-off sets the answer, e.g. q = 1e-5, σ = 0.8, 100 steps,
        # δ = 1e-10, the narrower window they allow moved ε up to +12 %: the round-off estimate
        # assumes a smooth composed law.)
        sharp_d, span_p = False, span_s
        if sharp and smooth:
            sharp_d = log_m_of(jnp.maximum(span_s, top_old - bottom) / (n - 2)) <= log_dt - _SHARP_LOG
            top_obj = (top_mgf - (log_dt + math.log(_ETA))) / thetas
            top_s, th_top_s = _min_and_theta(top_obj, thetas)
            top = where(sharp_d, top_s, top_old)
            th_top = where(sharp_d, th_top_s, th_top_old)
            span_p = where(sharp_d, span_f, span_s)
        if smooth:
            # The window [top - W, top] and the tilt λ: of a ladder of extensions W below
            # ``bottom`` and the ladder of θ, the pair that minimises the estimated sum of the
            # error terms in δ at the answer's estimate ε̂ = centre: mass folded down from
            # above, e^{λW} P(L > ε̂ + W) (a steep tilt on a narrow window folds mass from far
            # above onto the answer); mass folded up from below, e^{-λW} P(L < top - W); the
            # round-off bound m, untilted over the bins above ε̂ (≈ m e^{Λ(λ) - λε̂}/(λ(λ+1)h));
            # and the discretisation, connect-the-dots' extra loss variance Σ_c k_c h²/6 raising δ
            # by about δ λ*²/2 times it (λ* the answer's tilt). Each term only costs tightness:
            # folds and round-off are added to δ in compose, whatever the plan. (With the sharp
            # tops, P(L > ε̂ + W) by Λ of the steps cut there: the mass above goes to +∞, it is
            # never folded. Λ of the uncut steps, dominated by their far tails at steep θ,
            # overstated that fold by orders of magnitude and widened the window: issue 27's
            # q = 0.001, σ = 0.8, 1000 steps +2.4e-4 → +1.7e-4 against dp_accounting.)
            base = jnp.maximum(top - bottom, h1)
            # θ between the ladder's rungs too (Λ convex: its chords bound it above).
            if sharp:
                tf, mgf_f, neg_f, fine_f = _between_rungs(thetas, lam_mgf, neg_mgf, top_mgf)
                fine_f = where(sharp_d, fine_f, mgf_f)
            else:
                tf, mgf_f, neg_f = _between_rungs(thetas, lam_mgf, neg_mgf)
                fine_f = mgf_f
            b_c = bottom - base * f64(_EXTEND)
            w_c = top - b_c
            log_below = jnp.minimum(jnp.min(neg_f[None, :] + tf[None, :] * b_c[:, None], axis=1), 0.0)
            log_fu = log_below[:, None] - tf[None, :] * w_c[:, None]
            # min over θ' > θ of Λ(θ') - θ' ε̂ - (θ' - θ)W: a suffix minimum over the (increasing)
            # ladder of Λ(θ') - θ'(ε̂ + W), shifted by one, plus θW.
            b_ex = (fine_f - tf * centre)[None, :] - tf[None, :] * w_c[:, None]  # [W, θ]
            suffix = jax.lax.cummin(b_ex, axis=1, reverse=True)
            after = jnp.concatenate([suffix[:, 1:], jnp.full((suffix.shape[0], 1), jnp.inf)], axis=1)
            log_fd = jnp.minimum(after + tf[None, :] * w_c[:, None], 0.0)
            h_c = jnp.maximum(span_p, w_c) / (n - 2)
            bins = jnp.log(jnp.minimum(float(n), 1.0 + 1.0 / (tf[None, :] * h_c[:, None])))
            log_m = log_m_of(h_c)
            log_rd = log_m[:, None] + (mgf_f - tf * centre - jnp.log1p(tf))[None, :] + bins
            k_disc = sum(ks)
            log_disc = log_dt + jnp.log(lam0 * lam0 * k_disc / 12.0 + _TINY) + 2.0 * jnp.log(h_c)
            terms = jnp.stack([log_fu, log_fd, log_rd, jnp.broadcast_to(log_disc[:, None], log_fu.shape)])
            total = lse(jnp.moveaxis(terms, 0, -1), 0.0)
            total = where(jnp.all(jnp.isfinite(terms) | (terms == -jnp.inf), axis=0), total, jnp.inf)
            e_idx = f64(np.arange(len(_EXTEND)))
            # (No argmin: its variadic reduction breaks reverse mode outside the float64 scope.)
            least = jnp.min(total)
            hit = at_min(total, least)
            e_star = jnp.min(where(jnp.any(hit, axis=1), e_idx, 1e9))
            # Where every estimate is +inf or NaN, the Chernoff plan: the answer's tilt and the
            # narrowest window whose fold from below fits (only less tight, never invalid).
            w_fit = top - jnp.max(where(-lam0 * w_c + log_below <= log_dt - _FOLD_LOG, b_c, b_c[-1]))
            found = jnp.isfinite(least)
            sel = (e_idx == e_star)[:, None]
            lam_new = where(found, jnp.min(where(sel & hit, tf[None, :], jnp.inf)), lam0)
            span_new = where(found, jnp.sum(where(sel[:, 0], w_c, 0.0)), w_fit)
        # The s12 plan (kinds with atoms: Laplace, (ε, δ); and, for smooth kinds, where
        # round-off dominates, see below).
        # The window [top - W, top] and the tilt λ: the narrowest W of a ladder of extensions
        # below ``bottom`` (then the smallest λ of the ladder) for which three error terms are
        # negligible at the answer's lower estimate ε_b = bottom: mass folded down from above,
        # e^{λW} P(L > ε_b + W) ≤ δe^{-9} (a steep tilt on a narrow window folds mass from far
        # above onto the answer); mass folded up from below, e^{-λW} P(L < top - W) ≤ δe^{-9};
        # and the round-off bound m, untilted over the bins above the Chernoff point, ≤ δe^{-7}.
        # (It keeps the wide top: the sharp one is for the error-minimising plan only.)
        top_new, th_top_new = top, th_top
        top, th_top = top_old, th_top_old
        base = jnp.maximum(top - bottom, h1)
        b_c = bottom - base * f64(_EXTEND_ATOMS)
        w_c = top - b_c
        log_below = jnp.minimum(jnp.min(neg_mgf[None, :] + thetas[None, :] * b_c[:, None], axis=1), 0.0)
        fu = log_below[:, None] - thetas[None, :] * w_c[:, None] <= log_dt - _FOLD_LOG
        # min over θ > λ of Λ(θ) - θ ε_b - (θ - λ)W: a suffix minimum over the (increasing)
        # ladder of Λ(θ) - θ(ε_b + W), shifted by one, plus λW.
        b_ex = (lam_mgf - thetas * bottom)[None, :] - thetas[None, :] * w_c[:, None]  # [W, θ]
        suffix = jax.lax.cummin(b_ex, axis=1, reverse=True)
        after = jnp.concatenate([suffix[:, 1:], jnp.full((suffix.shape[0], 1), jnp.inf)], axis=1)
        fd = after + thetas[None, :] * w_c[:, None] <= log_dt - _FOLD_LOG
        h_c = jnp.maximum(span_s, w_c) / (n - 2)
        bins = jnp.log(jnp.minimum(float(n), 1.0 + 1.0 / (thetas[None, :] * h_c[:, None])))
        r_obj = log_m_worst + (lam_mgf - thetas * ref)[None, :] + bins
        rd = r_obj <= log_dt - 7.0
        # Only windows up to _MAX_WIDEN times the Chernoff plan's (wider ones cost accuracy).
        w_fit = top - jnp.max(where(-lam0 * w_c + log_below <= log_dt - _FOLD_LOG, b_c, b_c[-1]))
        near = (w_c <= _MAX_WIDEN * jnp.maximum(w_fit, span_s))[:, None]
        all3 = fd & fu & rd & near
        e_idx = f64(np.arange(len(_EXTEND_ATOMS)))
        e_star = jnp.min(where(jnp.any(all3, axis=1), e_idx, 1e9))
        # Where no window and tilt of the ladder fit, the Chernoff plan: the answer's tilt and
        # the narrowest window whose fold from below fits (what the bounds cannot certify is
        # then only less tight, never invalid).
        found = e_star < 1e9
        sel = (e_idx == e_star)[:, None]
        lam_old = where(found, jnp.min(where(sel & all3, thetas[None, :], jnp.inf)), lam0)
        span_old = where(found, jnp.sum(where(sel[:, 0], w_c, 0.0)), w_fit)
        if smooth:
            # The s12 plan where the estimates above cannot be trusted: where the estimated
            # round-off bound per bin m (least over the windows) exceeds δe^{_ROUND_LOG} (small
            # δ, e.g. 1e-12 at 2^14 bins: round-off then sets the answer, and at small q the
            # saddle-point estimate ε̂ that the objective is evaluated at lies far above it,
            # q = 1e-5, σ = 0.8, 100 steps: ε̂ = 0.61, answer 0.16). There the s12 plan's steeper
            # Chernoff tilt is tighter (on 90 small-δ configurations the default was up to 1.65×
            # the s12 plan's ε without this switch, now at most 1.03×). Decided from the coarse
            # pass (no second FFT); any plan is certified (see compose).
            # (ε(δ) only: for δ(ε) the estimate log δ can be far below the answer's δ.)
            use_new = (jnp.min(log_m) <= log_dt + _ROUND_LOG) | (what != "epsilon")
            lam = where(use_new, lam_new, lam_old)
            span_d = where(use_new, span_new, span_old)
            if sharp:
                top = where(use_new, top_new, top_old)
                th_top = where(use_new, th_top_new, th_top_old)
                sharp_d = sharp_d & use_new
        else:
            lam, span_d = lam_old, span_old
        # Per mechanism, for the two-stage composition's block windows (_pld_stages.py):
        # its own discrete log-MGF on the ladder (±θ) and its mean and variance tilted by λ.
        stats_d = [(pos_c, neg_c, m_t, v_t, logp, grid)
                   for (pos_c, neg_c), (m_t, v_t), (logp, grid, _) in zip(one_mgf, tilted, parts)]
        # (With ``sharp``, a sixth entry: whether the fine grids end at the sharp tops.)
        extra = (jnp.asarray(sharp_d, bool),) if sharp else ()
        return (lam, top, bottom, log_dt, th_top) + extra, span_d, stats_d

    plans, spans, stats = {}, [], {}
    if smooth and len(direction_list) == 2:
        # Both directions through one traced body (``lax.scan`` over the sign, the ranges as
        # computed above): half the program XLA compiles for the plan. (Gaussian kinds only:
        # XLA fuses the loop body differently, which moves the plan's last bits; for events
        # with atoms, Poisson-sampled (ε, δ), that moved ε by up to 7e-9 relative, so they
        # keep one traced copy per direction, bit-identical to session 15.)
        def step(carry, x):
            sign, ends, tops_d = x
            plan, span_d, _ = per_direction(sign, [(b, t) for b, t in ends], log_dt, tops_d)
            return carry, (plan, span_d)

        xs = (f64([1.0, -1.0]),
              [tuple(jnp.stack([ranges[d][c][i] for d in direction_list]) for i in (0, 1)) for c in range(len(kinds))],
              [jnp.stack([tops_f[d][c] for d in direction_list]) for c in range(len(kinds))] if sharp else None)
        _, (per, span_ds) = jax.lax.scan(step, None, xs)
        plans = {d: tuple(v[i] for v in per) for i, d in enumerate(direction_list)}
        spans = [span_ds[0], span_ds[1]]
    else:
        for d in direction_list:
            plans[d], span_d, stats[d] = per_direction(d, ranges[d], log_dt, tops_f[d])
            spans.append(span_d)
    span_c = jnp.max(jnp.stack(spans))
    if sharp:  # the sharp tops' spacing only where every direction ends its grids there
        span_f = where(jnp.all(jnp.stack([plans[d][5] for d in direction_list])), span_f, span_s)
    return span_f, span_c, plans, z, stats, thetas


def compose(kinds, params, counts, n, tau, estimate, query, what, stages=1, read=None):
    r"""Per direction, the composed discrete PLD on a window, computed in the tilted domain.

    Each mechanism's masses :math:`p_{c,i}` on its grid :math:`ℓ_i = (o_c + i)h` are tilted,
    :math:`\tilde p_{c,i} = p_{c,i} e^{λℓ_i - a_c}` with :math:`a_c = \log\sum_i p_{c,i}e^{λℓ_i}`
    (a distribution again), composed by FFT, and untilted:
    :math:`r_ℓ = \tilde r_ℓ e^{Λ - λℓ}`, Λ = Σ_c k_c a_c, exactly so in exact arithmetic.
    Round-off :math:`\|\tilde r - \tilde r^{fl}\|_∞ ≤ m` (normwise bound, Higham §24.1) is
    added to (upper) or subtracted from (lower) every tilted bin before untilting, so the
    error of each composed mass is relative to :math:`e^{Λ - λℓ}`, i.e. to the hockey
    stick near the tilt's centre, whatever δ. The circular convolution on n bins of width
    W = nh moves mass below the window up by W, scaled by :math:`e^{-λW}` (extra mass: the
    upper bound stays valid; the lower bound subtracts at most
    :math:`e^{-λW}/(1 - e^{-λW})`), and mass above the window down by W, scaled by
    :math:`e^{λW}` (extra mass for the upper bound; the lower bound subtracts a per-bin
    Chernoff bound). The mass really above the window is added to δ in full (Chernoff,
    :math:`\min_θ e^{Λ(θ) - θ\,top}` from the discrete moment generating functions).
    Mass below the window has loss below every ε read off it (ε is never reported below
    the window's bottom), so it does not count.

    Returns:
      ``[read(Composed) per direction]`` (remove, then add where the kinds are sampled);
      ``read`` maps a :class:`Composed` to arrays (e.g. :func:`epsilon_read` at the target).
    """
    dirs = directions(kinds)
    two_stage = estimate == "upper" and stages == 2
    # The Poisson-sampled Gaussian's sharp top (_single_range) for the one-stage upper ε(δ) only
    # (for δ(ε) its tail mass is set by ``tail_bound``, not by δ; the two-stage block plan was
    # tuned on the wide top).
    sharp = (estimate == "upper" and not two_stage and what == "epsilon" and "sampled_gaussian" in kinds
             and all(kd in _SMOOTH for kd in kinds))
    span_s, span_c, plans, z, stats, thetas_plan = _plan(kinds, params, counts, dirs, query, what, tau, n,
                                                         not two_stage, sharp)
    span_s, span_c = jax.lax.stop_gradient((span_s, span_c))
    if two_stage:  # the spacing h2 of stage 2 and each block's window (_pld_stages.block_plan)
        pairs = [_range_pairs(kd, p_, z) for kd, p_ in zip(kinds, params)]
        ranges = {d: [jax.lax.stop_gradient(_pick(pp, d)) for pp in pairs] for d in dirs}
        bp = jax.lax.stop_gradient(block_plan(kinds, params, stats, thetas_plan, counts, ranges, plans, span_c, n))
        h = bp.h2
    else:
        h = jnp.maximum(span_s, span_c) / (n - 2)
    h = where(jnp.isfinite(h) & (h > 0), h, 1.0)
    w_all = n * h
    j = jnp.arange(n, dtype=jnp.float64)

    def per_direction(direction, plan):
        """``read`` of one direction's composition (``direction`` a string or a traced sign)."""
        lam, top_need, bottom_need, log_dt, th_top = jax.lax.stop_gradient(plan[:5])
        sharp_d = jax.lax.stop_gradient(plan[5]) if sharp else None
        # Tilt at least so much that the folded-up bulk (≤ e^{-λW}) is far below δ.
        if estimate == "lower":  # a smaller tilt folds less mass down (see _fold_down)
            lam = jnp.minimum(lam, jnp.maximum((_FOLD_LOG_LOWER - log_dt) / w_all, 0.5 * lam))
        lam = jnp.minimum(lam, 600.0 / w_all)
        # Chernoff exponents: the tilt and multiples (the lower bound's fold-down uses those
        # above λ), and the plan's exponent for the window's top.
        if estimate == "upper" and what == "epsilon" and not two_stage and all(kd in _SMOOTH for kd in kinds):
            # Only the window's top (t_up): the plan's exponent for it and 1.5 times it. The
            # multiples of λ cost 8 % of the CPU and were the minimum on some configurations
            # (without them ε is up to 3.5e-4 relative higher on 60 random DP-SGD ones: still a
            # Chernoff bound, so still certified). δ(ε) queries, whose window is not planned
            # around one ε, and events with atoms keep them: there the plan's exponent alone
            # moved δ by 1e-5 relative, or left t_up at 1.
            thetas = jnp.maximum(th_top, lam)[None] * f64([1.0, 1.5])
        else:
            thetas = jnp.concatenate([lam * f64(_THETA_FACTORS), jnp.maximum(th_top, lam)[None] * f64([1.0, 1.5])])
        a0 = None
        if two_stage:
            # Stage 1 per mechanism (blocks of ⌊k/m⌋ and ⌊k/m⌋ + 1 steps on a finer grid),
            # then the blocks are composed below like mechanisms; their +∞ masses compose as
            # Π(f + i)^k - Π f^k (f: a block's finite mass, which may exceed 1 - i).
            mech, fin = [], []
            for c, (kd, p_, k) in enumerate(zip(kinds, params, counts)):
                for o, grid, p, p_inf, f, kb in blocks(kd, p_, k, direction, lam, bp, c, ranges[direction][c], n):
                    mech.append((o, grid, p, p_inf))
                    fin.append((f, p_inf, kb))
            counts_s = [kb for _, _, kb in fin]
            log_all = sum(kb * jnp.log(f + i) for f, i, kb in fin)
            log_fin = sum(kb * jnp.log1p(-i / (f + i)) for f, i, kb in fin)
            p_inf_tot = jnp.exp(log_all) * -jnp.expm1(log_fin)
        else:
            # Each mechanism's grid and masses (the grid depends on the spacing only). The grid
            # ends at the mechanism's planned top (as in the plan): above it the moment
            # generating function would be dominated by far tails that cost little δ.
            mech, counts_s = [], counts
            for kd, p_, k in zip(kinds, params, counts):
                b1, t1, *t_s = jax.lax.stop_gradient(_single_range(kd, p_, direction, z, sharp))
                if sharp:
                    t1 = where(sharp_d, t_s[0], t1)
                o = jnp.floor(b1 / h)
                grid = (o + j) * h
                mech.append((o, grid) + tuple(masses(kd, p_, grid, h, direction, estimate, _cut(o, t1, h, n))))
            log_keep_inf = sum(k * jnp.log1p(-jnp.minimum(m[3], 1.0 - 1e-16)) for k, m in zip(counts, mech))
            p_inf_tot = -jnp.expm1(log_keep_inf)
        # The lower bound lowers each loss, by the estimated mean decrease (h/2 for privacy
        # buckets rounded down, less for merged buckets): its composed loss sits about
        # Σ_c k_c·decrease lower, and so does its window.
        shift = 0.0
        if estimate == "lower":
            shift = h * sum(where(jnp.isfinite(k), k, 0.0) * m[4] for k, m in zip(counts, mech))
        if what == "delta":  # keep ε inside the window
            shift = jnp.minimum(shift, jnp.maximum(top_need - bottom_need - 2.0 * h, 0.0))
        a0 = jnp.ceil((top_need - jax.lax.stop_gradient(shift)) / h) - (n - 1)
        losses = (a0 + j) * h
        parts = [(o, grid, p) for o, grid, p, *_ in mech]
        r_t, (m_two, m_bin), big_lam = tilted_fft(parts, counts_s, lam, a0, n, split=True)
        log_mgf = jnp.zeros(thetas.shape)
        neg_mgf = jnp.zeros(thetas.shape)
        for k, (o, grid, p, *_) in zip(counts_s, mech):
            kf = where(jnp.isfinite(k), k, 0.0)
            logp = where(p > 0, jnp.log(where(p > 0, p, 1.0)), -jnp.inf)
            log_mgf = log_mgf + kf * lse(logp, grid, thetas)
            if estimate == "lower":
                neg_mgf = neg_mgf + kf * lse(logp, grid, -thetas)
        top = (a0 + n) * h  # smallest loss above the window
        log_scale = big_lam - lam * losses
        if estimate == "upper":
            t_up = jnp.exp(jnp.minimum(jnp.min(log_mgf - thetas * top), 0.0))
            # The per-bin round-off term m_bin is added to every tilted bin; the normwise one
            # m₂ ≥ ‖r̃^fl - r̃‖₂ is read out by Cauchy–Schwarz: for ε ∈ (ε_{j-1}, ε_j],
            # Σ_{i≥j} w_i e^{Λ-λℓ_i}|e_i| ≤ m₂ e^{Λ-λℓ_j} G, G² = Σ_{k≥0} w_k² e^{-2λkh} with the
            # weights at ε_{j-1} (the largest), w_k = 1 - e^{-(k+1)h} (at most 1: G² ≤ 1/(1-x)):
            # G² = 1/(1-x) - 2e^{-h}/(1-xe^{-h}) + e^{-2h}/(1-xe^{-2h}), x = e^{-2λh}, plus 80u/(1-x)
            # for the rounding of that difference.
            mass = jnp.maximum(r_t, 0.0) + m_bin
            probs = jnp.exp(jnp.minimum(jnp.log(mass) + log_scale, 0.0))
            # Only the window's bins i < n count: each geometric sum stops at k < K = n - j,
            # Σ_{k<K} (xe^{-ch})^k = (1 - (xe^{-ch})^K)/(1 - xe^{-ch}). The term falls with j (λ > 0
            # and G rises with K), so the read-outs evaluate it only where they need it: at the
            # first bin above a δ(ε) query, and at the block starts and one block's bins of the
            # ε(δ) read-out (_first_below_blocked), not at all n bins.
            lam_h = jnp.maximum(lam, 0.0) * h

            def l2(jj):
                """m₂ e^{Λ-λℓ_j} G at the (float) bin indices jj (0 at j = n)."""
                big_k = n - jj
                # The numerators 1 - (xe^{-ch})^K, c = 0, 1, 2, from two expm1 per bin: with
                # E_x = expm1(-2λhK) and E_h = expm1(-hK) (both in [-1, 0]), 1 - x^K = -E_x,
                # 1 - (xe^{-h})^K = -(E_x + E_h(1 + E_x)), 1 - (xe^{-2h})^K = -(E_x + E_h(2 + E_h)(1 + E_x)):
                # sums of terms of one sign (relative error ≤ 9u and 12u; each geo ≤ 7u, 13u, 16u
                # with its denominator: the difference below is off by ≤ 65u·g0, hence 80u·g0).
                e_x = jnp.expm1(-(2.0 * lam_h) * big_k)
                e_h = jnp.expm1(-h * big_k)
                nums = (-e_x, -(e_x + e_h * (1.0 + e_x)), -(e_x + e_h * (2.0 + e_h) * (1.0 + e_x)))

                def geo(c):
                    den = -jnp.expm1(-(2.0 * lam_h + c * h))
                    return where(den > 0, nums[c] / where(den > 0, den, 1.0), big_k)

                g0 = geo(0)  # the weights at most 1
                g_w = g0 - 2.0 * jnp.exp(-h) * geo(1) + jnp.exp(-2.0 * h) * geo(2) + 80.0 * _U * g0
                log_geo = 0.5 * jnp.log(jnp.minimum(g0 * (1.0 + 8.0 * _U), jnp.maximum(g_w, 0.0)))
                log_scale_j = big_lam - lam * ((a0 + jj) * h)
                return jnp.exp(jnp.minimum(jnp.log(m_two) + log_scale_j + log_geo, 0.0)) * (1.0 + 1e-6)

            # Bins whose mass underflows lose at most n times the smallest normal.
            extra = p_inf_tot + t_up + n * _TINY
            fold = None
        else:
            l2 = None
            mass = jnp.maximum(r_t - (m_two + m_bin), 0.0)
            logm = where(mass > 0, jnp.log(where(mass > 0, mass, 1.0)), -jnp.inf)
            probs = jnp.exp(jnp.minimum(logm + log_scale, 0.0))
            # Mass below the window folded up by mW, scaled by e^{-λmW}: at most
            # P(L < bottom) e^{-λW}/(1 - e^{-λW}), P(L < b) ≤ min_θ e^{Λ(-θ) + θb}.
            bottom = a0 * h
            log_below = jnp.minimum(jnp.min(neg_mgf + thetas * bottom), 0.0)
            extra = -jnp.exp(log_below - lam * w_all) / -jnp.expm1(-lam * w_all)
            fold = functools.partial(_fold_down, log_mgf[1:], thetas[1:], lam, w_all)
        return read(Composed(probs, losses, extra, fold, l2))

    # (The lower bound keeps one traced copy per direction: scanned, XLA fuses its merged
    # buckets differently and moves its last bits, up to 1.3e-10 relative, on DP-SGD; so do
    # events with atoms, see the plan.)
    if two_stage or len(dirs) == 1 or estimate == "lower" or not all(kd in _SMOOTH for kd in kinds):
        return [per_direction(d, plans[d]) for d in dirs]
    # Both directions through one traced body (``lax.scan`` over the sign): half the program
    # XLA compiles for the composition and the read-out (the same arithmetic; docs/pld.md
    # "Directions" for the last bits XLA's fusion moves).
    stacked = tuple(jnp.stack([plans[d][i] for d in dirs]) for i in range(len(plans[dirs[0]])))
    _, out = jax.lax.scan(lambda carry, x: (carry, per_direction(x[0], x[1])), None, (f64([1.0, -1.0]), stacked))
    return [out[0], out[1]]


def _fold_down(log_mgf, thetas, lam, w_all, eps):
    r"""Bound on the mass the circular convolution folds down onto losses > ε (lower bound).

    Mass at ℓ + mW lands at ℓ, multiplied by :math:`e^{λmW}`; it lands above ε only from
    above ε + mW: :math:`\sum_m e^{λmW} P(L > ε + mW) ≤ e^{Λ(θ) - θ(ε+W) + λW}/(1 - e^{-(θ-λ)W})`
    for every θ > λ (Chernoff).
    """
    eps = jnp.asarray(eps)
    d = thetas - lam
    ex = (log_mgf - thetas * (eps[..., None] + w_all) + lam * w_all - jnp.log(-jnp.expm1(-d * w_all)))
    return jnp.exp(jnp.minimum(jnp.min(ex, axis=-1), 0.0))


def delta_read(c: Composed, eps, estimate):
    w = -jnp.expm1(jnp.minimum(eps - c.losses, 0.0))
    w = where(c.losses > eps, w, 0.0)
    d = jnp.sum(c.probs * w) + c.extra
    if c.l2 is not None:  # the normwise round-off from the first bin above ε (0 if none)
        first = jnp.sum(c.losses <= eps).astype(jnp.float64)  # l2 falls with j: its largest there
        d = d + where(first < c.losses.shape[0], c.l2(first), 0.0)
    if c.fold is not None:
        d = d - c.fold(eps)
    if estimate == "upper":  # below the window's bottom (never planned so) nothing is certified
        d = where(eps >= c.losses[0] - (c.losses[1] - c.losses[0]), d, 1.0)
    return jnp.clip(d, 0.0, 1.0)


_BLOCK = 256


def _tail_sums(r, h):
    r""":math:`S_j = \sum_{i>j} r_i` and :math:`D_j = \sum_{i>j} r_i e^{-(i-j)h}` for every j.

    Blocked so that no exponential overflows: inside a block of m bins the weights are
    :math:`e^{\pm k h}` with k < m, and the blocks are chained by a short scan. Where
    :math:`m h > 600` some weights underflow to 0: D is then too small and δ = S - D too
    large, which is the safe side for the upper bound (the lower bound is refused there).
    """
    n = r.shape[0]
    m = math.gcd(_BLOCK, n)  # divides n (a power of two or three times one)
    nb = n // m
    k = jnp.arange(m, dtype=jnp.float64)
    rb = r.reshape(nb, m)
    down = jnp.exp(-jnp.minimum((k + 1.0) * h, 700.0))  # e^{-(k+1)h}
    up = jnp.exp(jnp.minimum(k * h, 700.0))  # e^{kh}
    u = rb * down[None, :]
    # Σ_{k' > k} u_{k'} within the block, then times e^{kh}·e^{h}... = Σ r e^{-(k'-k)h}.
    suf_u = jnp.cumsum(u[:, ::-1], axis=1)[:, ::-1] - u
    inner = suf_u * (up * jnp.exp(jnp.minimum(h, 700.0)))[None, :]
    # Contribution of later blocks at the block's last element: E_b = G_{b+1} + e^{-mh} E_{b+1},
    # G_b = Σ_k r_k e^{-(k+1)h} (distance from the element before the block).
    g = jnp.sum(u, axis=1)
    decay = jnp.exp(-jnp.minimum(m * h, 700.0))

    def step(carry, gb):
        return gb + decay * carry, carry

    _, e_after = jax.lax.scan(step, jnp.zeros(()), g, reverse=True)
    # e_after[b] = E_b: later blocks seen from the last element of block b.
    outer = e_after[:, None] * jnp.exp(-jnp.minimum((m - 1.0 - k) * h, 700.0))[None, :]
    d = (inner + outer).reshape(n)
    s_incl = jnp.cumsum(r[::-1])[::-1]
    return s_incl - r, d


def _first_below(r, e, h, x, target):
    """The first bin j from which the curve δ(ε_j) = X_j + S_j - D_j stays ≤ target, and the sums
    S_j + r_j, D_j + r_j, ε_j, X_j there (every bin evaluated: the lower bound's curve need not be
    monotone)."""
    n = r.shape[0]
    s_next, d_next = _tail_sums(r, h)
    d_at = x + s_next - d_next  # δ at ε = ε_j
    # The first bin from which the curve stays ≤ target (the lower bound's curve need not be
    # monotone; the true δ is, so δ(ε) ≥ the lower curve at every ε' ≥ ε): the bin after the
    # last one above it, n if none. (A max over the indices: the reversed cumsum it replaces
    # became a tree of reduce-window kernels in XLA's CPU compile.)
    idx = jnp.arange(n, dtype=jnp.float64)
    first = jnp.max(where(d_at > target, idx, -1.0)) + 1.0
    # S and T e^{ε_j} over i ≥ j: S_j = s_next_j + r_j, D'_j = d_next_j + r_j; picked at j = first
    # in one reduction (a sum with one nonzero term, exact; no argmax or gather: its variadic
    # reduction broke reverse mode outside the float64 scope).
    cols = [s_next + r, d_next + r, e] + ([x] if jnp.ndim(x) else [])
    picked = jnp.sum(where(idx == first, jnp.stack(cols), 0.0), axis=1)
    return first, picked[0], picked[1], picked[2], (picked[3] if jnp.ndim(x) else x)


def _first_below_blocked(r, e, h, x_at, target):
    """:func:`_first_below` for the upper bound's curve, in two levels.

    The upper curve X_j + S_j - D_j is nonincreasing in j (S_j - D_j = Σ_{i>j} r_i(1 - e^{-(i-j)h}),
    and X_j = extra + l2_j, ``x_at`` at float bin indices), so the last bin above the target lies
    in the last block (of b = gcd(256, n) bins) whose first bin is above it: the curve is
    evaluated at the n/b block starts (block sums and a short scan), then at the b bins of that
    block only. The same sums as :func:`_tail_sums` (in another order: last bits), without its
    per-bin passes.
    """
    n = r.shape[0]
    m = math.gcd(_BLOCK, n)
    nb = n // m
    k = jnp.arange(m, dtype=jnp.float64)
    rb = r.reshape(nb, m)
    # From each block's first bin on: S'_b = Σ_{i≥j0} r_i and D'_b = Σ_{i≥j0} r_i e^{-(i-j0)h}.
    decay_k = jnp.exp(-jnp.minimum(k * h, 700.0))
    decay = jnp.exp(-jnp.minimum(m * h, 700.0))

    def step(carry, xs):
        s_c, d_c = carry
        tot, wsum = xs
        out = (tot + s_c, wsum + decay * d_c)
        return out, out

    zero = jnp.zeros((), dtype=r.dtype)
    _, (s_from, d_from) = jax.lax.scan(step, (zero, zero), (jnp.sum(rb, axis=1), jnp.sum(rb * decay_k, axis=1)),
                                       reverse=True)
    r0 = rb[:, 0]
    # Above every bin of block b: the curve at its first bin (S_j - D_j and X_j fall with j).
    d_blk = x_at(m * jnp.arange(nb, dtype=jnp.float64)) + (s_from - r0) - (d_from - r0)
    b_star = jnp.max(where(d_blk > target, jnp.arange(nb, dtype=jnp.float64), -1.0))
    b0 = jnp.maximum(b_star, 0.0)
    start = (b0 * m).astype(jnp.int32)
    # The block's bins, the next block's first bin, and what lies beyond (0 past the window).
    s_ext, d_ext = (jnp.concatenate([a, jnp.zeros((1,), dtype=r.dtype)]) for a in (s_from, d_from))
    nxt = jnp.minimum(b0 + 1.0, float(nb))
    pick_b = jnp.arange(nb + 1, dtype=jnp.float64) == nxt
    after_s = jnp.sum(where(pick_b, s_ext, 0.0))  # Σ_{i≥j0'} r_i
    after_d = jnp.sum(where(pick_b, d_ext, 0.0))  # Σ_{i≥j0'} r_i e^{-(i-j0')h}
    seg = jax.lax.dynamic_slice(jnp.concatenate([r, jnp.zeros((1,), dtype=r.dtype)]), (start,), (m + 1,))
    x_seg = x_at(start.astype(jnp.float64) + jnp.arange(m + 1, dtype=jnp.float64))
    e_seg = jax.lax.dynamic_slice(jnp.concatenate([e, e[-1:] + h]), (start,), (m + 1,))
    blk = seg[:m]
    down = jnp.exp(-jnp.minimum((k + 1.0) * h, 700.0))
    up = jnp.exp(jnp.minimum(k * h, 700.0))
    u = blk * down
    inner = (jnp.cumsum(u[::-1])[::-1] - u) * (up * jnp.exp(jnp.minimum(h, 700.0)))
    outer = after_d * jnp.exp(-jnp.minimum((m - k) * h, 700.0))
    s_next = jnp.cumsum(blk[::-1])[::-1] - blk + after_s
    d_next = inner + outer
    d_at = x_seg[:m] + s_next - d_next
    t_star = jnp.max(where(d_at > target, k, -1.0)) + 1.0  # in [0, m]
    first = start.astype(jnp.float64) + t_star
    # S_j + r_j and D_j + r_j at j = first (the next block's first bin when t_star = m).
    s_inc = jnp.concatenate([s_next + blk, after_s[None]])
    d_inc = jnp.concatenate([d_next + blk, after_d[None]])
    idx = jnp.arange(m + 1, dtype=jnp.float64)
    picked = jnp.sum(where(idx == t_star, jnp.stack([s_inc, d_inc, e_seg, x_seg]), 0.0), axis=1)
    return first, picked[0], picked[1], picked[2], picked[3]


def epsilon_read(c: Composed, target, estimate="upper"):
    """Smallest ε ≥ 0 with δ(ε) ≤ target on the discrete curve (+inf if none on the grid).

    Between bins ε_{j-1} < ε ≤ ε_j the curve is :math:`δ(ε) = X + S - e^{ε} T` with
    S, T the sums of r_i and r_i e^{-ε_i} over i ≥ j: solved exactly there.

    ``estimate="lower"``: ε is certified from below only where the lower curve exceeds the
    target at some bin of the window (the true ε is above that bin). Where it does not, even
    at the window's bottom, the window says nothing about smaller ε and the answer is the
    solution on the first interval if it lies in it, else 0.
    """
    r, e = c.probs, c.losses
    n = r.shape[0]
    h = e[1] - e[0]
    # The constant part of the curve on (ε_{j-1}, ε_j] (the lower bound's fold-down bound is
    # taken at ε_{j-1}, its largest value there).
    if estimate == "upper":  # on (ε_{j-1}, ε_j] the normwise round-off over the bins i ≥ j too
        l2 = c.l2 if c.l2 is not None else jnp.zeros_like
        first, s_star, dd_star, e_star, x_star = _first_below_blocked(r, e, h, lambda jj: c.extra + l2(jj), target)
    else:
        x = c.extra if c.fold is None else c.extra - c.fold(e - h)
        first, s_star, dd_star, e_star, x_star = _first_below(r, e, h, x, target)
    any_ok = first < n
    num = x_star + s_star - target
    pos = (num > 0) & (dd_star > 0)
    # X + S - e^{ε - ε_j} D' = target  ⇒  ε = ε_j + log((X + S - target)/D').
    sol = where(pos, e_star + jnp.log(where(pos, num, 1.0)) - jnp.log(where(pos, dd_star, 1.0)),
                    -jnp.inf)
    sol = jnp.minimum(sol, e_star)  # δ(e_star) ≤ target was checked on the grid
    # Never below the bin before: at the window's bottom ε_0 the mass below the window (not
    # held) has losses ≤ ε_0 - h, so the curve is exact down to there and no further.
    # (The lower bound: only where some bin's lower curve exceeds the target, first > 0; at
    # first = 0 the true curve below the window is unknown, so a solution below ε_0 - h is
    # replaced by the trivial 0, never raised to ε_0 - h: that was above the true ε for
    # Poisson-sampled (ε, δ) events whose lower window lay above the answer.)
    clamped = jnp.maximum(sol, e_star - h)
    if estimate == "lower":
        clamped = where((first > 0) | (sol >= e_star - h), clamped, 0.0)
    out = jnp.maximum(clamped, 0.0)
    return where(any_ok & (c.extra < target), out, jnp.inf)


