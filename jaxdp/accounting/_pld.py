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
from .._program_cache import persistent
from ._events import Composed, Gaussian, Laplace, PoissonSampled, SelfComposed, check_event
from ._rdp import gaussian_rdp, laplace_rdp

# The public door is ``epsilon(event, delta, accountant="pld")`` / ``delta(...)`` (registered
# in _accountants.py); pld_epsilon and pld_delta stay for one release as deprecated names.
__all__ = [
    "PLD_GRID_SIZE",
    "PLD_TAIL_BOUND",
    "PLDBracket",
    "pld_bracket",
]

PLD_GRID_SIZE = 2**14
PLD_TAIL_BOUND = 1e-14
_ESTIMATES = ("upper", "lower")
_U = float(np.finfo(np.float64).eps)
# Orders for the window's RDP tail bound (its optimal order can be close to 1 for large μ).
_WINDOW_ORDERS = np.array([1.05, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0,
                           16.0, 20.0, 24.0, 32.0, 48.0, 64.0, 96.0, 128.0])
# Chernoff exponents for the certified tail masses: these multiples of the exponent
# α* - 1 that set the window's top (the optimum for the discrete PLD is close to it).
_LAMBDA_FACTORS = np.array([2.0**-0.5, 1.0, 2.0**0.5])
# The lower end of the window sits this many (upper-tail widths) below the mean estimate.
_LOW_SPAN = 1.15


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


def _rdp_of(kind, params, orders):
    r"""An RDP curve that places the window (an estimate: the window is certified afterwards).

    Poisson-sampled Gaussian: the exact binomial sum at the integer orders,
    :math:`A_α = \sum_k \binom{α}{k} q^k (1-q)^{α-k} e^{(k^2-k)/(2σ^2)}`, capped by the
    Gaussian's α/(2σ²) (sampling only helps), which also serves the fractional orders.
    Written out here (not :func:`sampled_gaussian_rdp`) to keep the compiled program small.
    """
    if kind == "gaussian":
        return gaussian_rdp(orders, params[0])
    if kind == "laplace":
        return laplace_rdp(orders, params[0])
    q, sigma = params
    full = f64(orders) / (2.0 * sigma**2)
    is_int = orders == np.round(orders)
    a = np.where(is_int, orders, 2.0)[:, None]
    k = np.arange(int(orders[is_int].max()) + 1, dtype=np.float64)[None, :]
    used = k <= a
    log_binom = np.where(used, _lgamma(a + 1) - _lgamma(k + 1) - _lgamma(np.maximum(a - k, 0) + 1),
                         -np.inf)
    inner = (q > 0) & (q < 1)
    qs = jnp.where(inner, q, 0.5)
    terms = (log_binom + k * jnp.log(qs) + np.maximum(a - k, 0.0) * jnp.log1p(-qs)
             + (k * k - k) / (2.0 * sigma**2))
    log_a = jax.scipy.special.logsumexp(jnp.where(used, terms, -jnp.inf), axis=-1)
    sampled = jnp.where(inner, log_a / (a[:, 0] - 1.0), jnp.where(q >= 1, full, 0.0))
    return jnp.where(is_int, jnp.minimum(sampled, full), full)


def _lgamma(x):
    return np.vectorize(math.lgamma)(np.asarray(x, dtype=np.float64))


def _mean_upper(kind, params):
    """An upper estimate of E_P[L] = KL(P‖Q) of one mechanism (both directions)."""
    if kind == "gaussian":
        return 0.5 / params[0] ** 2
    if kind == "laplace":
        inv = 1.0 / params[0]
        return inv + jnp.expm1(-inv)
    q, s = params
    mu2 = 1.0 / s**2
    # KL ≤ q μ²/2 (convexity) and KL ≤ D_2 = log(1 + q²(e^{μ²} - 1)).
    return jnp.minimum(0.5 * q * mu2, jnp.log1p(q * q * jnp.expm1(jnp.minimum(mu2, 700.0))))


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


def _masses(kind, params, eps_grid, h, direction, estimate):
    """Masses on the grid and the mass at +∞ (pessimistic CTD, or optimistic buckets)."""
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
    extra: jax.Array  # mass counted as +∞ (upper: ∞-mass + tail + margin) or subtracted (lower)


def _window(kinds, params, counts, tau):
    """Window [lo, hi] of the composed loss and the single mechanisms' lower ends and widths."""
    orders = _WINDOW_ORDERS
    ks = [jnp.where(jnp.isfinite(k), k, 0.0) for k in counts]
    k_tot = sum(ks)
    curves = [_rdp_of(kd, p, orders) for kd, p in zip(kinds, params)]
    # The Poisson-sampled Gaussian's mean estimate can be up to twice the true mean (D_2 vs
    # χ²/2): the window's lower end is placed from half of it, so that the bulk of the
    # composed loss is never below the window (folded mass would land at its top).
    means = [_mean_upper(kd, p) * (0.5 if kd == "sampled_gaussian" else 1.0) for kd, p in zip(kinds, params)]
    lam = f64(orders) - 1.0
    log_tau = jnp.log(tau)
    total = sum(k * c for k, c in zip(ks, curves))
    bound = total - log_tau / lam
    hi = jnp.min(bound)
    # (No argmin: its variadic reduction breaks reverse mode outside the float64 scope.)
    lam_star = jnp.max(jnp.where(bound <= hi, lam, 0.0))
    mean = sum(k * m for k, m in zip(ks, means))
    lo = mean - _LOW_SPAN * (hi - mean)
    width = hi - lo
    singles = []
    log_tau1 = log_tau - jnp.log(jnp.maximum(k_tot, 1.0))
    for c, m in zip(curves, means):
        hi1 = jnp.min(c - log_tau1 / lam)
        lo1 = m - _LOW_SPAN * (hi1 - m)
        singles.append(lo1)
        width = jnp.maximum(width, hi1 - lo1)
    return lo, width, singles, jax.lax.stop_gradient(lam_star)


def _compose(kinds, params, counts, n, tau, estimate):
    """Per direction, the composed discrete PLD on the window (see the module docstring)."""
    lo, width, singles, lam_star = _window(kinds, params, counts, tau)
    width = jnp.where(jnp.isfinite(width) & (width > 0), width, 1.0)
    h = width / (n - 2)
    a0 = jnp.floor(lo / h)  # window start (bins)
    j = jnp.arange(n, dtype=jnp.float64)
    losses = (a0 + j) * h
    lams = lam_star * f64(_LAMBDA_FACTORS)
    out = []
    for direction in _directions(kinds):
        spec = jnp.ones((n // 2 + 1,), dtype=jnp.complex128)
        offset = jnp.zeros(())
        log_keep_inf = jnp.zeros(())
        log_mgf_up = jnp.zeros(lams.shape)
        log_mgf_dn = jnp.zeros(lams.shape)
        norm_term = jnp.zeros(())
        for kd, p_, k, lo1 in zip(kinds, params, counts, singles):
            o = jnp.floor(lo1 / h)
            grid = (o + j) * h
            p, p_inf = _masses(kd, p_, grid, h, direction, estimate)
            c = jnp.fft.rfft(p)
            spec = spec * _safe_pow(c, k)
            offset = offset + k * o
            log_keep_inf = log_keep_inf + k * jnp.log1p(-jnp.minimum(p_inf, 1.0 - 1e-16))
            logp = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), -jnp.inf)
            if estimate == "upper":
                log_mgf_up = log_mgf_up + k * _logsumexp_weighted(logp[None, :], lams[:, None] * grid[None, :])
            else:
                log_mgf_dn = log_mgf_dn + k * _logsumexp_weighted(logp[None, :], -lams[:, None] * grid[None, :])
            norm_term = norm_term + k * jax.lax.stop_gradient(jnp.sqrt(jnp.sum(p * p)))
        # Roll the circular result so that entry j is bin a0 + j: multiply by a phase
        # (an elementwise product; (f·s) mod n is exact in float64 for n ≤ 2^26).
        s = jnp.mod(a0 - offset, n)
        f = jnp.arange(n // 2 + 1, dtype=jnp.float64)
        phase = 2.0 * math.pi * jnp.mod(f * s, n) / n
        spec_w = spec * jnp.exp(1j * phase)
        r = jnp.fft.irfft(spec_w, n)
        # The rounding margin carries no derivative (it is a bound on round-off).
        spec_norm = jnp.sqrt(2.0 * jnp.sum(jnp.abs(jax.lax.stop_gradient(spec)) ** 2))
        margin = 8.0 * _U * (math.log2(n) + 2.0) * (1.0 + norm_term) * (spec_norm + 1.0) + 4.0 * n * _U
        p_inf_tot = -jnp.expm1(log_keep_inf)
        top = (a0 + n) * h  # smallest loss above the window
        bottom = (a0 - 1.0) * h  # largest loss below it
        if estimate == "upper":
            t_up = jnp.exp(jnp.minimum(jnp.min(log_mgf_up - lams * top), 0.0))
            probs = jnp.maximum(r, 0.0)
            extra = p_inf_tot + t_up + margin
        else:
            t_dn = jnp.exp(jnp.minimum(jnp.min(log_mgf_dn + lams * bottom), 0.0))
            probs = r
            extra = -(t_dn + margin)
        out.append(_Composed(probs, losses, extra))
    return out


def _delta_read(c: _Composed, eps, estimate):
    w = -jnp.expm1(jnp.minimum(eps - c.losses, 0.0))
    w = jnp.where(c.losses > eps, w, 0.0)
    d = jnp.sum(c.probs * w) + c.extra
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
    d_at = c.extra + s_next - d_next  # δ at ε = ε_j
    ok = d_at <= target
    any_ok = jnp.any(ok)
    idx = jnp.arange(n, dtype=jnp.float64)
    first = jnp.min(jnp.where(ok, idx, float(n)))  # no argmax (see _window)
    onehot = (idx == first).astype(r.dtype)
    # S and T e^{ε_j} over i ≥ j: S_j = s_next_j + r_j, D'_j = d_next_j + r_j.
    s_star = jnp.sum(onehot * (s_next + r))
    dd_star = jnp.sum(onehot * (d_next + r))
    e_star = jnp.sum(onehot * e)
    num = c.extra + s_star - target
    pos = (num > 0) & (dd_star > 0)
    # X + S - e^{ε - ε_j} D' = target  ⇒  ε = ε_j + log((X + S - target)/D').
    sol = jnp.where(pos, e_star + jnp.log(jnp.where(pos, num, 1.0)) - jnp.log(jnp.where(pos, dd_star, 1.0)),
                    -jnp.inf)
    sol = jnp.minimum(sol, e_star)  # δ(e_star) ≤ target was checked on the grid
    sol = jnp.where(first > 0, jnp.maximum(sol, e_star - h), sol)
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
    check_event(event)
    return _components(event)  # raises on what the PLD accountant does not cover


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
    composed = _compose(kinds, params, counts, n, tau, estimate)
    if what == "delta":
        res = [_delta_read(c, query, estimate) for c in composed]
    else:
        res = [_epsilon_read(c, query) for c in composed]
    out = res[0] if len(res) == 1 else jnp.maximum(res[0], res[1])
    return jnp.where(valid, out, jnp.nan)


# Compiled once per event structure and static options; called eagerly it costs one dispatch.
@persistent("pld", static_argnums=(0, 1, 2, 3, 4, 5))
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
                estimate: str = "upper") -> jax.Array:
    r"""ε at which the event is (ε, δ)-DP, from its privacy loss distribution (FFT).

    The public door is ``epsilon(event, delta, accountant="pld", ...)``; the name
    ``jaxdp.accounting.pld_epsilon`` is deprecated and warns.

    :math:`ε = \min\{ε ≥ 0 : δ_ω(ε) ≤ δ\}` for the composed discrete PLD ω, with
    :math:`δ_ω(ε) = \sum_i ω_i (1 - e^{ε - ℓ_i})_+ + ω_∞`; see the module docstring for
    the discretisation (connect-the-dots, an upper bound) and its certificate.

    Args:
      event: a privacy event built from ``Gaussian``, ``Laplace``,
        ``PoissonSampled(q, Gaussian(...))`` (add/remove-one), ``SelfComposed`` and
        ``Composed`` (a batch if its leaves have leading axes).
      delta: target δ in (0, 1), broadcast against the batch.
      grid_size: static number of loss bins n (a power of two, default 2^16): the error of
        the upper bound shrinks like 1/n², time grows like n log n.
      tail_bound: static mass allowed outside the window / above each mechanism's grid
        (default 1e-14); the mass actually outside is certified and added to δ.
      estimate: ``"upper"`` (default, a certified upper bound on ε) or ``"lower"`` (a
        certified lower bound, privacy buckets rounded down).

    Returns:
      float64 ε ≥ 0 of the broadcast batch shape. Where the grid cannot certify δ (the
      mass placed at +∞ by truncation, tails and rounding exceeds it) eagerly a
      ``ValueError``, under ``jit`` +inf. Invalid leaves: ``ValueError`` eagerly, NaN under ``jit``.

    References:
      Doroshenko et al., PoPETs 2022, Algorithm 1; Koskela et al., AISTATS 2020.

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> e = A.epsilon(A.SelfComposed(A.Gaussian(2.0), 4), 1e-5, accountant="pld", grid_size=2**12)
      >>> round(float(e), 3)  # exact (μ = 1 Gaussian DP): 4.377
      4.377
    """
    _check_options(grid_size, tail_bound, estimate)
    _validate.check_delta(delta)
    out = _evaluate(event, delta, int(grid_size), float(tail_bound), estimate, "epsilon")
    _refuse_uncertified(out, delta)
    return out


@float64
def pld_delta(event, epsilon, *, grid_size: int = PLD_GRID_SIZE, tail_bound: float = PLD_TAIL_BOUND,
              estimate: str = "upper") -> jax.Array:
    r"""δ(ε) of the event from its privacy loss distribution (an upper bound by default).

    The public door is ``delta(event, epsilon, accountant="pld", ...)``; the name
    ``jaxdp.accounting.pld_delta`` is deprecated and warns.

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
      >>> d = A.delta(A.SelfComposed(A.Gaussian(2.0), 4), 1.0, accountant="pld", grid_size=2**12)
      >>> f"{float(d):.4e}"  # exact: 1.2694e-01
      '1.2694e-01'
    """
    _check_options(grid_size, tail_bound, estimate)
    _validate.check_in_range("epsilon", epsilon, 0.0, math.inf)
    return _evaluate(event, epsilon, int(grid_size), float(tail_bound), estimate, "delta")


@float64
def pld_bracket(event, delta, *, grid_size: int = PLD_GRID_SIZE, tail_bound: float = PLD_TAIL_BOUND) -> PLDBracket:
    """Both PLD estimates of ε: the true ε(δ) lies in ``[lower, upper]``.

    ``upper`` is ``epsilon(event, delta, accountant="pld")``, ``lower`` the same with
    ``estimate="lower"``.

    Args:
      event, delta, grid_size, tail_bound: as in :func:`epsilon` with ``accountant="pld"``.

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


# =======================================================================================
# The "pld" accountant of the event layer: epsilon(event, delta, accountant="pld").
# =======================================================================================


ACCOUNTANT_OPTIONS = ("grid_size", "tail_bound", "estimate")


def accountant_epsilon(event, delta, orders, **options):
    """``epsilon(event, delta, accountant="pld", **options)`` (``orders`` is not used)."""
    return pld_epsilon(event, delta, **options)


def accountant_delta(event, epsilon, orders, **options):
    """``delta(event, epsilon, accountant="pld", **options)`` (``orders`` is not used)."""
    return pld_delta(event, epsilon, **options)
