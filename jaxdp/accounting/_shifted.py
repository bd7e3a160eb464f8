r"""Per-record Gaussian differential privacy of PNSGD by shifted interpolation.

Bok, Su and Altschuler bound the tradeoff function of noisy gradient descent with hidden
iterates by interpolating between the two runs: a start time τ, shifts :math:`a_k ≥ 0`
absorbed by the noise of the steps after τ, and the distance :math:`z_k` left between the
real and the interpolated process,

.. math::
    z_τ = \|X_τ - X'_τ\| \;(0 \text{ at } τ = 0,\ ≤ D \text{ otherwise}),\qquad
    z_k = c\,z_{k-1} + η s_k - a_k ≥ 0,\qquad z_t = 0,

give :math:`G(μ)` with :math:`μ^2 = \sum_k a_k^2/(ησ)^2`. For PNSGD in a fixed order, the
record in batch j is used at the steps :math:`s_p = (p-1)m + j`, where the averaged
gradient moves by at most :math:`s = Δ = 2L/b_j` (replace-one), and c is the Lipschitz
constant of the gradient step. The smallest :math:`\sum a_k^2` is the energy of the
greatest convex minorant of a staircase (docs/shifted_interpolation.md); this module
computes it exactly for each record and start time and minimises over start times.

The result is a μ-GDP guarantee per record, converted exactly to (ε, δ) (it is the
Gaussian mechanism with noise multiplier 1/μ: :func:`gaussian_mechanism_epsilon`) or to
Rényi DP :math:`(α, αμ^2/2)` for composition with other events.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._numerics import f64, float64
from .._validate import check_integer, check_positions, is_int, nan_unless
from ._contraction import _batch_geometry

__all__ = ["pnsgd_shifted_gdp", "pnsgd_shifted_rdp", "shifted_contraction"]

# The hull energy is computed from float64 sums and ratios with relative error below
# ~1e-13; the energy is raised by this relative slack so that rounding never certifies a
# smaller μ than the exact minimiser's (μ moves by 5e-11 relative: invisible in ε).
_REL_SLACK = 1e-10
# c is floored here (a larger c is still a valid Lipschitz constant): c = 0 (η = 1/ρ = 1/β)
# would give log c = -inf and 0·inf in the geometric sums.
_LOG_C_FLOOR = -690.0


def _log_contraction(learning_rate, smoothness, strong_convexity):
    r"""log c with c = max(|1 - ηρ|, |1 - ηβ|), accurate near c = 1 (log1p of -ηρ)."""
    eta, beta, rho = learning_rate, smoothness, strong_convexity
    x_r, x_b = eta * rho, eta * beta

    def log_abs_one_minus(x):
        below = x < 1.0
        lo = jnp.log1p(-jnp.where(below, x, 0.0))
        hi = jnp.log(jnp.where(below | (x == 1.0), 1.0, x - 1.0))
        return jnp.where(below, lo, jnp.where(x == 1.0, -jnp.inf, hi))

    lc = jnp.maximum(log_abs_one_minus(x_r), log_abs_one_minus(x_b))
    return jnp.maximum(lc, _LOG_C_FLOOR)


def _geo(lx, n):
    r""":math:`\sum_{i<n} x^i = (1 - x^n)/(1 - x)` with lx = log x ≤ 0, n ≥ 0 (n at x = 1).

    expm1 keeps the ratio accurate for x close to 1; at x = 1 exactly the value n carries
    the first-order term n(n-1)/2·lx so that derivatives in x are right there too.
    """
    one = lx == 0.0
    lxs = jnp.where(one, -1.0, lx)
    ratio = jnp.expm1(n * lxs) / jnp.expm1(lxs)
    return jnp.where(n > 0, jnp.where(one, n + 0.5 * n * (n - 1.0) * lx, ratio), 0.0)


def _slope(du, dt, ok):
    return jnp.where(ok & (dt > 0), du / jnp.where(ok & (dt > 0), dt, 1.0), jnp.inf)


def _seg(du, dt):
    """(ΔU)²/ΔT of one hull segment; 0 when ΔU = 0, +inf when ΔT = 0 < ΔU (safe side)."""
    pos = dt > 0
    e = du * du / jnp.where(pos, dt, 1.0)
    return jnp.where(du > 0, jnp.where(pos, e, jnp.inf), 0.0)


def _energy(l1, r_cnt, z_start, delta_s, m, e, lc):
    r"""Smallest :math:`\sum a_k^2` (distance/η units) for one start time.

    Local steps 1..N after the start; R = ``r_cnt`` sensitive steps at l1, l1 + m, ...,
    the last one followed by e = m - j steps; the start distance is ``z_start`` (0 at the
    run's start). In end-scaled coordinates :math:`T_i = \sum_{l≤i} c^{2(N-l)}`,
    :math:`U_i = z c^N + Δ\sum_{\text{sensitive } l≤i} c^{N-l}`, the answer is the energy
    :math:`\sum (ΔU)^2/ΔT` of the greatest convex minorant of (0, 0) and the points
    (T_i, U_i). U is a staircase, so only the corners before each jump and the end
    matter, and the corners lie on a concave curve (U affine in y, T affine in y²,
    y = c^{N-i}; a line when c = 1): the minorant's vertices are among the origin O, the
    first corner A, the last corner B and the end E.
    """
    has_r = r_cnt >= 1
    n_loc = jnp.where(has_r, l1 + (r_cnt - 1.0) * m + e, e)
    lc2 = 2.0 * lc
    zc = z_start * jnp.exp(n_loc * lc)
    # The corners and the end (T, U) in end-scaled coordinates.
    ok_a = has_r & (l1 >= 2.0)
    i_a = l1 - 1.0
    t_a = jnp.exp((n_loc - i_a) * lc2) * _geo(lc2, i_a)
    ok_b = r_cnt >= 2.0
    i_b = n_loc - e - 1.0
    t_b = jnp.exp((e + 1.0) * lc2) * _geo(lc2, i_b)
    v_b = delta_s * jnp.exp((e + m) * lc) * _geo(m * lc, r_cnt - 1.0)
    t_e = _geo(lc2, n_loc)
    v_e = jnp.where(has_r, delta_s * jnp.exp(e * lc) * _geo(m * lc, r_cnt), 0.0)
    last = delta_s * jnp.exp(e * lc)  # the last sensitive step: U_E - U_B
    dt_be = _geo(lc2, e + 1.0)
    dt_ab = jnp.exp((e + 1.0) * lc2) * _geo(lc2, i_b - i_a)
    dt_ae = _geo(lc2, n_loc - i_a)
    u_a, u_b, u_e = zc, zc + v_b, zc + v_e
    # First vertex: least slope from O, the farthest point on ties.
    s_a = _slope(u_a, t_a, ok_a)
    s_b = _slope(u_b, t_b, ok_b)
    s_e = _slope(u_e, t_e, True)
    to_e = s_e <= jnp.minimum(s_a, s_b)
    to_b = (~to_e) & (s_b <= s_a)
    via_e = _seg(u_e, t_e)
    via_b = _seg(u_b, t_b) + _seg(last, dt_be)
    # From A: on to E or to B (then E).
    ab_then_e = _seg(v_b, dt_ab) + _seg(last, dt_be)
    a_to_e = _slope(v_e, dt_ae, True) <= _slope(v_b, dt_ab, ok_b)
    via_a = _seg(u_a, t_a) + jnp.where(a_to_e, _seg(v_e, dt_ae), ab_then_e)
    return jnp.where(to_e, via_e, jnp.where(to_b, via_b, via_a))


def _shifted_energy(pos, n, lip, eta, dia, b, k, lc):
    r"""Per position: min over start times of the allocation energy (μ² = energy/σ²).

    Start times: the run's start (distance 0) and, with distance D, each sensitive step
    :math:`s_p` of the record (a start just after a non-sensitive step is never better
    than one step earlier, docs/shifted_interpolation.md). With R = k - p sensitive steps
    left, the energy is searched over R by a ternary search (it is unimodal in R in every
    case we checked against the exhaustive minimum; any R gives a valid bound, so the
    search affects tightness only).

    The columns of each evaluation (the search's two per step, the final four) are read by a
    ``lax.scan`` over them, not by slices: XLA fused the energy into the slicing selects and
    emitted its code once per column read (a 0.5 MB kernel for the four; the program compiled
    in 1.2 CPU-s, 0.7 with the scans). The scans read the columns in order and select as the
    slices did, and the energies are computed as before: the values are the same bits.
    """
    j, m, b_eff = _batch_geometry(pos, n, b)
    e = m - j
    delta_s = 2.0 * lip / b_eff
    z0 = dia / eta
    sg = jax.lax.stop_gradient
    r_lo0 = sg(jnp.where(e >= 1, 0.0, 1.0) * jnp.ones_like(pos))
    r_hi0 = sg((k - 1.0) * jnp.ones_like(pos))
    m_s, e_s, d_s, z_s, lc_s = (sg(x)[..., None] for x in (m, e, delta_s, z0, lc))

    def f(r):  # energies for starts with r[..., i] sensitive steps left (one traced copy)
        return _energy(m_s, r, z_s, d_s, m_s, e_s, lc_s)

    def cond(state):
        lo, hi = state
        return jnp.any(hi - lo > 2.0)

    def body(state):
        lo, hi = state
        third = jnp.floor((hi - lo) / 3.0)
        active = hi - lo > 2.0
        vals = f(jnp.stack([lo + third, hi - third], axis=-1))

        def cmp(c, x):  # vals[..., 0] <= vals[..., 1], reading the columns in a scan
            v0, le, i = c
            return (jnp.where(i == 0, x, v0), jnp.where(i == 0, le, v0 <= x), i + 1), None

        (_, left, _), _ = jax.lax.scan(cmp, (jnp.zeros_like(lo), jnp.zeros(lo.shape, bool), 0),
                                       jnp.moveaxis(vals, -1, 0))
        return jnp.where(active & ~left, lo + third, lo), jnp.where(active & left, hi - third, hi)

    lo, hi = jax.lax.while_loop(cond, body, (r_lo0, r_hi0))
    cands = jnp.stack([lo, jnp.minimum(lo + 1.0, hi), jnp.minimum(lo + 2.0, hi)], axis=-1)
    any_start = r_lo0 <= r_hi0
    cands = sg(jnp.where(any_start[..., None], cands, 1.0))
    # One evaluation (one traced copy of the energy): the run's start (distance 0, first use
    # at j, k uses) and the three later starts left by the search (distance D, first use m
    # steps later); the least of the three later ones by selects (argmin and gathers break
    # vmap/grad with x64 off).
    col = jnp.broadcast_to(jnp.arange(4.0, dtype=cands.dtype), cands.shape[:-1] + (4,))
    first = col == 0.0
    cands4 = jnp.where(first, k[..., None], jnp.minimum(sg(lo)[..., None] + (col - 1.0), sg(hi)[..., None]))
    cands4 = jnp.where(first | any_start[..., None], cands4, 1.0)
    all4 = _energy(jnp.where(first, j[..., None], m[..., None]), cands4, jnp.where(first, 0.0, z0[..., None]),
                   delta_s[..., None], m[..., None], e[..., None], lc[..., None])

    def pick(c, x):  # column 0 is the start's; the least of columns 1-3 by selects, in a scan
        e0, best, i = c
        take = (i == 1) | ((i >= 2) & sg(x < best))
        return (jnp.where(i == 0, x, e0), jnp.where(take, x, best), i + 1), None

    zero = jnp.zeros(all4.shape[:-1], all4.dtype)
    (e_start, best_v, _), _ = jax.lax.scan(pick, (zero, zero, 0), jnp.moveaxis(all4, -1, 0))
    e_diam = jnp.where(any_start, best_v, jnp.inf)
    return jnp.minimum(e_start, e_diam) * (1.0 + _REL_SLACK)


def _shifted_valid(pos, n, lip, sig, eta, beta, rho, dia, b, k):
    return (
        is_int(pos) & is_int(n) & (pos <= n) & is_int(b) & (b <= n) & is_int(k)
        & (lip >= 0) & jnp.isfinite(lip) & (sig > 0) & jnp.isfinite(sig)
        & (eta > 0) & (beta > 0) & jnp.isfinite(beta) & (rho >= 0) & (rho <= beta) & (eta * beta <= 2.0)
        & (dia > 0) & jnp.isfinite(dia)
    )


@jax.jit
def _mu_core(pos, n, lip, sig, eta, beta, rho, dia, b, k):
    shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in (pos, n, lip, sig, eta, beta, rho, dia, b, k)))
    pos, n, lip, sig, eta, beta, rho, dia, b, k = (jnp.broadcast_to(x, shape) for x in (pos, n, lip, sig, eta, beta, rho, dia, b, k))
    valid = _shifted_valid(pos, n, lip, sig, eta, beta, rho, dia, b, k)
    one = lambda x: jnp.where(valid, x, 1.0)  # noqa: E731
    pos_s, n_s, b_s, k_s, eta_s, sig_s, dia_s = one(pos), one(n), one(b), one(k), one(eta), one(sig), one(dia)
    lip_s = jnp.where(valid, lip, 0.0)
    lc = _log_contraction(eta_s, jnp.where(valid, beta, 1.0), jnp.where(valid, rho, 0.0))
    energy = _shifted_energy(pos_s, n_s, lip_s, eta_s, dia_s, b_s, k_s, lc)
    pos_e = energy > 0
    mu = jnp.where(pos_e, jnp.sqrt(jnp.where(pos_e, energy, 1.0)), 0.0) / sig_s
    return nan_unless(valid, mu)


def _check_run(positions, num_records, lipschitz, noise_std, learning_rate, diameter, smoothness, strong_convexity, batch_size, passes):
    check_positions(positions, num_records)
    _validate.check_in_range("lipschitz", lipschitz, 0.0, math.inf)
    _validate.check_in_range("noise_std", noise_std, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("diameter", diameter, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("smoothness", smoothness, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("strong_convexity", strong_convexity, 0.0, math.inf)
    _validate.check_in_range("learning_rate", learning_rate, 0.0, math.inf, lo_open=True)
    _validate.check_not_above("strong_convexity", strong_convexity, "smoothness", smoothness)
    if _validate.is_concrete(learning_rate) and _validate.is_concrete(smoothness):
        eta, beta = np.broadcast_arrays(np.asarray(learning_rate, np.float64), np.asarray(smoothness, np.float64))
        bad = eta * beta > 2.0
        if np.any(bad):
            raise ValueError(
                "learning_rate must be ≤ 2/smoothness (then the gradient step is non-expansive); got "
                f"learning_rate {eta[bad][0]:g} > {2.0 / beta[bad][0]:g}."
            )
    check_integer("batch_size", batch_size)
    _validate.check_not_above("batch_size", batch_size, "num_records", num_records)
    check_integer("passes", passes)


@float64
def shifted_contraction(learning_rate, smoothness, strong_convexity=0.0) -> jax.Array:
    r"""Lipschitz constant of the gradient step used by the shifted-interpolation analysis.

    .. math:: c = \max\{|1 - ηρ|,\ |1 - ηβ|\}

    is the Lipschitz constant of :math:`y ↦ y - η∇ℓ(y)` for a ρ-strongly convex, β-smooth
    ℓ and :math:`0 < η ≤ 2/β` (c = 1 for convex losses). On :math:`η ≤ 2/(β+ρ)` it is
    never larger than :func:`step_contraction`'s :math:`\sqrt{1 - 2ηβρ/(β+ρ)}` (equal at
    :math:`η = 2/(β+ρ)`).

    Args:
      learning_rate: η in (0, 2/β].
      smoothness: β > 0.
      strong_convexity: ρ in [0, β].

    Returns:
      c in [0, 1], float64, broadcast shape (NaN under ``jit`` for invalid inputs).

    References:
      J. Bok, W. Su, J. M. Altschuler, "Shifted Interpolation for Differential Privacy",
      ICML 2024 (arXiv:2403.00278), §4 (strongly convex NoisyGD/NoisyCGD).

    Examples:
      >>> import jaxdp
      >>> round(float(jaxdp.accounting.shifted_contraction(0.5, 1.0, 0.1)), 12)
      0.95
    """
    _validate.check_in_range("smoothness", smoothness, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("strong_convexity", strong_convexity, 0.0, math.inf)
    _validate.check_in_range("learning_rate", learning_rate, 0.0, math.inf, lo_open=True)
    eta, beta, rho = f64(learning_rate), f64(smoothness), f64(strong_convexity)
    valid = (eta > 0) & (beta > 0) & jnp.isfinite(beta) & (rho >= 0) & (rho <= beta) & (eta * beta <= 2.0)
    c = jnp.maximum(jnp.abs(1.0 - eta * rho), jnp.abs(1.0 - eta * beta))
    return nan_unless(valid, c)


@float64
def pnsgd_shifted_gdp(
    positions,
    num_records,
    lipschitz,
    noise_std,
    learning_rate,
    diameter,
    *,
    smoothness,
    strong_convexity=0.0,
    batch_size=1,
    passes=1,
) -> jax.Array:
    r"""μ per record: PNSGD with hidden iterates is μ-GDP for the record at each position.

    The run is :math:`Y ← Π_K(Y - η(\frac1b\sum_{x∈B}∇ℓ(Y, x) + Z))`,
    :math:`Z \sim N(0, σ^2 I)`, over n records in consecutive batches of b (m = ⌈n/b⌉
    batches, the last one possibly smaller), k passes in the same order, only the final
    iterate released. For the record in batch j (sensitivity :math:`Δ = 2L/b_j` of the
    averaged gradient under replace-one),

    .. math::
        μ^2 = \frac{1}{σ^2}\min_{τ}\ \min_{a ≥ 0}\Big\{\sum_{k>τ} a_k^2 :
              z_k = c z_{k-1} + ηΔ\,1[k \text{ uses the record}] - a_k ≥ 0,\ z_t = 0\Big\}\Big/η^2,

    with :math:`z_τ = 0` at τ = 0 and :math:`z_τ = D` otherwise, and
    c = :func:`shifted_contraction`. The inner minimum is the energy of a greatest convex
    minorant (exact, O(1) per start); the start times searched are τ = 0 and the record's
    own steps (the only candidates that can be optimal). Special cases: with c = 1 and
    τ = 0, :math:`μ^2 = \frac{4L^2}{b_j^2σ^2}\big(\frac{k-1}{m} + \frac{1}{m-j+1}\big)`
    (twice Feldman et al.'s RDP coefficient); with one batch (NoisyGD),
    :math:`μ = \frac{Δ}{σ}\sqrt{\frac{1+c}{1-c}\frac{1-c^t}{1+c^t}}` at τ = 0.

    μ-GDP means the tradeoff function is at least :math:`G_μ`; the exact (ε, δ) profile is
    that of the Gaussian mechanism with noise multiplier 1/μ
    (:func:`gaussian_mechanism_epsilon`, :func:`gaussian_mechanism_delta`), and it implies
    :math:`(α, αμ^2/2)`-RDP (:func:`pnsgd_shifted_rdp`).

    Assumptions (not checked): every record's loss is convex, L-Lipschitz, β-smooth and
    ρ-strongly convex on the convex set K of diameter D; projection onto K after the noise;
    data-independent start; fixed record order; fresh Gaussian noise; hidden iterates.

    Args:
      positions: record positions in 1..n (any shape).
      num_records: n ≥ 1.
      lipschitz: L ≥ 0.
      noise_std: σ > 0, noise standard deviation on the averaged gradient.
      learning_rate: η in (0, 2/β].
      diameter: D > 0.
      smoothness: β > 0.
      strong_convexity: ρ in [0, β].
      batch_size: b in 1..n (integer).
      passes: k ≥ 1 (integer).

    Returns:
      μ ≥ 0, float64, broadcast shape (NaN under ``jit`` for invalid inputs).

    References:
      J. Bok, W. Su, J. M. Altschuler, "Shifted Interpolation for Differential Privacy",
      ICML 2024 (arXiv:2403.00278), §3 (shifted interpolation for f-DP) and §4 (NoisyGD,
      NoisyCGD); the per-record allocation is derived in docs/shifted_interpolation.md.
      Dong, Roth, Su, "Gaussian Differential Privacy", JRSS-B 2022, Corollary 2.13.

    Examples:
      >>> import jaxdp
      >>> mu = jaxdp.accounting.pnsgd_shifted_gdp([1, 1408], 1408, 2.0, 0.0625, 1.0, 2.0, smoothness=1.0,
      ...                                         batch_size=64, passes=400)
      >>> [round(float(x), 8) for x in mu]
      [2.37584516, 2.57771997]
    """
    _check_run(positions, num_records, lipschitz, noise_std, learning_rate, diameter, smoothness, strong_convexity, batch_size, passes)
    return _mu_core(*(f64(x) for x in (positions, num_records, lipschitz, noise_std, learning_rate, smoothness, strong_convexity, diameter, batch_size, passes)))


@float64
def pnsgd_shifted_rdp(
    orders,
    positions,
    num_records,
    lipschitz,
    noise_std,
    learning_rate,
    diameter,
    *,
    smoothness,
    strong_convexity=0.0,
    batch_size=1,
    passes=1,
) -> jax.Array:
    r"""Rényi DP of PNSGD implied by the shifted-interpolation GDP bound: :math:`αμ^2/2`.

    A μ-GDP mechanism is :math:`(α, αμ^2/2)`-RDP for every α > 1 (the Rényi divergence
    of :math:`N(μ, 1)` from :math:`N(0, 1)`; tradeoff dominance implies Rényi dominance),
    with μ from :func:`pnsgd_shifted_gdp`. Use it to compose the run with other RDP events;
    for the run alone, the exact GDP conversion is tighter.

    Args:
      orders: Rényi orders α > 1 (last axis of the result).
      positions, num_records, lipschitz, noise_std, learning_rate, diameter, smoothness,
        strong_convexity, batch_size, passes: as :func:`pnsgd_shifted_gdp`.

    Returns:
      RDP values, float64, shape ``positions.shape + orders.shape`` (NaN under ``jit``
      for invalid inputs).

    References:
      Bok, Su, Altschuler (ICML 2024), §3 and Appendix A (RDP and tradeoff functions).

    Examples:
      >>> import jaxdp
      >>> r = jaxdp.accounting.pnsgd_shifted_rdp([2.0], 40, 40, 1.0, 2.0, 0.5, 1.0, smoothness=1.0)
      >>> round(float(r[0]), 6)
      1.0
    """
    _validate.check_orders("orders", orders)
    mu = pnsgd_shifted_gdp(
        positions, num_records, lipschitz, noise_std, learning_rate, diameter, smoothness=smoothness,
        strong_convexity=strong_convexity, batch_size=batch_size, passes=passes,
    )
    return _rdp_of(mu, f64(orders))


@functools.partial(jax.jit)
def _rdp_of(mu, orders):
    ok = jnp.all(orders > 1)
    return nan_unless(ok, 0.5 * mu[..., None] ** 2 * orders)
