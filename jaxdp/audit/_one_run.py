r"""One-run auditing (Steinke, Nasr & Jagielski 2023): a lower bound on ε from one training run.

m canaries are each included independently with probability 1/2; after one run the
auditor guesses "in" or "out" for r of them (abstaining on the rest) and v guesses are
right. If the run is (ε, δ)-DP, with :math:`f(v) = P[\mathrm{Binomial}(r, p_ε) \ge v]`
and :math:`p_ε = e^ε/(1 + e^ε)`,

.. math::

    P[W \ge v] \le f(v) + 2mδ\,\max_{1 \le i \le v} \frac{f(v - i) - f(v)}{i}

(their Theorem 5.2; δ = 0 is Theorem 3.1). The largest ε whose p-value is below
1 − confidence is a lower bound on ε with that confidence.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._numerics import f64, float64
from ._host import DOWN, UP, on_host_when_x64_off

__all__ = ["OneRunLowerBound", "one_run_audit", "one_run_epsilon_lower_bound", "one_run_p_value"]

# Bisection on ε ∈ [0, _EPS_MAX]: 80 halvings of 64 leave 5e-23; the lower end (whose
# p-value is below the level) is returned. At ε = 64, p_ε = 1 - 1.6e-28 rounds to 1 in
# float64, so every p-value is 1 there and no larger ε can be certified from counts.
_EPS_MAX = 64.0
_EPS_ITERS = 80


def _p_value(eps, num_canaries, num_guesses, num_correct, delta):
    """The bound of Theorem 5.2 for one ε (broadcasting over ε); ``num_canaries`` is static."""
    r, v, m = f64(num_guesses), f64(num_correct), int(num_canaries)
    p = jax.nn.sigmoid(f64(eps))
    # f(v) = P[Bin(r, p) ≥ v] = I_p(v, r - v + 1) (regularized incomplete beta), 1 at v = 0.
    pos = v > 0
    tail = jnp.where(pos, jax.scipy.special.betainc(jnp.where(pos, v, 1.0), r - v + 1.0, p), 1.0)
    # pmf(k) for k = 0..m (last axis), exactly 0 above r; in log space (gammaln) against overflow.
    k = jnp.arange(m + 1, dtype=jnp.float64)
    rr, ee = r[..., None], f64(eps)[..., None]
    inside = k <= rr
    ks = jnp.where(inside, k, 0.0)
    logpmf = (jax.scipy.special.gammaln(rr + 1.0) - jax.scipy.special.gammaln(ks + 1.0)
              - jax.scipy.special.gammaln(rr - ks + 1.0) + ks * jax.nn.log_sigmoid(ee)
              + (rr - ks) * jax.nn.log_sigmoid(-ee))
    pmf = jnp.where(inside, jnp.exp(logpmf), 0.0)
    cdf = jnp.cumsum(pmf, axis=-1)  # cdf[..., j] = P[Bin ≤ j]
    # f(v - i) - f(v) = P[v - i ≤ Bin ≤ v - 1] = cdf[v-1] - cdf[v-i-1] (cdf[-1] = 0), i = 1..v.
    i = jnp.arange(1, m + 1, dtype=jnp.int32)
    vi = jnp.round(v).astype(jnp.int32)[..., None]
    upper = jnp.where(vi >= 1, jnp.take_along_axis(cdf, jnp.clip(vi - 1, 0, m), axis=-1), 0.0)
    idx = vi - i - 1
    lower = jnp.where(idx >= 0, jnp.take_along_axis(cdf, jnp.clip(idx, 0, m), axis=-1), 0.0)
    ratios = jnp.where(i <= vi, jnp.maximum(upper - lower, 0.0) / i, 0.0)
    alpha = jnp.max(ratios, axis=-1)
    return jnp.minimum(tail + 2.0 * m * f64(delta) * alpha, 1.0)


_p_value_jit = jax.jit(_p_value, static_argnums=1)


def _check_counts(num_canaries, num_guesses, num_correct) -> None:
    if isinstance(num_canaries, bool) or not isinstance(num_canaries, (int, np.integer)) or num_canaries < 1:
        raise ValueError(f"num_canaries must be a Python int >= 1 (it sets array shapes); got {num_canaries!r}.")
    _validate.check_integer("num_guesses", num_guesses, 0.0, float(num_canaries))
    _validate.check_integer("num_correct", num_correct, 0.0, float(num_canaries))
    if _validate.is_concrete(num_guesses) and _validate.is_concrete(num_correct):
        if np.any(np.asarray(num_correct) > np.asarray(num_guesses)):
            raise ValueError(f"num_correct must be at most num_guesses; got {num_correct!r} > {num_guesses!r}.")


@on_host_when_x64_off(UP)
@float64
def one_run_p_value(epsilon, num_canaries: int, num_guesses, num_correct, delta=0.0):
    r"""Probability of at least ``num_correct`` right guesses if the run is (ε, δ)-DP.

    .. math::

        β(ε) = f(v) + 2mδ\,\max_{1\le i\le v}\frac{f(v-i) - f(v)}{i},\qquad
        f(u) = P\bigl[\mathrm{Binomial}(r, \tfrac{e^ε}{1+e^ε}) \ge u\bigr]

    (capped at 1), with m canaries each included with probability 1/2, r guesses and v of
    them right.

    Args:
      epsilon: ε ≥ 0 (any shape).
      num_canaries: m ≥ 1, a Python int (static: it sets the shape of the binomial table).
      num_guesses: r in [0, m], integer.
      num_correct: v in [0, r], integer.
      delta: δ in [0, 1].

    Returns:
      float64 p-value in [0, 1] of the broadcast shape.

    References:
      T. Steinke, M. Nasr, M. Jagielski, "Privacy auditing with one (1) training run",
      NeurIPS 2023, Theorem 5.2 (Theorem 3.1 at δ = 0).

    Examples:
      >>> round(float(one_run_p_value(1.0, 1000, 100, 80)), 6)  # P[Bin(100, 0.731) >= 80]
      0.071556
    """
    _check_counts(num_canaries, num_guesses, num_correct)
    _validate.check_in_range("epsilon", epsilon, 0.0, math.inf)
    _validate.check_in_range("delta", delta, 0.0, 1.0)
    eps, r, v, d = jnp.broadcast_arrays(f64(epsilon), f64(num_guesses), f64(num_correct), f64(delta))
    return _p_value_jit(eps, num_canaries, r, v, d)


@functools.partial(jax.jit, static_argnums=0)
def _epsilon_at_level(num_canaries, r, v, delta, level):
    lo = jnp.zeros(jnp.shape(r), jnp.float64)
    hi = jnp.full(jnp.shape(r), _EPS_MAX)

    def body(_, lohi):
        lo, hi = lohi
        mid = 0.5 * (lo + hi)
        ok = _p_value(mid, num_canaries, r, v, delta) < level  # (ε = mid, δ)-DP is rejected
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, _EPS_ITERS, body, (lo, hi))
    # lo keeps p(lo) < level except when no ε > 0 is rejected, where lo stays 0.
    return lo


@on_host_when_x64_off(DOWN)
@float64
def one_run_epsilon_lower_bound(num_canaries: int, num_guesses, num_correct, delta=0.0, confidence=0.95):
    r"""Largest ε that the observed guesses reject: a lower bound on ε with the given confidence.

    .. math::

        ε_{lb} = \sup\{ε \ge 0 : β(ε) < 1 - c\}

    with β of :func:`one_run_p_value` (increasing in ε), found by bisection; the returned
    value is the bracket's lower end, so β(ε_lb) < 1 − c always holds (0 if no ε > 0 is
    rejected).

    Args:
      num_canaries: m ≥ 1 (Python int), each canary included independently with probability 1/2.
      num_guesses: r in [0, m]; num_correct: v in [0, r].
      delta: δ in [0, 1] of the claim being tested.
      confidence: c in (0, 1).

    Returns:
      float64 ε_lb ≥ 0 of the broadcast shape of the counts.

    References:
      T. Steinke, M. Nasr, M. Jagielski, "Privacy auditing with one (1) training run",
      NeurIPS 2023, Theorem 5.2 and Section 6 (the bisection).

    Examples:
      >>> round(float(one_run_epsilon_lower_bound(1000, 100, 100)), 3)  # all 100 guesses right
      3.493
    """
    _check_counts(num_canaries, num_guesses, num_correct)
    _validate.check_in_range("delta", delta, 0.0, 1.0)
    _validate.check_in_range("confidence", confidence, 0.0, 1.0, lo_open=True, hi_open=True)
    r, v, d = jnp.broadcast_arrays(f64(num_guesses), f64(num_correct), f64(delta))
    return _epsilon_at_level(num_canaries, r, v, d, 1.0 - f64(confidence))


class OneRunLowerBound(NamedTuple):
    """The result of :func:`one_run_audit`.

    Attributes:
      epsilon: the lower bound on ε (with the stated confidence, over every guess count tried).
      num_guesses: r of the guess count that gave it.
      num_correct: v, the right guesses among them.
    """

    epsilon: jax.Array
    num_guesses: jax.Array
    num_correct: jax.Array


@float64
def one_run_audit(scores, included, delta=0.0, confidence=0.95, *, num_guesses=None) -> OneRunLowerBound:
    r"""One-run audit from a score per canary: guess the top scores "in" and the bottom ones "out".

    For each guess count r of ``num_guesses`` (fixed before the run), the r/2 canaries
    with the highest scores are guessed included and the r − r/2 with the lowest excluded;
    v counts the right guesses, and :func:`one_run_epsilon_lower_bound` is taken at
    confidence :math:`1 - (1-c)/K` for K guess counts (Bonferroni), so the maximum over
    them holds with confidence c.

    Args:
      scores: shape ``(m,)``, a score per canary (higher = more likely included).
      included: shape ``(m,)``, booleans: which canaries were in the training data (each
        drawn independently with probability 1/2 before the run).
      delta: δ in [0, 1].
      confidence: c in (0, 1).
      num_guesses: guess counts r in [1, m] (a tuple of Python ints; default
        m/100, m/50, m/20, m/10, m/5, m/2, m, rounded and at least 1).

    Returns:
      A :class:`OneRunLowerBound`.

    References:
      T. Steinke, M. Nasr, M. Jagielski, "Privacy auditing with one (1) training run",
      NeurIPS 2023, Algorithm 1 and Theorem 5.2.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> inc = jax.random.bernoulli(jax.random.key(0), 0.5, (1000,))
      >>> res = one_run_audit(jnp.where(inc, 1.0, -1.0), inc)  # a mechanism with no noise
      >>> float(res.epsilon) > 1.0
      True
    """
    scores, included = f64(scores), jnp.asarray(included)
    if scores.ndim != 1 or included.shape != scores.shape:
        raise ValueError(f"scores and included must be 1-D of one length; got {scores.shape}, {included.shape}.")
    m = scores.shape[0]
    if m < 1:
        raise ValueError("scores must hold at least one canary.")
    _validate.check_in_range("delta", delta, 0.0, 1.0)
    _validate.check_in_range("confidence", confidence, 0.0, 1.0, lo_open=True, hi_open=True)
    if num_guesses is None:
        num_guesses = sorted({max(1, round(m * f)) for f in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)})
    ks = [int(k) for k in np.atleast_1d(num_guesses)]
    if not ks or any(k < 1 or k > m for k in ks):
        raise ValueError(f"num_guesses must be integers in [1, {m}]; got {num_guesses!r}.")
    order = jnp.argsort(-scores)  # highest first
    inc_sorted = included[order].astype(jnp.float64)
    top_right = jnp.concatenate([jnp.zeros(1), jnp.cumsum(inc_sorted)])  # included among the top j
    bottom_right = jnp.concatenate([jnp.zeros(1), jnp.cumsum((1.0 - inc_sorted)[::-1])])  # excluded among bottom j
    r = np.asarray(ks, np.float64)
    n_top = np.asarray([k - k // 2 for k in ks])
    n_bottom = np.asarray([k // 2 for k in ks])
    v = top_right[n_top] + bottom_right[n_bottom]
    level = (1.0 - f64(confidence)) / len(ks)
    eps = _epsilon_at_level(m, jnp.asarray(r), v, jnp.full(r.shape, f64(delta)), level)
    i = jnp.argmax(eps)
    return OneRunLowerBound(eps[i], jnp.asarray(r)[i], v[i])
