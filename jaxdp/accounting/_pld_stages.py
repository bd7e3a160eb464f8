r"""Two-stage PLD composition, the upper bound's default: blocks of steps on a fine grid, then the blocks.

One tilted FFT on n bins must hold the whole composed window W, so its spacing is h = W/n, and
connect-the-dots adds about h²/6 of loss variance per step: the upper bound's error grows like
K·h² over K steps. Here each mechanism composed k times is split into m blocks: stage 1
composes a = ⌊k/m⌋ and a + 1 steps on a fine grid whose window only holds one block (about
√(k/m) of the spread, so h₁ = h₂/R with an integer R ≥ 1), then each block is moved onto the
stage-2 grid (spacing h₂) by connect-the-dots of atoms, and stage 2 composes m − r blocks of a
steps and r of a + 1 (k = m·a + r) like the single-stage composition composes mechanisms.
The error is about Σ_c (k_c h₁² + min(m, k_c) h₂²); m is chosen from a ladder to minimise it
(:func:`block_plan`).

Why it stays an upper bound (δ(ε) = ∫(1 - e^{ε-ℓ})₊ dω(ℓ) + ω(+∞) is linear in the loss
measure ω and nondecreasing in each loss; so is it after composing with any positive
measure): (i) adding positive mass, (ii) moving mass to a higher loss or to +∞, and
(iii) splitting an atom at ℓ between grid points ℓ₋ < ℓ < ℓ₊ with the masses that keep
its total and its E[e^{-L}] (Jensen: (1 - x e^{-ℓ})₊ is convex in e^{-ℓ}; this is
connect-the-dots, Doroshenko et al. 2022, applied to a discrete PLD) never decrease any
δ(ε), and each survives composition with the other factors. Stage 1 is the tilted FFT of
``_pld_compose`` on the block's window: what the circular convolution folds in is extra
positive mass, the round-off bound is added to every bin; the true mass below the window is
bounded by Chernoff, min_θ e^{bΛ(-θ) + θ·bottom}, and added at the window's bottom (ii);
the true mass above its top, min_θ e^{bΛ(θ) - θ·top}, and the +∞ mass 1 - (1 - p∞)^b go to
+∞ (ii). The block is then split onto the coarse grid (iii, the weights rounded up by
(1 + (2R + 16)u), a sum of positive terms); stage 2 adds its own certified folds, tail and
round-off as in ``_pld_compose.compose``, and the +∞ mass of the blocks composes as
Π_b (f_b + i_b)^{k_b} - Π_b f_b^{k_b} (f_b the block's finite mass, bounded from above).
The windows are chosen a priori from the plan's moment generating functions; nothing in
the choice needs to be right for the result to be certified.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._numerics import f64, min_and_first
from ._pld_curves import curve, lse, masses, tilted_fft

_U = float(np.finfo(np.float64).eps)
_TINY = float(np.finfo(np.float64).tiny)
# Numbers of blocks m the plan chooses from.
_BLOCK_COUNTS = np.array([2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0])
# Each block's tails outside its window (moved to its bottom or to +∞) are planned below
# δ·this/m in all (they add to δ about m times).
_ETA_BLOCK = 1e-7
# ... and the block's window holds its λ-tilted law (what the answer depends on) to this many
# standard deviations (what folds there is extra mass, ≈ Φ̄(z) of δ relative).
_Z_TILT = 7.0
# Chernoff exponents around the plan's, for the block's certified tails.
_CHERNOFF_WINDOW = True
# One step's cut: its mass at +∞ over all steps is planned below δ·this; the ladder's points.
_ETA_STEP = 1e-5
_CUTS = 128
# At most this much of the blocks' mass in all is planned below their windows.
_MASS_MOVED = 1e-4
_FACTORS = np.array([0.7, 1.0, 1.4])
_W_FACTORS = np.array([4.0, 16.0, 64.0])  # ... and these over the block's window width


class BlockPlan(NamedTuple):
    h2: jax.Array  # stage-2 spacing
    m: jax.Array  # number of blocks
    windows: dict  # direction -> per mechanism (R, c0, θ_top, θ_bottom, one step's grid bottom): h₁ = h₂/R


def _window(pos, neg, m_t, v_t, thetas, b, lvl_top, lvl_bot, lvl_mass, lam):
    """A block's window [bottom, top] (per m of the ladder) and the Chernoff exponents of its tails.

    Mass at ℓ ≥ top moved to +∞ raises δ(ε) by at most its mass times e^{ε - top} (the rest
    of the composition has E_P[e^{-L}] ≤ 1), so the top solves
    bΛ(θ) - θ·top + ε - top = lvl_top; mass below the bottom moved up to it raises δ by at
    most its mass times δ_rest(ε - bottom) ≤ e^{Λ_rest(λ) - λ(ε - bottom)}, so the bottom
    solves bΛ(-θ) + θ·bottom + λ·bottom = lvl_bot (both with the best θ of the ladder). The
    window also holds the block's λ-tilted law to ± z standard deviations.
    """
    top_obj = (b[:, None] * pos[None, :] - lvl_top[:, None]) / thetas[None, :]
    top = jnp.min(top_obj, axis=1)
    th_top = jnp.max(jnp.where(top_obj <= top[:, None], thetas[None, :], 0.0), axis=1)
    bot_obj = (lvl_bot[:, None] - b[:, None] * neg[None, :]) / (thetas[None, :] + lam)
    # ... and at most a small fraction of the block's mass is moved (the bound above is the
    # first-order term of moving mass in every block at once).
    bot_obj = jnp.minimum(bot_obj, (lvl_mass[:, None] - b[:, None] * neg[None, :]) / thetas[None, :])
    bot = jnp.max(bot_obj, axis=1)
    th_bot = jnp.max(jnp.where(bot_obj >= bot[:, None], thetas[None, :], 0.0), axis=1)
    sd = _Z_TILT * jnp.sqrt(b * jnp.maximum(v_t, 0.0))
    if _CHERNOFF_WINDOW:
        return jnp.minimum(bot, b * m_t - sd), jnp.maximum(top, b * m_t + sd), th_top, th_bot
    return b * m_t - sd, b * m_t + sd, th_top, th_bot


def block_plan(kinds, params, stats, thetas, counts, ranges, plans, span_c, n) -> BlockPlan:
    """The number of blocks m, the stage-2 spacing h₂ and each block's window (estimates only).

    Per mechanism c (count k) and direction: one step's grid ends at the cut c_s where
    k·δ_c(c_s) ≤ δ·η_s (the mass above goes to +∞ at every step); for each m of
    ``_BLOCK_COUNTS`` the window of a and a + 1 steps (a = ⌊k/m⌋) from the plan's discrete
    log-MGF Λ_c of that truncated step (:func:`_window`), also holding 0 and one step's grid;
    h₂ = max(composed window, block windows)/(n - 2), R = ⌊n h₂/(W₁ + h₂)⌋ ≥ 1. m minimises
    the estimated error Σ_c (k_c h₁² + min(m, k_c) h₂²) (the larger direction).
    """
    big_m = f64(_BLOCK_COUNTS)
    k_tot = sum(jnp.where(jnp.isfinite(x) & (x >= 0), x, 0.0) for x in counts)
    per = {}
    w_max = jnp.zeros(big_m.shape)
    for d, st in stats.items():
        lam, eps_hi, eps_lo, log_dt = plans[d][:4]
        lvl = log_dt + jnp.log(_ETA_BLOCK) - jnp.log(big_m)
        lvl_mass = math.log(_MASS_MOVED) - jnp.log(big_m)
        per[d] = []
        for kd, p_, (_, neg, m_t, v_t, logp, grid), k, (b_s, t_s) in zip(kinds, params, st, counts, ranges[d]):
            kf = jnp.where(jnp.isfinite(k) & (k >= 0), k, 0.0)
            # One step's cut: the lowest point of a ladder in [b_s, t_s] with k·δ(c) ≤ δ·η_s.
            ladder = b_s + (t_s - b_s) * f64(np.arange(1, _CUTS + 1) / _CUTS)
            d_cut = curve(kd, p_, ladder, d, "upper")
            ok = jnp.log(jnp.maximum(kf, 1.0) * jnp.clip(d_cut, 0.0, 1.0)) <= log_dt + math.log(_ETA_STEP)
            c_s = jnp.min(jnp.where(ok, ladder, t_s))
            # Λ_c of the step truncated there (the plan's coarse masses; above: +∞).
            pos = lse(jnp.where(grid <= c_s, logp, -jnp.inf)[None, :], thetas[:, None] * grid[None, :])
            a = jnp.floor(kf / big_m)
            mgf_lam = jnp.sum(jnp.where(thetas == lam, pos, 0.0))  # λ is on the ladder
            lvl_bot = lvl - (k_tot - a) * mgf_lam + lam * eps_lo
            lo0, hi0, _, _ = _window(pos, neg, m_t, v_t, thetas, a, lvl, lvl_bot, lvl_mass, lam)
            lo1, hi1, th_top, th_bot = _window(pos, neg, m_t, v_t, thetas, a + 1.0, lvl, lvl_bot - mgf_lam, lvl_mass, lam)
            bot = jnp.minimum(jnp.minimum(lo0, lo1), 0.0)
            top = jnp.maximum(jnp.maximum(hi0, hi1), 0.0)
            bot = jnp.where(jnp.isfinite(bot), bot, -0.5)
            # One step's grid starts where a step below cannot lift a block into its window
            # (mass below a grid is moved up to it by connect-the-dots).
            lo_s = jnp.minimum(jnp.maximum(b_s, bot - a * jnp.maximum(t_s, 0.0)), c_s - h_min(c_s, b_s))
            w1 = jnp.maximum(top - bot, c_s - lo_s)
            w1 = jnp.where(jnp.isfinite(w1) & (w1 > 0), w1, 1.0)
            w_max = jnp.maximum(w_max, w1)
            per[d].append((kf, bot, w1, th_top, th_bot, lo_s, c_s))
    h2 = jnp.maximum(span_c, w_max) / (n - 2)
    err = jnp.zeros(big_m.shape)
    for d in per:
        e_d = jnp.zeros(big_m.shape)
        for kf, bot, w1, *_ in per[d]:
            r = jnp.maximum(jnp.floor(n * h2 / (w1 + h2)), 1.0)
            e_d = e_d + kf * (h2 / r) ** 2 + jnp.minimum(big_m, kf) * h2**2
        err = jnp.maximum(err, e_d)
    # The smallest m at the minimum (big_m ascending: the first; within 8 ulps, see min_and_first).
    sel = min_and_first(err)[2]
    pick = lambda x: jnp.sum(jnp.where(sel, x, 0.0))  # noqa: E731
    h2_s = pick(h2)
    windows = {}
    for d in per:
        windows[d] = []
        for kf, bot, w1, th_top, th_bot, lo_s, c_s in per[d]:
            w = pick(w1)
            r = jnp.maximum(jnp.floor(n * h2_s / (w + h2_s)), 1.0)
            windows[d].append((r, jnp.floor(pick(bot) / h2_s), pick(th_top), pick(th_bot), pick(lo_s), c_s))
    return BlockPlan(h2_s, pick(big_m), windows)


def h_min(c_s, b_s):
    """A step's grid is at least this long below its cut (a sliver of its range)."""
    return 1e-3 * jnp.maximum(c_s - b_s, 0.0)


def _regrid(p, r, h1, h2, lam, n):
    """Masses on fine bins c0·h₂ + j·h₁ split onto the coarse bins (c0 + i)·h₂ (h₂ = R·h₁).

    The atom at offset t·h₁ in [i·h₂, (i+1)·h₂) sends w = (1 - e^{-t h₁})/(1 - e^{-h₂}) of
    its mass up and 1 - w down: total and E[e^{-L}] kept (connect-the-dots of atoms). The
    sums over each coarse bin's R atoms are differences of prefix sums, taken in the domain
    tilted by λ (as the FFT's): their round-off, at most 2nu times the tilted total per bin
    (Higham 2002 §4.2), is added there (to the bins that receive atoms), so it is relative
    to the tilted law, whatever δ.
    The weights are rounded up by (1 + 16u).
    """
    j = jnp.arange(n, dtype=jnp.float64)
    c = jnp.floor(j / r)
    t = j - c * r
    w = jnp.where(t > 0, jnp.expm1(-t * h1) / jnp.expm1(-h2), 0.0)
    logp = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), -jnp.inf)
    # Tilt relative to the coarse point below each atom: e^{λ(ℓ - t h₁)} = e^{λ c h₂}·const.
    a = lse(logp, lam * c * h2)
    pt = jnp.exp(jnp.where(p > 0, logp + lam * c * h2 - a, -jnp.inf)) * (1.0 + 16.0 * _U)
    lo_t = pt * (1.0 - w)
    hi_t = pt * w * jnp.exp(lam * h2)  # tilted at the coarse point above
    ends = jnp.minimum((j + 1.0) * r, float(n)).astype(jnp.int32)
    starts = jnp.minimum(j * r, float(n)).astype(jnp.int32)

    def block_sums(x):
        s_ = jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(x)])
        return jnp.where(starts < n, jnp.maximum(s_[ends] - s_[starts], 0.0) + 2.0 * n * _U * s_[-1], 0.0)

    lo = block_sums(lo_t)
    hi = jnp.concatenate([jnp.zeros((1,)), block_sums(hi_t)[:-1]])
    tot = lo + hi
    pos = tot > 0  # (double where: no NaN derivative from log 0)
    out = jnp.exp(jnp.minimum(jnp.log(jnp.where(pos, tot, 1.0)) + a - lam * j * h2, 0.0))
    return jnp.where(pos, out, 0.0)


def blocks(kind, params, count, direction, lam, bp: BlockPlan, c, single_range, n):
    """Stage 1 for one mechanism: its two blocks on the stage-2 grid, certified (module docstring).

    Returns:
      ``[(c0, coarse grid, masses, +∞ mass, finite mass bound f, count in stage 2)]`` for the
      blocks of a = ⌊k/m⌋ steps (m - r of them) and of a + 1 steps (r of them).
    """
    r_, c0, th_top, th_bot, lo_s, c_s = bp.windows[direction][c]
    h2, m = bp.h2, bp.m
    h1 = h2 / r_
    j = jnp.arange(n, dtype=jnp.float64)
    o = jnp.floor(lo_s / h1)
    grid = (o + j) * h1
    cut = (o + jnp.clip(jnp.ceil(c_s / h1 - o), 1.0, n - 1.0)) * h1
    p, p_inf = masses(kind, params, grid, h1, direction, "upper", cut)
    logp = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), -jnp.inf)
    # Chernoff exponents: the plan's, the tilt, and multiples of 1/window (the plan's can be
    # off, e.g. for a one-sided step law such as the add direction's, or a block of one step).
    extra = jnp.concatenate([lam[None], f64(_W_FACTORS) / (n * h1)])
    ths_top = jnp.concatenate([th_top * f64(_FACTORS), extra])
    ths_bot = jnp.concatenate([th_bot * f64(_FACTORS), extra])
    pos = lse(logp[None, :], ths_top[:, None] * grid[None, :])
    neg = lse(logp[None, :], -ths_bot[:, None] * grid[None, :])
    kf = jnp.where(jnp.isfinite(count) & (count >= 0), count, 0.0)
    a = jnp.floor(kf / m)
    rem = kf - a * m
    a1 = c0 * r_  # the window's first fine bin: on a coarse grid point
    losses = (a1 + j) * h1
    coarse_l = (c0 + j) * h2
    bottom, top = a1 * h1, (a1 + n) * h1
    out = []
    for b, kb in ((a, m - rem), (a + 1.0, rem)):
        r_t, margin, big_lam = tilted_fft([(o, grid, p)], [b], lam, a1, n)
        mass = jnp.maximum(r_t, 0.0) + margin
        probs = jnp.exp(jnp.minimum(jnp.log(mass) + big_lam - lam * losses, 0.0))
        some = b > 0
        t_up = jnp.exp(jnp.minimum(jnp.min(b * pos - ths_top * top), 0.0))
        c_lo = jnp.exp(jnp.minimum(jnp.min(b * neg + ths_bot * bottom), 0.0))
        probs = probs.at[0].add(c_lo)
        # No step: the point mass at loss 0, exactly.
        probs = jnp.where(some, probs, (a1 + j == 0.0).astype(probs.dtype))
        p_inf_b = -jnp.expm1(b * jnp.log1p(-jnp.minimum(p_inf, 1.0 - 1e-16))) + jnp.where(some, t_up, 0.0) \
            + n * _TINY
        coarse = _regrid(probs, r_, h1, h2, lam, n)
        # A coarse bin holds the mass of atoms in [ℓ - h₂, ℓ + h₂) only, at most P(S < ℓ + h₂)
        # and P(S ≥ ℓ - h₂) (Chernoff): far from the tilt's centre this, not the untilted
        # round-off bounds, is the smaller (it keeps the blocks' moment generating functions
        # and finite masses sharp).
        cap = jnp.minimum(jnp.min(b * neg[:, None] + ths_bot[:, None] * (coarse_l + h2)[None, :], axis=0),
                          jnp.min(b * pos[:, None] - ths_top[:, None] * (coarse_l - h2)[None, :], axis=0))
        coarse = jnp.where(some, jnp.minimum(coarse, jnp.exp(jnp.minimum(cap, 0.0))), coarse)
        f = jnp.sum(coarse) * (1.0 + n * _U)
        out.append((c0, coarse_l, coarse, p_inf_b, f, kb))
    return out
