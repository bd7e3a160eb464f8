r"""Rényi DP of the Gaussian and the Poisson-subsampled Gaussian mechanisms.

All functions compute in float64 whatever the global ``jax_enable_x64`` flag, broadcast
over leading batch axes of ``q`` and ``noise_multiplier``, and put the orders on the last axis.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._numerics import crvz_weights, f64, float64, log_expm1, log_ndtr, read_only, signed_logsumexp, take, take_windows
from .._program_cache import persistent

__all__ = ["DEFAULT_ORDERS", "gaussian_rdp", "sampled_gaussian_rdp", "heterogeneous_rdp", "laplace_rdp"]

DEFAULT_ORDERS: np.ndarray = np.array(
    [1.0 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024], dtype=np.float64
)
DEFAULT_ORDERS.setflags(write=False)
"""The 156 orders of dp_accounting's ``RdpAccountant`` default: 1.1, 1.2, …, 10.9, 11, …, 63,
128, 256, 512, 1024 (so results compare like for like)."""

# Terms of the alternating tail summed by Cohen–Rodriguez Villegas–Zagier acceleration.
# Its certified relative error is 2/(3+√8)^20 ≈ 1e-15 of the first tail term, and that
# bound is added to the result, so the fractional-order value is an upper bound.
_N_TAIL = 20
# For αq ≤ this, (1-q)^α - 1 + αq is summed as its binomial series (no cancellation).
_B2_SERIES_MAX_AQ = 0.5
_B2_TERMS = 32  # k = 2 .. 33: truncation error below (0.5)^34/34! relative
_CHUNK = 64  # configurations per chunk in large batches
_ROUNDING_MARGIN_LOG = -46.0 * math.log(2.0)
_NEG = -1e300  # stands for log 0 in masked entries (finite, so gradients stay finite)
# Outside [_SIGMA_MIN, _SIGMA_MAX] the series' σ² or 1/(2σ²) leave float64's range (NaN at
# 1e±300 before). RDP is non-increasing in σ (more noise is post-processing), so a larger σ
# is evaluated at _SIGMA_MAX (an upper bound, below 1e-190 per order at α ≤ 2^16: ε → 0),
# and a smaller one with 0 < q < 1 gives +inf (an upper bound: the exact value is beyond
# 1e190 there).
_SIGMA_MAX = 1e100
_SIGMA_MIN = 1e-100


@float64
def gaussian_rdp(orders, noise_multiplier) -> jax.Array:
    r"""Rényi DP of the Gaussian mechanism with sensitivity 1: :math:`ε(α) = α / (2σ^2)`.

    Args:
      orders: Rényi orders α > 1, shape ``(k,)`` (may be traced here).
      noise_multiplier: σ > 0, the noise standard deviation divided by the L2 sensitivity
        of the released quantity (dimensionless), any shape ``B``.

    Returns:
      float64 array of shape ``B + (k,)``. Invalid inputs under ``jit`` give NaN.

    References:
      I. Mironov, "Rényi Differential Privacy", CSF 2017, Proposition 7.

    Examples:
      >>> import jaxdp
      >>> [round(float(v), 6) for v in jaxdp.accounting.gaussian_rdp([2.0, 8.0], 2.0)]
      [0.25, 1.0]
    """
    _validate.check_orders("orders", orders)
    _validate.check_nonempty("orders", orders)
    _validate.check_nonempty("noise_multiplier", noise_multiplier)
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    orders = f64(orders)
    sigma = f64(noise_multiplier)[..., None]
    valid = (sigma > 0) & jnp.isfinite(sigma) & jnp.all(orders > 1)
    return jnp.where(valid, orders / (2.0 * sigma**2), jnp.nan)


@dataclasses.dataclass(frozen=True)
class _IntGroup:
    positions: np.ndarray  # where these orders sit in the caller's grid
    alpha: np.ndarray  # (n,)
    log_comb: np.ndarray  # (n, K): log C(α, k), 0 where masked
    mask: np.ndarray  # (n, K): 2 ≤ k ≤ α
    k: np.ndarray  # (K,)


@dataclasses.dataclass(frozen=True)
class _FracPlan:
    positions: np.ndarray
    alpha: np.ndarray  # (n,)
    log_abs_comb: np.ndarray  # (n, I): log |C(α, i)|
    w_left: np.ndarray  # (n, I): 1 on the head 2 ≤ i < i0, CRVZ weights on the tail, else 0
    w_right: np.ndarray  # (n, I): 1 on the head 0 ≤ i < i0, CRVZ weights on the tail, else 0
    i0: np.ndarray  # (n,) first index of the alternating tail, floor(α) + 1
    # Right series: g(j) is needed at j = α - i = frac(α) + m with m = floor(α) - i. It is
    # evaluated once per distinct fractional part on a descending integer grid,
    # j_grid[u, t] = frac_u + (m_max - t), and each order reads a contiguous slice
    # (static slicing; a gather is several times slower on CPU). frac_u + m and α - i round
    # the same real number, so the values are identical to evaluating at α - i.
    j_grid: np.ndarray  # (U, T)
    frac_index: np.ndarray  # (n,) row of j_grid for each order
    slice_start: np.ndarray  # (n,) first column for each order
    b2_coef: np.ndarray  # (n, _B2_TERMS): C(α, k) (-1)^k for k = 2, 3, ...
    tail_bound: float
    n_i: int


@dataclasses.dataclass(frozen=True)
class _Plan:
    n_orders: int
    int_groups: tuple[_IntGroup, ...]
    frac: _FracPlan | None
    max_int: int


# ``scipy.special.gammaln`` at every argument a plan of ``DEFAULT_ORDERS`` (or of a subset of
# them) evaluates, shape (2, m): sorted arguments, then their values. Importing scipy.special
# costs a fresh process ~0.15 CPU-s (0.2-0.4 s wall) before its first ε, most of a plan's
# cost; the table holds SciPy's own values, so plans and results are bit-identical
# (tests/accounting/test_rdp.py checks it against SciPy and regenerates it with
# ``_write_gammaln_table``). Any other argument goes to SciPy.
_GAMMALN_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_gammaln_table.npy")


@functools.cache
def _gammaln_table() -> np.ndarray | None:
    try:
        return read_only(np.load(_GAMMALN_TABLE, allow_pickle=False))
    except OSError:  # not shipped: every value from SciPy
        return None


def _scipy_gammaln(x: np.ndarray) -> np.ndarray:
    from scipy import special as _sp  # lazy: ~0.3 s of import (see _GAMMALN_TABLE)

    return _sp.gammaln(x)


def _gammaln(x) -> np.ndarray:
    """``scipy.special.gammaln(x)`` (log|Γ(x)|, +inf at the poles 0, -1, -2, ...), from the
    shipped table when it holds every finite argument (the same numbers), else from SciPy."""
    x = np.asarray(x, dtype=np.float64)
    table = _gammaln_table()
    pole = (x <= 0) & (x == np.floor(x))
    if table is not None:
        args, values = table
        at = np.minimum(np.searchsorted(args, x), args.size - 1)
        if np.all((args[at] == x) | pole):
            return np.where(pole, np.inf, values[at])
    return _scipy_gammaln(x)


def _write_gammaln_table(path: str = _GAMMALN_TABLE) -> np.ndarray:
    """Write the table of ``_GAMMALN_TABLE``: SciPy's gammaln at every argument that building
    the plan of ``DEFAULT_ORDERS`` evaluates (recorded while building it with SciPy)."""
    from scipy import special as _sp  # lazy: only when (re)writing the table

    seen = []

    def record(x):
        seen.append(np.asarray(x, dtype=np.float64).ravel())
        return _sp.gammaln(x)

    global _gammaln
    use = _gammaln
    _gammaln = record
    try:
        _plan.__wrapped__(tuple(DEFAULT_ORDERS.tolist()))
    finally:
        _gammaln = use
    x = np.unique(np.concatenate(seen))
    x = x[np.isfinite(x) & ~((x <= 0) & (x == np.floor(x)))]
    table = np.stack([x, _sp.gammaln(x)])
    np.save(path, table, allow_pickle=False)
    return table


def _log_abs_comb(alpha: np.ndarray, i: np.ndarray) -> np.ndarray:
    """log |C(α, i)| via log-gamma (gammaln returns log|Γ| for negative non-integers)."""
    return _gammaln(alpha + 1.0) - _gammaln(i + 1.0) - _gammaln(alpha - i + 1.0)


def _int_buckets(ints: np.ndarray) -> list[np.ndarray]:
    """Masks of the integer orders summed together: few groups, padding at most 2.5x.

    Each group is one padded ``(n, max α + 1)`` block of terms, and each block costs XLA
    its own kernels (a max and a sum over more than 32 terms are two or three kernels each,
    10-25 ms of compile apiece on the 2-core CPU: most of a first call). Power-of-two
    buckets waste at most half of a block; consecutive buckets are merged while the merged
    block holds at most 2.5 times the terms of the separate buckets, so the default grid's
    nine buckets become two (2..63, and 128..1024: 4 × 1,025 terms instead of 3 × 513 +
    1,025, 24 % more integer-order terms per configuration, a 1,000-configuration grid
    within noise of 2x rather than 2.5x). With 128..512 and 1024 merged, the integer orders'
    RDP program compiles in 0.19-0.21 CPU-s instead of 0.36-0.37 (as jaxdp compiles it,
    classic emitters; 24 → 15 kernels and 0.58-0.65 → 0.31-0.40 s with XLA's default
    emitters), and a first ε of DP-SGD's program in 0.96-0.99 instead of 1.11-1.26 (load
    ~20). The terms are the same (a padded entry adds an exact 0), and so are the
    sums here: XLA sums 513 and 1,025 terms in windows of 32 from the same offset (15
    padded zeros first), so the extra windows add exact zeros (46,800 default-grid values
    bit-identical). Where a merge pads rows to a length with another offset, the sums of
    the same positive terms may round differently in the last bits.
    """
    bucket = np.floor(np.log2(ints)).astype(np.int64)
    groups: list[np.ndarray] = []
    separate = 0
    for b in np.unique(bucket):
        sel = bucket == b
        cost = int(sel.sum()) * (int(ints[sel].max()) + 1)
        if groups:
            merged = groups[-1] | sel
            if int(merged.sum()) * (int(ints[merged].max()) + 1) <= 2.5 * (separate + cost):
                groups[-1] = merged
                separate += cost
                continue
        groups.append(sel)
        separate = cost
    return groups


@functools.lru_cache(maxsize=64)
def _plan(orders_key: tuple[float, ...]) -> _Plan:
    orders = np.asarray(orders_key, dtype=np.float64)
    is_int = orders == np.floor(orders)
    groups = []
    int_pos = np.nonzero(is_int)[0]
    if int_pos.size:
        ints = orders[int_pos].astype(np.int64)
        for sel in _int_buckets(ints):
            alpha = ints[sel]
            kmax = int(alpha.max())
            k = np.arange(kmax + 1)
            mask = (k[None, :] >= 2) & (k[None, :] <= alpha[:, None])
            with np.errstate(all="ignore"):
                lc = _log_abs_comb(alpha[:, None].astype(np.float64), k[None, :].astype(np.float64))
            lc = np.where(mask, lc, 0.0)
            groups.append(_IntGroup(int_pos[sel], alpha.astype(np.float64), lc, mask, k.astype(np.float64)))
    frac = None
    frac_pos = np.nonzero(~is_int)[0]
    if frac_pos.size:
        alpha = orders[frac_pos]
        i0 = np.floor(alpha).astype(np.int64) + 1
        n_i = int(i0.max()) + _N_TAIL
        i = np.arange(n_i)
        w_tail, bound = crvz_weights(_N_TAIL)
        rel = i[None, :] - i0[:, None]
        in_tail = (rel >= 0) & (rel < _N_TAIL)
        tail_w = np.where(in_tail, w_tail[np.clip(rel, 0, _N_TAIL - 1)], 0.0)
        w_left = np.where((i[None, :] >= 2) & (rel < 0), 1.0, tail_w)
        w_right = np.where(rel < 0, 1.0, tail_w)
        lac = _log_abs_comb(alpha[:, None], i[None, :].astype(np.float64))
        used = (w_left != 0) | (w_right != 0)
        lac = np.where(used, lac, 0.0)
        a_int = np.floor(alpha)
        frac_part = alpha - a_int  # exact (Sterbenz)
        fu, frac_index = np.unique(frac_part, return_inverse=True)
        m_max = int(a_int.max())
        m_min = int((a_int - (n_i - 1)).min())
        t = np.arange(m_max - m_min + 1)
        j_grid = fu[:, None] + (m_max - t)[None, :].astype(np.float64)
        slice_start = (m_max - a_int).astype(np.int64)
        kk = np.arange(2, 2 + _B2_TERMS, dtype=np.float64)
        b2 = np.exp(_log_abs_comb(alpha[:, None], kk[None, :]))
        # sign C(α, k) for fractional α > 1: C(α, k) = Π_{j<k} (α - j)/k! has k - ⌈α⌉ negative
        # factors when k > ⌈α⌉ (exact in integers; SciPy's binom gave the same signs).
        sign = (-1.0) ** np.maximum(kk[None, :] - np.ceil(alpha)[:, None], 0.0) * (-1.0) ** kk[None, :]
        frac = _FracPlan(
            positions=frac_pos,
            alpha=alpha,
            log_abs_comb=lac,
            w_left=w_left,
            w_right=w_right,
            i0=i0,
            j_grid=j_grid,
            frac_index=frac_index.astype(np.int64),
            slice_start=slice_start,
            b2_coef=sign * b2,
            tail_bound=bound,
            n_i=n_i,
        )
    max_int = int(max((g.alpha.max() for g in groups), default=0))
    return read_only(_Plan(len(orders), tuple(groups), frac, max_int))  # cached: shared by later calls


def _log_am1_integer(g: _IntGroup, log_q, log_1mq, log_expm1_k):
    """log(A_α - 1) for integer α: log Σ_{k=2}^{α} C(α,k) q^k (1-q)^{α-k} (e^{(k²-k)/(2σ²)} - 1).

    Every term is positive, so the sum has no cancellation at any q (the k = 0, 1 terms of
    A_α cancel the 1 exactly, since Σ_k C(α,k) q^k (1-q)^{α-k} = 1).
    """
    k = g.k
    n_k = k.shape[0]
    le = log_expm1_k[..., None, :n_k]  # (..., 1, K)
    lc = np.where(g.mask, g.log_comb, _NEG)  # masked entries ≈ log 0 (finite: safe gradients)
    # k log q + (α-k) log(1-q) = α log(1-q) + k log(q/(1-q)); the first part is added after
    # the sum, so each term costs one multiply-add, two adds and one exp.
    t = (lc + le) + k * (log_q - log_1mq)[..., None, None]
    m = jax.lax.stop_gradient(jnp.max(t, axis=-1, keepdims=True))
    return jnp.log(jnp.sum(jnp.exp(t - m), axis=-1)) + m[..., 0] + g.alpha * log_1mq[..., None]


def _log_am1_fractional(p: _FracPlan, q, log_q, log_1mq, sigma, z0):
    r"""log(A_α - 1) for fractional α by the split binomial series, made cancellation-free.

    With :math:`Y = e^{(2z-1)/(2σ^2)}` and :math:`z_0 = σ^2 \log(1/q - 1) + 1/2` (where
    :math:`qY = 1 - q`), :math:`A_α - 1 = E_{z∼N(0,σ^2)}[h(z)]` with
    :math:`h = (1-q+qY)^α - 1 - αq(Y-1) ≥ 0`. Splitting the integral at :math:`z_0` and
    expanding the binomial in the ratio that is below 1 on each side (Mironov, Talwar,
    Zhang 2019, §3.3) gives, for the left part, the terms
    :math:`C(α,i) q^i (1-q)^{α-i} e^{(i^2-i)/(2σ^2)} Φ((z_0-i)/σ)` and for the right part
    the same with :math:`i ↔ j = α - i` and :math:`Φ ↔ \bar Φ`. The left i = 0, 1 terms are
    combined with the subtracted :math:`1 + αq(Y-1)` in closed form (this removes the
    cancellation that otherwise costs all digits at q = 1e-5), and the alternating tail
    :math:`i > α` of each series, whose magnitudes are a product of |C(α,i)| (a Beta
    moment sequence) and a Mills ratio (a Laplace transform), both Hausdorff moment
    sequences in i, is summed exactly to 1e-15 by Cohen–Villegas–Zagier acceleration;
    its certified error bound is added, so the result is never below the true value.
    """
    alpha = p.alpha
    n_i = p.n_i
    i = jnp.arange(n_i, dtype=jnp.float64)
    inv2s2 = (1.0 / (2.0 * sigma**2))[..., None]
    lq = log_q[..., None]
    l1q = log_1mq[..., None]
    s = sigma[..., None]
    z = z0[..., None]
    jg = p.j_grid  # (U, T)
    zs = z / s
    zs1 = (z - 1.0) / s
    # Every log Φ value in one call (one copy of the erfc kernel in the compiled program):
    # Φ((z0-i)/σ) for the left series, Φ((j-z0)/σ) on the right-series grid, and the four
    # closed-form pieces Φ(±z0/σ), Φ(±(z0-1)/σ).
    batch = z.shape[:-1]
    args = [(z - i) / s, ((jg - z[..., None]) / s[..., None]).reshape(batch + (-1,)), zs, zs1, -zs, -zs1]
    lnd = log_ndtr(jnp.concatenate(args, axis=-1))
    cuts = np.cumsum([a.shape[-1] for a in args])[:-1].tolist()
    lnd_f, lnd_g, ln_zs, ln_zs1, ln_mzs, ln_mzs1 = jnp.split(lnd, cuts, axis=-1)
    # Left series, term i: log|C(α,i)| + α log(1-q) + f(i); f is shared by all orders.
    f = i * (lq - l1q) + (i * i - i) * inv2s2 + lnd_f  # (..., I)
    lac_l = np.where(p.w_left != 0, p.log_abs_comb, _NEG)  # masked entries ≈ log 0, finite
    lac_r = np.where(p.w_right != 0, p.log_abs_comb, _NEG)
    left = lac_l + f[..., None, :]  # (..., n, I); the common α log(1-q) is added after the sum
    # Right series, term i: log|C(α,i)| + i log(1-q) + g(α - i).
    g = jg * lq[..., None] + (jg * jg - jg) * inv2s2[..., None] + lnd_g.reshape(batch + jg.shape)
    g_rows = take_windows(g, p.frac_index, p.slice_start, n_i)  # (..., n, I)
    right = lac_r + i * l1q[..., None] + g_rows
    log_l, sign_l = signed_logsumexp(left, p.w_left, axis=-1)
    log_l = log_l + alpha * l1q
    log_r, sign_r = signed_logsumexp(right, p.w_right, axis=-1)
    # The first two tail terms a_0, a_1 (at i = i0, i0 + 1) of each series: a_0 scales the
    # certified CRVZ error bound, and both bound the sum of magnitudes for the rounding
    # margin below.
    # Picked per row by a select and a sum (one nonzero entry: exact), not a gather: the
    # derivative of a gather of scattered indices is one slice per index, hundreds of
    # kernels that multiply the compile time of every derivative. g(α - i0 - s) is
    # g_rows[:, i0 + s] (the same grid entry).
    i0 = p.i0
    rows_n = np.arange(len(alpha))
    tails = []
    for shift in (0, 1):
        lac = p.log_abs_comb[rows_n, i0 + shift]
        at = np.arange(n_i)[None, :] == (i0 + shift)[:, None]  # (n, I), one True per row
        f_at = jnp.sum(jnp.where(at, f[..., None, :], 0.0), axis=-1)
        g_at = jnp.sum(jnp.where(at, g_rows, 0.0), axis=-1)
        tails.append((lac + alpha * l1q + f_at, lac + (i0 + shift) * l1q + g_at))
    (first_left, first_right), (second_left, second_right) = tails
    # Σ|w_i| e_i ≤ S + a_0 + (N-1) a_1: the head terms are positive (so their sum is at most
    # the signed sum S, whose tail part lies in [0, a_0]), and the tail magnitudes decrease
    # with |w| ≤ 1. This avoids a second reduction over the series.
    log_nm1 = math.log(_N_TAIL - 1)
    mag_l = jnp.logaddexp(jnp.logaddexp(log_l, first_left), second_left + log_nm1)
    mag_r = jnp.logaddexp(jnp.logaddexp(log_r, first_right), second_right + log_nm1)
    log_bound = math.log(p.tail_bound)
    # Closed-form pieces (shape (..., n)).
    qq = q[..., None]
    aq = alpha * qq
    log_aq = jnp.log(alpha) + lq
    # B2 = (1-q)^α - 1 + αq ≥ 0: binomial series when αq is small, else direct.
    use_series = aq <= _B2_SERIES_MAX_AQ
    # q^(k-2) for k = 2, 3, ... is shared by all orders: 32 exps per configuration, then
    # one small contraction with the coefficients C(α,k)(-1)^k. A product and a sum, not `@`:
    # reverse mode transposes this outside the float64 scope, where a dot's requested float64
    # accumulation is truncated to float32 (JAX warns); a sum keeps the cotangent's dtype.
    powers = jnp.exp(lq * np.arange(_B2_TERMS, dtype=np.float64))  # (..., K)
    b2_series = qq**2 * jnp.sum(powers[..., None, :] * p.b2_coef, axis=-1)
    b2 = jnp.where(use_series, b2_series, jnp.expm1(alpha * l1q) + aq)
    log_p3 = ln_zs + jnp.log(jnp.maximum(b2, 1e-300))
    log_p4 = log_aq + ln_zs1 + jnp.log(-jnp.expm1((alpha - 1.0) * l1q))
    one_m_aq = 1.0 - aq
    log_p6a = jnp.log(jnp.maximum(jnp.abs(one_m_aq), 1e-300)) + ln_mzs
    log_p6b = log_aq + ln_mzs1
    ones = jnp.ones(log_p3.shape)
    pieces = jnp.stack(
        [log_l, log_r, first_left + log_bound, first_right + log_bound, log_p3, log_p4, log_p6a, log_p6b], axis=-1
    )
    weights = jnp.stack([sign_l, sign_r, ones, ones, ones, -ones, -jnp.sign(one_m_aq), -ones], axis=-1)
    # Rounding margin: the signed sum loses up to (number of terms + size of the term
    # exponents) ulps of the sum of magnitudes, which is about σ² times A - 1 for large σ
    # (the i = 2 term cancels against B_left). Adding 2^-46 of that magnitude (≈ 70 terms
    # and exponents up to ~500 in size) keeps the result an upper bound: it costs < 1e-10
    # relative for σ ≤ 50 and makes extreme σ (≥ 1e4) conservative rather than wrong.
    log_t, sign_t, log_mp = signed_logsumexp(pieces, weights, axis=-1, return_abs=True)
    # Σ of magnitudes: the pieces' own, plus what the two series' signed sums hide.
    log_mag = jnp.logaddexp(log_mp, jnp.logaddexp(mag_l, mag_r))
    log_margin = log_mag + _ROUNDING_MARGIN_LOG
    # A_α - 1 ≤ T + margin, with T the signed total. A_α - 1 > 0 for 0 < q < 1; if T is so
    # negative that T + margin ≤ 0, the value is below the rounding noise of its pieces and
    # cannot be certified: +inf rather than a guess.
    neg = sign_t < 0
    gap = jnp.where(neg & (log_t < log_margin), log_t - log_margin, -1.0)  # < 0 where used
    log_up = jnp.where(
        neg,
        log_margin + jnp.log(-jnp.expm1(gap)),
        jnp.logaddexp(jnp.where(sign_t > 0, log_t, -jnp.inf), log_margin),
    )
    return jnp.where(neg & ~(log_t < log_margin), jnp.inf, log_up)


@float64
def sampled_gaussian_rdp(orders, q, noise_multiplier) -> jax.Array:
    r"""Rényi DP of the Poisson-subsampled Gaussian mechanism, exact at every real order.

    With sampling rate q, noise multiplier σ and add-or-remove-one neighbours,

    .. math::
        ε(α) = \frac{1}{α-1}\log A_α,\qquad
        A_α = E_{z∼N(0,σ^2)}\big[\big(1 - q + q\,e^{(2z-1)/(2σ^2)}\big)^α\big],

    which is :math:`D_α(μ\,\|\,μ_0)` for :math:`μ_0 = N(0,σ^2)`, :math:`μ = (1-q)μ_0 + qN(1,σ^2)`,
    the direction that dominates (Mironov, Talwar, Zhang 2019, Theorem 5).

    * Integer α: :math:`A_α - 1 = \sum_{k=2}^{α} \binom{α}{k} q^k (1-q)^{α-k}(e^{(k^2-k)/(2σ^2)} - 1)`,
      a sum of positive terms in log space (no cancellation even at q = 1e-9).
    * Fractional α: the two-sided series of Mironov–Talwar–Zhang §3.3 with the signs kept
      (so the value is exact, not dp_accounting 0.6.0's sum of absolute values), the
      alternating tail summed by Cohen–Villegas–Zagier acceleration with its error bound
      added, and the low-order terms combined in closed form so that the result keeps
      its relative precision as q → 0. See ``_log_am1_fractional``.

    Both are finite wherever the true value is (no iteration cap returns ``inf``), and
    agree with 30-digit quadrature of :math:`A_α` to 2e-10 relative or better for σ in
    [0.3, 50] and α ≥ 1.01 (the fractional-order value carries a rounding margin that keeps
    it an upper bound; see ``_log_am1_fractional``). Closer to α = 1 the cancellation grows
    like α/(α-1): the value stays above the truth, within about 1e-13·α/(α-1) relative
    (1.4e-9 measured at α = 1.0001).

    Args:
      orders: Rényi orders α > 1, a concrete 1-D sequence of length k (static: close over
        it inside ``jit``). ``DEFAULT_ORDERS`` matches dp_accounting.
      q: Poisson sampling rate in [0, 1], shape broadcastable with ``noise_multiplier``.
      noise_multiplier: σ > 0, the noise standard deviation divided by the L2 sensitivity C
        of the clipped sum (each example's gradient clipped to norm C, noise N(0, σ²C²)
        added to the sum; add/remove-one neighbours, as dp_accounting and Opacus).

    Returns:
      float64 array of shape ``broadcast(q, noise_multiplier).shape + (k,)``: the RDP of one step.
      Under ``jit``, invalid q or σ give NaN.

    References:
      I. Mironov, K. Talwar, L. Zhang, "Rényi Differential Privacy of the Sampled Gaussian
      Mechanism", arXiv:1908.10530 (2019), §3.2 (integer α) and §3.3 (fractional α).

    Examples:
      >>> import jaxdp, numpy as np
      >>> r = jaxdp.accounting.sampled_gaussian_rdp([2.0], 0.01, 1.0)
      >>> bool(np.isclose(r[0], np.log1p(0.01**2 * np.expm1(1.0))))
      True
    """
    orders_np = _validate.concrete_orders(orders)
    _validate.check_nonempty("q", q)
    _validate.check_nonempty("noise_multiplier", noise_multiplier)
    _validate.check_broadcastable(q=q, noise_multiplier=noise_multiplier)
    _validate.check_in_range("q", q, 0.0, 1.0)
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    return _sgm_rdp_jit(tuple(orders_np.tolist()), f64(q), f64(noise_multiplier))


@persistent("sampled_gaussian_rdp", static_argnums=(0,))
@functools.partial(jax.jit, static_argnums=0)
def _sgm_rdp_jit(orders_key: tuple[float, ...], q: jax.Array, sigma: jax.Array) -> jax.Array:
    # Compiled once per (orders grid, shapes): eager calls then cost one dispatch.
    plan = _plan(orders_key)
    orders_np = np.asarray(orders_key, dtype=np.float64)
    q, sigma = jnp.broadcast_arrays(q, sigma)
    n = q.size
    if n <= _CHUNK:
        return _sgm_rdp(plan, orders_np, q, sigma)
    # Large batches run in chunks that stay in cache (about 1.5x faster on CPU).
    n_pad = -(-n // _CHUNK) * _CHUNK
    # Padded by concatenation, not jnp.pad: the transpose of a pad creates its zero as a
    # NumPy scalar that becomes float32 when a caller differentiates with x64 off.
    qf = jnp.concatenate([q.reshape(-1), jnp.full((n_pad - n,), 0.5, q.dtype)])
    sf = jnp.concatenate([sigma.reshape(-1), jnp.full((n_pad - n,), 1.0, sigma.dtype)])
    out = jax.lax.map(lambda a: _sgm_rdp(plan, orders_np, a[0], a[1]), (qf.reshape(-1, _CHUNK), sf.reshape(-1, _CHUNK)))
    return out.reshape(n_pad, -1)[:n].reshape(q.shape + (plan.n_orders,))


def _sgm_rdp(plan: _Plan, orders_np: np.ndarray, q: jax.Array, sigma: jax.Array) -> jax.Array:
    valid = (q >= 0) & (q <= 1) & (sigma > 0) & jnp.isfinite(sigma)
    inner = (q > 0) & (q < 1) & valid
    # Double-where: evaluate the series at harmless values where it is not used, so
    # gradients at q = 0, q = 1 or at invalid inputs stay finite.
    qs = jnp.where(inner, q, 0.5)
    ss = jnp.where(valid, jnp.clip(sigma, _SIGMA_MIN, _SIGMA_MAX), 1.0)
    log_q = jnp.log(qs)
    log_1mq = jnp.log1p(-qs)
    lams, alphas, positions = [], [], []
    if plan.int_groups:
        k_all = jnp.arange(plan.max_int + 1, dtype=jnp.float64)
        kk = jnp.maximum(k_all * k_all - k_all, 2.0)  # k < 2 is masked out; keep it finite
        log_expm1_k = log_expm1(kk / (2.0 * ss[..., None] ** 2))
        for g in plan.int_groups:
            lams.append(_log_am1_integer(g, log_q, log_1mq, log_expm1_k))
            alphas.append(g.alpha)
            positions.append(g.positions)
    if plan.frac is not None:
        fp = plan.frac
        z0 = ss**2 * (log_1mq - log_q) + 0.5
        lams.append(_log_am1_fractional(fp, qs, log_q, log_1mq, ss, z0))
        alphas.append(fp.alpha)
        positions.append(fp.positions)
    # ε(α) = log(1 + (A_α - 1))/(α - 1), then one static permutation back to the caller's order.
    lam = jnp.concatenate(lams, axis=-1)
    out = jnp.logaddexp(0.0, lam) / (np.concatenate(alphas) - 1.0)
    out = take(out, np.argsort(np.concatenate(positions)), axis=-1)
    orders_j = jnp.asarray(orders_np)
    out = jnp.where((inner & (sigma < _SIGMA_MIN))[..., None], jnp.inf, out)
    sv = jnp.where(valid, sigma, 1.0)
    full = orders_j / (2.0 * sv[..., None] ** 2)  # q = 1: the Gaussian mechanism
    out = jnp.where((q == 1)[..., None], full, out)
    out = jnp.where((q == 0)[..., None], 0.0, out)
    return jnp.where(valid[..., None], out, jnp.nan)


@float64
def heterogeneous_rdp(orders, q, noise_multiplier, num_steps) -> jax.Array:
    r"""RDP of a schedule of segments, composed by summing RDP curves.

    Segment s runs ``num_steps[s]`` steps of the sampled Gaussian with rate ``q[s]`` and
    noise multiplier ``noise_multiplier[s]`` (relative to the L2 sensitivity of the clipped
    sum, add/remove-one neighbours, as :func:`sampled_gaussian_rdp`); RDP composes additively (Mironov 2017, Proposition 1):
    :math:`ε(α) = \sum_s T_s\,ε_{q_s,σ_s}(α)`. The segment axis is the *last* axis of
    ``q``, ``noise_multiplier`` and ``num_steps`` (after broadcasting); leading axes are batch axes.
    Step counts are rounded up (a fractional count is charged as the next integer).

    Returns:
      float64 array ``batch + (k,)``.

    Examples:
      >>> import jaxdp
      >>> r = jaxdp.accounting.heterogeneous_rdp([2.0, 4.0], [1.0, 1.0], [1.0, 2.0], [1, 4])
      >>> [round(float(v), 6) for v in r]
      [2.0, 4.0]
    """
    _validate.check_nonempty("num_steps", num_steps)
    _validate.check_broadcastable(q=q, noise_multiplier=noise_multiplier, num_steps=num_steps)
    _validate.check_in_range("num_steps", num_steps, 0.0, math.inf)
    # sampled_gaussian_rdp's checks, on the concrete values, before the one compiled program.
    orders_np = _validate.concrete_orders(orders)
    _validate.check_nonempty("q", q)
    _validate.check_nonempty("noise_multiplier", noise_multiplier)
    _validate.check_in_range("q", q, 0.0, 1.0)
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    return _heterogeneous_rdp_jit(tuple(orders_np.tolist()), f64(q), f64(noise_multiplier), f64(num_steps))


@persistent("heterogeneous_rdp", static_argnums=(0,))
@functools.partial(jax.jit, static_argnums=0)
def _heterogeneous_rdp_jit(orders_key, q, noise_multiplier, num_steps):
    # One compiled program for an eager call (about fifty small ones op by op); inlined
    # inside a caller's jit, vmap or grad.
    steps_arr = jnp.ceil(num_steps)
    per_step = sampled_gaussian_rdp(orders_key, q, noise_multiplier)  # (..., S, k)
    steps_b = jnp.broadcast_to(steps_arr, per_step.shape[:-1])
    total = jnp.sum(jnp.where(steps_b[..., None] > 0, steps_b[..., None] * per_step, 0.0), axis=-2)
    return jnp.where(jnp.all(steps_b >= 0, axis=-1)[..., None], total, jnp.nan)


# ---------------------------------------------------------------------------------------
# Laplace mechanism.
# ---------------------------------------------------------------------------------------

# Below these arguments the two cancelling pieces of the Laplace RDP are summed as power
# series (12 and 16 terms: truncation error below 0.1^14/14! and 0.1^18/18, far under
# one ulp of the leading term).
_LAPLACE_SERIES_X = 0.1
_LAPLACE_SERIES_Y = 0.1


@float64
def laplace_rdp(orders, noise_multiplier) -> jax.Array:
    r"""Rényi DP of the Laplace mechanism (Mironov 2017, Proposition 6).

    With scale b and L1 sensitivity Δ, :math:`λ = b/Δ` (``noise_multiplier``) and
    :math:`t = 1/λ`,

    .. math::
        ε(α) = \frac{1}{α-1}\log\Big(\frac{α}{2α-1}e^{(α-1)t} + \frac{α-1}{2α-1}e^{-αt}\Big).

    Arranged without cancellation: with :math:`x = (2α-1)t`, :math:`c = -(1 - e^{-x})/(2α-1)`
    and :math:`y = (α-1)c ∈ (-1/2, 0]`,

    .. math:: ε(α) = \frac{x - (1 - e^{-x})}{2α-1} + \frac{\log(1+y) - y}{α-1},

    the first piece ≥ 0, the second ≤ 0 and at most half the first in size, and each is
    summed as its power series when its argument is small (so ε ≈ αt²/2 keeps its
    relative precision as λ → ∞). No exponential of a positive argument is taken, so the
    value is finite for every λ > 0 and every order, and tends to :math:`t` as α → ∞.

    Args:
      orders: Rényi orders α > 1, shape ``(k,)`` (may be traced).
      noise_multiplier: λ = b/Δ > 0, the Laplace scale over the L1 sensitivity under the
        neighbouring relation of interest; any shape ``B``.

    Returns:
      float64 array of shape ``B + (k,)``. Invalid inputs under ``jit`` give NaN.

    References:
      I. Mironov, "Rényi Differential Privacy", CSF 2017, Proposition 6 (Table II).

    Examples:
      >>> import jaxdp, math
      >>> r = jaxdp.accounting.laplace_rdp([2.0], 1.0)
      >>> bool(abs(float(r[0]) - math.log(2 / 3 * math.e + 1 / 3 * math.exp(-2))) < 1e-15)
      True
    """
    _validate.check_orders("orders", orders)
    _validate.check_nonempty("orders", orders)
    _validate.check_nonempty("noise_multiplier", noise_multiplier)
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    orders = f64(orders)
    lam = f64(noise_multiplier)[..., None]
    valid = (lam > 0) & jnp.isfinite(lam) & jnp.all(orders > 1)
    t = 1.0 / jnp.where(valid, lam, 1.0)
    u = orders - 1.0
    w = 2.0 * orders - 1.0
    x = w * t
    # g(x) = x - (1 - e^{-x}) = Σ_{k≥2} (-x)^k / k!
    xs = jnp.where(x < _LAPLACE_SERIES_X, x, 0.0)
    g_series = jnp.zeros_like(xs)
    term = xs * xs / 2.0
    for k in range(2, 14):
        g_series = g_series + term
        term = -term * xs / (k + 1)
    xl = jnp.where(x < _LAPLACE_SERIES_X, 1.0, x)
    g = jnp.where(x < _LAPLACE_SERIES_X, g_series, xl + jnp.expm1(-xl))
    y = u * jnp.expm1(-x) / w
    # h(y) = log(1 + y) - y = Σ_{k≥2} (-1)^{k+1} y^k / k
    ys = jnp.where(jnp.abs(y) < _LAPLACE_SERIES_Y, y, 0.0)
    h_series = jnp.zeros_like(ys)
    power = ys * ys
    for k in range(2, 18):
        h_series = h_series + (-1.0) ** (k + 1) * power / k
        power = power * ys
    yl = jnp.where(jnp.abs(y) < _LAPLACE_SERIES_Y, -0.5, y)
    h = jnp.where(jnp.abs(y) < _LAPLACE_SERIES_Y, h_series, jnp.log1p(yl) - yl)
    out = g / w + h / u
    return jnp.where(valid, jnp.maximum(out, 0.0), jnp.nan)

