r"""Privacy amplification by iteration: Rényi-DP bounds for projected noisy SGD.

Feldman, Mironov, Talwar and Thakurta bound the Rényi divergence of a contractive noisy
iteration with the *shifted* Rényi divergence: every noisy step can absorb part of the
shift caused by the differing record at a cost :math:`α a^2/(2 s^2)` (s the noise standard
deviation), and contractions do not increase it (their Theorem 22). For PNSGD the noise on
the parameters is ησ and the differing gradient step moves the iterate by at most 2ηL, so
spreading the shift evenly over the :math:`n - i + 1` noisy steps from the record's own
step to the end gives :math:`(α, 2αL^2/(σ^2 (n-i+1)))`-RDP (η cancels).

All bounds here are linear in the order, :math:`(α, cα)` for every α > 1, so they are
returned on a grid of orders (last axis, as the rest of the library) and can be converted
in closed form or by a one-dimensional search over continuous α (:func:`linear_rdp_epsilon`).

Every public function computes in float64 whatever the global flag, validates concrete
inputs eagerly (``ValueError`` naming the parameter) and gives NaN (or +inf where a bound
cannot be certified) under ``jit``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._numerics import f64, float64, log_expm1
from .._validate import check_integer, check_positions, is_int, nan_unless
from ._contraction import _batch_geometry

__all__ = [
    "pnsgd_iteration_rdp",
    "skip_pnsgd_iteration_rdp",
    "stop_pnsgd_iteration_rdp",
    "strongly_convex_iteration_rdp",
    "linear_rdp_epsilon",
    "linear_rdp_delta",
]

_SC_FORMS = ("proposition1", "shifted")
_STOP_FORMS = ("harmonic", "logmeanexp")
_CONVERSION_METHODS = ("improved", "classic")
# Stop-PNSGD log-mean-exp form: the first _STOP_HEAD terms of Σ_t expm1(y/t) are summed
# exactly, the rest bounded in closed form (see stop_pnsgd_iteration_rdp).
_STOP_HEAD = 32
# Best continuous order for the improved conversion: ε'(α) = c + (log δ + log α)/(α−1)², so
# with u = α − 1 the optimum is the unique root of F(u) = c u² + log(1+u) + log δ (F is
# increasing, F(0) = log δ < 0 < F(u_c) at the classic optimum u_c = √(log(1/δ)/c)).
# Safeguarded Newton (bisection fallback) inside [0, u_c]. 16 iterations were not always
# enough (ρ ≈ 1e-16 left ε 3e-8 high, breaking monotonicity in the position); 64 reach the
# root to rounding even when every step bisects. Any order gives a valid ε, so the search
# only affects tightness.
_NEWTON_ITERS = 64


def _check_orders(orders) -> None:
    _validate.check_orders("orders", orders)


def _check_common(positions, num_records, lipschitz, noise_std) -> None:
    check_positions(positions, num_records)
    _validate.check_in_range("lipschitz", lipschitz, 0.0, math.inf)
    _validate.check_in_range("noise_std", noise_std, 0.0, math.inf, lo_open=True)


def _base_valid(pos, n, lip, sig):
    return is_int(pos) & is_int(n) & (pos <= n) & (lip >= 0) & jnp.isfinite(lip) & (sig > 0) & jnp.isfinite(sig)


def _pabi_coefficient(pos, n, lip, sig, b, k):
    """c of (α, cα)-RDP for PNSGD with batches and passes (see pnsgd_iteration_rdp)."""
    valid = _base_valid(pos, n, lip, sig) & is_int(b) & is_int(k)
    j, m, b_eff = _batch_geometry(pos, n, b)
    sig_s = jnp.where(valid, sig, 1.0)
    b_s = jnp.where(valid, b_eff, 1.0)
    m_s = jnp.where(valid, m, 1.0)
    j_s = jnp.where(valid, j, 1.0)
    scale = 2.0 * lip**2 / (b_s * sig_s) ** 2
    c = scale * ((k - 1.0) / m_s + 1.0 / (m_s - j_s + 1.0))
    return valid, c


def _sc_coefficient(pos, n, lip, sig, m_c, b, form):
    """c of (α, cα)-RDP for strongly convex PNSGD with batches (see strongly_convex_iteration_rdp)."""
    valid = _base_valid(pos, n, lip, sig) & is_int(b) & (m_c >= 0) & (m_c <= 1)
    j, m, b_eff = _batch_geometry(pos, n, b)
    sig_s = jnp.where(valid, sig, 1.0)
    b_s = jnp.where(valid, b_eff, 1.0)
    later = jnp.where(valid, m - j, 0.0)  # K = number of later steps
    scale = 2.0 * lip**2 / (b_s * sig_s) ** 2
    has_later = later > 0
    k_s = jnp.where(has_later, later, 1.0)
    mm = jnp.where(valid, m_c, 1.0)
    pos_m = mm > 0
    log_m = jnp.log(jnp.where(pos_m, mm, 1.0))
    if form == "proposition1":
        # κ = 2L² M^{K+1} / (K σ²) for K ≥ 1; 2L²/σ² for K = 0.
        factor = jnp.where(pos_m, jnp.exp((k_s + 1.0) * log_m), 0.0) / k_s
        factor = jnp.where(has_later, factor, 1.0)
    else:
        # M^{2K}/Σ_{l=0}^{K} M^{2l} = M^{2K}(1 − M²)/(1 − M^{2(K+1)}); → 1/(K+1) as M → 1.
        one = mm >= 1.0
        lm = jnp.where(one | ~pos_m, -1.0, log_m)
        ratio = jnp.expm1(2.0 * lm) / jnp.expm1(2.0 * (later + 1.0) * lm)
        geo = jnp.exp(2.0 * later * lm) * ratio
        factor = jnp.where(one, 1.0 / (later + 1.0), geo)
        factor = jnp.where(pos_m, factor, jnp.where(has_later, 0.0, 1.0))
    return valid, scale * factor


def _with_orders(valid, c, orders):
    orders = f64(orders)
    valid = valid[..., None] & jnp.all(orders > 1)
    return nan_unless(valid, c[..., None] * orders)


@float64
def pnsgd_iteration_rdp(orders, positions, num_records, lipschitz, noise_std, *, batch_size=1, passes=1) -> jax.Array:
    r"""Rényi DP of projected noisy SGD for the record at ``positions`` (Feldman et al. Thm 23).

    One pass, batch size 1: the record processed at step i of n satisfies

    .. math:: D_α ≤ \frac{2 α L^2}{σ^2 (n - i + 1)} \qquad \text{for every } α > 1.

    *Proof sketch* (Theorem 22 of Feldman et al.): the differing map moves the iterate by
    :math:`s_i ≤ 2ηL`; choose shifts :math:`a_t = 2ηL/(n-i+1)` for the :math:`n - i + 1`
    noisy steps t = i..n (noise :math:`N(0, η^2σ^2 I)`), so the cost is
    :math:`(n-i+1)\, α a^2/(2η^2σ^2) = 2αL^2/(σ^2(n-i+1))`.

    **Mini-batches (extension, derived here).** With consecutive batches of b records and
    noise σ on the *averaged* gradient, a pass has :math:`m = \lceil n/b\rceil` noisy steps
    and the record is in batch :math:`j = \lceil i/b\rceil`; the averaged loss is convex,
    L-Lipschitz and β-smooth, so every step is a contraction when η ≤ 2/β, and the
    differing batch map moves by at most :math:`2ηL/b_j` (:math:`b_j = b`, or the size of
    a last, smaller batch when the record is in it). The same schedule over the
    :math:`m - j + 1` steps gives :math:`2αL^2/(b_j^2σ^2(m-j+1))`.

    **Several passes in the same order (extension; schedule derived here).** With k passes
    the record's map differs at steps :math:`j, j+m, …, j+(k-1)m` (shift
    :math:`s = 2ηL/b_j` each). Theorem 22 needs shifts :math:`a_t ≥ 0` whose partial sums
    never exceed those of the :math:`s_t` and match them at the end. The schedule
    :math:`a_t = s/m` for the :math:`(k-1)m` steps :math:`t ∈ [j, (k-1)m + j - 1]`, then
    :math:`a_t = s/(m-j+1)` for the last :math:`m - j + 1` steps, is feasible (its partial
    sums equal :math:`(k-1)s` exactly at the last use) and is the least-squares optimum
    (the greatest convex minorant of the staircase of partial sums). Its cost is

    .. math::
        D_α ≤ \frac{2 α L^2}{b_j^2 σ^2}\Big(\frac{k-1}{m} + \frac{1}{m-j+1}\Big).

    With b = 1 and k = 1 this is exactly Theorem 23. For the last record it is at least
    :math:`2αL^2/σ^2` whatever k.

    Assumptions (not checked by the library): for every record, :math:`w ↦ f(w, x)` is
    convex, L-Lipschitz (:math:`\|∇f\| ≤ L`) and β-smooth on a convex set K, with η ≤ 2/β
    (:func:`step_contraction` enforces the stricter η ≤ 2/(β+ρ)); the starting point is
    data-independent; the noise is fresh and independent; only the final iterate is
    released (hidden intermediate iterates); the order is fixed in advance (it need not be
    random or secret).

    Args:
      orders: Rényi orders α > 1, shape ``(k,)``.
      positions: record index i in 1..``num_records`` (integer), any shape ``B``.
      num_records: number of records n ≥ 1 (integer).
      lipschitz: L ≥ 0.
      noise_std: σ > 0, standard deviation of the noise on the (averaged) gradient.
      batch_size: b ≥ 1 (integer).
      passes: k ≥ 1 (integer).

    Returns:
      RDP values, float64, shape ``B + (k,)`` (orders on the last axis). NaN under
      ``jit`` for invalid inputs.

    References:
      V. Feldman, I. Mironov, K. Talwar, A. Thakurta, "Privacy Amplification by Iteration",
      FOCS 2018 (arXiv:1808.06651), Theorems 22 and 23; Theorem 35 (several epochs).

    Examples:
      >>> import jaxdp
      >>> [round(float(v), 10) for v in jaxdp.accounting.pnsgd_iteration_rdp([2.0, 10.0], 50, 100, 1.0, 1.0)]
      [0.0784313725, 0.3921568627]
    """
    _check_orders(orders)
    _check_common(positions, num_records, lipschitz, noise_std)
    check_integer("batch_size", batch_size)
    _validate.check_not_above("batch_size", batch_size, "num_records", num_records)
    check_integer("passes", passes)
    pos, n, lip, sig, b, k = (f64(x) for x in (positions, num_records, lipschitz, noise_std, batch_size, passes))
    valid, c = _pabi_coefficient(pos, n, lip, sig, b, k)
    return _with_orders(valid, c, orders)


@float64
def skip_pnsgd_iteration_rdp(orders, positions, num_records, lipschitz, noise_std) -> jax.Array:
    r"""Rényi DP of Skip-PNSGD for the record at ``positions`` (Feldman et al. Thm 24).

    Skip-PNSGD draws a number t of leading records to skip and runs PNSGD on the rest. If
    t < i the record is processed at step i − t of n − t and is followed by the same
    :math:`n - i + 1` noisy steps (its own included); if t ≥ i it is never touched. Hence
    the bound of Theorem 23 holds for every t, and whether t is hidden does not matter:

    .. math:: D_α ≤ \frac{2αL^2}{σ^2(n - i + 1)}.

    Assumptions: as :func:`pnsgd_iteration_rdp` (convex, L-Lipschitz, β-smooth, η ≤ 2/β,
    hidden intermediate iterates, fixed order); batch size 1, one pass.

    Args:
      orders: α > 1, shape ``(k,)``.
      positions: i in 1..n.
      num_records: n ≥ 1.
      lipschitz: L ≥ 0.
      noise_std: σ > 0.

    Returns:
      float64, shape ``B + (k,)`` (NaN under ``jit`` for invalid inputs).

    References:
      Feldman, Mironov, Talwar, Thakurta (arXiv:1808.06651), Theorem 24.

    Examples:
      >>> import jaxdp
      >>> round(float(jaxdp.accounting.skip_pnsgd_iteration_rdp([8.0], 5000, 10000, 1.0, 4.0)[0]), 12)
      0.000199960008
    """
    return pnsgd_iteration_rdp(orders, positions, num_records, lipschitz, noise_std)


@float64
def stop_pnsgd_iteration_rdp(orders, num_records, lipschitz, noise_std, *, positions=None, form: str = "harmonic") -> jax.Array:
    r"""Rényi DP of Stop-PNSGD (uniformly random, hidden stopping time), Feldman et al. Thm 26.

    Stop-PNSGD draws t uniformly from {1, …, n}, runs t steps and releases :math:`w_t`.
    Given t, record i has :math:`ε_t = 0` for t < i and :math:`ε_t = 2αL^2/(σ^2(t-i+1))`
    otherwise (Theorem 23 with n := t); the output is their mixture.

    * ``form="harmonic"`` (the paper, via the weak convexity Lemma 25, which needs every
      :math:`ε_t ≤ 1/(α-1)`, i.e. :math:`σ ≥ L\sqrt{2α(α-1)}`):

      .. math:: D_α ≤ \frac{4αL^2 H_{n-i+1}}{σ^2 n},

      with :math:`H_m` the harmonic number. Orders with :math:`σ < L\sqrt{2α(α-1)}` get
      +inf (the bound is not certified there). The paper's printed simplification is not
      recoverable from our copy; :math:`H_n > \ln n`, so a "ln n" form would not be an
      upper bound, and the harmonic form is used.
    * ``form="logmeanexp"`` (from the equality step of Lemma 25's proof; no condition on σ;
      it is never larger than the harmonic form where that one is valid):

      .. math::
          D_α ≤ \frac{1}{α-1}\log\Big(1 + \frac1n\sum_{t=1}^{n-i+1}\big(e^{y/t} - 1\big)\Big),
          \qquad y = (α-1)\frac{2αL^2}{σ^2}.

      The first 32 terms are summed exactly; for the rest,
      :math:`e^{x} - 1 ≤ x + c_2 x^2` for :math:`0 < x ≤ x_0 = y/33`, with
      :math:`c_2 = (e^{x_0} - 1 - x_0)/x_0^2` (increasing in x_0), and
      :math:`\sum_{t=33}^{K} 1/t = ψ(K+1) - ψ(33)`,
      :math:`\sum_{t=33}^{K} 1/t^2 = ψ'(33) - ψ'(K+1)`, so the result is an upper bound.

    Assumptions: convex, L-Lipschitz, β-smooth loss, η ≤ 2/β; the stopping time is uniform
    on 1..n and hidden; only :math:`w_t` is released; fixed order; batch size 1.

    Args:
      orders: α > 1, shape ``(k,)``.
      num_records: n ≥ 1.
      lipschitz: L ≥ 0.
      noise_std: σ > 0.
      positions: record index i in 1..n, or ``None`` (default) for the bound that holds
        for every record, which is the one at i = 1 (the worst case).
      form: ``"harmonic"`` or ``"logmeanexp"`` (static).

    Returns:
      float64, shape ``B + (k,)``; +inf at orders where the harmonic form is not valid;
      NaN under ``jit`` for invalid inputs.

    References:
      Feldman, Mironov, Talwar, Thakurta (arXiv:1808.06651), Lemma 25 and Theorem 26.

    Examples:
      >>> import jaxdp
      >>> round(float(jaxdp.accounting.stop_pnsgd_iteration_rdp([2.0], 1000, 1.0, 2.0)[0]), 11)
      0.01497094172
    """
    _validate.check_static_choice("form", form, _STOP_FORMS)
    _check_orders(orders)
    if positions is None:
        positions = 1
    _check_common(positions, num_records, lipschitz, noise_std)
    return _stop_rdp_core(f64(orders), f64(positions), f64(num_records), f64(lipschitz), f64(noise_std), form=form)


@functools.partial(jax.jit, static_argnames=("form",))
def _stop_rdp_core(orders, positions, num_records, lipschitz, noise_std, form):
    # One compiled program (eager op-by-op dispatch took seconds on a first call).
    pos, n, lip, sig = (x[..., None] for x in (positions, num_records, lipschitz, noise_std))
    valid = _base_valid(pos, n, lip, sig) & (orders > 1)
    sig_s = jnp.where(valid, sig, 1.0)
    n_s = jnp.where(valid, n, 1.0)
    count = jnp.where(valid, n - pos + 1.0, 1.0)  # K = n − i + 1
    alpha = jnp.where(valid, orders, 2.0)
    x1 = 2.0 * alpha * lip**2 / sig_s**2  # ε_t at t − i + 1 = 1
    if form == "harmonic":
        harmonic = jax.scipy.special.digamma(count + 1.0) + np.euler_gamma
        rdp = 2.0 * x1 * harmonic / n_s
        ok = (alpha - 1.0) * x1 <= 1.0  # σ ≥ L √(2α(α−1))
        return nan_unless(valid, jnp.where(ok, rdp, jnp.inf))
    y = (alpha - 1.0) * x1
    t = jnp.arange(1, _STOP_HEAD + 1, dtype=jnp.float64)
    in_head = t <= count[..., None]
    y_pos = y > 0
    y_s = jnp.where(y_pos, y, 1.0)
    head = jnp.where(in_head, log_expm1(y_s[..., None] / t), -jnp.inf)
    h = float(_STOP_HEAD)
    has_tail = count > h
    cnt_t = jnp.where(has_tail, count, h + 1.0)
    x0 = y_s / (h + 1.0)
    # log c2, c2 = (e^{x0} − 1 − x0)/x0²: a series for small x0 (the x0³/100 term bounds
    # the remainder), e^{x0} − 1 − x0 directly up to x0 = 30, and beyond it
    # x0 + log1p(−(1 + x0) e^{−x0}), so that nothing overflows: the tail stays finite (and
    # so do its derivatives) however large y is.
    small = x0 < 1e-3
    big = x0 > 30.0
    x0_m = jnp.where(small | big, 1.0, x0)
    x0_b = jnp.where(big, x0, 31.0)
    log_c2 = jnp.where(
        small,
        jnp.log(0.5 + x0 / 6.0 + x0**2 / 24.0 + x0**3 / 100.0),
        jnp.where(big, x0_b + jnp.log1p(-(1.0 + x0_b) * jnp.exp(-x0_b)), jnp.log(jnp.expm1(x0_m) - x0_m))
        - 2.0 * jnp.log(jnp.where(small, 1.0, x0)),
    )
    s1 = jax.scipy.special.digamma(cnt_t + 1.0) - jax.scipy.special.digamma(h + 1.0)
    s2 = jax.scipy.special.polygamma(1, h + 1.0) - jax.scipy.special.polygamma(1, cnt_t + 1.0)
    # tail = y s1 + c2 y² s2 (s1 > 0 and s2 ≥ 0 when there is a tail), in logs.
    s1_s = jnp.where(has_tail & (s1 > 0), s1, 1.0)
    s2_pos = has_tail & (s2 > 0)
    s2_s = jnp.where(s2_pos, s2, 1.0)
    log_lin = jnp.log(y_s) + jnp.log(s1_s)
    log_quad = jnp.where(s2_pos, log_c2 + 2.0 * jnp.log(y_s) + jnp.log(s2_s), -jnp.inf)
    log_tail = jnp.where(has_tail & (s1 > 0), jnp.logaddexp(log_lin, log_quad), -jnp.inf)
    log_sum = jax.scipy.special.logsumexp(jnp.concatenate([head, log_tail[..., None]], axis=-1), axis=-1)
    rdp = jnp.logaddexp(0.0, log_sum - jnp.log(n_s)) / (alpha - 1.0)
    rdp = jnp.where(y_pos, rdp, 0.0)
    return nan_unless(valid, rdp)


@float64
def strongly_convex_iteration_rdp(
    orders, positions, num_records, lipschitz, noise_std, contraction, *, batch_size=1, form: str = "proposition1"
) -> jax.Array:
    r"""Rényi DP of PNSGD on a strongly convex loss (Balle et al. Thm 5, as quoted by Asoodeh et al.).

    With M < 1 the step contraction (:func:`step_contraction`), K = n − i later steps:

    * ``form="proposition1"`` — Balle et al.'s bound as quoted in Proposition 1 of Asoodeh
      et al.: :math:`(α, κα)`-RDP with

      .. math::
          κ = \frac{2L^2 M^{K+1}}{K σ^2}\ (K ≥ 1), \qquad κ = \frac{2L^2}{σ^2}\ (K = 0).

      **Decisions on the paper's inconsistencies.** (1) The statement of Proposition 1 has
      σ² in κ, its proof does not; we keep σ², the only dimensionally consistent reading
      (one Gaussian step of sensitivity 2ηL and noise ησ has RDP :math:`2αL^2/σ^2`);
      dropping it would be *optimistic* for σ < 1. (2) For i = n the proof writes
      :math:`κ = 2αL^2`, which depends on α; we use the statement's :math:`2L^2/σ^2`.
      (3) For M = 1 the quoted κ has denominator n − i, not Feldman et al.'s n − i + 1;
      we keep n − i as printed. Keeping these choices is never optimistic: by AM–GM,
      :math:`\sum_{l=0}^{K-1} M^{2l} ≥ K M^{K-1}`, so this κ is at least the optimal
      shifted-divergence bound below, which we derive independently.
    * ``form="shifted"`` — our derivation with Theorem 22 of Feldman et al. for M-Lipschitz
      maps (the shift left after a map is multiplied by M; Balle et al.'s technique). With
      shift :math:`s = 2ηL` at the record's step and absorptions :math:`a_0, …, a_K` at the
      K + 1 noisy steps, the residual :math:`M^K s - \sum_l M^{K-l} a_l` must be 0; the
      least-squares optimum (Cauchy–Schwarz) gives

      .. math::
          D_α ≤ \frac{2αL^2}{σ^2}\,\frac{M^{2K}}{\sum_{l=0}^{K} M^{2l}}
              = \frac{2αL^2}{σ^2}\,\frac{M^{2K}(1 - M^2)}{1 - M^{2(K+1)}},

      which is exactly Feldman et al.'s Theorem 23 at M = 1.

    **Mini-batches (extension).** The averaged loss over a batch is again L-Lipschitz,
    β-smooth and ρ-strongly convex, so both forms hold with n, i replaced by the number of
    batches m and the record's batch j, and L by :math:`L/b_j` (see
    :func:`pnsgd_iteration_rdp`); b = 1 gives the formulas above. Several passes are not
    offered for this analysis (the derivation is not written down here); use
    :func:`pnsgd_iteration_rdp`, which is valid for ρ > 0 as well.

    Assumptions (not checked): for every record, :math:`w ↦ f(w, x)` is L-Lipschitz,
    β-smooth and ρ-strongly convex on a convex set, η ≤ 2/(β+ρ) (so that M is the Lipschitz
    constant of the gradient step); hidden intermediate iterates; fixed order.

    Args:
      orders: α > 1, shape ``(k,)``.
      positions: i in 1..n.
      num_records: n ≥ 1.
      lipschitz: L ≥ 0.
      noise_std: σ > 0 (gradient noise).
      contraction: M in [0, 1] from :func:`step_contraction`.
      batch_size: b ≥ 1.
      form: ``"proposition1"`` or ``"shifted"`` (static).

    Returns:
      float64, shape ``B + (k,)`` (NaN under ``jit`` for invalid inputs).

    References:
      B. Balle, G. Barthe, M. Gaboardi, J. Geumlek, "Privacy Amplification by Mixing and
      Diffusion Mechanisms", NeurIPS 2019, Theorem 5; Asoodeh, Diaz, Calmon
      (arXiv:2001.06546), Proposition 1 and its proof; Feldman et al. (arXiv:1808.06651),
      Theorem 22.

    Examples:
      >>> import jaxdp
      >>> v = jaxdp.accounting.strongly_convex_iteration_rdp([2.0], 30, 40, 1.0, 1.0, 0.871779788708135)
      >>> round(float(v[0]) / 2, 10)
      0.0442083955
    """
    _validate.check_static_choice("form", form, _SC_FORMS)
    _check_orders(orders)
    _check_common(positions, num_records, lipschitz, noise_std)
    _validate.check_in_range("contraction", contraction, 0.0, 1.0)
    check_integer("batch_size", batch_size)
    _validate.check_not_above("batch_size", batch_size, "num_records", num_records)
    pos, n, lip, sig, m_c, b = (f64(x) for x in (positions, num_records, lipschitz, noise_std, contraction, batch_size))
    valid, c = _sc_coefficient(pos, n, lip, sig, m_c, b, form)
    return _with_orders(valid, c, orders)


def _improved_eps(c, log_delta, u):
    """ε(α) = cα + log(1 − 1/α) − (log δ + log α)/(α − 1) (Canonne–Kamath–Steinke, Prop. 12), at α = 1 + u.

    Written in u = α − 1 (log(1 − 1/α) = log u − log1p u): for a huge coefficient the optimal
    u is below the spacing of floats near 1, where 1 + u rounds to 1 and the α form gives
    log 0 = −inf, i.e. ε = 0 for a mechanism that is not private at all.
    """
    return c * (1.0 + u) + jnp.log(u) - jnp.log1p(u) - (log_delta + jnp.log1p(u)) / u


def _linear_eps(c, log_delta, method):
    """min over α > 1 of the RDP→DP conversion of (α, cα)-RDP; c > 0 finite, log δ < 0."""
    log_inv = -log_delta
    # Classic optimum: α* = 1 + √(log(1/δ)/c), ε = c + 2√(c log(1/δ)).
    classic = c + 2.0 * jnp.sqrt(c * log_inv)
    if method == "classic":
        return classic
    u_c = jnp.sqrt(log_inv / c)

    def body(_, state):
        lo, hi, u = state
        f = c * u * u + jnp.log1p(u) + log_delta
        lo = jnp.where(f <= 0, u, lo)
        hi = jnp.where(f > 0, u, hi)
        u_new = u - f / (2.0 * c * u + 1.0 / (1.0 + u))
        inside = (u_new > lo) & (u_new < hi)
        return lo, hi, jnp.where(inside, u_new, 0.5 * (lo + hi))

    init = (jnp.zeros_like(u_c), u_c, u_c)
    _, _, u = jax.lax.fori_loop(0, _NEWTON_ITERS, body, jax.lax.stop_gradient(init))
    u = jnp.where(u > 0, u, u_c)
    # Every order gives a valid ε; keep the better of the search and the classic order, and
    # the classic conversion itself where the improved one is not a finite number (u = 0).
    imp = jnp.minimum(_improved_eps(c, log_delta, u), _improved_eps(c, log_delta, u_c))
    return jnp.where(jnp.isfinite(imp), jnp.minimum(imp, classic), classic)


@float64
def linear_rdp_epsilon(coefficient, delta, *, method: str = "improved") -> jax.Array:
    r"""ε for target δ of a mechanism that is :math:`(α, cα)`-RDP for every α > 1.

    The bounds of this module are linear in the order, so the order can be optimised over
    the continuum instead of a grid.

    * ``method="improved"`` (default): the conversion of Canonne, Kamath and Steinke,
      valid at every α > 1,

      .. math:: ε(α) = cα + \log(1 - 1/α) - \frac{\log δ + \log α}{α - 1},

      minimised over continuous α. Since :math:`ε'(α) = c + (\log δ + \log α)/(α-1)^2`,
      the optimum is the unique root of :math:`c u^2 + \log(1 + u) + \log δ = 0`,
      :math:`u = α - 1`, found by a fixed-count safeguarded Newton iteration inside
      :math:`[0, \sqrt{\log(1/δ)/c}]`; the result is the smaller of the value there and at
      the classic optimum (any α is valid, so the search affects tightness only, never
      validity). It is 0 when :math:`δ ≥ \sqrt{1 - e^{-c}}`
      (total-variation bound via Bretagnolle–Huber with KL ≤ c), and clipped at 0.
    * ``method="classic"`` (Mironov, Prop. 3; the conversion used by Proposition 1 of
      Asoodeh et al.): closed form
      :math:`ε = c + 2\sqrt{c\log(1/δ)}` at :math:`α^* = 1 + \sqrt{\log(1/δ)/c}`.

    Args:
      coefficient: c ≥ 0 (``inf`` allowed, giving ε = inf).
      delta: δ in (0, 1).
      method: ``"improved"`` or ``"classic"`` (static).

    Returns:
      ε ≥ 0, float64, broadcast shape (NaN under ``jit`` for invalid inputs).

    References:
      C. Canonne, G. Kamath, T. Steinke, "The Discrete Gaussian for Differential Privacy",
      NeurIPS 2020, Proposition 12; I. Mironov, "Rényi Differential Privacy", CSF 2017,
      Proposition 3; Asoodeh, Diaz, Calmon (arXiv:2001.06546), Eq. (25)–(27).

    Examples:
      >>> import jaxdp
      >>> round(float(jaxdp.accounting.linear_rdp_epsilon(0.02, 1e-5, method="classic")), 10)
      0.9797051824
    """
    _validate.check_static_choice("method", method, _CONVERSION_METHODS)
    _validate.check_in_range("coefficient", coefficient, 0.0, math.inf, allow_inf=True)
    _validate.check_delta(delta)
    c = f64(coefficient)
    dlt = f64(delta)
    valid = (c >= 0) & (dlt > 0) & (dlt < 1)
    return nan_unless(valid, _linear_eps_jit(c, dlt, valid, method=method))


def _linear_eps_masked(c, dlt, valid, method):
    """ε ≥ 0 for c ∈ [0, ∞], δ ∈ (0, 1) (entries where ``valid`` is false are arbitrary)."""
    c, dlt, valid = jnp.broadcast_arrays(c, dlt, valid)
    good = valid & (c > 0) & jnp.isfinite(c)
    c_s = jnp.where(good, c, 1.0)
    log_d = jnp.log(jnp.where(valid, dlt, 0.5))
    eps = jnp.maximum(_linear_eps(c_s, log_d, method), 0.0)
    if method == "improved":
        tv_ok = dlt**2 + jnp.expm1(-jnp.where(good, c, 0.0)) >= 0  # √(1 − e^{−KL}) ≤ δ
        eps = jnp.where(tv_ok, 0.0, eps)
    eps = jnp.where(c == 0, 0.0, eps)
    return jnp.where(jnp.isinf(c), jnp.inf, eps)


_linear_eps_jit = jax.jit(_linear_eps_masked, static_argnames=("method",))


@float64
def linear_rdp_delta(epsilon, coefficient) -> jax.Array:
    r"""δ for a given ε of an :math:`(α, cα)`-RDP mechanism, classic conversion (Prop. 1).

    .. math::
        δ = \inf_{α > 1} e^{-(α-1)(ε - cα)} =
        \begin{cases} e^{-(ε - c)^2/(4c)} & ε > c, \\ 1 & ε ≤ c, \end{cases}

    attained at :math:`α^* = (ε + c)/(2c)`. This is the curve Asoodeh et al. plot as the
    baseline of their Figures 2 and 3 (with c = κ of Proposition 1). Being the classic
    conversion, it is looser than :func:`linear_rdp_epsilon` with the improved method.

    Args:
      epsilon: ε ≥ 0.
      coefficient: c ≥ 0.

    Returns:
      δ in [0, 1], float64 (NaN under ``jit`` for invalid inputs).

    References:
      Asoodeh, Diaz, Calmon (arXiv:2001.06546), Proposition 1, Eq. (15), (26)–(27);
      Mironov (2017), Proposition 3.

    Examples:
      >>> import jaxdp
      >>> f"{float(jaxdp.accounting.linear_rdp_delta(1.0, 1.0 / 78)):.6e}"
      '5.584868e-09'
    """
    _validate.check_in_range("epsilon", epsilon, 0.0, math.inf)
    _validate.check_in_range("coefficient", coefficient, 0.0, math.inf)
    eps, c = f64(epsilon), f64(coefficient)
    valid = (eps >= 0) & (c >= 0) & jnp.isfinite(eps) & jnp.isfinite(c)
    above = eps > c
    c_s = jnp.where(above & (c > 0), c, 1.0)
    val = jnp.exp(-((eps - c_s) ** 2) / (4.0 * c_s))
    val = jnp.where(c > 0, val, 0.0)
    return nan_unless(valid, jnp.where(above, val, 1.0))
