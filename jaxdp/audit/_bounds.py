r"""Lower bounds on ε from distinguishing experiments (many runs with and without a canary).

A mechanism M is (ε, δ)-DP only if every test S between neighbouring inputs D (canary in)
and D' (canary out) satisfies

.. math::

    \mathrm{TPR} \le e^{ε}\,\mathrm{FPR} + δ, \qquad 1 - \mathrm{FPR} \le e^{ε}(1 - \mathrm{TPR}) + δ,

with TPR = P[M(D) ∈ S] and FPR = P[M(D') ∈ S]. Clopper–Pearson intervals replace the
two probabilities by a lower bound on TPR and an upper bound on FPR that hold together
with the stated confidence, so

.. math::

    ε \ge \max\Bigl(\log\frac{\mathrm{TPR}_{lo} - δ}{\mathrm{FPR}_{hi}},
                   \log\frac{1 - \mathrm{FPR}_{hi} - δ}{1 - \mathrm{TPR}_{lo}}\Bigr)

holds with that confidence (Jagielski, Ullman & Oprea 2020, Section 3; Nasr et al. 2021).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._numerics import f64, float64
from ._host import DOWN, NEAREST, UP, on_host_when_x64_off

__all__ = ["EmpiricalTradeoff", "EpsilonLowerBound", "clopper_pearson", "empirical_tradeoff", "epsilon_lower_bound"]

# Bisection of the Beta quantile on [0, 1]: 100 halvings leave a bracket of 2^-100 ≈ 8e-31,
# far below any rate estimated from at most ~1e9 runs (the smallest non-zero rate is 1e-9).
_BETA_ITERS = 100
# Candidate thresholds per direction when they are chosen from the data (selection half):
# order statistics at geometrically spaced tail counts.
_NUM_CANDIDATES = 64


def _beta_quantile_bracket(p, a, b):
    """A bracket [lo, hi] around the x with I_x(a, b) = p (regularized incomplete beta)."""

    def body(_, lohi):
        lo, hi = lohi
        mid = 0.5 * (lo + hi)
        below = jax.scipy.special.betainc(a, b, mid) < p
        return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

    shape = jnp.broadcast_shapes(jnp.shape(p), jnp.shape(a), jnp.shape(b))
    lo0, hi0 = jnp.zeros(shape, jnp.float64), jnp.ones(shape, jnp.float64)
    return jax.lax.fori_loop(0, _BETA_ITERS, body, (lo0, hi0))


@jax.jit
def _clopper_pearson(k, n, tail):
    """One-sided Clopper–Pearson bounds, each failing with probability ≤ ``tail``."""
    k, n = f64(k), f64(n)
    # Lower bound: the tail-quantile of Beta(k, n - k + 1); 0 when k = 0. Double where: the
    # unused branch gets a = 1 so betainc stays finite.
    has = k > 0
    lo_bracket = _beta_quantile_bracket(tail, jnp.where(has, k, 1.0), n - k + 1.0)
    lower = jnp.where(has, lo_bracket[0], 0.0)  # the bracket's lower end: never too high
    # Upper bound: the (1 - tail)-quantile of Beta(k + 1, n - k); 1 when k = n.
    short = k < n
    hi_bracket = _beta_quantile_bracket(1.0 - tail, k + 1.0, jnp.where(short, n - k, 1.0))
    upper = jnp.where(short, hi_bracket[1], 1.0)  # the bracket's upper end: never too low
    return lower, upper


@on_host_when_x64_off(DOWN, UP)
@float64
def clopper_pearson(successes, trials, confidence=0.95):
    r"""Two-sided Clopper–Pearson (exact binomial) confidence interval for a rate.

    .. math::

        p_{lo} = B^{-1}\bigl(\tfrac{1-c}{2}; k, n-k+1\bigr),\qquad
        p_{hi} = B^{-1}\bigl(\tfrac{1+c}{2}; k+1, n-k\bigr),

    with :math:`B^{-1}` the Beta quantile (found by bisection on
    ``jax.scipy.special.betainc``; the bracket's safe end is returned), :math:`p_{lo} = 0`
    at k = 0 and :math:`p_{hi} = 1` at k = n. Each side fails with probability at most
    (1 − c)/2, so the interval covers the rate with probability at least c.

    Args:
      successes: k, integers in [0, trials] (any shape; broadcast with ``trials``).
      trials: n ≥ 1.
      confidence: c in (0, 1).

    Returns:
      ``(lower, upper)``, float64 arrays of the broadcast shape.

    References:
      C. J. Clopper and E. S. Pearson, "The use of confidence or fiducial limits illustrated
      in the case of the binomial", Biometrika 26(4), 1934.

    Examples:
      >>> lo, hi = clopper_pearson(5, 100, 0.95)
      >>> round(float(lo), 5), round(float(hi), 5)
      (0.01643, 0.11284)
    """
    _validate.check_in_range("confidence", confidence, 0.0, 1.0, lo_open=True, hi_open=True)
    _validate.check_in_range("trials", trials, 1.0, np.inf)
    if _validate.is_concrete(successes) and _validate.is_concrete(trials):
        k, n = np.asarray(successes, np.float64), np.asarray(trials, np.float64)
        if np.any((k < 0) | (k > n) | (k != np.round(k))):
            raise ValueError(f"successes must be integers in [0, trials]; got {successes!r} of {trials!r}.")
    return _clopper_pearson(successes, trials, 0.5 * (1.0 - f64(confidence)))


class EpsilonLowerBound(NamedTuple):
    """An empirical lower bound on ε and the test that gave it.

    Attributes:
      epsilon: the lower bound (≥ 0), valid with the stated confidence.
      threshold: the score threshold of the test ("canary in" when score ≥ threshold).
      true_positive_rate: the Clopper–Pearson lower bound on TPR at that threshold.
      false_positive_rate: the Clopper–Pearson upper bound on FPR at that threshold.
    """

    epsilon: jax.Array
    threshold: jax.Array
    true_positive_rate: jax.Array
    false_positive_rate: jax.Array


def _counts_at_or_above(sorted_scores, thresholds):
    n = sorted_scores.shape[-1]
    return n - jnp.searchsorted(sorted_scores, thresholds, side="left")


def _directions(sorted_in, sorted_out, thresholds, delta, tail):
    """The two directions' bounds at each threshold, and the rate bounds used."""
    n_in, n_out = sorted_in.shape[-1], sorted_out.shape[-1]
    tp = _counts_at_or_above(sorted_in, thresholds)
    fp = _counts_at_or_above(sorted_out, thresholds)
    tpr_lo, _ = _clopper_pearson(tp, n_in, tail)
    _, fpr_hi = _clopper_pearson(fp, n_out, tail)
    # log((TPR_lo - δ)/FPR_hi) and log((1 - FPR_hi - δ)/(1 - TPR_lo)); a non-positive
    # numerator gives no evidence (-inf). Double where keeps the logs finite.
    def log_ratio(num, den):
        ok = (num > 0) & (den > 0)
        return jnp.where(ok, jnp.log(jnp.where(ok, num, 1.0)) - jnp.log(jnp.where(ok, den, 1.0)), -jnp.inf)

    return log_ratio(tpr_lo - delta, fpr_hi), log_ratio(1.0 - fpr_hi - delta, 1.0 - tpr_lo), tpr_lo, fpr_hi


def _bounds_at(sorted_in, sorted_out, thresholds, delta, tail):
    """ε lower bound of each threshold (best direction), with one-sided tails ``tail``."""
    e1, e2, tpr_lo, fpr_hi = _directions(sorted_in, sorted_out, thresholds, delta, tail)
    return jnp.maximum(e1, e2), tpr_lo, fpr_hi


def _candidates(sorted_in, sorted_out):
    """Thresholds at geometrically spaced tail counts: top of the out-scores, bottom of the in-scores."""
    def tail_idx(n):
        k = np.unique(np.round(np.geomspace(1, n, _NUM_CANDIDATES)).astype(np.int64))
        return k

    top = sorted_out[sorted_out.shape[-1] - tail_idx(sorted_out.shape[-1])]
    # just above the k-th smallest in-score, so "score < threshold" holds k in-scores
    bottom = jnp.nextafter(sorted_in[tail_idx(sorted_in.shape[-1]) - 1], jnp.inf)
    return jnp.concatenate([top, bottom])


@on_host_when_x64_off(DOWN, NEAREST, DOWN, UP)
@float64
def epsilon_lower_bound(scores_in, scores_out, delta, confidence=0.95, *, thresholds=None) -> EpsilonLowerBound:
    r"""Empirical lower bound on ε from scores of runs with and without the canary.

    The test "canary in when score ≥ t" has true and false positive rates TPR(t) and
    FPR(t); for an (ε, δ)-DP mechanism

    .. math::

        ε \ge \max_t \max\Bigl(\log\frac{\mathrm{TPR}_{lo}(t) - δ}{\mathrm{FPR}_{hi}(t)},
        \log\frac{1 - \mathrm{FPR}_{hi}(t) - δ}{1 - \mathrm{TPR}_{lo}(t)}\Bigr),

    with one-sided Clopper–Pearson bounds. The returned bound holds with probability at
    least ``confidence`` over the runs:

    * ``thresholds`` given (they must not depend on these scores): each of the 2·T
      one-sided bounds fails with probability (1 − c)/(2T) (Bonferroni over the sweep);
    * ``thresholds=None``: the runs are split in two halves. On the first, the threshold
      with the best bound in each direction is picked among order statistics at
      geometrically spaced tail counts; on the second, independent of that choice, the two
      picked thresholds are evaluated with Bonferroni over 2 thresholds.

    The runs must be independent and in the order they were run (not sorted): the halves
    must be samples of the same distribution.

    Args:
      scores_in: shape ``(runs_in,)``, a score per run with the canary (higher = "in").
      scores_out: shape ``(runs_out,)``, a score per run without it (≥ 2 runs each when
        ``thresholds`` is None).
      delta: δ in [0, 1).
      confidence: c in (0, 1).
      thresholds: optional 1-D array of thresholds fixed before seeing the scores.

    Returns:
      An :class:`EpsilonLowerBound` (float64 scalars); ε = 0 when no test gives evidence.

    References:
      M. Jagielski, J. Ullman, A. Oprea, "Auditing differentially private machine learning:
      how private is private SGD?", NeurIPS 2020 (Section 3, Algorithm 2); M. Nasr, S. Song,
      A. Thakurta, N. Papernot, N. Carlini, "Adversary instantiation: lower bounds for
      differentially private machine learning", IEEE S&P 2021 (Section 3).

    Examples:
      >>> import jax
      >>> k1, k2 = jax.random.split(jax.random.key(0))
      >>> s_in = 1.0 + jax.random.normal(k1, (20000,))    # Gaussian mechanism, sigma = 1
      >>> s_out = jax.random.normal(k2, (20000,))
      >>> lb = epsilon_lower_bound(s_in, s_out, delta=1e-5)
      >>> 1.0 < float(lb.epsilon) < 4.4  # the exact epsilon at delta = 1e-5 is 4.4
      True
    """
    _validate.check_in_range("delta", delta, 0.0, 1.0, hi_open=True)
    _validate.check_in_range("confidence", confidence, 0.0, 1.0, lo_open=True, hi_open=True)
    scores_in, scores_out = f64(scores_in), f64(scores_out)
    if scores_in.ndim != 1 or scores_out.ndim != 1:
        raise ValueError(f"scores_in and scores_out must be 1-D; got shapes {scores_in.shape}, {scores_out.shape}.")
    delta, alpha = f64(delta), 1.0 - f64(confidence)
    if thresholds is not None:
        t = jnp.atleast_1d(f64(thresholds))
        if t.ndim != 1 or t.shape[0] == 0:
            raise ValueError(f"thresholds must be a non-empty 1-D array; got shape {t.shape}.")
        if scores_in.shape[0] < 1 or scores_out.shape[0] < 1:
            raise ValueError("scores_in and scores_out must hold at least one run each.")
        return _fixed_bound(scores_in, scores_out, t, delta, alpha)
    if scores_in.shape[0] < 2 or scores_out.shape[0] < 2:
        raise ValueError("scores_in and scores_out must hold at least 2 runs each (half choose the threshold).")
    return _split_bound(scores_in, scores_out, delta, alpha)


@jax.jit
def _fixed_bound(scores_in, scores_out, t, delta, alpha):
    eps, tpr, fpr = _bounds_at(jnp.sort(scores_in), jnp.sort(scores_out), t, delta, alpha / (2 * t.shape[0]))
    i = jnp.argmax(eps)
    return EpsilonLowerBound(jnp.maximum(eps[i], 0.0), t[i], tpr[i], fpr[i])


@jax.jit
def _split_bound(scores_in, scores_out, delta, alpha):
    h_in, h_out = scores_in.shape[0] // 2, scores_out.shape[0] // 2
    sel_in, sel_out = jnp.sort(scores_in[:h_in]), jnp.sort(scores_out[:h_out])
    ev_in, ev_out = jnp.sort(scores_in[h_in:]), jnp.sort(scores_out[h_out:])
    cand = _candidates(sel_in, sel_out)
    # Selection on the first half: each direction's best candidate (at the final tails).
    e1, e2, _, _ = _directions(sel_in, sel_out, cand, delta, alpha / 4.0)
    picked = jnp.stack([cand[jnp.argmax(e1)], cand[jnp.argmax(e2)]])
    # Evaluation on the second half: 2 thresholds x 2 one-sided bounds, each failing w.p. alpha/4.
    eps, tpr, fpr = _bounds_at(ev_in, ev_out, picked, delta, alpha / 4.0)
    i = jnp.argmax(eps)
    return EpsilonLowerBound(jnp.maximum(eps[i], 0.0), picked[i], tpr[i], fpr[i])


class EmpiricalTradeoff(NamedTuple):
    """Empirical (FPR, TPR) points of threshold tests, with Clopper–Pearson boxes.

    Attributes:
      threshold: the score thresholds ("canary in" when score ≥ threshold), shape ``(T,)``.
      fpr, tpr: the observed rates at each threshold.
      fpr_lower, fpr_upper, tpr_lower, tpr_upper: the boxes; all 4·T one-sided bounds hold
        together with the stated confidence (Bonferroni).
    """

    threshold: jax.Array
    fpr: jax.Array
    tpr: jax.Array
    fpr_lower: jax.Array
    fpr_upper: jax.Array
    tpr_lower: jax.Array
    tpr_upper: jax.Array


@on_host_when_x64_off(NEAREST, NEAREST, NEAREST, DOWN, UP, DOWN, UP)
@float64
def empirical_tradeoff(scores_in, scores_out, confidence=0.95, *, thresholds=None) -> EmpiricalTradeoff:
    r"""The audit's points on the trade-off plane: each threshold test's (FPR, TPR) and its confidence box.

    For the test "canary in when score ≥ t", :math:`\widehat{\mathrm{TPR}}(t)` and
    :math:`\widehat{\mathrm{FPR}}(t)` are the fractions of runs with and without the canary
    scoring at least t; the box is the product of one-sided Clopper–Pearson bounds, each
    failing with probability (1 − c)/(4T), so all T boxes cover the true rates together
    with probability at least c. A box lying wholly above a claimed trade-off curve
    (:func:`~jaxdp.accounting.tradeoff`) refutes the claim at that confidence.

    Args:
      scores_in: shape ``(runs_in,)``, scores of runs with the canary (higher = "in").
      scores_out: shape ``(runs_out,)``, scores of runs without it.
      confidence: c in (0, 1).
      thresholds: optional 1-D array of thresholds; default the out-scores' order
        statistics at geometrically spaced tail counts (1, …, runs_out), which spread the
        points evenly on a logarithmic FPR axis. (Chosen from the out-scores, the default
        boxes are for display: use fixed ``thresholds`` for a test.)

    Returns:
      An :class:`EmpiricalTradeoff` of float64 arrays of shape ``(T,)``.

    Examples:
      >>> import jax
      >>> k1, k2 = jax.random.split(jax.random.key(0))
      >>> pts = empirical_tradeoff(1.0 + jax.random.normal(k1, (20000,)), jax.random.normal(k2, (20000,)),
      ...                          thresholds=[1.0])
      >>> bool(pts.tpr_lower[0] <= 0.5 <= pts.tpr_upper[0]), bool(pts.fpr_lower[0] <= 0.1587 <= pts.fpr_upper[0])
      (True, True)
    """
    _validate.check_in_range("confidence", confidence, 0.0, 1.0, lo_open=True, hi_open=True)
    scores_in, scores_out = f64(scores_in), f64(scores_out)
    if scores_in.ndim != 1 or scores_out.ndim != 1 or scores_in.shape[0] < 1 or scores_out.shape[0] < 1:
        raise ValueError(f"scores_in and scores_out must be non-empty 1-D arrays; got shapes {scores_in.shape}, "
                         f"{scores_out.shape}.")
    sorted_out = jnp.sort(scores_out)
    if thresholds is None:
        n = sorted_out.shape[0]
        k = np.unique(np.round(np.geomspace(1, n, _NUM_CANDIDATES)).astype(np.int64))
        t = sorted_out[n - k]
    else:
        t = jnp.atleast_1d(f64(thresholds))
        if t.ndim != 1 or t.shape[0] == 0:
            raise ValueError(f"thresholds must be a non-empty 1-D array; got shape {t.shape}.")
    return _empirical_points(jnp.sort(scores_in), sorted_out, t, 1.0 - f64(confidence))


@jax.jit
def _empirical_points(sorted_in, sorted_out, t, alpha):
    n_in, n_out = sorted_in.shape[-1], sorted_out.shape[-1]
    tp, fp = _counts_at_or_above(sorted_in, t), _counts_at_or_above(sorted_out, t)
    tail = alpha / (4 * t.shape[0])
    tpr_lo, tpr_hi = _clopper_pearson(tp, n_in, tail)
    fpr_lo, fpr_hi = _clopper_pearson(fp, n_out, tail)
    return EmpiricalTradeoff(t, f64(fp) / n_out, f64(tp) / n_in, fpr_lo, fpr_hi, tpr_lo, tpr_hi)
