r"""What shuffling costs at least: the lower bound of Chua et al. (2024) on ε of shuffled DP-SGD.

No tight upper bound is known for DP-SGD whose batches come from a random permutation
(:func:`~jaxdp.accounting.shuffled_event` certifies the run without any amplification).
This module bounds ε from **below**: no valid analysis of the scheme can report less.

The construction (Chua, Ghazi, Kamath, Kumar, Manurangsi, Sinha, Zhang, ICML 2024, Section 4;
reconstructed here under jaxdp's replace-one relation, see ``docs/batch_schemes.md``). One
pass cuts a uniformly random permutation of the n records into T = ``steps_per_pass`` batches.
Take a one-dimensional model whose per-record clipped gradient is −C for every record but
one, which is +C in D and −C in the neighbour D' (replace-one; n is public). The noisy batch
sums (noise σC per coordinate) are then, after subtracting the public −C·|B_t| and dividing
by σC,

.. math::
    P = \sum_t w_t\, N(m e_t, I_T) \quad\text{vs}\quad Q = N(0, I_T), \qquad m = 2/σ,

with w_t the probability that the record lands in batch t. Every test of P against Q
therefore lower-bounds ε: DP under replace-one gives TPR ≤ e^ε FPR + δ in both orders of
the pair. The test used is the one the paper uses, a threshold on the largest coordinate
M = max_t Y_t, whose laws are (whatever the weights w_t)

.. math::
    F_Q(x) = Φ(x)^T, \qquad F_P(x) = Φ(x - m)\,Φ(x)^{T-1}.

Here M is binned on a fine grid (post-processing, so still a lower bound) and the whole
Neyman–Pearson region of the binned pair is used, which contains every threshold test at
the bin edges: δ_lower(ε) = Σ_k (p_k − e^ε q_k)_+ (and with P, Q swapped).

Several passes (a fresh permutation each pass, "dynamic shuffling", Chua et al., NeurIPS
2024): the passes are independent, so the E-fold product of the binned pair is a
post-processing of the run, and its hockey-stick divergence is a lower bound. It is
composed on a loss grid by FFT with every per-pass loss rounded **down** and the mass of
the lowest losses (at most 10⁻³ δ in all) dropped; both only lower δ(ε) outcome by
outcome, so the result stays a lower bound (the FFT's rounding bound is subtracted from
every composed mass). ε_lower = sup{ε ≥ 0 : δ_lower(ε) > δ}, by bisection, with its
derivative from the implicit function theorem.

What the bound assumes: every noisy batch sum is released (the threat model of the usual
DP-SGD analysis), batches of the permutation, noise σC per step on the clipped sum.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from .. import _validate
from .._numerics import f64, float64, log_ndtr

__all__ = ["shuffled_lower_epsilon"]

# Bins of the max statistic: K interior bins on [median_Q - 7, max(median_Q, m) + 10]
# (below and above are two more bins). 4096 keeps the binning loss small (a bin moves the
# likelihood ratio by at most m · width, ~ 0.01 at σ = 0.5).
_BINS = 4096
# Loss-grid size of the multi-pass composition (FFT length).
_GRID = 2**14
# The multi-pass composition drops at most this fraction of δ of the lowest-loss mass.
_DROP = 1e-3
# δ_lower is used times (1 - this): covers float64 rounding of the masses (~1e-13 relative).
_SAFETY = 1e-9
# Bisection steps for ε (interval ≤ ~100 wide: below 1e-14 after 60 halvings).
_BISECT = 64
# Exponentiation by squaring of the spectrum: passes up to 2^_POW_BITS - 1.
_POW_BITS = 24
_U = 2.0**-52
# ε is searched up to here (e^ε stays finite): a larger ε is reported as this value, still a
# lower bound.
_EPS_MAX = 500.0


def _log_neg_log_cdf(x):
    """log(-log Φ(x)), accurate in both tails (F near 1: -log Φ(x) ≈ Φ̄(x), kept in log space)."""
    x_pos = jnp.where(x > 0, x, 1.0)
    log_u = log_ndtr(-x_pos)  # log Φ̄(x), finite however far out (Mills series below -37)
    u = jnp.exp(log_u)
    # -log1p(-u)/u = 1 + u/2 + ...: log of it, 0 where u underflows.
    ratio = jnp.where(u > 1e-300, jnp.log(-jnp.log1p(-u) / jnp.where(u > 1e-300, u, 1.0)), 0.0)
    upper = log_u + ratio
    lower = jnp.log(-log_ndtr(jnp.where(x > 0, -1.0, x)))
    return jnp.where(x > 0, upper, lower)


def _log_sub(a, b):
    """log(e^a - e^b) for a ≥ b (−inf where equal)."""
    d = jnp.where(a > b, b - a, -1.0)
    return jnp.where(a > b, a + jnp.log(-jnp.expm1(d)), -jnp.inf)


def _binned_pair(m, t, m_q=0.0):
    """Log masses (log p, log q) of the binned max statistic: shape (_BINS + 2,).

    P is the mixture with shift ``m``, Q the one with shift ``m_q`` (0: Q = N(0, I_T)); the
    max of Σ_t w_t N(μ e_t, I_T) has F(x) = Φ(x - μ)Φ(x)^{T-1} whatever the weights.
    """
    med = jax.scipy.special.ndtri(jnp.exp(jnp.log(0.5) / t))  # median of the max under N(0, I_T)
    lo = med - 7.0
    hi = jnp.maximum(med, m) + 10.0
    x = lo + (hi - lo) * jnp.arange(_BINS + 1, dtype=jnp.float64) / _BINS
    # Everything through l = log(-log F), exact where F is near 1 (the far upper tail, where
    # the pair's largest losses are): log F = -e^l, log S = log(1 - F) = log(-expm1(-e^l)).
    nl = _log_neg_log_cdf(x)
    log_t1 = jnp.log(jnp.maximum(t - 1.0, 1.0))

    def log_neg_log_f(mu):
        nl_shift = _log_neg_log_cdf(x - mu)
        return jnp.where(t > 1.0, jnp.logaddexp(nl_shift, log_t1 + nl), nl_shift)

    l_p = log_neg_log_f(m)
    l_q = log_neg_log_f(m_q)

    def masses(l):
        y = jnp.exp(l)
        log_f = -y
        # log(1 - e^{-y}): log y - y/2 + ... for small y (no underflow), else direct.
        small = l < -20.0
        log_s = jnp.where(small, l - 0.5 * jnp.where(small, y, 0.0),
                          jnp.log(-jnp.expm1(-jnp.where(small, 1.0, y))))
        by_cdf = _log_sub(log_f[1:], log_f[:-1])
        by_sf = _log_sub(log_s[:-1], log_s[1:])
        inner = jnp.where(log_f[1:] < math.log(0.5), by_cdf, by_sf)
        return jnp.concatenate([log_f[:1], inner, log_s[-1:]])

    return masses(l_p), masses(l_q)


def _delta_of(eps, losses, log_w):
    """Σ_k w_k (1 - e^{ε - L_k})_+ (w_k = e^{log_w}), and its ε-derivative."""
    pos = losses > eps
    d = jnp.where(pos, eps - losses, -1.0)
    w = jnp.exp(log_w)
    val = jnp.sum(jnp.where(pos, w * -jnp.expm1(d), 0.0))
    slope = -jnp.sum(jnp.where(pos, w * jnp.exp(d), 0.0))
    return val, slope


def _compose(losses, log_w, log_other, passes, target):
    """One pass's pair on the composition's loss grid: (grid losses, masses v), losses rounded down.

    Per-pass indices run over [0, (GRID-1)//E], so the E-fold sum stays below GRID (the
    circular convolution of the FFT is the linear one).
    """
    w = jnp.exp(log_w)
    # The bins are in order of the statistic, along which the loss is monotone (the max's
    # likelihood ratio is): cumulate from the low-loss end. Correctness does not depend on
    # it: dropping mass and rounding losses down are safe wherever they happen.
    rising = losses[-1] >= losses[0]
    ws = jnp.where(rising, w, w[::-1])
    from_low = jnp.cumsum(ws)
    from_high = jnp.cumsum(ws[::-1])[::-1]
    from_low = jnp.where(rising, from_low, from_low[::-1])
    from_high = jnp.where(rising, from_high, from_high[::-1])
    tol = _DROP * target / passes
    live = log_w > -jnp.inf
    keep = live & (from_low > tol)  # dropped: at most tol per pass
    l_lo = jnp.min(jnp.where(keep, losses, jnp.inf))
    l_hi = jnp.max(jnp.where(keep & (from_high > tol), losses, -jnp.inf))  # above: rounded down to it
    l_hi = jnp.maximum(l_hi, l_lo + 1e-6)
    keep = keep & (losses >= l_lo)
    width = (_GRID - 1) // passes  # per-pass index range (passes ≥ 1, an integer here)
    h = jax.lax.stop_gradient((l_hi - l_lo) / jnp.maximum(width, 1.0))
    l_lo = jax.lax.stop_gradient(l_lo)
    idx = jnp.floor((jnp.minimum(jax.lax.stop_gradient(losses), l_hi) - l_lo) / h)
    idx = jnp.clip(jnp.where(keep, idx, 0), 0, width).astype(jnp.int32)
    v = jnp.zeros((_GRID,), jnp.float64).at[idx].add(jnp.where(keep, w, 0.0))
    v_other = jnp.zeros((_GRID,), jnp.float64).at[idx].add(jnp.where(keep, jnp.exp(log_other), 0.0))
    grid = passes * l_lo + h * jnp.arange(_GRID, dtype=jnp.float64)
    return grid, v, v_other


def _power(v, e):
    """The ``e``-fold self-convolution of ``v`` (FFT, exponentiation by squaring; no wrap: see _compose)."""
    spec = jnp.fft.rfft(v)
    out = jnp.ones_like(spec)
    e = e.astype(jnp.int32)
    for bit in range(_POW_BITS):
        out = jnp.where((e >> bit) & 1 == 1, out * spec, out)
        spec = spec * spec
    return jnp.fft.irfft(out, n=_GRID)


def _bisect(losses, log_w, target):
    """sup{ε ≥ 0 : Σ w (1 - e^{ε-L})_+ · (1 - safety) > δ} (no derivative) and whether it is > 0."""
    scale = 1.0 - _SAFETY
    ls, lw = jax.lax.stop_gradient(losses), jax.lax.stop_gradient(log_w)
    top = jnp.clip(jnp.max(jnp.where(lw > -jnp.inf, ls, 0.0)), 0.0, _EPS_MAX)

    def body(_, lohi):
        lo, hi = lohi
        mid = 0.5 * (lo + hi)
        ok = _delta_of(mid, ls, lw)[0] * scale > target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, _BISECT, body, (jnp.zeros(()), top))
    found = _delta_of(0.0, ls, lw)[0] * scale > target
    return jnp.where(found, lo, 0.0), found


def _implicit(eps, found, val, slope):
    """ε with the derivative of the implicit function δ_lower(ε; σ) = δ: dε/dσ = -∂_σδ/∂_εδ.

    ``val`` is δ_lower at ε carrying its σ-derivative; the value of ε is unchanged.
    """
    slope = jax.lax.stop_gradient(jnp.where(slope < 0, slope, -1.0))
    return eps - jnp.where(found, (val - jax.lax.stop_gradient(val)) / slope, 0.0)


def _single(losses, log_w, target):
    eps, found = _bisect(losses, log_w, target)
    val, slope = _delta_of(eps, losses, log_w)
    return _implicit(eps, found, val, slope)


def _multi(losses, log_w, log_other, passes, target):
    grid, v, v_other = _compose(losses, log_w, log_other, passes, target)
    v0, u0 = jax.lax.stop_gradient(v), jax.lax.stop_gradient(v_other)
    comp = _power(v0, passes)
    # Rounding of the FFT (a few ulps per stage, log2(GRID) stages, the squarings), subtracted.
    err = 8.0 * _U * (math.log2(_GRID) + 2.0 * _POW_BITS) * passes
    log_c = jnp.log(jnp.maximum(comp - err, 0.0))
    eps, found = _bisect(grid, log_c, target)
    # The derivative is that of Σ_{ω: L(ω) > ε} (p(ω) - e^ε q(ω)) over pass tuples ω with the
    # region held fixed (it does not move δ: the integrand vanishes on its boundary). In the
    # per-pass masses p_k, q_k: E·Σ_j 1[ℓ_j > ε] p^{*(E-1)}_{j-k}, a correlation computed
    # without a derivative, so that only real, linear maps are differentiated (no FFT is
    # transposed); likewise for q. ∂δ/∂ε = -e^ε Q(L > ε).
    ind = (grid > eps).astype(jnp.float64)
    ind_spec = jnp.fft.rfft(ind)

    def corr(u):
        prev = _power(u, passes - 1.0)
        return passes * jnp.fft.irfft(ind_spec * jnp.conj(jnp.fft.rfft(prev)), n=_GRID)

    g_p, g_q = jax.lax.stop_gradient(corr(v0)), jax.lax.stop_gradient(corr(u0))
    e_eps = jnp.exp(eps)
    val = jnp.sum(g_p * v) - e_eps * jnp.sum(g_q * v_other)
    slope = -e_eps * jnp.sum(ind * _power(u0, passes))
    return _implicit(eps, found, val, slope)


def _one(sigma, t, passes, target):
    return _pair(2.0 / sigma, 0.0, t, passes, target)


def _one_zero_out(sigma, t, passes, target):
    # Chua et al.'s pair: the other records' gradients −C, the record's +C in D and ⊥ (a zero
    # gradient) in D'; after the public shift the batch sums are mixtures with shifts 2/σ and 1/σ.
    return _pair(2.0 / sigma, 1.0 / sigma, t, passes, target)


def _pair(m, m_q, t, passes, target):
    """Lower bound on ε from the pair of mixtures with shifts m (P) and m_q (Q), both orders."""
    log_p, log_q = _binned_pair(m, t, m_q)
    out = []
    for log_a, log_b in ((log_p, log_q), (log_q, log_p)):
        has_a, has_b = log_a > -jnp.inf, log_b > -jnp.inf
        # Where the other side's mass underflows (below the smallest double, e^-744.4), its
        # loss is at least log_a + 744 (a lower value is safe); an empty bin counts nowhere.
        diff = jnp.where(has_a & has_b, log_a, 0.0) - jnp.where(has_a & has_b, log_b, 0.0)
        floor = jnp.where(has_a, log_a, 0.0) + 744.0
        losses = jnp.where(has_a, jnp.where(has_b, diff, floor), -_EPS_MAX)
        out.append(jnp.where(passes == 1, _single(losses, log_a, target), _multi(losses, log_a, log_b, passes, target)))
    return jnp.maximum(out[0], out[1])


@float64
def shuffled_lower_epsilon(noise_multiplier, steps_per_pass, passes, delta) -> jax.Array:
    r"""A certified lower bound on ε of shuffled DP-SGD (Chua et al. 2024): no analysis can report less.

    For ``passes`` E passes, each a fresh uniformly random permutation cut into T =
    ``steps_per_pass`` batches, with Gaussian noise of standard deviation σC on each batch's
    sum of gradients clipped to C, and replace-one neighbours (n public), every valid
    (ε, δ) guarantee of the released noisy batch sums has ε at least

    .. math::
        ε_{\mathrm{lower}} = \sup\{ε ≥ 0 : H_{e^ε}(\tilde P^{⊗E} \,\|\, \tilde Q^{⊗E}) > δ\}
        \ \text{(and with the pair swapped)},

    where :math:`\tilde P, \tilde Q` are the laws of the binned largest coordinate of
    :math:`P = \frac1T\sum_t N(2e_t/σ, I_T)` and :math:`Q = N(0, I_T)`,
    :math:`F_P(x) = Φ(x - 2/σ)Φ(x)^{T-1}`, :math:`F_Q(x) = Φ(x)^T` (see the module
    docstring for the construction, the rounding that keeps it a lower bound, and the
    threat model). Compare with the certified upper bound ``epsilon(shuffled_event(σ, E),
    δ)`` (no amplification); the true ε lies between them. Chua et al. replace the record
    by ⊥ (a zero gradient), which gives the weaker pair with Q = (1/T)Σ_t N(e_t/σ, I_T) at
    the same σ; their published values are reproduced to 1e-3 relative (see
    ``docs/batch_schemes.md``), and this bound is above them.

    Args:
      noise_multiplier: σ > 0, the noise standard deviation over the clip norm C (as for
        :func:`dpsgd_event`; the replace-one sensitivity of a batch sum is 2C).
      steps_per_pass: T ≥ 1, the batches (steps) of one pass.
      passes: E ≥ 1, the number of passes, each with a fresh permutation.
      delta: δ in (0, 1).

    Returns:
      float64 ε ≥ 0, the broadcast shape of the arguments (NaN under ``jit`` for invalid
      values). Its derivative in σ is the implicit one at the bound's δ-level set.

    References:
      L. Chua, B. Ghazi, P. Kamath, R. Kumar, P. Manurangsi, A. Sinha, C. Zhang, "How Private
      are DP-SGD Implementations?", ICML 2024 (arXiv 2403.17673), Section 4; the same
      authors, "Scalable DP-SGD: Shuffling vs. Poisson Subsampling", NeurIPS 2024 (arXiv
      2411.04205), multi-epoch lower bounds.

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> lo = float(A.shuffled_lower_epsilon(1.0, 1000, 1, 1e-5))
      >>> hi = float(A.epsilon(A.shuffled_event(1.0, 1), 1e-5, accountant="pld", grid_size=2**12))
      >>> round(lo, 3), 0.0 < lo <= hi
      (3.134, True)
    """
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    _validate.check_integer("steps_per_pass", steps_per_pass, lo=1.0)
    _validate.check_integer("passes", passes, lo=1.0, hi=2.0**_POW_BITS - 1.0)
    _validate.check_delta(delta)
    _validate.check_broadcastable(noise_multiplier=noise_multiplier, steps_per_pass=steps_per_pass, passes=passes,
                                  delta=delta)
    return _batch(*(f64(x) for x in (noise_multiplier, steps_per_pass, passes, delta)))


@float64
def _zero_out_lower_epsilon(noise_multiplier, steps_per_pass, passes, delta) -> jax.Array:
    """The lower bound in Chua et al.'s own setting: the record is replaced by ⊥ (zero gradient).

    Same arguments, rounding and output as :func:`shuffled_lower_epsilon` (no validation:
    for checks and figures), for the pair Σ_t w_t N((2/σ)e_t, I) vs Σ_t w_t N((1/σ)e_t, I)
    (their "cube" pair: the other records' gradients −C, the record's +C in D and ⊥ in D').
    A zero gradient is a valid record, so this is also a lower bound under replace-one; it
    is below :func:`shuffled_lower_epsilon` (−C neighbour) on every configuration checked.
    """
    return _batch(*(f64(x) for x in (noise_multiplier, steps_per_pass, passes, delta)), zero_out=True)


@functools.partial(jax.jit, static_argnames="zero_out")
def _batch(s, t, e, d, zero_out=False):
    # One compiled program per argument shape: an eager call then runs it instead of
    # dispatching (and compiling) each operation (2.5 s -> ms per call); inside a caller's
    # jit, vmap or grad it is inlined.
    shape = jnp.broadcast_shapes(s.shape, t.shape, e.shape, d.shape)
    valid = ((s > 0) & jnp.isfinite(s) & (t >= 1) & (t == jnp.floor(t)) & (e >= 1) & (e == jnp.floor(e))
             & (e < 2.0**_POW_BITS) & (d > 0) & (d < 1))
    safe = [jnp.where(valid, x, v) for x, v in ((s, 1.0), (t, 1.0), (e, 1.0), (d, 0.5))]
    flat = [jnp.broadcast_to(x, shape).reshape(-1) for x in safe]
    out = jax.vmap(_one_zero_out if zero_out else _one)(*flat).reshape(shape)
    return jnp.where(valid, out, jnp.nan)
