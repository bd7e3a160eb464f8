r"""Privacy loss distributions (PLD): tight (ε, δ) of composed mechanisms, under ``jit``.

The privacy loss of a dominating pair (P, Q) is :math:`L = \log(P(x)/Q(x))`, x ~ P; after
adaptive composition the losses add, and the hockey-stick divergence is
:math:`δ(ε) = E[(1 - e^{ε - L})_+]` (+ the mass of L = +∞). This module discretises L on a
uniform grid, composes by FFT (self-composition by a power in the Fourier domain,
heterogeneous composition by a product), and reads δ(ε) and ε(δ) off the result. Every
step runs under ``jax.jit`` and ``jax.vmap`` with a **static** grid size; all values
(noise multipliers, rates, counts, δ, ε) are traced.

Upper bound (``estimate="upper"``, the default; a proof sketch, see docs/pld.md):

1. *Connect-the-dots discretisation* (Doroshenko et al. 2022, Algorithm 1). For grid
   losses :math:`ε_0 < … < ε_{n-1}` (spacing h) the discrete PLD whose hockey-stick curve
   interpolates the exact δ(ε_i) linearly in :math:`e^{ε}` (and joins (e^ε = 0, δ = 1)
   below the grid) has mass
   :math:`p_i = \frac{δ_{i+1} - δ_i}{e^h - 1} - e^h\frac{δ_i - δ_{i-1}}{e^h - 1}`
   (:math:`δ_{-1} = 1` through the chord, :math:`δ_n` = 0 slope above), and mass
   :math:`δ(ε_{n-1})` at +∞. δ is convex in :math:`e^ε`, so the interpolation lies above
   it: the discrete pair dominates the true pair (their Theorem 4.2), also after any
   composition. Mass below the grid is moved up to ε_0 (the chord); mass above it goes
   to +∞, i.e. into δ.
2. *FFT composition on a window.* The composed discrete loss lives on bins
   :math:`(A + j)h`, j < n. The circular convolution aliases mass outside the window
   into it; as :math:`(1 - e^{ε - ℓ})_+` is non-decreasing in ℓ and at most 1, mass
   aliased from below only raises δ, and mass above the window is added to δ in full:
   a certified Chernoff bound :math:`\min_λ \prod_c M_c(λ)^{k_c} e^{-λ(A+n)h}` computed
   from the discrete moment generating functions :math:`M_c` themselves.
3. *Floating point.* FFT round-off is bounded normwise (Higham 2002, §24.1) by
   :math:`≈ u\log_2 n` relative; the power multiplies it by the count. A margin
   :math:`8u(\log_2 n + 2)(1 + \sum_c k_c‖p_c‖_2)(‖\hat C‖_2 + 1) + 4nu` is added to δ
   (a rounding model, not an interval-arithmetic proof); negative round-off masses are
   set to 0 (which only raises δ).
4. Two directions for add/remove-one Poisson sampling (remove: P = (1-q)N(0,σ²) +
   qN(1,σ²), Q = N(0,σ²); add: the reverse), each composed on its own; δ is the larger,
   ε the larger (dp_accounting does the same). The Gaussian and Laplace pairs are
   symmetric (one direction).

So ``pld_delta`` is an upper bound on the true δ(ε) and ``pld_epsilon`` (the exact
solution of δ(ε) = target on the discrete curve, which is continuous and piecewise
:math:`S - e^{ε}T` between bins) an upper bound on the true ε(δ).

Lower bound (``estimate="lower"``): privacy buckets rounded down (Meiser & Mohammadi
2018): the mass of L in :math:`(ε_i, ε_{i+1}]` is placed at ε_i, mass above the grid at
its top, mass below dropped; composition of losses that are each smaller gives a smaller
δ; the window's aliasing is corrected by subtracting a Chernoff bound on the mass below
it and the rounding margin. Its gap to the upper bound is first order in h (about
:math:`\sum_c k_c h/2` in ε), so it brackets the truth but is much looser than the upper
bound's own error, which is second order in h (Doroshenko et al., §4).

The grid: spacing h = W/(n - 2), W the larger of the composed window (from the RDP tail
bound :math:`\min_α K D_α + \log(1/τ)/(α - 1)` above, and a symmetric margin about an
upper estimate of the mean below) and every single mechanism's own range (its tail at
τ/K). Both are values, so h adapts to each configuration without recompiling. The
accuracy knob is ``grid_size`` (static n, a power of two): error ∝ h² for the upper
bound; time ∝ n log n.

Differentiable (``jax.grad``) in the noise multipliers and q: the masses are smooth
functions of them at a fixed grid (h moves with them too), and the read-out is smooth
between bins. Counts are integers (no gradient). At the kinks where the read-out moves
to another bin the derivative is one-sided.

References:
  V. Doroshenko, B. Ghazi, P. Kamath, R. Kumar, P. Manurangsi, "Connect the Dots: Tighter
  Discrete Approximations of Privacy Loss Distributions", PoPETs 2022, Algorithm 1 and
  Theorem 4.2.
  S. Meiser, E. Mohammadi, "Tight on Budget? Tight Bounds for r-Fold Approximate
  Differential Privacy", CCS 2018 (privacy buckets).
  A. Koskela, J. Jälkö, A. Honkela, "Computing Tight Differential Privacy Guarantees Using
  FFT", AISTATS 2020 (FFT composition).
  I. Mironov, K. Talwar, L. Zhang, "Rényi Differential Privacy of the Sampled Gaussian
  Mechanism", arXiv:1908.10530 (the two directions, RDP for the window).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._numerics import f64, float64, log_ndtr

__all__ = [
    "PLD_GRID_SIZE",
    "PLD_TAIL_BOUND",
    "PLDBracket",
    "pld_epsilon",
    "pld_delta",
    "pld_bracket",
    "calibrate_pld_noise_multiplier",
]

PLD_GRID_SIZE = 2**14
PLD_TAIL_BOUND = 1e-6
_ESTIMATES = ("upper", "lower")
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
_EXTEND = np.concatenate([[0.0], 2.0 ** (np.arange(0, 24) / 2.0) - 0.75])
_FOLD_LOG_LOWER = 4.6


class PLDBracket(NamedTuple):
    """ε from the optimistic and the pessimistic PLD: the true ε lies in [lower, upper]."""

    lower: jax.Array
    upper: jax.Array
    width: jax.Array


# =======================================================================================
# Hockey-stick curves δ(ε) and survival functions P(L > ε) of the dominating pairs.
# =======================================================================================


def _delta_gauss(eps, mu):
    """δ of N(μ,1) vs N(0,1): Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2), as e^a(1 - e^{b-a})."""
    a = log_ndtr(-eps / mu + mu / 2.0)
    b = eps + log_ndtr(-eps / mu - mu / 2.0)
    return jnp.exp(a) * -jnp.expm1(jnp.minimum(b - a, 0.0))


def _survival_gauss(eps, mu):
    return jnp.exp(log_ndtr(-eps / mu + mu / 2.0))


def _sgm_y(eps, q, sign):
    """y = log((e^{±ε} - 1 + q)/q) where defined (double-where outside), and the mask."""
    lq = jnp.log1p(-q)  # -inf at q = 1
    inside = (sign * eps > lq) if sign > 0 else (eps < -lq)
    e_s = jnp.where(inside, eps, jnp.where(sign > 0, 1.0, -1.0) + jnp.where(jnp.isfinite(lq), sign * lq, 0.0))
    y = jnp.log(jnp.expm1(sign * e_s) + q) - jnp.log(q)
    return y, inside


def _delta_sgm(eps, q, sigma, direction):
    """δ of the Poisson-sampled Gaussian, remove (P = mixture) or add (Q = mixture) direction.

    Remove: for ε > log(1-q), δ = q δ_G(y) with y = log((e^ε - 1 + q)/q), μ = 1/σ; else 1 - e^ε.
    Add: for ε < -log(1-q), δ = (1 - (1-q)e^ε) δ_G(-y'), y' = log((e^{-ε} - 1 + q)/q); else 0.
    (Substituting the threshold x* = σ²y + 1/2 of the monotone loss into
    P(L > ε) - e^ε Q(L > ε) gives these Gaussian forms.)
    """
    mu = 1.0 / sigma
    q_s = jnp.where(q > 0, q, 1.0)
    if direction == "remove":
        y, inside = _sgm_y(eps, q_s, 1)
        d = jnp.where(inside, q_s * _delta_gauss(y, mu), -jnp.expm1(jnp.minimum(eps, 0.0)))
    else:
        y, inside = _sgm_y(eps, q_s, -1)
        d = jnp.where(inside, -jnp.expm1(eps + jnp.log1p(-q_s)) * _delta_gauss(-y, mu), 0.0)
    # q = 0: the loss is 0 (δ = (1 - e^ε)_+).
    return jnp.where(q > 0, d, -jnp.expm1(jnp.minimum(eps, 0.0)))


def _survival_sgm(eps, q, sigma, direction):
    q_s = jnp.where(q > 0, q, 1.0)
    if direction == "remove":
        y, inside = _sgm_y(eps, q_s, 1)
        z0, z1 = sigma * y + 0.5 / sigma, sigma * y - 0.5 / sigma
        s = (1.0 - q_s) * jnp.exp(log_ndtr(-z0)) + q_s * jnp.exp(log_ndtr(-z1))
        s = jnp.where(inside, s, 1.0)
    else:
        y, inside = _sgm_y(eps, q_s, -1)
        s = jnp.where(inside, jnp.exp(log_ndtr(sigma * y + 0.5 / sigma)), 0.0)
    return jnp.where(q > 0, s, jnp.where(eps < 0, 1.0, 0.0))


def _delta_laplace(eps, b):
    """δ of Lap(1, b) vs Lap(0, b): 1 - e^{ε/2 - 1/(2b)} on [-1/b, 1/b], 1 - e^ε below, 0 above."""
    inv = 1.0 / b
    mid = -jnp.expm1(jnp.minimum(eps / 2.0 - inv / 2.0, 0.0))
    low = -jnp.expm1(jnp.minimum(eps, 0.0))
    return jnp.where(eps >= inv, 0.0, jnp.where(eps <= -inv, low, mid))


def _survival_laplace(eps, b):
    inv = 1.0 / b
    mid = 1.0 - 0.5 * jnp.exp(jnp.minimum(eps / 2.0 - inv / 2.0, 0.0))
    return jnp.where(eps >= inv, 0.0, jnp.where(eps < -inv, 1.0, mid))


# =======================================================================================
# The event tree as a list of mechanisms with counts.
# =======================================================================================


def _components(event, count=None):
    """``[(kind, params, count)]`` of an event tree; kind static, params and counts leaves."""
    from ._events import Composed, Gaussian, Laplace, PoissonSampled, SelfComposed

    one = f64(1.0) if count is None else count
    if isinstance(event, Gaussian):
        return [("gaussian", (f64(event.noise_multiplier),), one)]
    if isinstance(event, Laplace):
        return [("laplace", (f64(event.noise_multiplier),), one)]
    if isinstance(event, PoissonSampled):
        inner = event.event
        if not isinstance(inner, Gaussian) or inner.relation != "add_remove":
            raise ValueError("the PLD accountant covers PoissonSampled(q, Gaussian(...)) under add_remove only; "
                             f"got PoissonSampled({type(inner).__name__}, relation={getattr(inner, 'relation', None)!r}).")
        return [("sampled_gaussian", (f64(event.q), f64(inner.noise_multiplier)), one)]
    if isinstance(event, SelfComposed):
        c = f64(event.count)
        k = jnp.where(c >= 0, jnp.ceil(jnp.where(c >= 0, c, 0.0)), jnp.nan)
        return _components(event.event, k * one)
    if isinstance(event, Composed):
        out = []
        for e in event.events:
            out.extend(_components(e, one))
        return out
    raise ValueError(f"the PLD accountant does not cover {type(event).__name__} events "
                     "(Gaussian, Laplace, PoissonSampled Gaussian and their compositions only).")


def _directions(kinds) -> tuple[str, ...]:
    return ("remove", "add") if "sampled_gaussian" in kinds else ("remove",)


def _curve(kind, params, eps, direction, estimate):
    if kind == "gaussian":
        return (_delta_gauss if estimate == "upper" else _survival_gauss)(eps, 1.0 / params[0])
    if kind == "laplace":
        return (_delta_laplace if estimate == "upper" else _survival_laplace)(eps, params[0])
    fn = _delta_sgm if estimate == "upper" else _survival_sgm
    return fn(eps, params[0], params[1], direction)


def _ctd(d, h):
    """Connect-the-dots masses from hockey-stick values d_i on a grid of spacing h."""
    em1 = jnp.expm1(h)
    diff = jnp.diff(d)  # δ_{i+1} - δ_i ≤ 0
    right = jnp.concatenate([diff / em1, jnp.zeros((1,))])
    left = jnp.concatenate([(1.0 - d[:1]), -diff * (1.0 + em1) / em1])
    # p_0 = (1 - δ_0) + (δ_1 - δ_0)/(e^h - 1);  p_i = (δ_{i+1}-δ_i)/(e^h-1) - e^h (δ_i - δ_{i-1})/(e^h-1)
    return left + right


def _ctd_complement(g, eps_grid, h):
    """The same masses from g(ε) = δ(ε) - (1 - e^ε) = e^ε Q(L ≤ ε) - P(L ≤ ε).

    The linear part 1 - e^ε of δ has zero second differences on the grid, so it drops
    out: where δ is close to 1 (below and at the bottom of the loss support) these masses
    are free of the cancellation that the differences of δ ≈ 1 would suffer (there g is
    small and accurate, often exactly 0).
    """
    em1 = jnp.expm1(h)
    diff = jnp.diff(g)
    right = jnp.concatenate([diff / em1, jnp.zeros((1,))])
    left = jnp.concatenate([-g[:1], -diff * (1.0 + em1) / em1])
    # The last bin keeps e^{ε_{n-1}} from the linear part (its right neighbour is +∞).
    last = jnp.concatenate([jnp.zeros((eps_grid.shape[0] - 1,)), jnp.exp(eps_grid[-1:])])
    return left + right + last


_REVERSE = {"remove": "add", "add": "remove"}


def _masses(kind, params, eps_grid, h, direction, estimate, cut_loss=None):
    """Masses on the grid and the mass at +∞ (pessimistic CTD, or optimistic buckets).

    ``cut_loss`` (a grid point) ends the grid there: the curve is held constant above it, so
    the upper bound's mass above it goes to +∞ (δ(cut)) and the lower bound's to the cut.
    """
    beyond = None
    if cut_loss is not None:
        beyond = eps_grid >= cut_loss
        eps_grid = jnp.minimum(eps_grid, cut_loss)
    if estimate == "upper":
        d = jnp.clip(_curve(kind, params, eps_grid, direction, "upper"), 0.0, 1.0)
        # g(ε) = e^ε δ_reverse(-ε): the hockey stick of the swapped pair (Q, P).
        rev = _REVERSE[direction] if kind == "sampled_gaussian" else direction
        g = jnp.exp(jnp.minimum(eps_grid, 700.0)) * jnp.clip(_curve(kind, params, -eps_grid, rev, "upper"), 0.0, 1.0)
        p_d = _ctd(d, h)
        p_g = _ctd_complement(g, eps_grid, h)
        # Each bin from the formula whose three inputs are smaller (round-off is relative to
        # them): δ decreases and g increases with ε, so compare δ_{i-1} with g_{i+1}. Where
        # δ = 1 - e^ε exactly (no loss there) g is 0 and so are the masses; differences of
        # δ would leave round-off noise that, clipped at 0, adds up to spurious mass.
        # Round-off can still leave a tiny negative mass; it is set to 0 (raises δ).
        d_prev = jnp.concatenate([jnp.ones((1,)), d[:-1]])
        g_next = jnp.concatenate([g[1:], jnp.full((1,), jnp.inf)])
        p = jnp.where(d_prev <= g_next, p_d, p_g)
        if beyond is not None:
            p = jnp.where(beyond, p_d, p)
        return jnp.maximum(p, 0.0), d[-1]
    s = jnp.clip(_curve(kind, params, eps_grid, direction, "lower"), 0.0, 1.0)
    p = jnp.concatenate([s[:-1] - s[1:], s[-1:]])
    return p, jnp.zeros(())


def _safe_pow(c, k):
    """c**k for complex c and a real count k ≥ 0 (0 where |c| underflows), grad-safe."""
    ok = jnp.abs(c) > 1e-300
    c_s = jnp.where(ok, c, 1.0 + 0.0j)
    # exp(k Log c) = c^k exactly for integer k, whatever branch of the logarithm.
    out = jnp.exp(k * jnp.log(c_s))
    return jnp.where(ok, out, jnp.where(k > 0, 0.0, 1.0).astype(out.dtype))


def _logsumexp_weighted(logp, x):
    m = jax.lax.stop_gradient(jnp.max(jnp.where(jnp.isfinite(x), x, -jnp.inf), axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    s = jnp.sum(jnp.exp(jnp.where(jnp.isfinite(logp), logp, -jnp.inf) + x - m), axis=-1)
    pos = s > 0
    return jnp.where(pos, jnp.log(jnp.where(pos, s, 1.0)) + m[..., 0], -jnp.inf)


class _Composed(NamedTuple):
    probs: jax.Array  # (n,) masses on bins (A + j) h
    losses: jax.Array  # (n,) the bin losses
    extra: jax.Array  # mass counted as +∞ (upper: ∞-mass + tail) or subtracted (lower)
    fold: object = None  # lower bound: ε ↦ bound on the mass folded down onto losses > ε


def _single_range(kind, params, direction, z):
    """Loss range [b, t] of one mechanism outside which each tail has mass ≤ Φ̄(z) (a placement).

    Gaussian (μ = 1/σ): L ~ N(μ²/2, μ²). Laplace: L ∈ [-1/b, 1/b]. Poisson-sampled Gaussian,
    remove: L = log(1 - q + q e^g) ≥ log(1 - q), and L > t only if g > y, g ~ N(μ²/2, μ²)
    under the mixture's worse component; add: L = -log(1 - q + q e^{g'}) ≤ -log(1 - q).
    Mass below b is moved up to the grid (the chord), mass above t goes to +∞ (exactly,
    δ(top)): the range only places the grid, it certifies nothing.
    """
    if kind == "laplace":
        inv = 1.0 / params[0]
        return -inv, inv
    mu = 1.0 / params[-1]
    if kind == "gaussian":
        return 0.5 * mu * mu - z * mu, 0.5 * mu * mu + z * mu
    q = jnp.clip(params[0], 1e-300, 1.0)
    lq = jnp.log1p(-jnp.minimum(q, 1.0 - 1e-16))
    lq = jnp.where(q < 1.0, lq, -1e300)
    logq = jnp.log(q)
    if direction == "remove":
        b = jnp.maximum(lq, logq - 0.5 * mu * mu - z * mu)
        t = jnp.logaddexp(lq, logq + mu * z + 0.5 * mu * mu)
    else:
        t = jnp.minimum(-lq, -logq + 0.5 * mu * mu + z * mu)
        b = -jnp.logaddexp(lq, logq + mu * z - 0.5 * mu * mu)
    return b, t


def _lse(logp, x):
    """log Σ_i exp(logp_i + x_i) along the last axis (-inf for no mass; logp may be -inf)."""
    v = jnp.where(jnp.isfinite(logp), logp + x, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(v, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    s = jnp.sum(jnp.exp(v - m), axis=-1)
    pos = s > 0
    return jnp.where(pos, jnp.log(jnp.where(pos, s, 1.0)) + m[..., 0], -jnp.inf)


def _cut(o, t, h, n):
    """The grid point (o + i)h, i < n, at or just above the loss t (the grid's end)."""
    i = jnp.clip(jnp.ceil(t / h - o), 1.0, n - 1.0)
    return (o + i) * h


def _plan(kinds, params, counts, direction_list, query, what, tau):
    """The grid spacing, and per direction the tilt λ and the window's top (all estimates).

    A coarse pass (``_COARSE`` bins per mechanism) gives the discrete log moment generating
    function Λ(θ) = Σ_c k_c log Σ_i p_{c,i} e^{θ ℓ_i} on a ladder of θ. For ε(δ) the
    Chernoff point ε_ch = min_θ (Λ(θ) - log δ)/θ and its θ are the tilt's centre; the
    answer lies a little below (saddle point, ε_ch - log(λ s √(2π))/λ, s² the tilted
    variance); the window covers [answer - 2 s, Chernoff point at δ·η]. For δ(ε) the
    window starts just below ε. The spacing is the larger of that span and every
    mechanism's own range over n - 2 bins. Nothing here needs to be exact: the result is
    certified for any plan (see :func:`_compose`); the plan only makes it tight.
    """
    ks = [jnp.where(jnp.isfinite(k) & (k >= 0), k, 0.0) for k in counts]
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
    ranges = {d: [_single_range(kd, p, d, z) for kd, p in zip(kinds, params)] for d in direction_list}
    span_s = jnp.max(jnp.stack([t - b for d in direction_list for b, t in ranges[d]]))
    span_s = jnp.where(jnp.isfinite(span_s) & (span_s > 0), span_s, 1.0)
    n1 = _COARSE
    h1 = span_s / (n1 - 2)
    j1 = jnp.arange(n1, dtype=jnp.float64)
    thetas = f64(_THETAS) / span_s
    plans, spans = {}, []
    for d in direction_list:
        lam_mgf = jnp.zeros(thetas.shape)
        neg_mgf = jnp.zeros(thetas.shape)
        parts = []
        for kd, p_, k, (b, _) in zip(kinds, params, ks, ranges[d]):
            o1 = jnp.floor(b / h1)
            grid = (o1 + j1) * h1
            p, _ = _masses(kd, p_, grid, h1, d, "upper", _cut(o1, ranges[d][len(parts)][1], h1, n1))
            logp = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), -jnp.inf)
            lam_mgf = lam_mgf + k * _lse(logp[None, :], thetas[:, None] * grid[None, :])
            neg_mgf = neg_mgf + k * _lse(logp[None, :], -thetas[:, None] * grid[None, :])
            parts.append((logp, grid, k))
        if what == "epsilon":
            obj = (lam_mgf - log_dt) / thetas
        else:
            obj = lam_mgf - thetas * query
        best = jnp.min(obj)
        lam = jnp.max(jnp.where(obj <= best, thetas, 0.0))  # (no argmin, see _epsilon_read)
        if what == "delta":
            log_dt = jnp.minimum(best, 0.0)
        # Tilted variance at λ.
        var = jnp.zeros(())
        for logp, grid, k in parts:
            a = _lse(logp, lam * grid)
            w = jnp.exp(jnp.where(jnp.isfinite(logp), logp + lam * grid - a, -jnp.inf))
            m = jnp.sum(w * grid)
            var = var + k * jnp.sum(w * (grid - m) ** 2)
        s = jnp.sqrt(jnp.maximum(var, 0.0))
        # Top: the Chernoff point at δ·η (mass above it is certified and negligible).
        top_obj = (lam_mgf - (log_dt + math.log(_ETA))) / thetas
        top = jnp.min(top_obj)
        th_top = jnp.max(jnp.where(top_obj <= top, thetas, 0.0))
        if what == "epsilon":
            centre = best - jnp.log(jnp.maximum(lam * s * math.sqrt(2.0 * math.pi), 1.0)) / lam
            bottom = centre - _Z_BOTTOM * s
        else:
            bottom = query - 2.0 * h1
        # The window [b, top] holds [bottom, top] and reaches so far down that the mass folded
        # up by W = top - b, at most e^{-λW} P(L < b) ≤ e^{-λW + Λ(-θ) + θb}, is below δe^{-9}:
        # the smallest of a ladder of extensions below ``bottom`` that does.
        base = jnp.maximum(top - bottom, h1)
        b_c = bottom - base * f64(_EXTEND)
        log_below = jnp.minimum(jnp.min(neg_mgf[None, :] + thetas[None, :] * b_c[:, None], axis=1), 0.0)
        fits = -lam * (top - b_c) + log_below <= log_dt - _FOLD_LOG
        b_fit = jnp.max(jnp.where(fits, b_c, b_c[-1]))
        plans[d] = (lam, top, bottom, log_dt, th_top)
        spans.append(top - b_fit)
    span_c = jnp.max(jnp.stack(spans))
    return span_s, span_c, plans, z


def _compose(kinds, params, counts, n, tau, estimate, query, what):
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
    """
    directions = _directions(kinds)
    span_s, span_c, plans, z = _plan(kinds, params, counts, directions, query, what, tau)
    span_s, span_c = jax.lax.stop_gradient((span_s, span_c))
    h = jnp.maximum(span_s, span_c) / (n - 2)
    h = jnp.where(jnp.isfinite(h) & (h > 0), h, 1.0)
    w_all = n * h
    j = jnp.arange(n, dtype=jnp.float64)
    out = []
    for direction in directions:
        lam, top_need, bottom_need, log_dt, th_top = jax.lax.stop_gradient(plans[direction])
        # Tilt at least so much that the folded-up bulk (≤ e^{-λW}) is far below δ.
        if estimate == "lower":  # a smaller tilt folds less mass down (see _fold_down)
            lam = jnp.minimum(lam, jnp.maximum((_FOLD_LOG_LOWER - log_dt) / w_all, 0.5 * lam))
        lam = jnp.minimum(lam, 600.0 / w_all)
        # The window: the top at the Chernoff point, unless the span is shorter than W (then
        # the window is extended below; for δ(ε), the bottom stays just below ε).
        # Privacy buckets round each loss down, by h/2 on average: the lower bound's
        # composed loss sits about Σ_c k_c h/2 lower.
        shift = sum(jnp.where(jnp.isfinite(k), k, 0.0) for k in counts) * h / 2 if estimate == "lower" else 0.0
        if what == "delta":  # keep ε inside the window
            shift = jnp.minimum(shift, jnp.maximum(top_need - bottom_need - 2.0 * h, 0.0))
        a0 = jnp.ceil((top_need - jax.lax.stop_gradient(shift)) / h) - (n - 1)
        losses = (a0 + j) * h
        spec = jnp.ones((n // 2 + 1,), dtype=jnp.complex128)
        offset = jnp.zeros(())
        log_keep_inf = jnp.zeros(())
        big_lam = jnp.zeros(())
        # Chernoff exponents: the tilt and multiples (the lower bound's fold-down uses those
        # above λ), and the plan's exponent for the window's top.
        thetas = jnp.concatenate([lam * f64(_THETA_FACTORS), jnp.maximum(th_top, lam)[None] * f64([1.0, 1.5])])
        log_mgf = jnp.zeros(thetas.shape)
        neg_mgf = jnp.zeros(thetas.shape)
        norm_term = jnp.zeros(())
        for kd, p_, k in zip(kinds, params, counts):
            kf = jnp.where(jnp.isfinite(k), k, 0.0)
            b1, t1 = jax.lax.stop_gradient(_single_range(kd, p_, direction, z))
            o = jnp.floor(b1 / h)
            grid = (o + j) * h
            # The grid ends at the mechanism's planned top (as in the plan): above it the
            # moment generating function would be dominated by far tails that cost little δ.
            p, p_inf = _masses(kd, p_, grid, h, direction, estimate, _cut(o, t1, h, n))
            logp = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), -jnp.inf)
            a = _lse(logp, lam * grid)
            pt = jnp.exp(jnp.where(p > 0, logp + lam * grid - a, -jnp.inf))
            c = jnp.fft.rfft(pt)
            spec = spec * _safe_pow(c, k)
            offset = offset + k * o
            big_lam = big_lam + kf * a
            log_keep_inf = log_keep_inf + k * jnp.log1p(-jnp.minimum(p_inf, 1.0 - 1e-16))
            log_mgf = log_mgf + kf * _lse(logp[None, :], thetas[:, None] * grid[None, :])
            if estimate == "lower":
                neg_mgf = neg_mgf + kf * _lse(logp[None, :], -thetas[:, None] * grid[None, :])
            norm_term = norm_term + k * jax.lax.stop_gradient(jnp.sqrt(jnp.sum(pt * pt)))
        # Roll the circular result so that entry j is bin a0 + j: multiply by a phase
        # (an elementwise product; (f·s) mod n is exact in float64 for n ≤ 2^26).
        s = jnp.mod(a0 - offset, n)
        f = jnp.arange(n // 2 + 1, dtype=jnp.float64)
        phase = 2.0 * math.pi * jnp.mod(f * s, n) / n
        r_t = jnp.fft.irfft(spec * jnp.exp(1j * phase), n)
        # The rounding margin carries no derivative (it is a bound on round-off).
        spec_norm = jnp.sqrt(2.0 * jnp.sum(jnp.abs(jax.lax.stop_gradient(spec)) ** 2))
        margin = 8.0 * _U * (math.log2(n) + 2.0) * (1.0 + norm_term) * (spec_norm + 1.0) + 4.0 * n * _U
        p_inf_tot = -jnp.expm1(log_keep_inf)
        top = (a0 + n) * h  # smallest loss above the window
        log_scale = big_lam - lam * losses
        if estimate == "upper":
            t_up = jnp.exp(jnp.minimum(jnp.min(log_mgf - thetas * top), 0.0))
            mass = jnp.maximum(r_t, 0.0) + margin
            probs = jnp.exp(jnp.minimum(jnp.log(mass) + log_scale, 0.0))
            # Bins whose mass underflows lose at most n times the smallest normal.
            extra = p_inf_tot + t_up + n * _TINY
            fold = None
        else:
            mass = jnp.maximum(r_t - margin, 0.0)
            logm = jnp.where(mass > 0, jnp.log(jnp.where(mass > 0, mass, 1.0)), -jnp.inf)
            probs = jnp.exp(jnp.minimum(logm + log_scale, 0.0))
            # Mass below the window folded up by mW, scaled by e^{-λmW}: at most
            # P(L < bottom) e^{-λW}/(1 - e^{-λW}), P(L < b) ≤ min_θ e^{Λ(-θ) + θb}.
            bottom = a0 * h
            log_below = jnp.minimum(jnp.min(neg_mgf + thetas * bottom), 0.0)
            extra = -jnp.exp(log_below - lam * w_all) / -jnp.expm1(-lam * w_all)
            fold = functools.partial(_fold_down, log_mgf[1:], thetas[1:], lam, w_all)
        out.append(_Composed(probs, losses, extra, fold))
    return out


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


def _delta_read(c: _Composed, eps, estimate):
    w = -jnp.expm1(jnp.minimum(eps - c.losses, 0.0))
    w = jnp.where(c.losses > eps, w, 0.0)
    d = jnp.sum(c.probs * w) + c.extra
    if c.fold is not None:
        d = d - c.fold(eps)
    if estimate == "upper":  # below the window's bottom (never planned so) nothing is certified
        d = jnp.where(eps >= c.losses[0] - (c.losses[1] - c.losses[0]), d, 1.0)
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
    m = min(_BLOCK, n)
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


def _epsilon_read(c: _Composed, target):
    """Smallest ε ≥ 0 with δ(ε) ≤ target on the discrete curve (+inf if none on the grid).

    Between bins ε_{j-1} < ε ≤ ε_j the curve is :math:`δ(ε) = X + S - e^{ε} T` with
    S, T the sums of r_i and r_i e^{-ε_i} over i ≥ j: solved exactly there.
    """
    r, e = c.probs, c.losses
    n = r.shape[0]
    h = e[1] - e[0]
    s_next, d_next = _tail_sums(r, h)
    # The constant part of the curve on (ε_{j-1}, ε_j] (the lower bound's fold-down bound is
    # taken at ε_{j-1}, its largest value there).
    x = c.extra if c.fold is None else c.extra - c.fold(e - h)
    d_at = x + s_next - d_next  # δ at ε = ε_j
    # The first bin from which the curve stays ≤ target (the lower bound's curve need not be
    # monotone; the true δ is, so δ(ε) ≥ the lower curve at every ε' ≥ ε).
    ok = jnp.cumsum((d_at > target)[::-1])[::-1] == 0
    any_ok = jnp.any(ok)
    idx = jnp.arange(n, dtype=jnp.float64)
    first = jnp.min(jnp.where(ok, idx, float(n)))  # no argmax (see _window)
    onehot = (idx == first).astype(r.dtype)
    # S and T e^{ε_j} over i ≥ j: S_j = s_next_j + r_j, D'_j = d_next_j + r_j.
    s_star = jnp.sum(onehot * (s_next + r))
    dd_star = jnp.sum(onehot * (d_next + r))
    e_star = jnp.sum(onehot * e)
    x_star = jnp.sum(onehot * x) if c.fold is not None else x
    num = x_star + s_star - target
    pos = (num > 0) & (dd_star > 0)
    # X + S - e^{ε - ε_j} D' = target  ⇒  ε = ε_j + log((X + S - target)/D').
    sol = jnp.where(pos, e_star + jnp.log(jnp.where(pos, num, 1.0)) - jnp.log(jnp.where(pos, dd_star, 1.0)),
                    -jnp.inf)
    sol = jnp.minimum(sol, e_star)  # δ(e_star) ≤ target was checked on the grid
    # Never below the bin before: at the window's bottom ε_0 the mass below the window (not
    # held) has losses ≤ ε_0 - h, so the curve is exact down to there and no further.
    sol = jnp.maximum(sol, e_star - h)
    out = jnp.maximum(sol, 0.0)
    return jnp.where(any_ok & (c.extra < target), out, jnp.inf)


# =======================================================================================
# Public functions.
# =======================================================================================


def _check_options(grid_size, tail_bound, estimate):
    if isinstance(grid_size, bool) or not isinstance(grid_size, (int, np.integer)) or grid_size < 64 \
            or grid_size > 2**24 or (grid_size & (grid_size - 1)):
        raise ValueError(f"grid_size must be a power of two in [64, 2^24] (static); got {grid_size!r}.")
    if not (isinstance(tail_bound, (int, float)) and 0.0 < tail_bound < 1e-3):
        raise ValueError(f"tail_bound must be a float in (0, 1e-3) (static); got {tail_bound!r}.")
    _validate.check_static_choice("estimate", estimate, _ESTIMATES)


def _prepared(event):
    from ._events import _prepare

    _prepare(event)
    comps = _components(event)
    return comps


def _evaluate(event, query, grid_size, tail_bound, estimate, what):
    """Map the scalar evaluation over the broadcast batch of the event's leaves and ``query``."""
    comps = _prepared(event)
    kinds = tuple(kd for kd, _, _ in comps)
    vals = []
    for _, params, k in comps:
        vals.extend(params)
        vals.append(k)
    vals.append(f64(query))
    sizes = tuple(len(p) + 1 for _, p, _ in comps)
    return _evaluate_jit(kinds, sizes, grid_size, tail_bound, estimate, what, *vals)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _one(kinds, sizes, n, tau, estimate, what, *xs):
    return _one_value(kinds, sizes, n, tau, estimate, what, *xs)


@_one.defjvp
def _one_jvp(kinds, sizes, n, tau, estimate, what, primals, tangents):
    # Forward-mode partials, combined with products only: the linear program that reverse
    # mode transposes (possibly outside the float64 scope) then holds no FFT or complex op.
    f = functools.partial(_one_value, kinds, sizes, n, tau, estimate, what)
    out = f(*primals)
    partials = jax.jacfwd(f, argnums=tuple(range(len(primals))))(*primals)
    t_out = sum(jnp.where(jnp.isfinite(g), g, 0.0) * t for g, t in zip(partials, tangents))
    return out, t_out


def _one_value(kinds, sizes, n, tau, estimate, what, *xs):
    params, counts, i = [], [], 0
    for s in sizes:
        params.append(tuple(xs[i:i + s - 1]))
        counts.append(xs[i + s - 1])
        i += s
    query = xs[-1]
    valid = jnp.all(jnp.stack([jnp.isfinite(x) for x in xs[:-1]]))
    for kd, p_, k in zip(kinds, params, counts):
        valid &= (p_[-1] > 0) & (k >= 0)
        if kd == "sampled_gaussian":
            valid &= (p_[0] >= 0) & (p_[0] <= 1)
    composed = _compose(kinds, params, counts, n, tau, estimate, query, what)
    if what == "delta":
        res = [_delta_read(c, query, estimate) for c in composed]
    else:
        res = [_epsilon_read(c, query) for c in composed]
    out = res[0] if len(res) == 1 else jnp.maximum(res[0], res[1])
    return jnp.where(valid, out, jnp.nan)


# Compiled once per event structure and static options; called eagerly it costs one dispatch.
@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _evaluate_jit(kinds, sizes, n, tau, estimate, what, *vals):
    shape = jnp.broadcast_shapes(*(jnp.shape(v) for v in vals))
    fn = functools.partial(_one, kinds, sizes, n, tau, estimate, what)
    if shape == ():
        return fn(*vals)
    flat = [jnp.broadcast_to(v, shape).reshape(-1) for v in vals]
    return jax.vmap(fn)(*flat).reshape(shape)


def _refuse_uncertified(eps, delta) -> None:
    if _validate.is_concrete(eps) and _validate.is_concrete(delta):
        e = np.asarray(eps)
        if np.any(np.isposinf(e)):
            raise ValueError(
                f"the PLD grid cannot certify delta={np.ravel(np.broadcast_to(np.asarray(delta), e.shape))[np.argmax(np.ravel(np.isposinf(e)))]:g}: "
                "the mass it cannot place (tails, +inf loss, rounding) already exceeds it; increase grid_size "
                "or tail_bound's precision (smaller tail_bound), or use a larger delta.")


@float64
def pld_epsilon(event, delta, *, grid_size: int = PLD_GRID_SIZE, tail_bound: float = PLD_TAIL_BOUND,
                estimate: str = "upper", fallback: str = "rdp") -> jax.Array:
    r"""ε at which the event is (ε, δ)-DP, from its privacy loss distribution (FFT).

    :math:`ε = \min\{ε ≥ 0 : δ_ω(ε) ≤ δ\}` for the composed discrete PLD ω, with
    :math:`δ_ω(ε) = \sum_i ω_i (1 - e^{ε - ℓ_i})_+ + ω_∞`; see the module docstring for
    the discretisation (connect-the-dots, an upper bound) and its certificate.

    Args:
      event: a privacy event built from ``Gaussian``, ``Laplace``,
        ``PoissonSampled(q, Gaussian(...))`` (add/remove-one), ``SelfComposed`` and
        ``Composed`` (a batch if its leaves have leading axes).
      delta: target δ in (0, 1), broadcast against the batch.
      grid_size: static number of loss bins n (a power of two, default 2^14 = 16384): the
        error of the upper bound shrinks like 1/n², time grows like n log n.
      tail_bound: static cap on the mass the grid plan leaves outside the window and above
        each mechanism's grid (default 1e-6; the plan uses min(tail_bound, 1e-4·δ)); the
        mass actually outside is certified and added to δ.
      estimate: ``"upper"`` (default, a certified upper bound on ε) or ``"lower"`` (a
        certified lower bound, privacy buckets rounded down).
      fallback: ``"rdp"`` (default): where the PLD grid cannot certify δ (the mass it
        places at +∞ exceeds it), the upper bound is the RDP accountant's ε
        (:func:`epsilon`, also certified; a ``UserWarning`` says so when called eagerly);
        ``"none"``: +inf there (eagerly a ``ValueError``). Ignored for ``"lower"``.

    Returns:
      float64 ε ≥ 0 of the broadcast batch shape. Invalid leaves: ``ValueError`` eagerly,
      NaN under ``jit``.

    References:
      Doroshenko et al., PoPETs 2022, Algorithm 1; Koskela et al., AISTATS 2020.

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> e = A.pld_epsilon(A.SelfComposed(A.Gaussian(2.0), 4), 1e-5, grid_size=2**12)
      >>> round(float(e), 3)  # exact (μ = 1 Gaussian DP): 4.377
      4.377
    """
    _check_options(grid_size, tail_bound, estimate)
    _validate.check_static_choice("fallback", fallback, ("rdp", "none"))
    _validate.check_delta(delta)
    out = _evaluate(event, delta, int(grid_size), float(tail_bound), estimate, "epsilon")
    if estimate == "upper" and fallback == "rdp":
        out = _rdp_fallback(event, delta, out)
    _refuse_uncertified(out, delta)
    return out


def _rdp_fallback(event, delta, out):
    """+inf (the grid cannot certify δ) replaced by the RDP accountant's ε, with a warning."""
    import warnings

    from .. import accounting

    rdp = accounting.epsilon(event, delta)
    fell = jnp.isposinf(out)
    if _validate.is_concrete(out) and bool(np.any(np.asarray(fell))):
        warnings.warn("pld_epsilon: the PLD grid cannot certify this delta for some configurations; "
                      "the RDP accountant's epsilon (also an upper bound) is returned there.", stacklevel=3)
    return jnp.where(fell, rdp, out)


@float64
def pld_delta(event, epsilon, *, grid_size: int = PLD_GRID_SIZE, tail_bound: float = PLD_TAIL_BOUND,
              estimate: str = "upper") -> jax.Array:
    r"""δ(ε) of the event from its privacy loss distribution (an upper bound by default).

    :math:`δ = \sum_i ω_i (1 - e^{ε - ℓ_i})_+ + ω_∞` + the certified tail and rounding
    terms (see :func:`pld_epsilon` and the module docstring).

    Args:
      event: as in :func:`pld_epsilon`.
      epsilon: ε ≥ 0, broadcast against the batch.
      grid_size, tail_bound, estimate: as in :func:`pld_epsilon`.

    Returns:
      float64 δ in [0, 1] of the broadcast batch shape (NaN under ``jit`` for invalid leaves).

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> d = A.pld_delta(A.SelfComposed(A.Gaussian(2.0), 4), 1.0, grid_size=2**12)
      >>> 0.126936 <= float(d) <= 0.1272  # exact: 0.1269359...
      True
    """
    _check_options(grid_size, tail_bound, estimate)
    _validate.check_in_range("epsilon", epsilon, 0.0, math.inf)
    return _evaluate(event, epsilon, int(grid_size), float(tail_bound), estimate, "delta")


@float64
def pld_bracket(event, delta, *, grid_size: int = PLD_GRID_SIZE, tail_bound: float = PLD_TAIL_BOUND) -> PLDBracket:
    """Both PLD estimates of ε: the true ε(δ) lies in ``[lower, upper]``.

    Args:
      event, delta, grid_size, tail_bound: as in :func:`pld_epsilon`.

    Returns:
      ``PLDBracket(lower, upper, width)``, float64, batch shape.

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> b = A.pld_bracket(A.SelfComposed(A.Gaussian(2.0), 4), 1e-5, grid_size=2**12)
      >>> bool(b.lower <= 4.3771 <= b.upper)
      True
    """
    up = pld_epsilon(event, delta, grid_size=grid_size, tail_bound=tail_bound, estimate="upper")
    lo = pld_epsilon(event, delta, grid_size=grid_size, tail_bound=tail_bound, estimate="lower")
    return PLDBracket(lo, up, up - lo)


def _dpsgd_pld_epsilon(x, q, steps, delta, *, grid_size, tail_bound):
    """PLD ε of DP-SGD at σ = e^x (no eager checks: the calibration's inner function)."""
    return _evaluate_jit(("sampled_gaussian",), (3,), grid_size, tail_bound, "upper", "epsilon",
                         q, jnp.exp(x), steps, delta)


@float64
def calibrate_pld_noise_multiplier(target_epsilon, q, num_steps, delta, *, grid_size: int = PLD_GRID_SIZE,
                                   tail_bound: float = PLD_TAIL_BOUND, solver_iterations: int = 24):
    r"""Smallest DP-SGD noise multiplier whose PLD ε (upper bound) is at most ``target_epsilon``.

    The RDP calibration (:func:`calibrate_noise_multiplier`) gives :math:`σ_{RDP}`, which
    meets the target under the PLD accountant too (the PLD upper bound is below the RDP
    bound up to its certified error); the PLD root is searched by bisection on
    :math:`\log σ ∈ [\log σ_{RDP} - 1, \log σ_{RDP}]` (fixed steps, one PLD evaluation per step,
    so it runs under ``jit`` and ``vmap``). Every returned σ was checked:
    ``pld_epsilon(dpsgd_event(q, σ, T), δ) ≤ target``; where the PLD grid cannot certify
    the target at :math:`σ_{RDP}`, :math:`σ_{RDP}` itself (an RDP-certified answer) is
    returned. Derivatives with respect to the target, q, num_steps and δ come from the
    implicit function theorem. σ is relative to the clipped sum's L2 sensitivity
    (add/remove-one), as in :func:`calibrate_noise_multiplier`.

    Args:
      target_epsilon: ε target > 0.
      q: sampling rate in [0, 1].
      num_steps: number of steps ≥ 0.
      delta: δ in (0, 1).
      grid_size, tail_bound: as in :func:`pld_epsilon` (static).
      solver_iterations: bisection steps (static); the bracket is e wide, so 24 steps
        give σ within 6e-8 relative of the grid's threshold.

    Returns:
      ``CalibrationResult(noise_multiplier, epsilon, at_lower_bound)``, float64 (and a
      boolean flag), broadcast shape; the ε is the PLD upper bound at the returned σ;
      ``at_lower_bound`` is true where the target is met at the lower end of the search.

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> r = A.calibrate_pld_noise_multiplier(1.0, 256 / 60000, 14040, 1e-5, grid_size=2**13)
      >>> float(r.epsilon) <= 1.0, round(float(r.noise_multiplier), 2)
      (True, 2.03)
    """
    _check_options(grid_size, tail_bound, "upper")
    _validate.check_in_range("target_epsilon", target_epsilon, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("q", q, 0.0, 1.0)
    _validate.check_in_range("num_steps", num_steps, 0.0, math.inf)
    _validate.check_delta(delta)
    if int(solver_iterations) < 1:
        raise ValueError(f"solver_iterations must be >= 1; got {solver_iterations!r}.")
    target, q, steps, delta = (f64(x) for x in (target_epsilon, q, num_steps, delta))
    target, q, steps, delta = jnp.broadcast_arrays(target, q, steps, delta)
    return _calibrate_core(target, q, jnp.ceil(steps), delta, int(grid_size), float(tail_bound),
                           int(solver_iterations))


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _calibrate_core(target, q, steps, delta, grid_size, tail_bound, iterations):
    from ._dpsgd import CalibrationResult, calibrate_noise_multiplier
    from ._solve import implicit_root, search_decreasing

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


# =======================================================================================
# The "pld" accountant of the event layer: epsilon(event, delta, accountant="pld").
# =======================================================================================


def _accountant_epsilon(event, delta, orders):
    out = _evaluate(event, delta, PLD_GRID_SIZE, PLD_TAIL_BOUND, "upper", "epsilon")
    _refuse_uncertified(out, delta)
    return out


def _accountant_delta(event, epsilon, orders):
    return _evaluate(event, epsilon, PLD_GRID_SIZE, PLD_TAIL_BOUND, "upper", "delta")
