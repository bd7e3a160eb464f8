r"""Fixed-size and truncated batch sampling: events and their RDP analyses.

Three ways to pick a batch besides Poisson sampling, each an event wrapping a Gaussian
mechanism (the sum of the batch's clipped gradients plus noise), with the analysis the RDP
accountant uses:

* :class:`SampledWithoutReplacement`: a uniformly random subset of ``batch_size`` = m of
  the ``num_records`` = n records, **replace-one** neighbours (n is public). RDP: Wang,
  Balle & Kasiviswanathan (AISTATS 2019), Theorem 27, computed as dp_accounting 0.6.0
  does (:func:`sampled_without_replacement_rdp`; the same forward differences, kept as
  ratios instead of logs, same interpolation of the CGF at fractional orders, same
  Stirling branch above order 256), so the two agree to rounding where nothing cancels.
* :class:`SampledWithReplacement`: m draws uniformly with replacement (a record may appear
  K ~ Binomial(m, 1/n) times), **replace-one** neighbours. dp_accounting 0.6.0 has the
  event but no accountant for it. RDP here (:func:`sampled_with_replacement_rdp`): the
  mechanism that also releases the drawn indices, which post-processing dominates; given
  the indices the two outputs are Gaussians whose means differ by at most K times the
  sensitivity, so

  .. math:: ε(α) = \frac{1}{α-1}\log \mathbb{E}_{K}\, e^{α(α-1)K^2/(2σ^2)}

  exactly for that mechanism (an upper bound here, first order in m/n: it gives up the
  second-order amplification a finer analysis, e.g. Birrell et al. arXiv 2408.10456, finds).
* :class:`TruncatedPoissonSampled`: Poisson sampling at rate q, and when more than
  ``max_batch_size`` = B records are drawn a uniformly random B of them are kept
  (dp_accounting's ``TruncatedSubsampledGaussianDpEvent``), **add/remove-one**. RDP here
  (:func:`truncated_poisson_rdp`): release the number N of the other records drawn (its
  law is the same on both data sets) and, when truncation can bite, the common part of
  the batch. Given N = k < B the step is the Poisson-sampled Gaussian at rate q; given
  k ≥ B the differing record is kept with probability q' = qB/(k+1), and then it
  *replaces* one of the other records, so the step is the Poisson-sampled Gaussian at
  rate q' with twice the sensitivity (σ/2). Hence

  .. math:: ε(α) = \frac{1}{α-1}\log \mathbb{E}_N\, e^{(α-1)ε_N(α)},

  with the expectation over N ~ Bin(c, q), c the number of common records (n − 1 or n;
  the larger of the two curves is taken), evaluated on buckets of k with the largest ε_k
  of each bucket (ε_k falls with k ≥ B). dp_accounting analyses this event with a PLD
  only (Ganesh, arXiv 2508.15089); this curve composes with every other RDP event.

All leaves are float64 under every transformation; ``jit``, ``vmap`` and ``grad`` apply.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._numerics import f64, float64, take
from ._events import Event, Gaussian, SelfComposed, _event, _is_structural, register_event_type, relation_of
from ._sampling_truncated import _tp_rdp, truncated_poisson_rdp  # noqa: F401 (re-exported)

__all__ = [
    "SampledWithoutReplacement",
    "SampledWithReplacement",
    "TruncatedPoissonSampled",
    "sampled_without_replacement_rdp",
    "sampled_with_replacement_rdp",
    "truncated_poisson_rdp",
    "shuffled_event",
]

# dp_accounting computes Theorem 27 exactly up to this order and with its Stirling-type
# bound above (rdp_privacy_accountant._compute_rdp_sample_wor_gaussian_int, max_alpha).
_WOR_EXACT_MAX = 256
# Relative margin on binomial masses from betainc (its own error is ~1e-14 relative).
_TAU_MARGIN = 1e-9
# Units in the last place charged per operation of the forward-difference recurrence.
_FD_ULPS = 8.0
# Stages of the forward-difference recurrence between two narrowings of its array.
_FD_CHUNK = 32


# =======================================================================================
# Events.
# =======================================================================================


def _check_inner(owner: str, event) -> None:
    if not isinstance(event, Event) and _is_structural(event):
        raise TypeError(f"{owner}.event must be an Event; got {type(event).__name__}.")


@_event(data=("num_records", "batch_size", "event"), meta=())
class SampledWithoutReplacement(Event):
    """``event`` run on a uniformly random subset of ``batch_size`` of ``num_records`` records.

    Replace-one neighbours (the data set size n is public). The RDP accountant covers a
    :class:`Gaussian` inner event with ``relation="replace_one"`` (its noise multiplier is
    relative to the replace-one sensitivity, twice the clipping norm for a sum of clipped
    gradients); see :func:`sampled_without_replacement_rdp`.

    Attributes:
      num_records: n ≥ 1 (a leaf).
      batch_size: m in [0, n] (a leaf; only q = m/n enters the analysis).
      event: the event applied to the sample.
    """

    num_records: Any
    batch_size: Any
    event: Event

    def __post_init__(self):
        _check_inner("SampledWithoutReplacement", self.event)


@_event(data=("num_records", "event"), meta=("batch_size",))
class SampledWithReplacement(Event):
    """``event`` run on ``batch_size`` records drawn uniformly with replacement from ``num_records``.

    Replace-one neighbours. ``batch_size`` is static (it fixes the support of the number
    of copies of a record). See :func:`sampled_with_replacement_rdp`.

    Attributes:
      num_records: n ≥ 1 (a leaf).
      batch_size: m ≥ 0 (a static Python int).
      event: a :class:`Gaussian` with ``relation="replace_one"``.
    """

    num_records: Any
    batch_size: int
    event: Event

    def __post_init__(self):
        _check_inner("SampledWithReplacement", self.event)
        m = self.batch_size
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 0:
            raise ValueError(f"SampledWithReplacement.batch_size must be a Python int >= 0 (it is static); got {m!r}.")


@_event(data=("q", "num_records", "max_batch_size", "event"), meta=())
class TruncatedPoissonSampled(Event):
    """Poisson sampling at rate ``q`` with the batch cut to ``max_batch_size`` records.

    When more than B = ``max_batch_size`` records are drawn, a uniformly random B of them
    are kept. Add/remove-one neighbours; the inner event must be a :class:`Gaussian` with
    ``relation="add_remove"``. See :func:`truncated_poisson_rdp`.

    Attributes:
      q: sampling rate in [0, 1] (a leaf).
      num_records: n ≥ 1, the size of the data set (a neighbour has n − 1 or n + 1
        records; both are covered; a leaf).
      max_batch_size: B ≥ 0 (a leaf; a fractional B is rounded down).
      event: the event applied to the (truncated) sample.
    """

    q: Any
    num_records: Any
    max_batch_size: Any
    event: Event

    def __post_init__(self):
        _check_inner("TruncatedPoissonSampled", self.event)


def _relation(ev) -> str:
    return relation_of(ev.event)


def _check_wor(ev, path, chk, rec):
    chk(f"{path}.num_records (SampledWithoutReplacement)", ev.num_records, 1.0, math.inf)
    chk(f"{path}.batch_size (SampledWithoutReplacement)", ev.batch_size, 0.0, math.inf)
    _validate.check_not_above(f"{path}.batch_size (SampledWithoutReplacement)", ev.batch_size,
                              f"{path}.num_records", ev.num_records)
    rec(ev.event, f"{path}.event")


def _check_wr(ev, path, chk, rec):
    chk(f"{path}.num_records (SampledWithReplacement)", ev.num_records, 1.0, math.inf)
    rec(ev.event, f"{path}.event")


def _check_trunc(ev, path, chk, rec):
    chk(f"{path}.q (TruncatedPoissonSampled)", ev.q, 0.0, 1.0)
    chk(f"{path}.num_records (TruncatedPoissonSampled)", ev.num_records, 1.0, math.inf)
    chk(f"{path}.max_batch_size (TruncatedPoissonSampled)", ev.max_batch_size, 0.0, math.inf)
    rec(ev.event, f"{path}.event")


SAMPLING_EVENTS = (SampledWithoutReplacement, SampledWithReplacement, TruncatedPoissonSampled)

register_event_type(SampledWithoutReplacement, relation=_relation, check=_check_wor)
register_event_type(SampledWithReplacement, relation=_relation, check=_check_wr)
register_event_type(TruncatedPoissonSampled, relation=_relation, check=_check_trunc)


# =======================================================================================
# Sampling without replacement: Wang, Balle & Kasiviswanathan (2019), Theorem 27.
# =======================================================================================


def _log_comb(n, k):
    from scipy import special as _sp  # lazy: ~0.3 s of import, needed only when tracing

    return _sp.gammaln(n + 1.0) - _sp.gammaln(k + 1.0) - _sp.gammaln(n - k + 1.0)


def _forward_diffs(sigma, n: int):
    r"""log|Δ^k e^{c}|(-1) for k = 1..n+2, c(x) = x(x+1)/(2σ²), and a bound on its rounding error.

    dp_accounting's ``_get_forward_diffs`` runs the recurrence Δ^{k+1}f(x) = Δ^k f(x+1) −
    Δ^k f(x) in log space with signs (a log1p and an exp per entry and stage, and logs of
    size c ≈ k²/2σ² whose absolute rounding grows with c: ~1e-7 relative in Δ at σ = 0.3,
    k = 258). Here each Δ^k f(x_j) is kept as M^k_j · f(x_{j+k}) (x_j = j − 1): then

    .. math:: M^{k+1}_j = M^k_{j+1} - r_{j+k} M^k_j, \qquad r_i = f(x_i)/f(x_{i+1}) = e^{-i/σ^2} ≤ 1,

    one multiply and one subtract per entry, |M^k| ≤ 2^k (f increases), and
    log|Δ^k f(-1)| = log|M^k_0| + c(k − 1). High differences of a slowly growing f cancel
    catastrophically (σ ≳ 5) in any order of summation, so a first-order bound on the
    absolute rounding error of M is carried along (``_FD_ULPS`` units in the last place
    per operation on its operands, and the rounding of r_i, relative ``_FD_ULPS``·(1 + i/σ²)
    ulps); the caller uses |computed| + error, an upper bound on the true |Δ|. Against 400
    digits (mpmath) the bound is above the truth and closer to it than the log-space
    recurrence everywhere checked (σ from 0.3 to 9, k up to 258).

    Returns:
      ``(log_abs, log_err)``, each of shape ``(batch, n + 2)``, entry k − 1 for Δ^k.
    """
    u = _FD_ULPS * 2.0**-52
    w = n + 3  # f at x = -1, 0, ..., n + 1
    inv = 1.0 / sigma[:, None] ** 2
    j = jnp.arange(w - 1, dtype=jnp.float64)[None, :]
    r_j = jnp.exp(-j * inv)

    def stage(carry, k):
        # r_{j+k} = e^{-j/σ²} e^{-k/σ²} (products, not slices of one long row: a dynamic
        # slice's transpose builds float32 zeros under grad with x64 off). Its rounding,
        # relative, in ulps: 1/σ² and the exponents 3|t| (t = -(j+k)/σ²), the two exps and
        # the product 5 (XLA's exp within 2), so 5 + 3|t| ≤ _FD_ULPS (1 + |t|); plus the
        # smallest normal double, absolute, where a factor or the product is subnormal.
        m, e = carry
        width = m.shape[1]
        rk = r_j[:, : width - 1] * jnp.exp(-k * inv)
        rek = rk * (u * (1.0 + (j[:, : width - 1] + k) * inv)) + 2.0**-1022
        a, b, ea, eb = m[:, :-1], m[:, 1:], e[:, :-1], e[:, 1:]
        ar = a * rk
        new_e = eb + ea * (rk + rek) + jnp.abs(a) * rek + u * (jnp.abs(b) + jnp.abs(ar))
        m = jnp.concatenate([b - ar, m[:, -1:]], axis=1)
        e = jnp.concatenate([new_e, e[:, -1:]], axis=1)
        return (m, e), (m[:, 0], e[:, 0])

    # Stage k needs the entries j ≤ n + 2 − k only: every _FD_CHUNK stages the columns no
    # later stage reads are dropped (about half the work of a fixed width).
    m = jnp.ones(sigma.shape + (w,))
    e = jnp.zeros_like(m)
    outs, errs = [], []
    for k0 in range(0, n + 2, _FD_CHUNK):
        k1 = min(k0 + _FD_CHUNK, n + 2)
        keep = w - k0  # columns j = 0 .. n + 2 - k0
        (m, e), (o, oe) = jax.lax.scan(stage, (m[:, :keep], e[:, :keep]), jnp.arange(k0, k1, dtype=jnp.float64))
        outs.append(o)
        errs.append(oe)
    out, out_err = jnp.concatenate(outs), jnp.concatenate(errs)
    k = jnp.arange(1.0, n + 3.0)[None, :]
    c = (k - 1.0) * k * inv / 2.0  # log f(x_k): the scale of Δ^k f(x_0)
    c = c + jnp.log1p(u * (1.0 + c))  # its rounding, outwards
    return _safe_log(jnp.abs(out.T)) + c, _safe_log(out_err.T) + c


def _safe_log(x):
    # log x, -inf at 0 with a zero (not NaN) derivative there (Δ^1 f(-1) = f(0) - f(-1) = 0).
    pos = x > 0
    return jnp.where(pos, jnp.log(jnp.where(pos, x, 1.0)), -jnp.inf)


@functools.cache
def _wor_plan(orders_key: tuple[float, ...]):
    orders = np.asarray(orders_key, dtype=np.float64)
    ints = set()
    for a in orders:
        ints.update({int(math.floor(a)), int(math.ceil(a))})
    ints = np.array(sorted(i for i in ints if i >= 2), dtype=np.int64)
    max_exact = int(max([i for i in ints if i <= _WOR_EXACT_MAX], default=2))
    max_all = int(max(ints, default=2))
    i_idx = np.arange(2, max_all + 1, dtype=np.float64)  # summation index i
    log_comb = _log_comb(ints[:, None].astype(np.float64), i_idx[None, :])
    mask = i_idx[None, :] <= ints[:, None]
    log_comb = np.where(mask, log_comb, 0.0)
    exact = ints <= _WOR_EXACT_MAX
    # For each order, the rows of its floor and ceiling integers and the weight t.
    pos = {int(v): r for r, v in enumerate(ints)}
    lo_row, hi_row, t = [], [], []
    for a in orders:
        f, c = int(math.floor(a)), int(math.ceil(a))
        lo_row.append(pos.get(f, -1))
        hi_row.append(pos[c])
        t.append(a - f)
    return dict(ints=ints, max_exact=max_exact, i_idx=i_idx, log_comb=log_comb, mask=mask, exact=exact,
                lo_row=np.array(lo_row), hi_row=np.array(hi_row), t=np.array(t))


def _wor_log_a(q, sigma, plan):
    """log A_α of Theorem 27 at the plan's integers α ≥ 2: shape (batch, n_ints)."""
    i_idx = plan["i_idx"]
    n_ex = plan["max_exact"]
    log_q = jnp.log(jnp.where(q > 0, q, 1.0))[:, None]
    f2 = 1.0 / sigma**2  # func(2) = 2/(2σ²)
    log_f2m1 = f2 + jnp.log(-jnp.expm1(-f2))  # log(e^{f2} - 1) without cancellation at large σ
    s2 = jnp.minimum(math.log(4.0) + log_f2m1, f2 + math.log(2.0))  # (batch,)
    cgf_im1 = (i_idx - 1.0)[None, :] * i_idx[None, :] / (2.0 * sigma[:, None] ** 2)  # cgf(i - 1)
    stirling = math.log(2.0) + cgf_im1  # (batch, I)
    deltas, errs = _forward_diffs(sigma, n_ex)  # (batch, n_ex + 2)
    deltas = jnp.logaddexp(deltas, errs)  # an upper bound on the true |Δ|
    ii = i_idx[i_idx <= n_ex].astype(np.int64)
    lo_i = np.maximum(2 * (ii // 2) - 1, 0)
    hi_i = 2 * ((ii + 1) // 2) - 1
    fd = math.log(4.0) + 0.5 * (take(deltas, lo_i, axis=1) + take(deltas, hi_i, axis=1))
    exact_t = jnp.minimum(fd, stirling[:, : len(ii)])
    exact_t = jnp.concatenate([exact_t, stirling[:, len(ii):]], axis=1)
    # The i = 2 term (concatenated, not scattered: a scatter's batching rule builds float32
    # constants under vmap with x64 off).
    exact_t = jnp.concatenate([s2[:, None], exact_t[:, 1:]], axis=1)
    stir_t = jnp.concatenate([s2[:, None], stirling[:, 1:]], axis=1)
    # Rows (orders) up to 256 sum i = 2..α with the exact terms; the few above (512, 1024)
    # sum i = 2..α with the Stirling-branch terms. The rows are sorted; each group of rows
    # (α up to 16, 32, 64, ...) sums only the i its largest α needs (the default orders:
    # 2..63 need i ≤ 63, not the 255 of order 256).
    parts = []
    for rows, terms in _wor_row_groups(plan["ints"], exact_t, stir_t):
        width = int(plan["ints"][rows.stop - 1]) - 1  # i = 2..α_max
        lc, mk = plan["log_comb"][rows, :width], plan["mask"][rows, :width]
        if lc.shape[0] == 0:
            continue
        term = terms[:, None, :width] + i_idx[None, None, :width] * log_q[:, :, None] + lc[None]
        term = jnp.where(mk[None], term, -jnp.inf)
        # log A = log(1 + Σ_j e^{term_j}), through log1p: A − 1 may be ~1e-6 (large σ, small q),
        # where log of the rounded 1 + x would lose u/x relative (below the theorem).
        parts.append(jnp.logaddexp(jax.nn.logsumexp(term, axis=-1), 0.0))
    return jnp.concatenate(parts, axis=1)


def _wor_row_groups(ints, exact_t, stir_t):
    """Consecutive row slices of the plan's sorted integer orders and the terms each sums."""
    groups, start = [], 0
    for r in range(1, len(ints) + 1):
        if r == len(ints) or _wor_bucket(ints[r]) != _wor_bucket(ints[start]):
            groups.append((slice(start, r), exact_t if ints[start] <= _WOR_EXACT_MAX else stir_t))
            start = r
    return groups


def _wor_bucket(alpha) -> tuple[bool, int]:
    # Rows grouped by branch and by the power of two at or above α (at least 16).
    return bool(alpha > _WOR_EXACT_MAX), max(4, int(math.ceil(math.log2(alpha))))


@float64
def sampled_without_replacement_rdp(orders, q, noise_multiplier) -> jax.Array:
    r"""RDP of the Gaussian mechanism on a uniform fixed-size subsample (replace-one).

    Theorem 27 of Wang, Balle & Kasiviswanathan (2019) for the Gaussian mechanism
    (ε(α) = α/(2σ²)): at integer α,

    .. math::
        A_α = 1 + q^2\binom{α}{2}\min\{4(e^{ε(2)}-1), 2e^{ε(2)}\}
              + \sum_{j=3}^{α} q^j\binom{α}{j}\min\{4\,\sqrt{Δ_{2⌊j/2⌋}Δ_{2⌈j/2⌉}},\ 2e^{(j-1)ε(j)}\}

    with Δ_ℓ the ℓ-th forward difference of :math:`f(x) = e^{x(x+1)/(2σ^2)}` at x = −1 (as
    dp_accounting takes it, plus a bound on its rounding where it cancels, σ ≳ 5), and
    ε(α) = log A_α/(α−1); at fractional α the CGF log A is interpolated
    linearly between ⌊α⌋ and ⌈α⌉ (their Corollary 10); above order 256 the j ≥ 3 terms use
    the second member of the minimum only (as dp_accounting). q = 0 gives 0, q = 1 gives
    α/(2σ²).

    Args:
      orders: Rényi orders > 1, a concrete 1-D sequence (static).
      q: m/n in [0, 1] (any shape, broadcast with ``noise_multiplier``).
      noise_multiplier: σ > 0 over the replace-one sensitivity.

    Returns:
      float64 array ``batch + (k,)``; NaN under ``jit`` for invalid inputs.

    References:
      Y.-X. Wang, B. Balle, S. Kasiviswanathan, "Subsampled Rényi Differential Privacy and
      Analytical Moments Accountant", AISTATS 2019, Theorem 27 and Corollary 10;
      dp_accounting 0.6.0 ``rdp_privacy_accountant._compute_rdp_sample_wor_gaussian``.

    Examples:
      >>> import jaxdp
      >>> r = jaxdp.accounting.sampled_without_replacement_rdp([2.0, 8.0], 0.01, 1.0)
      >>> [round(float(v), 8) for v in r]
      [0.00054351, 0.00268417]
    """
    orders_np = _validate.concrete_orders(orders)
    _validate.check_in_range("q", q, 0.0, 1.0)
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    _validate.check_broadcastable(q=q, noise_multiplier=noise_multiplier)
    return _wor_rdp(orders_np, f64(q), f64(noise_multiplier))


def _wor_rdp(orders_np, q, sigma):
    plan = _wor_plan(tuple(orders_np.tolist()))
    shape = jnp.broadcast_shapes(jnp.shape(q), jnp.shape(sigma))
    qf = jnp.broadcast_to(q, shape).reshape(-1)
    sf = jnp.broadcast_to(sigma, shape).reshape(-1)
    valid = (qf >= 0) & (qf <= 1) & (sf > 0) & jnp.isfinite(sf)
    s_safe = jnp.where(valid, sf, 1.0)
    q_mid = jnp.where(valid & (qf > 0) & (qf < 1), qf, 0.5)
    log_a = _wor_log_a(q_mid, s_safe, plan)  # (b, n_ints)
    lo_row, hi_row, t = plan["lo_row"], plan["hi_row"], plan["t"]
    x = jnp.where(lo_row[None, :] >= 0, take(log_a, np.maximum(lo_row, 0), axis=1), 0.0)  # log A_1 = 0
    y = take(log_a, hi_row, axis=1)
    cgf = jnp.where(t[None, :] == 0.0, y, (1.0 - t[None, :]) * x + t[None, :] * y)
    orders = f64(orders_np)
    out = cgf / (orders - 1.0)
    out = jnp.where((qf == 0)[:, None], 0.0, out)
    out = jnp.where((qf == 1)[:, None], orders / (2.0 * s_safe[:, None] ** 2), out)
    out = jnp.where(valid[:, None], out, jnp.nan)
    return out.reshape(shape + (len(orders_np),))


# =======================================================================================
# Sampling with replacement: the indices released (an upper bound).
# =======================================================================================


@float64
def sampled_with_replacement_rdp(orders, num_records, batch_size: int, noise_multiplier) -> jax.Array:
    r"""An RDP upper bound for the Gaussian mechanism on m draws with replacement (replace-one).

    With K ~ Binomial(m, 1/n) the number of times the differing record is drawn,

    .. math:: ε(α) = \frac{1}{α-1}\log \sum_{k=0}^{m} \binom{m}{k} n^{-k}(1-1/n)^{m-k}\, e^{α(α-1)k^2/(2σ^2)},

    the exact Rényi divergence of the mechanism that also releases which draws hit the
    record (post-processing makes it an upper bound; joint convexity gives the same bound
    directly). Exact for the pair "the record drawn K times vs a record at distance σ
    drawn K times" once the drawn indices are public; it keeps only first-order
    amplification in m/n.

    Args:
      orders: Rényi orders > 1 (static).
      num_records: n ≥ 1 (any shape).
      batch_size: m ≥ 0, a static Python int.
      noise_multiplier: σ > 0 over the replace-one sensitivity.

    Returns:
      float64 ``batch + (k,)`` (NaN under ``jit`` for invalid inputs; +inf where it overflows).

    Examples:
      >>> import jaxdp, math
      >>> r = jaxdp.accounting.sampled_with_replacement_rdp([2.0], 100, 1, 1.0)
      >>> bool(abs(float(r[0]) - math.log(0.99 + 0.01 * math.e)) < 1e-14)
      True
    """
    orders_np = _validate.concrete_orders(orders)
    _validate.check_integer("batch_size", batch_size, lo=0.0)
    _validate.check_in_range("num_records", num_records, 1.0, math.inf)
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    _validate.check_broadcastable(num_records=num_records, noise_multiplier=noise_multiplier)
    return _wr_rdp(orders_np, f64(num_records), int(batch_size), f64(noise_multiplier))


def _wr_rdp(orders_np, n, m: int, sigma):
    orders = f64(orders_np)
    n = n[..., None, None]
    s = sigma[..., None, None]
    valid = (n >= 1) & (s > 0) & jnp.isfinite(s)
    n_safe = jnp.where(valid, n, 2.0)
    s_safe = jnp.where(valid, s, 1.0)
    k = np.arange(m + 1, dtype=np.float64)
    log_comb = _log_comb(float(m), k)
    p = 1.0 / n_safe
    log_p = jnp.log(p)
    log_1mp = jnp.where(n_safe > 1, jnp.log1p(-jnp.where(n_safe > 1, p, 0.5)), -jnp.inf)
    # k log p + (m - k) log(1-p), with 0 * -inf = 0 where n = 1.
    log_w = log_comb + k * log_p + jnp.where(k < m, (m - k) * log_1mp, 0.0)
    a = orders[:, None]
    expo = a * (a - 1.0) * k**2 / (2.0 * s_safe**2)
    out = jax.nn.logsumexp(log_w + expo, axis=-1) / (orders - 1.0)
    out = jnp.maximum(out, 0.0)
    return jnp.where(valid[..., 0], out, jnp.nan)


# =======================================================================================
# What the RDP accountant calls.
# =======================================================================================


def check_support(event, path: str) -> None:
    """Raise ``ValueError`` unless the inner event is the Gaussian the analysis covers."""
    inner = event.event
    need = "add_remove" if isinstance(event, TruncatedPoissonSampled) else "replace_one"
    name = type(event).__name__
    if not isinstance(inner, Gaussian):
        raise ValueError(f"{path}: the RDP accountant supports {name} only of a Gaussian event; got "
                         f"{name}({type(inner).__name__}).")
    if inner.relation != need:
        raise ValueError(f"{path}: the {name} analysis covers relation {need!r} only; got relation "
                         f"{inner.relation!r}.")


def rdp_curve(event, orders: np.ndarray):
    """The RDP curve of one sampling event (its Gaussian inner event checked by :func:`check_support`)."""
    sigma = f64(event.event.noise_multiplier)
    if isinstance(event, SampledWithoutReplacement):
        n, m = f64(event.num_records), f64(event.batch_size)
        ok = (n >= 1) & (m >= 0) & (m <= n)
        q = jnp.where(ok, m / jnp.where(ok, n, 1.0), jnp.nan)
        return _wor_rdp(orders, q, sigma)
    if isinstance(event, SampledWithReplacement):
        return _wr_rdp(orders, f64(event.num_records), event.batch_size, sigma)
    return _tp_rdp(orders, f64(event.q), f64(event.num_records), f64(event.max_batch_size), sigma)


# =======================================================================================
# Shuffling: the certified statement (no amplification).
# =======================================================================================


def shuffled_event(noise_multiplier, passes) -> SelfComposed:
    r"""The event a shuffled DP-SGD run is certified by: one Gaussian step per pass, replace-one, no amplification.

    Each pass shuffles the n records by a permutation independent of the data and cuts it
    into batches. Under replace-one neighbours (n public) both data sets get the same
    permutation, so given it the differing record is in exactly one batch per pass; that
    step's clipped sum moves by at most 2C (C the clipping norm) and every other step is
    unchanged. The run is therefore the adaptive composition of ``passes`` Gaussian
    mechanisms with noise σC over sensitivity 2C, and averaging over the permutation (the
    same law on both) does not increase the divergence:
    ``SelfComposed(Gaussian(σ/2, relation="replace_one"), passes)``.

    No tight analysis of shuffling is known, and shuffling can cost far more than Poisson
    sampling at the same noise (Chua et al., ICML 2024, arXiv 2403.17673): never report a
    Poisson ε for a shuffled run. This bound takes no credit for the shuffle at all.

    Args:
      noise_multiplier: σ > 0, the noise standard deviation over the clipping norm C (as
        in :func:`dpsgd_event`).
      passes: number of passes ≥ 0 (epochs).

    Returns:
      A :class:`SelfComposed` event (replace-one).

    Examples:
      >>> import jaxdp
      >>> ev = jaxdp.accounting.shuffled_event(4.0, 4)  # = one Gaussian with σ/2 over √4: μ = 1
      >>> round(float(jaxdp.accounting.epsilon(ev, 1e-5, accountant="pld", grid_size=2**12)), 3)
      4.377
    """
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("passes", passes, 0.0, math.inf)
    _validate.check_broadcastable(noise_multiplier=noise_multiplier, passes=passes)
    sigma = np.asarray(noise_multiplier, dtype=np.float64) if isinstance(noise_multiplier, (list, tuple)) else noise_multiplier
    half = sigma / 2.0  # exact in any dtype (a power of two)
    return SelfComposed(Gaussian(half, relation="replace_one"), passes)
