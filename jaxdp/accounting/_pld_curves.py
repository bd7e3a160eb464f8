r"""PLD building blocks: hockey-stick curves of the dominating pairs and their discretisation.

Each supported mechanism (``kind``) has an exact hockey-stick curve δ(ε) (the upper bound's
input) and a survival function P(L > ε) (the lower bound's). :func:`masses` turns either into
masses on a uniform loss grid: connect-the-dots (Doroshenko et al. 2022, Algorithm 1; a
dominating discrete pair) for the upper bound; for the lower bound merged buckets centred
just above the grid points (a dominated pair, :func:`_merged_buckets`) where both survival
functions are known (:func:`survival_pair`), else privacy buckets rounded down (Meiser &
Mohammadi 2018). The composition lives in ``_pld_compose.py``, the event
layer in ``_pld.py``.

A new mechanism's PLD (e.g. a sampling scheme's) needs only its curve here: add a ``kind``
to :func:`curve` (δ(ε) for ``"upper"``, P(L > ε) for ``"lower"``, in both directions if the
pair is not symmetric; P(L > ε) and Q(L > ε) in :func:`survival_pair` for a tight lower bound)
and a loss range to ``_pld_compose._single_range``; composition,
tilting and the read-outs are generic.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .._numerics import erfc_parts, log_ndtr, where

_U = float(np.finfo(np.float64).eps)

# =======================================================================================
# Hockey-stick curves δ(ε) and survival functions P(L > ε) of the dominating pairs.
# =======================================================================================


def _delta_gauss(eps, mu):
    r"""δ of N(μ,1) vs N(0,1): Φ(x₁) - e^ε Φ(x₂), x₁ = -ε/μ + μ/2, x₂ = x₁ - μ, with no ``log``.

    With :math:`Φ(-|x|) = \tfrac12 w\,n/d` from :func:`erfc_parts` (w = 1 on its ``mid``
    branch, else :math:`e^{-x^2/2}`) and :math:`e^ε e^{-x_2^2/2} = e^{-x_1^2/2}`:
    :math:`δ = \tfrac12(V_1 - V_2)` for :math:`x_1 ≤ 0`, :math:`1 - \tfrac12(V_1 + V_2)` for
    :math:`x_2 ≤ 0 < x_1`, :math:`-\mathrm{expm1}(ε) + \tfrac12(V_2 - V_1)` for :math:`x_2 > 0`,
    where :math:`V_1 = w_1 n_1/d_1 = 2Φ(-|x_1|)` and :math:`V_2 = 2e^εΦ(-|x_2|)`, i.e.
    :math:`w_2 = e^ε` on x₂'s ``mid`` branch (there ε ≤ 1), else :math:`e^{-x_1^2/2}`. One
    division, one ``exp``, one ``expm1``; max(·, 0) absorbs the rounding where V₁ ≈ V₂.
    Against mpmath its relative error is ≤ 1e-11 wherever δ is a normal float (μ from 1e-3
    to 100, x₁ in [-40, 40]; e^a(1 - e^{b-a}) from two log Φ: 1e-8 in the lower tail), with
    nothing underflowing before δ does (docs/pld.md, "Cost per bin").
    """
    x1 = -eps / mu + mu / 2.0
    x2 = -eps / mu - mu / 2.0
    n1, d1, mid1 = erfc_parts(x1)
    n2, d2, mid2 = erfc_parts(x2)
    tail = jnp.exp(-0.5 * x1 * x1)
    em = jnp.expm1(jnp.minimum(eps, 2.0))
    pos1, pos2 = x1 > 0.0, x2 > 0.0
    a1 = where(mid1, 1.0, tail) * n1 * d2
    a2 = where(mid2, 1.0 + em, tail) * n2 * d1
    mixed = (where(pos1, -a1, a1) - where(pos2, -a2, a2)) / (d1 * d2)
    base = where(pos2, -em, where(pos1, 1.0, 0.0))
    return jnp.maximum(base + 0.5 * mixed, 0.0)


def _sgm_y(eps, q, sign):
    """y = log((e^{±ε} - 1 + q)/q) where defined (double-where outside), and the mask.

    ``sign`` is +1 (remove: e^ε) or -1 (add: e^{-ε}), a number or a traced ±1.0. One ``log``
    of the ratio: the sum and the quotient round once each, so y's absolute error is that
    of e^{±ε} - 1 + q relative to itself plus ~2u (log(e^{±ε} - 1 + q) - log q added
    u(|log(e^{±ε} - 1 + q)| + |log q|)); a float64 ``log`` is a large per-bin cost.
    """
    lq = jnp.log1p(-q)  # -inf at q = 1
    inside = sign * eps > lq  # (for sign -1: ε < -log(1-q))
    e_s = where(inside, eps, where(sign > 0, 1.0, -1.0) + where(jnp.isfinite(lq), sign * lq, 0.0))
    y = jnp.log((jnp.expm1(sign * e_s) + q) / q)
    return y, inside


def sign_of(direction):
    """+1 for the remove direction, -1 for add; a traced sign (±1.0) is returned as it is.

    The curves below take either: a traced sign lets one traced body serve both directions
    (``lax.scan`` over them in ``_pld_compose``), a string keeps the direction static. The
    formulas of the two directions differ by exact operations only (negation, ×±1,
    selects): the same arithmetic per element. (Compiled, the values can still move in the
    last bits where XLA fuses a loop body differently; see docs/pld.md "Directions".)
    """
    if isinstance(direction, str):
        return {"remove": 1.0, "add": -1.0}[direction]
    return direction


def by_direction(sign, remove, add):
    """``remove`` where the direction's sign is +1, else ``add`` (a select when traced)."""
    if isinstance(sign, float):
        return remove if sign > 0 else add
    return where(sign > 0, remove, add)


def _sampled_delta(eps, q, sign, d_in):
    r"""δ of Poisson sampling at rate q of a symmetric pair with curve δ_in, either direction.

    Remove: for ε > log(1-q), δ = q δ_in(y) with y = log((e^ε - 1 + q)/q); else 1 - e^ε.
    Add: for ε < -log(1-q), δ = (1 - (1-q)e^ε) δ_in(-y'), y' = log((e^{-ε} - 1 + q)/q); else 0
    (Balle, Barthe, Gaboardi 2018, Theorem 8 and its add form). The inner curve is evaluated
    once, at sign·y.
    """
    q_s = where(q > 0, q, 1.0)
    y, inside = _sgm_y(eps, q_s, sign)
    pre = by_direction(sign, q_s, -jnp.expm1(eps + jnp.log1p(-q_s)))
    outside = by_direction(sign, -jnp.expm1(jnp.minimum(eps, 0.0)), 0.0)
    d = where(inside, pre * d_in(sign * y), outside)
    # q = 0: the loss is 0 (δ = (1 - e^ε)_+).
    return where(q > 0, d, -jnp.expm1(jnp.minimum(eps, 0.0)))


def _delta_sgm(eps, q, sigma, direction):
    """δ of the Poisson-sampled Gaussian, remove (P = mixture) or add (Q = mixture) direction.

    :func:`_sampled_delta` with δ_in the Gaussian pair's (μ = 1/σ): substituting the
    threshold x* = σ²y + 1/2 of the monotone loss into P(L > ε) - e^ε Q(L > ε) gives it.
    """
    mu = 1.0 / sigma
    return _sampled_delta(eps, q, sign_of(direction), lambda y: _delta_gauss(y, mu))


def _delta_laplace(eps, b):
    """δ of Lap(1, b) vs Lap(0, b): 1 - e^{ε/2 - 1/(2b)} on [-1/b, 1/b], 1 - e^ε below, 0 above."""
    inv = 1.0 / b
    mid = -jnp.expm1(jnp.minimum(eps / 2.0 - inv / 2.0, 0.0))
    low = -jnp.expm1(jnp.minimum(eps, 0.0))
    return where(eps >= inv, 0.0, where(eps <= -inv, low, mid))


def _survival_laplace(eps, b):
    inv = 1.0 / b
    mid = 1.0 - 0.5 * jnp.exp(jnp.minimum(eps / 2.0 - inv / 2.0, 0.0))
    return where(eps >= inv, 0.0, where(eps < -inv, 1.0, mid))



def directions(kinds) -> tuple[str, ...]:
    """Both add/remove directions where a kind is Poisson-sampled (an asymmetric pair), else one."""
    return ("remove", "add") if any(k.startswith("sampled_") for k in kinds) else ("remove",)


def _approx_dp_weights(eps0, d0):
    """The masses (1 - δ)e^ε/(1 + e^ε) at loss ε and (1 - δ)/(1 + e^ε) at -ε of the (ε, δ) pair."""
    low = (1.0 - d0) * jnp.exp(-jnp.logaddexp(0.0, eps0))
    return (1.0 - d0) - low, low


def _delta_approx_dp(eps, eps0, d0):
    r"""δ of the (ε₀, δ₀) pair: :math:`δ_0 + (1-δ_0)[w_+(1 - e^{ε-ε_0})_+ + w_-(1 - e^{ε+ε_0})_+]`."""
    hi, lo = _approx_dp_weights(eps0, d0)
    return (d0 + hi * -jnp.expm1(jnp.minimum(eps - eps0, 0.0)) + lo * -jnp.expm1(jnp.minimum(eps + eps0, 0.0)))


def _survival_approx_dp(eps, eps0, d0, strict=True):
    """P(L > ε) (or P(L ≥ ε) with ``strict=False``) of the (ε₀, δ₀) pair's loss (δ₀ at +∞)."""
    hi, lo = _approx_dp_weights(eps0, d0)
    if strict:
        return d0 + where(eps < eps0, hi, 0.0) + where(eps < -eps0, lo, 0.0)
    return d0 + where(eps <= eps0, hi, 0.0) + where(eps <= -eps0, lo, 0.0)


def _survival_laplace_ge(eps, b):
    """P(L ≥ ε) of the Laplace pair (atoms at ±1/b)."""
    inv = 1.0 / b
    mid = 1.0 - 0.5 * jnp.exp(jnp.minimum(eps / 2.0 - inv / 2.0, 0.0))
    return where(eps > inv, 0.0, where(eps <= -inv, 1.0, mid))


def _inner(kind, params):
    """(δ(ε), P(L > ε), P(L ≥ ε)) of the symmetric pair a ``sampled_<inner>`` kind samples."""
    if kind == "sampled_laplace":
        b = params[1]
        return (lambda e: _delta_laplace(e, b), lambda e: _survival_laplace(e, b),
                lambda e: _survival_laplace_ge(e, b))
    e0, d0 = params[1], params[2]
    return (lambda e: _delta_approx_dp(e, e0, d0), lambda e: _survival_approx_dp(e, e0, d0),
            lambda e: _survival_approx_dp(e, e0, d0, strict=False))


def _delta_sampled(kind, params, eps, direction):
    r"""δ of Poisson sampling (rate q, add/remove-one) of a symmetric pair (P, Q) with curve δ_in.

    Remove (P' = (1-q)Q + qP vs Q): :math:`H_{e^ε}(P'‖Q) = q\,δ_{in}(y)`,
    :math:`e^y = (e^ε - 1 + q)/q`, for ε > log(1-q), else 1 - e^ε. Add (Q vs P'):
    :math:`(1 - (1-q)e^ε)\,δ_{in}(-y')`, :math:`e^{y'} = (e^{-ε} - 1 + q)/q`, for
    ε < -log(1-q), else 0 (Balle, Barthe, Gaboardi 2018, Theorem 8 and its add form; the
    same identities as the Poisson-sampled Gaussian's, :func:`_sampled_delta`).
    """
    return _sampled_delta(eps, params[0], sign_of(direction), _inner(kind, params)[0])


def _survival_sampled(kind, params, eps, direction):
    """P'(L' > ε) of the sampled pair, from the inner loss L (law of L under Q = law of -L under P).

    Remove: L' = log(1 - q + q e^L) under (1-q)Q + qP: (1-q)P(L < -y) + qP(L > y), and
    P(L < -y) = 1 - P(L ≥ -y) (atoms counted: never above the truth). Add: L'' = -log(1 - q +
    q e^L) under Q: P(L > -y').
    """
    q = params[0]
    _, surv, surv_ge = _inner(kind, params)
    q_s = where(q > 0, q, 1.0)
    sign = sign_of(direction)
    y, inside = _sgm_y(eps, q_s, sign)
    # Remove: (1-q)(1 - P(L ≥ -y)) + q P(L > y), 1 outside; add: P(L > -y'), 0 outside.
    s = by_direction(sign, (1.0 - q_s) * (1.0 - surv_ge(-y)) + q_s * surv(y), surv(-y))
    s = where(inside, s, by_direction(sign, 1.0, 0.0))
    return where(q > 0, s, where(eps < 0, 1.0, 0.0))


def curve(kind, params, eps, direction, estimate):
    """δ(ε) (``estimate="upper"``) or P(L > ε) (``"lower"``) of a kind's dominating pair."""
    if kind in ("gaussian", "sampled_gaussian") and estimate == "lower":
        return survival_pair(kind, params, eps, direction)[0]
    if kind == "gaussian":
        return _delta_gauss(eps, 1.0 / params[0])
    if kind == "laplace":
        return (_delta_laplace if estimate == "upper" else _survival_laplace)(eps, params[0])
    if kind == "approx_dp":
        return (_delta_approx_dp if estimate == "upper" else _survival_approx_dp)(eps, params[0], params[1])
    if kind == "sampled_gaussian":
        return _delta_sgm(eps, params[0], params[1], direction)
    fn = _delta_sampled if estimate == "upper" else _survival_sampled
    return fn(kind, params, eps, direction)


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


# Bins around loss 0 where both hockey sticks are evaluated and compared (|ε_i| ≤ _NEAR·h);
# below, each bin's masses come from g alone, above from δ alone (docs/pld.md "Cost per bin").
_NEAR = 4


def _upper_masses(kind, params, eps_grid, h, direction, beyond):
    r"""Connect-the-dots masses from one hockey-stick value per grid point (and the +∞ mass).

    Each bin's masses come from δ (:func:`_ctd`) or from g(ε) = δ(ε) - (1 - e^ε) =
    e^ε δ_swap(-ε) (:func:`_ctd_complement`), algebraically equal, whichever has the smaller
    inputs: δ_{i-1} ≤ g_{i+1}. As |dδ/dε| ≤ e^ε, δ_{i-1} - δ_{i+1} ≤ e^{ε_{i+1}} - e^{ε_{i-1}},
    so that holds wherever ε_{i-1} ≥ 0 (by a margin e^{ε_{i-1}} - 1 ≥ h at ε_i ≥ 2h), and fails
    wherever ε_{i+1} < 0 (δ_{i-1} - δ_{i+1} ≥ 0 > e^{ε_{i+1}} - 1). So each grid point needs
    only δ (ε ≥ 0) or only g (ε < 0): one curve evaluation per point, at |ε| in the direction
    the sign of ε selects (g's curve is the swapped pair's, the other direction's), plus both
    on the 2·_NEAR + 3 points around loss 0, where the comparison is made as before. The grid
    points are (o + i)h (integers o + i): ε = 0 is one, wherever the grid lies. Bins at or
    above ``beyond``'s cut (a grid point ≥ 0: every kind's range top is positive; it is raised
    to 0 otherwise) take δ's masses.
    """
    n = eps_grid.shape[0]
    near = 2 * _NEAR + 3
    # The grid index of each bin relative to loss 0 (exact small integers), and 0's position.
    m0 = jnp.round(eps_grid[0] / h)
    m = m0 + jnp.arange(n, dtype=eps_grid.dtype)
    e = eps_grid  # (held at the cut above it)
    pos = e >= 0.0
    idx = (-m0 - (_NEAR + 1) + jnp.arange(near, dtype=eps_grid.dtype))
    inside = (idx >= 0) & (idx < n)
    idx = where(inside, idx, n).astype(jnp.int32)
    idx_c = jnp.minimum(idx, n - 1)
    e_near = e[idx_c]
    # One curve evaluation: every point's own half (δ at ε ≥ 0, g's δ_swap(-ε) below), then the
    # other half at the points around 0, then δ at the last point (the +∞ mass).
    pos_near = pos[idx_c]
    args = jnp.concatenate([where(pos, e, -e), where(pos_near, -e_near, e_near), e[-1:]])
    if kind.startswith("sampled_"):
        sign = jnp.asarray(sign_of(direction), eps_grid.dtype)
        own = where(pos, sign, -sign)
        direction = jnp.concatenate([own, -own[idx_c], sign[None]])
    vals = jnp.clip(curve(kind, params, args, direction, "upper"), 0.0, 1.0)
    val, other, d_last = vals[:n], vals[n:n + near], vals[n + near]
    val_near = val[idx_c]
    d = where(pos, val, 0.0).at[idx].set(where(pos_near, val_near, other), mode="drop")
    g_raw = where(pos, 0.0, val).at[idx].set(where(pos_near, other, val_near), mode="drop")
    g = jnp.exp(jnp.minimum(e, 700.0)) * g_raw
    p_d = _ctd(d, h)
    p_g = _ctd_complement(g, e, h)
    d_prev = jnp.concatenate([jnp.ones((1,)), d[:-1]])
    g_next = jnp.concatenate([g[1:], jnp.full((1,), jnp.inf)])
    # Each bin from the formula whose three inputs are smaller (round-off is relative to them).
    # Where δ = 1 - e^ε exactly (no loss there) g is 0 and so are the masses; differences of
    # δ would leave round-off noise that, clipped at 0, adds up to spurious mass. Round-off can
    # still leave a tiny negative mass; it is set to 0 (raises δ).
    p = where(m > _NEAR, p_d, where(m < -_NEAR, p_g, where(d_prev <= g_next, p_d, p_g)))
    if beyond is not None:
        p = where(beyond, p_d, p)
    return jnp.maximum(p, 0.0), d_last


def masses(kind, params, eps_grid, h, direction, estimate, cut_loss=None):
    """Masses on the grid and the mass at +∞ (pessimistic CTD, or optimistic buckets).

    For ``estimate="lower"`` a third value: the mean decrease of the loss, in bins (about
    1/2 for rounding down, less for merged buckets, see :func:`_merged_buckets`).

    ``cut_loss`` (a grid point) ends the grid there: the curve is held constant above it, so
    the upper bound's mass above it goes to +∞ (δ(cut)) and the lower bound's to the cut.
    """
    beyond = None
    if cut_loss is not None:
        cut_loss = jnp.maximum(cut_loss, 0.0) if estimate == "upper" else cut_loss
        beyond = eps_grid >= cut_loss
        eps_grid = jnp.minimum(eps_grid, cut_loss)
    if estimate == "upper":
        return _upper_masses(kind, params, eps_grid, h, direction, beyond)
    if survival_pair(kind, None, None, None, probe=True):
        return _merged_buckets(kind, params, eps_grid, h, direction, beyond)
    s = jnp.clip(curve(kind, params, eps_grid, direction, "lower"), 0.0, 1.0)
    p = jnp.concatenate([s[:-1] - s[1:], s[-1:]])
    if beyond is not None:
        # The mass above the cut, P(L > cut), at the cut's own bin (its loss lowered to the
        # cut), nothing above: the differences there are 0 but the last bin would hold it,
        # raising losses between the cut and the grid's top (δ over-stated: the lower bound
        # of Poisson-sampled (ε, δ) events was above the true ε).
        at_cut = beyond & ~jnp.concatenate([jnp.zeros((1,), dtype=bool), beyond[:-1]])
        p = where(beyond, where(at_cut, s, 0.0), p)
    return p, jnp.zeros(()), jnp.full((), 0.5)


# Offsets s/h of the lower bound's centred buckets (see _merged_buckets), tried per mechanism
# (h/4, also tried, was never the better one on issue 27's table and costs one more pair of
# survival functions per bin).
LOWER_OFFSETS = (1.0 / 64.0, 1.0 / 16.0)


def _merged_buckets(kind, params, eps_grid, h, direction, beyond):
    r"""Lower-bound masses from merged buckets centred just above the grid points.

    Bucket i is :math:`B_i = (ε_i - h/2 + s, ε_i + h/2 + s]` (the last one, at the grid's
    cut, takes everything above its lower edge; mass below the first is dropped). Merging
    the outputs of a bucket is a post-processing of the pair (data processing: the merged
    pair is dominated by the true one), and the merged output has loss
    :math:`ℓ'_i = \log(P(B_i)/Q(B_i)) ∈ B_i`. Its mass is placed at ε_i when
    :math:`P(B_i) - e^{ε_i}Q(B_i)` exceeds its round-off bound (then ℓ'_i ≥ ε_i), else at
    :math:`ε_{i-1} < ℓ'_i` (dropped for i = 0): every loss only decreases, so δ does.
    The loss decreases by about s per mechanism where ℓ'_i ≥ ε_i (rounding each bucket
    down, the classical privacy buckets, costs h/2): the composed bias is about Σ_c k_c s
    instead of Σ_c k_c h/2. Where the density changes fast across a bucket ℓ'_i falls below
    ε_i and the bucket costs h; s is chosen from ``LOWER_OFFSETS`` to minimise the estimated
    mean decrease s + h·(mass of such buckets).

    Returns:
      (masses, 0 (no +∞ mass), the estimated mean decrease in bins).
    """
    n = eps_grid.shape[0]
    last = jnp.zeros((n,), dtype=bool).at[-1].set(True) if beyond is None else beyond
    after = jnp.concatenate([jnp.zeros((1,), dtype=bool), last[:-1]])  # bins above the cut's bin
    ex = jnp.exp(jnp.minimum(eps_grid, 700.0))
    best = None
    for off in LOWER_OFFSETS:
        sp, sq = survival_pair(kind, params, eps_grid + (off - 0.5) * h, direction)
        sp = where(after, 0.0, jnp.clip(sp, 0.0, 1.0))
        sq = where(after, 0.0, jnp.clip(sq, 0.0, 1.0))
        pb = jnp.maximum(sp - jnp.concatenate([sp[1:], jnp.zeros((1,))]), 0.0)
        qb = jnp.maximum(sq - jnp.concatenate([sq[1:], jnp.zeros((1,))]), 0.0)
        ok = pb - ex * qb > 64.0 * _U * (sp + ex * sq)
        keep = where(ok, pb, 0.0)
        down = where(ok, 0.0, pb)
        p = keep + jnp.concatenate([down[1:], jnp.zeros((1,))])
        total = jnp.maximum(jnp.sum(pb), _U)
        bias = off + jnp.sum(down) / total
        if best is None:
            best = (p, bias)
        else:
            better = bias < best[1]
            best = (where(better, p, best[0]), where(better, bias, best[1]))
    return best[0], jnp.zeros(()), best[1]


def survival_pair(kind, params, eps, direction, probe=False):
    """(P(L > ε), Q(L > ε)) of a kind's dominating pair, for the kinds with a density; else None.

    ``probe=True`` only says whether the kind has them (True / False).
    """
    if probe:
        return kind in ("gaussian", "sampled_gaussian")
    if kind == "gaussian":
        mu = 1.0 / params[0]
        return (jnp.exp(log_ndtr(-eps / mu + mu / 2.0)), jnp.exp(log_ndtr(-eps / mu - mu / 2.0)))
    if kind != "sampled_gaussian":
        return None
    q, sigma = params
    q_s = where(q > 0, q, 1.0)
    sign = sign_of(direction)
    y, inside = _sgm_y(eps, q_s, sign)
    # Remove: P = (1-q)N(0,1) + qN(μ,1), Q = N(0,1); L > ε ⟺ x > z0 = σy + 1/(2σ):
    # Q(L > ε) = Φ(-z0), P(L > ε) = (1-q)Q(L > ε) + qΦ(-(σy - 1/(2σ))).
    # Add: P = N(0,1), Q = (1-q)N(0,1) + qN(μ,1); L > ε ⟺ x < w = σy + 1/(2σ):
    # P(L > ε) = Φ(w), Q(L > ε) = (1-q)P(L > ε) + qΦ(w - 1/σ).
    w = sigma * y + 0.5 / sigma
    one = jnp.exp(log_ndtr(-sign * w))
    other = by_direction(sign, -(sigma * y - 0.5 / sigma), w - 1.0 / sigma)
    mixed = (1.0 - q_s) * one + q_s * jnp.exp(log_ndtr(other))
    sp, sq = by_direction(sign, mixed, one), by_direction(sign, one, mixed)
    outside = by_direction(sign, 1.0, 0.0)
    sp, sq = where(inside, sp, outside), where(inside, sq, outside)
    zero = where(eps < 0, 1.0, 0.0)
    return where(q > 0, sp, zero), where(q > 0, sq, zero)


def safe_log(c):
    """(Log c, dead) for complex c: the principal logarithm, 0 where |c| underflows (dead), grad-safe.

    ``exp(Σ_c k_c Log c_c)`` is Π_c c_c^{k_c} exactly for integer counts, whatever branch of
    the logarithm; a dead factor with k_c > 0 makes the product 0 (as c**k underflows).
    """
    mod = jnp.abs(c)
    dead = mod <= 1e-300
    log_mod = jnp.log(where(dead, 1.0, mod))
    arg = jnp.arctan2(where(dead, 0.0, jnp.imag(c)), where(dead, 1.0, jnp.real(c)))
    return jax.lax.complex(log_mod, arg), dead


_ROW = 8192


def _blocks(a):
    """``a`` with its last axis split into blocks of 8,192 where it is longer than 16,384 (else as is)."""
    n = a.shape[-1]
    return a if n <= 2 * _ROW or n % _ROW else a.reshape(a.shape[:-1] + (n // _ROW, _ROW))


def _reduce(f, v, blocked):
    """f (``jnp.sum`` or ``jnp.max``) along the last axis, or of the blocks' results: XLA's CPU
    exp-and-reduce costs ~7× more per entry on rows longer than 16,384 (the barrier keeps the two
    reductions apart)."""
    r = f(v, axis=-1)
    return f(jax.lax.optimization_barrier(r), axis=-1) if blocked else r


def lse(logp, x, theta=None):
    """log Σ_i exp(logp_i + x_i) along the last axis (-inf for no mass; logp may be -inf).

    With ``theta`` (shape (m,)), x is a grid of shape (n,) and the result is the m sums of
    logp_i + θ_j x_i."""
    blocked = _blocks(logp).ndim > logp.ndim
    if blocked:
        logp = _blocks(logp)
        x = _blocks(x) if jnp.ndim(x) else x
    if theta is not None:
        shape = theta.shape + (1,) * x.ndim
        x = theta.reshape(shape) * x
    v = where(jnp.isfinite(logp), logp + x, -jnp.inf)
    m = jax.lax.stop_gradient(_reduce(jnp.max, v, blocked))
    m = where(jnp.isfinite(m), m, 0.0)
    mb = m[..., None, None] if blocked else m[..., None]
    s = _reduce(jnp.sum, jnp.exp(v - mb), blocked)
    pos = s > 0
    return where(pos, jnp.log(where(pos, s, 1.0)) + m, -jnp.inf)


def _mod_exact(x, n):
    """x mod n for integer-valued float64 0 ≤ x < 2^53 and integer n ≤ 2^24, exactly.

    x - n·⌊x/n⌋ is exact (integers below 2^53); ⌊fl(x/n)⌋ may be one too large where x/n lies
    just below an integer, hence the correction. ~40× cheaper than ``jnp.mod`` (a libm fmod) on
    XLA's CPU; the same value.
    """
    rem = x - n * jnp.floor(x / n)
    return where(rem < 0.0, rem + n, rem)


def fft_passes(n):
    r"""The round-off bound's count of radix-2 passes for an FFT of n = 2^a or 3·2^a points: a, or a + 3.

    Higham 2002 (Theorem 24.2) bounds a radix-2 FFT's normwise relative error by
    :math:`\log_2 n·η`, one η per pass. A radix-3 pass counts as three: each of its outputs is
    a three-term sum of twiddled inputs with at most three more roundings than a radix-2
    output, and its entrywise absolute matrix has 2-norm 3 = √3 times its own, so its error is
    at most √3(3u + η) ≤ 3η (η ≥ 4√2u); docs/pld.md, "Round-off".
    """
    return math.log2(n) if n & (n - 1) == 0 else math.log2(n // 3) + 3.0


def tilted_fft(parts, counts, lam, a0, n, split=False):
    r"""The circular composition of masses tilted by λ, rolled to start at bin a0, and its round-off bound.

    ``parts`` are ``(o, grid, p)``: masses p on the bins ``grid = (o + i)h``, composed
    ``counts`` times each. Each is tilted, :math:`\tilde p_i = p_i e^{λℓ_i - a}`,
    :math:`a = \log\sum_i p_i e^{λℓ_i}` (a distribution again), transformed, raised to its
    count and multiplied; one ``irfft`` gives the circular convolution, rolled by a phase so
    that entry j is bin a0 + j (an elementwise product; (f·s) mod n is exact in float64 for
    n ≤ 2^26). n is a power of two or three times one. Untilted, bin ℓ holds :math:`\tilde r_ℓ e^{Λ - λℓ}`, Λ = Σ_c k_c a_c.

    Returns:
      (the tilted circular result r̃, the round-off bound m on each of its bins (Higham 2002
      §24.1), Λ); with ``split=True`` m is returned as (m₂, m_bin), m = m₂ + m_bin: m₂ bounds
      the 2-norm of the error vector r̃^fl − r̃ and m_bin = 4nu is a per-bin term (docs/pld.md,
      "Round-off").
    """
    # The spectrum Π_c rfft(p̃_c)^{k_c}·e^{iφ} as one complex exponential of Σ_c k_c Log rfft(p̃_c) + iφ
    # (one exp per frequency, not one per mechanism and one for the phase: docs/pld.md "Round-off").
    log_spec = jnp.zeros((n // 2 + 1,), dtype=jnp.complex128)
    dead = jnp.zeros((n // 2 + 1,), dtype=bool)
    offset = jnp.zeros(())
    big_lam = jnp.zeros(())
    norm_term = jnp.zeros(())
    for (o, grid, p), k in zip(parts, counts):
        kf = where(jnp.isfinite(k), k, 0.0)
        logp = where(p > 0, jnp.log(where(p > 0, p, 1.0)), -jnp.inf)
        a = lse(logp, lam * grid)
        pt = jnp.exp(where(p > 0, logp + lam * grid - a, -jnp.inf))
        log_c, dead_c = safe_log(jnp.fft.rfft(pt))
        log_spec = log_spec + k * log_c
        dead = dead | (dead_c & (k > 0))
        offset = offset + k * o
        big_lam = big_lam + kf * a
        norm_term = norm_term + k * jax.lax.stop_gradient(jnp.sqrt(jnp.sum(pt * pt)))
    s = jnp.mod(a0 - offset, n)
    f = jnp.arange(n // 2 + 1, dtype=jnp.float64)
    phase = 2.0 * math.pi * _mod_exact(f * s, n) / n
    spec = where(dead, 0.0 + 0.0j, jnp.exp(log_spec + 1j * phase))
    r_t = jnp.fft.irfft(spec, n)
    # The rounding margin carries no derivative (it is a bound on round-off). Its leading
    # factor covers the FFTs (fft_passes(n) + 2: log₂n for a power of two) and the exponential's evaluation ((C + 3)π + 2)/8 for
    # C mechanisms; the first is the larger for C ≤ 16 at every grid size (docs/pld.md "Round-off").
    spec_abs2 = jax.lax.stop_gradient(jnp.real(spec) ** 2 + jnp.imag(spec) ** 2)
    spec_norm = jnp.sqrt(2.0 * jnp.sum(spec_abs2))
    lead = max(fft_passes(n) + 2.0, ((len(parts) + 3) * math.pi + 2.0) / 8.0)
    norm_wise = 8.0 * _U * lead * (1.0 + norm_term) * (spec_norm + 1.0)
    per_bin = 4.0 * n * _U
    if split:
        return r_t, (norm_wise, per_bin), big_lam
    return r_t, norm_wise + per_bin, big_lam
