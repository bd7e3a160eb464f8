r"""Random allocation (balls-in-bins batching, and k of t steps): the event and its certified RDP curve.

Each epoch has t = ``steps_per_pass`` steps; every record takes part in exactly one of
them, chosen uniformly at random and independently across records (k = 1 of t:
balls-in-bins). Each step is a Gaussian mechanism on the sum of the clipped gradients of
its batch (noise multiplier σ over the add/remove-one sensitivity, the clipping norm C).
Neighbouring relation: **add/remove one record**; both directions are bounded.

With the record's contribution e_i in the step it was allocated to, the pair of output
distributions that dominates one epoch (Feldman & Shenfeld, arXiv 2502.08202: the
Gaussian case of their analysis; see docs/batch_schemes.md) is

.. math:: P = \frac1t \sum_{i=1}^t N(e_i, σ^2 I_t), \qquad Q = N(0, σ^2 I_t),

P with the record, Q without. The curve reported at order α is
max(D_α(P‖Q), D_α(Q‖P)) per epoch, composed over epochs by :class:`SelfComposed`.

* **Remove direction** D_α(P‖Q), exact at integer α (:func:`_remove_log_moment`):
  :math:`E_Q[(P/Q)^α] = t^{-α} e^{-α/(2σ^2)} \sum_{a} \binom{α}{a} \prod_i e^{a_i^2/(2σ^2)}`
  over compositions a of α into t parts, i.e. t^{-α} α! [x^α] f(x)^t with
  f(x) = Σ_k e^{k(k−1)/(2σ²)} x^k/k!, computed by binary powering of the series in log
  space; at a fractional order the next integer (D_α is non-decreasing in α); above
  order :data:`REMOVE_EXACT_MAX`, the Gaussian α/(2σ²) (joint convexity).
* **Add direction** D_α(Q‖P) = log E[S^{-β}]/β, β = α − 1, S = (1/t)Σ_i Y_i, Y_i =
  exp((2x_i − 1)/(2σ²)) with x_i ~ N(0, σ²) iid; the smaller of two certified bounds:

  - AM–GM: S ≥ exp((2x̄ − 1)/(2σ²)) gives (α + t − 1)/(2tσ²);
  - the Laplace-transform quadrature :func:`_add_log_moment`:
    :math:`E[S^{-β}] = Γ(β)^{-1}\int_0^∞ u^{β-1} φ(u/t)^t\,du`, φ(s) = E e^{-sY}, with
    φ bounded above on a z-grid (its first-order term exact), log(e^u φ(u/t)^t) convex
    in u (a log-MGF) and so bounded by chords between nodes, and the u-integral of each
    chord bounded in closed form; rounding margins added. Every step is an upper bound.

k of t steps (``selected=k``, each record in a uniformly random k-subset of the t steps):
with t = km + r, 0 ≤ r < k, each direction is bounded by k − r epochs of 1 of m plus r
epochs of 1 of m + 1 (a random partition into blocks, then one step per block, is exactly
random allocation; mixtures over the hidden partition do not increase the divergence;
the blocks compose concurrently). k = 1 runs the code above unchanged.

ε (k = 1, dp_accounting's orders or any list of ≥ 48): the add direction's quadrature runs
at 39 of the 156 orders only (:func:`pruned_curve`: every 6th, then the 12 likeliest by a
lower estimate); any subset of the orders gives a certified ε, and on every configuration
checked the minimising order is among them. Its chords take the φ bound at 177 of the 385
u-nodes (:func:`_add_chords_refined`: every 8th, then where the chords bend most;
certified by convexity, ε ≤ 3e-9 relative above the all-node value on the configurations
checked). :func:`random_allocation_rdp` is exact at every order asked (all nodes).

The derivation, the decisions where the papers are incomplete and the checks are in
docs/batch_schemes.md ("Random allocation", "k of t steps").
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import gammaln, ndtr

from .. import _validate
from .._numerics import f64, float64, take
from ._conversion import improved_per_order
from ._events import Event, Gaussian, SelfComposed, _event, _is_structural, register_event_type, relation_of

__all__ = ["RandomAllocation", "balls_in_bins_event", "random_allocation_event", "random_allocation_rdp",
           "REMOVE_EXACT_MAX"]

#: Largest integer order at which the remove direction is computed exactly (above it, the
#: Gaussian α/(2σ²)); dp_accounting's default orders end at 256 below their far tail.
REMOVE_EXACT_MAX = 256

# Quadrature of the add direction (see _add_log_moment): z-cells for φ, coarse u-nodes for
# the chords of log(e^u φ^t), sub-cells per chord for the closed-form integral, u range.
_NZ = 4096
_NC = 384
_NF = 4
_LOG_U0 = math.log(1e-10)
_LOG_U1 = math.log(1e6)
_Z_LO = -12.0  # Φ(-12) < 2e-33: the left tail is charged in full
_Z_HI = 12.0  # plus 1/σ (the first-moment tail Φ̄(z_N − 1/σ) < 2e-33)
# Rounding margins: relative on a sum of _NZ positive terms, absolute on values near 1.
_SUM_REL = 2e-12
_ABS = 1e-15
# log M margin for the float64 series powering (≤ 62 log-space products of positive terms,
# each a few ulps relative).
_TABLE_MARGIN = 1e-11
# Configurations evaluated together by lax.map (memory: ~15 MB each).
_MAP_BATCH = 8
# u-nodes whose φ bound is evaluated together (a (5, _NZ + 1) block per configuration stays
# in cache: about 2x faster than all _NC + 1 nodes at once, the same values bit for bit).
_PHI_CHUNK = 5


# =======================================================================================
# The event.
# =======================================================================================


@_event(data=("steps_per_pass", "event"), meta=("selected",))
class RandomAllocation(Event):
    """One epoch of ``steps_per_pass`` runs of ``event``, each record in k of them chosen uniformly.

    Random allocation of k = ``selected`` of t steps (a uniformly random k-subset,
    independently per record; k = 1 is balls-in-bins batching), add/remove-one
    neighbours. The RDP accountant covers a :class:`Gaussian` inner event with
    ``relation="add_remove"`` (σ over the clipping norm); see
    :func:`random_allocation_rdp`. Compose epochs with :class:`SelfComposed` (or use
    :func:`balls_in_bins_event` / :func:`random_allocation_event`).

    Attributes:
      steps_per_pass: t ≥ 1, the number of steps (batches) per epoch (a leaf; integer).
      event: the event of one step.
      selected: k, 1 ≤ k ≤ t, the number of steps each record takes part in per epoch
        (static: a Python int; default 1).
    """

    steps_per_pass: Any
    event: Event
    selected: Any = 1

    def __post_init__(self):
        if not isinstance(self.event, Event) and _is_structural(self.event):
            raise TypeError(f"RandomAllocation.event must be an Event; got {type(self.event).__name__}.")
        _check_selected("RandomAllocation.selected", self.selected)


def _check_selected(name: str, selected) -> None:
    """k must be a static whole number ≥ 1 (it picks the block sizes of the reduction)."""
    if isinstance(selected, bool) or not isinstance(selected, (int, np.integer)) or selected < 1:
        raise ValueError(f"{name} must be a Python int ≥ 1 (static); got {selected!r}.")


def _check_alloc(ev, path, chk, rec):
    _validate.check_integer(f"{path}.steps_per_pass (RandomAllocation)", ev.steps_per_pass, lo=1.0)
    _validate.check_not_above(f"{path}.selected (RandomAllocation)", ev.selected, "steps_per_pass", ev.steps_per_pass)
    rec(ev.event, f"{path}.event")


register_event_type(RandomAllocation, relation=lambda ev: relation_of(ev.event), check=_check_alloc)


def balls_in_bins_event(noise_multiplier, steps_per_pass, passes) -> SelfComposed:
    r"""The event of a DP-SGD run with balls-in-bins batches: ``passes`` epochs of t steps each.

    Every pass (epoch) allocates each record to one of its t steps uniformly at random,
    independently across records and passes; each step adds Gaussian noise of standard
    deviation σC to the sum of clipped gradients (add/remove-one neighbours):
    ``SelfComposed(RandomAllocation(t, Gaussian(σ)), passes)``. Its ε is certified by
    :func:`random_allocation_rdp` (both directions; no Poisson ε is implied).

    Args:
      noise_multiplier: σ > 0, the noise standard deviation over the clipping norm.
      steps_per_pass: t ≥ 1 (integer), the number of batches per epoch.
      passes: number of passes (epochs) ≥ 0.

    Returns:
      A :class:`SelfComposed` event (add/remove-one).

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> e1 = float(A.epsilon(A.balls_in_bins_event(2.0, 1, 4), 1e-5))  # t = 1: the Gaussian
      >>> e1 == float(A.epsilon(A.SelfComposed(A.Gaussian(2.0), 4), 1e-5))
      True
      >>> bool(A.epsilon(A.balls_in_bins_event(2.0, 100, 4), 1e-5) < e1)
      True
    """
    return random_allocation_event(noise_multiplier, steps_per_pass, 1, passes)


def random_allocation_event(noise_multiplier, steps_per_pass, selected: int, passes) -> SelfComposed:
    r"""The event of a DP-SGD run in which each record takes part in k of the t steps of every pass.

    Every pass (epoch) gives each record a uniformly random set of k = ``selected`` of its
    t steps, independently across records and passes; each step adds Gaussian noise of
    standard deviation σC to the sum of clipped gradients (add/remove-one neighbours):
    ``SelfComposed(RandomAllocation(t, Gaussian(σ), selected=k), passes)``. k = 1 is
    :func:`balls_in_bins_event`. Its ε is certified by :func:`random_allocation_rdp`
    through the reduction of k of t to k passes of 1 of about t/k (docs/batch_schemes.md,
    "k of t").

    Args:
      noise_multiplier: σ > 0, the noise standard deviation over the clipping norm.
      steps_per_pass: t ≥ k (integer), the number of steps per epoch.
      selected: k ≥ 1, a Python int (static): the steps each record takes part in per pass.
      passes: number of passes (epochs) ≥ 0.

    Returns:
      The run's :class:`SelfComposed` event, add/remove-one neighbours.

    Examples:
      >>> from jaxdp import accounting as acc
      >>> e2 = float(acc.epsilon(acc.random_allocation_event(2.0, 100, 2, 3), 1e-5))
      >>> abs(e2 - float(acc.epsilon(acc.balls_in_bins_event(2.0, 50, 6), 1e-5))) < 1e-12  # 2 passes of 1 of 50
      True
    """
    _check_selected("selected", selected)
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    _validate.check_integer("steps_per_pass", steps_per_pass, lo=1.0)
    _validate.check_not_above("selected", selected, "steps_per_pass", steps_per_pass)
    _validate.check_in_range("passes", passes, 0.0, math.inf)
    _validate.check_broadcastable(noise_multiplier=noise_multiplier, steps_per_pass=steps_per_pass, passes=passes)
    return SelfComposed(RandomAllocation(steps_per_pass, Gaussian(noise_multiplier), selected=int(selected)), passes)


# =======================================================================================
# Remove direction: the moment series (exact at integer orders).
# =======================================================================================


def _log_series_mul(la, lb):
    """log of the coefficients of (Σ e^{la_j} x^j)(Σ e^{lb_j} x^j), truncated at the same degree K.

    c_n = logsumexp_j (la_j + lb_{n−j}); all terms positive, nothing cancels. The Toeplitz
    matrix lb_{n−j} is built by the skew-reshape trick (static slices and reshapes only,
    which transpose cleanly in reverse mode, unlike a gather).
    """
    k1 = la.shape[-1]  # K + 1
    u = jnp.concatenate([lb[::-1], jnp.full((k1 - 1,), -jnp.inf)])  # u[i] = lb[K − i], length 2K + 1
    # Row n must start at u[K − n]: roll so that index 0 is u[K], then rows of 2K elements
    # of the tiled sequence start one element earlier each.
    v = jnp.concatenate([u[k1 - 1:], u[:k1 - 1]])
    tiled = jnp.tile(v, k1)[: k1 * (2 * k1 - 2)].reshape(k1, 2 * k1 - 2) if k1 > 1 else v[None, :1]
    toeplitz = tiled[:, :k1]
    return jax.nn.logsumexp(la[None, :] + toeplitz, axis=-1)


def _power_round(carry):
    """One round of binary powering, least significant bit of t first: (acc, base, rem)."""
    acc, base, rem = carry
    bit = jnp.mod(rem, 2.0) == 1.0
    acc = jnp.where(bit, _log_series_mul(acc, base), acc)
    return acc, _log_series_mul(base, base), jnp.floor(rem / 2.0)


def _series_power_fixed(lf, one, t):
    """f^t in log space by 31 rounds of binary powering (t < 2^31); differentiable in reverse mode."""
    return jax.lax.fori_loop(0, 31, _power_round_step, (one, lf, t))[0]


def _power_round_step(i, carry):
    return _power_round(carry)


@jax.custom_jvp
def _series_power(lf, one, t):
    """f^t in log space: the rounds of :func:`_series_power_fixed` that change the result only.

    Rounds stop when no bit of t is left and the base is squared only while a higher bit
    remains (the skipped rounds would multiply by the series 1 and square a base no longer
    used): the same operations on the same values, so the same bits. A while loop has no
    reverse-mode derivative, so derivatives are those of the fixed 31 rounds.
    """
    # The loop's functions live at module level: an eager call then finds the loop JAX
    # compiled at an earlier call (functions defined here were new objects at every call).
    return jax.lax.while_loop(_bits_left, _power_round_skipping, (one, lf, t))[0]


def _bits_left(carry):
    return carry[2] > 0.0


def _square(b):
    return _log_series_mul(b, b)


def _unchanged(b):
    return b


def _power_round_skipping(carry):
    """One round of :func:`_series_power`: as :func:`_power_round`, squaring only while bits remain."""
    acc, base, rem = carry
    bit = jnp.mod(rem, 2.0) == 1.0
    acc = jnp.where(bit, _log_series_mul(acc, base), acc)
    rem = jnp.floor(rem / 2.0)
    base = jax.lax.cond(rem > 0.0, _square, _unchanged, base)
    return acc, base, rem


@_series_power.defjvp
def _series_power_jvp(primals, tangents):
    return jax.jvp(_series_power_fixed, primals, tangents)


def _remove_log_moment(alphas: np.ndarray, t, sigma):
    r"""log E_Q[(P/Q)^α] at the integer ``alphas`` (≤ REMOVE_EXACT_MAX), scalar t, σ: ``(len(alphas),)``.

    With Y = exp((2x − 1)/(2σ²)), E Y^k = e^{k(k−1)/(2σ²)}, and the multinomial theorem,
    E[(Σ_i Y_i)^α] = α! [x^α] f(x)^t with f(x) = Σ_k E[Y^k] x^k/k! (exponential generating
    functions multiply under independent sums). f^t is computed by binary powering of the
    series truncated at degree max(alphas), in log space (every term positive, nothing
    cancels); then E_Q[(P/Q)^α] = E[(ΣY_i)^α]/t^α.
    """
    kmax = int(max(alphas))
    k = np.arange(kmax + 1, dtype=np.float64)
    lf = k * (k - 1.0) * (0.5 / sigma**2) - gammaln(k + 1.0)
    one = jnp.where(k == 0, 0.0, -jnp.inf)  # the series 1

    acc = _series_power(lf, one, t)
    a = f64(alphas)
    return gammaln(a + 1.0) + take(acc, np.asarray(alphas, dtype=np.int64), axis=0) - a * jnp.log(t)


# =======================================================================================
# Add direction: the Laplace-transform quadrature (certified upper bound).
# =======================================================================================


def _r_upper(w):
    """An upper bound on R(w) = e^{-w} − 1 + w ≥ 0 (alternating series below 1e-2)."""
    small = w < 1e-2
    ws = jnp.where(small, w, 0.0)
    series = ws * ws * (0.5 - ws / 6.0 + ws * ws / 24.0)
    return jnp.where(small, series, jnp.expm1(-w) + w)


def _log_phi_upper(s, sigma):
    r"""An upper bound on log φ(s) at each ``s`` (1-D), φ(s) = E e^{-sY}, Y = exp(z/σ − 1/(2σ²)), z ~ N(0, 1).

    Two bounds, the smaller taken:

    * first order exact: φ(s) = 1 − s + E R(sY) (E Y = 1), with R(sY(z)) increasing in z
      bounded by its value at each z-cell's right end, and R(w) ≤ w beyond the grid
      (E[Y; z > c] = Φ̄(c − 1/σ));
    * direct: e^{-sY(z)} decreasing in z, bounded by its value at each cell's left end
      (1 below the grid).
    """
    frac = np.arange(_NZ + 1, dtype=np.float64) / _NZ
    z_hi = _Z_HI + 1.0 / sigma
    z = _Z_LO + (z_hi - _Z_LO) * frac  # (NZ + 1,)
    # Cell masses, each from the tail on its own side (relative accuracy in both tails).
    mass = jnp.where(z[:-1] >= 0, ndtr(-z[:-1]) - ndtr(-z[1:]), ndtr(z[1:]) - ndtr(z[:-1]))
    mass = jnp.maximum(mass, 0.0)
    sy = s[:, None] * jnp.exp(z / sigma - 0.5 / sigma**2)[None, :]  # (n, NZ + 1)
    left = 0.5 * math.erfc(-_Z_LO / math.sqrt(2.0))  # Φ(z_0)
    r_sum = jnp.sum(mass * _r_upper(sy[:, 1:]), axis=-1) + left * _r_upper(sy[:, 0])
    r_sum = r_sum * (1.0 + _SUM_REL) + s * ndtr(-(z_hi - 1.0 / sigma))
    x = -s + r_sum + _ABS * (1.0 + s)  # φ ≤ 1 + x
    log_r = jnp.where(x > -1.0, jnp.log1p(jnp.where(x > -1.0, x, 0.0)), jnp.inf)  # x ≤ −1 only by rounding
    d_sum = jnp.sum(mass * jnp.exp(-sy[:, :-1]), axis=-1) + left + ndtr(-z_hi) * jnp.exp(-sy[:, -1])
    log_d = jnp.log(d_sum * (1.0 + _SUM_REL) + 1e-300)
    return jnp.minimum(jnp.minimum(log_r, log_d), 0.0)


def _log_phi_upper_chunked(s, sigma):
    """:func:`_log_phi_upper` at each ``s`` (1-D), :data:`_PHI_CHUNK` values at a time."""
    pad = (-s.shape[0]) % _PHI_CHUNK
    blocks = jnp.concatenate([s, jnp.ones((pad,))]).reshape(-1, _PHI_CHUNK)
    return jax.lax.map(lambda b: _log_phi_upper(b, sigma), blocks).reshape(-1)[: s.shape[0]]


def _lsinhc(x):
    """log(sinh(x)/x), even in x, stable at 0."""
    ax = jnp.abs(x)
    small = ax < 1e-3
    axs = jnp.where(small, 1.0, ax)
    big = axs + jnp.log1p(-jnp.exp(-2.0 * axs)) - jnp.log(2.0 * axs)
    return jnp.where(small, x * x / 6.0, big)


def _add_log_moment(betas: np.ndarray, t, sigma):
    r"""An upper bound on log E[S^{-β}] at each β > 0 (scalar t, σ): shape ``(len(betas),)``.

    E[S^{-β}] = Γ(β)^{-1} ∫_0^∞ u^{β−1} φ(u/t)^t du (S^{-β} = Γ(β)^{-1}∫u^{β−1}e^{-uS}du,
    Fubini, independence). Write φ(u/t)^t = e^{-u} e^{L(u)}, L(u) = t log E e^{-(u/t)(Y−1)}:
    a cumulant generating function, convex in u, so L ≤ the chord through upper bounds
    of L at consecutive nodes. On each sub-cell the exponent (β−1) log u − λu + κ is
    concave (β ≥ 1: bounded by its tangent at the midpoint) or convex (β < 1: by its
    chord), and the exponential of a line integrates in closed form. [0, U_0]: φ ≤ 1.
    [U_1, ∞): e^{-w} ≤ (m/(e w))^m per factor with E Y^{-m} = e^{m(m+1)/(2σ²)}, p = mt,
    the best of a few p > β.
    """
    return _add_cells(np.asarray(betas, dtype=np.float64), *_add_chords(t, sigma), t, sigma)


def _sub_cells():
    """The static sub-cells of the u-integral: (log_nodes, ea, eb, w, mid), NF per chord."""
    log_nodes = np.linspace(_LOG_U0, _LOG_U1, _NC + 1)
    sub = np.linspace(0.0, 1.0, _NF + 1)
    log_edges = log_nodes[:-1, None] + np.diff(log_nodes)[:, None] * sub[None, :]  # (NC, NF + 1)
    ea, eb = np.exp(log_edges[:, :-1]), np.exp(log_edges[:, 1:])
    return log_nodes, ea, eb, eb - ea, 0.5 * (ea + eb)


def _add_chords(t, sigma):
    """The chords of the upper bound on L(u) (order-independent): ``(lam, kappa)``, each ``(NC, 1)``."""
    log_nodes = np.linspace(_LOG_U0, _LOG_U1, _NC + 1)
    nodes = np.exp(log_nodes)
    big_l = nodes + t * _log_phi_upper_chunked(nodes / t, sigma)  # upper bounds on L at the nodes
    return _chords(nodes, big_l)


def _chords(nodes, big_l):
    """``(lam, kappa)``, each ``(NC, 1)``: the chords of L through ``big_l`` at consecutive ``nodes``."""
    slope = (big_l[1:] - big_l[:-1]) / np.diff(nodes)
    lam = (1.0 - slope)[:, None]  # (NC, 1)
    kappa = (big_l[:-1] - slope * nodes[:-1])[:, None]
    return lam, kappa


def _add_chords_refined(t, sigma, u_max):
    """:func:`_add_chords` from the φ bound at 177 of the 385 u-nodes (ε's pruned path).

    L(u) = u + t log φ(u/t) is convex (a cumulant generating function), so the chord
    through upper bounds of L at any two nodes is an upper bound of L between them: the φ
    bound at a subset of the nodes gives certified chords at every node; each node not
    evaluated carries its chord's value plus a rounding margin (2e-15 u ≥ 4 ulps of the
    chord's end values, |L| ≤ u). Which nodes: every :data:`_REFINE_STRIDE`-th and the
    last, then the :data:`_REFINE_K` others below ``u_max`` with the largest estimated
    chord gap (the coarse chords' second differences at the interval's ends times
    x(1 − x) at the node's position x in the interval). The choice moves tightness only:
    on the configurations checked ε moved by ≤ 4e-12 relative (docs/batch_schemes.md).
    """
    n = _NC + 1
    nodes = np.exp(np.linspace(_LOG_U0, _LOG_U1, n))
    coarse = np.unique(np.r_[np.arange(0, n, _REFINE_STRIDE), n - 1])
    rest = np.setdiff1d(np.arange(n), coarse)
    seg = np.searchsorted(coarse, rest) - 1  # the coarse interval of each other node
    x = (nodes[rest] - nodes[coarse][seg]) / (nodes[coarse][seg + 1] - nodes[coarse][seg])
    big_l_c = nodes[coarse] + t * _log_phi_upper_chunked(f64(nodes[coarse]) / t, sigma)
    ua, um, ub = nodes[coarse][:-2], nodes[coarse][1:-1], nodes[coarse][2:]
    wa = (ub - um) / (ub - ua)
    gap = wa * big_l_c[:-2] + (1.0 - wa) * big_l_c[2:] - big_l_c[1:-1]  # ≈ the curvature at each inner node
    gap = jnp.concatenate([gap[:1], gap, gap[-1:]])
    est = jnp.where(nodes[rest] < u_max, jnp.maximum(gap[seg], gap[seg + 1]) * (x * (1.0 - x)), -jnp.inf)
    pick = jnp.sort(jax.lax.top_k(jax.lax.stop_gradient(est), _REFINE_K)[1])
    fine = jnp.asarray(rest, jnp.int32)[pick]
    big_l_f = f64(nodes)[fine] + t * _log_phi_upper_chunked(f64(nodes)[fine] / t, sigma)
    # All evaluated nodes in increasing order, then the chords' values at the others (the
    # evaluated values picked by selects, not gathers: see _select).
    idx = jnp.concatenate([jnp.asarray(coarse, jnp.int32), fine])
    order = jnp.argsort(idx)
    idx = idx[order]
    vals = _select(order, jnp.concatenate([big_l_c, big_l_f]))
    right = jnp.clip(jnp.searchsorted(idx, np.arange(n), side="right"), 1, idx.shape[0] - 1)
    l_lo, l_hi = _select(right - 1, vals), _select(right, vals)
    u_lo, u_hi = f64(nodes)[idx[right - 1]], f64(nodes)[idx[right]]
    filled = l_lo + ((nodes - u_lo) / (u_hi - u_lo)) * (l_hi - l_lo) + 2e-15 * nodes
    return _chords(nodes, jnp.where(idx[right - 1] == np.arange(n), l_lo, filled))


def _select(index, values):
    """``values[index]`` for traced integer ``index`` (1-D): a select and an exact sum per entry.

    Not a gather: JAX transposes a gather into a scatter-add onto zeros that, differentiated
    outside the float64 scope with x64 off, are float32 (see :func:`jaxdp._numerics.take`).
    """
    hit = index[:, None] == jnp.arange(values.shape[0])[None, :]
    return jnp.sum(jnp.where(hit, values[None, :], 0.0), axis=1)


def _head_tail_log(bv, parts_cells, t, sigma):
    """logsumexp of the cells, the head [0, U_0] and the best tail bound, minus log Γ(β)."""
    head = bv * _LOG_U0 - jnp.log(bv)  # ∫_0^{U_0} u^{β−1} du (φ ≤ 1)
    tails = []
    for mult in (1.0, 2.0, 4.0, 8.0):
        p = mult * (bv + 1.0)
        tails.append(p * (jnp.log(p) - 1.0 - _LOG_U1) + p * (p / t + 1.0) * (0.5 / sigma**2) + bv * _LOG_U1
                     - jnp.log(p - bv))
    tail = functools.reduce(jnp.minimum, tails)
    parts = jnp.concatenate([parts_cells, head[:, None], tail[:, None]], axis=-1)
    return jax.nn.logsumexp(parts, axis=-1) - gammaln(bv)


def _add_cells(betas: np.ndarray, lam, kappa, t, sigma):
    """:func:`_add_log_moment` at the static ``betas`` from the chords ``(lam, kappa)``."""
    _, ea, eb, w, mid = _sub_cells()
    # The orders are static: each is bounded by the one rule that applies to it (tangent or
    # chord), the other is not computed.
    concave = betas >= 1.0
    rows = []
    if np.any(~concave):
        # β < 1: the exponent is convex; its chord bounds it.
        b_ = f64(betas[~concave])[:, None, None]
        log_ga = (b_ - 1.0) * np.log(ea) - lam * ea + kappa
        log_gb = (b_ - 1.0) * np.log(eb) - lam * eb + kappa
        delta = log_ga - log_gb
        rows.append((np.log(w) + log_ga - 0.5 * delta + _lsinhc(0.5 * delta)).reshape(b_.shape[0], -1))
    if np.any(concave):
        # β ≥ 1: the exponent is concave; its tangent at the midpoint bounds it.
        b_ = f64(betas[concave])[:, None, None]
        d = (b_ - 1.0) / mid - lam
        tangent = (b_ - 1.0) * np.log(mid) - lam * mid + kappa + np.log(w) + _lsinhc(0.5 * d * w)
        rows.append(tangent.reshape(b_.shape[0], -1))
    order = np.argsort(np.concatenate([np.flatnonzero(~concave), np.flatnonzero(concave)]), kind="stable")
    cells = jnp.concatenate(rows, axis=0)
    cells = cells if np.array_equal(order, np.arange(len(betas))) else take(cells, order, axis=0)
    return _head_tail_log(f64(betas), cells, t, sigma)


def _add_cells_dynamic(b, lam, kappa, t, sigma):
    """:func:`_add_cells` at traced β values ``b`` (1-D): both cell rules computed, the one that applies kept."""
    _, ea, eb, w, mid = _sub_cells()
    b_ = b[:, None, None]
    log_ga = (b_ - 1.0) * np.log(ea) - lam * ea + kappa
    log_gb = (b_ - 1.0) * np.log(eb) - lam * eb + kappa
    delta = log_ga - log_gb
    chord = np.log(w) + log_ga - 0.5 * delta + _lsinhc(0.5 * delta)
    d = (b_ - 1.0) / mid - lam
    tangent = (b_ - 1.0) * np.log(mid) - lam * mid + kappa + np.log(w) + _lsinhc(0.5 * d * w)
    cells = jnp.where(b_ >= 1.0, tangent, chord).reshape(b.shape[0], -1)
    return _head_tail_log(b, cells, t, sigma)


# =======================================================================================
# The curve.
# =======================================================================================


_DIRECTIONS = ("both", "remove", "add")


@float64
def random_allocation_rdp(orders, steps_per_pass, noise_multiplier, *, selected: int = 1,
                          direction: str = "both") -> jax.Array:
    r"""Certified RDP of one epoch of random allocation (k of t steps per record), Gaussian steps.

    Add/remove-one neighbours; P the epoch's output with the record, Q without (module
    docstring). For k = 1 (balls-in-bins), ``direction="both"`` (the guarantee) is the
    larger of

    .. math::
        ε_{rem}(α) = \frac{1}{α-1}\log\Big(t^{-α}\,α!\,[x^α]\Big(\sum_{k≥0} \frac{e^{k(k-1)/(2σ^2)}}{k!}x^k\Big)^t\Big),
        \qquad ε_{add}(α) \le \min\Big\{\frac{α + t - 1}{2tσ^2},\ \frac{1}{α-1}\log \widehat{E}[S^{1-α}]\Big\},

    the first exact at integer α ≤ :data:`REMOVE_EXACT_MAX` (the multinomial expansion
    of E_Q[(P/Q)^α]), at ⌈α⌉ for fractional α and α/(2σ²) above; the second the AM–GM bound and a certified
    quadrature (see the module docstring). t = 1 gives the Gaussian α/(2σ²) exactly.

    For k > 1, with m = ⌊t/k⌋ and r = t − km, each direction is bounded by the composition
    of k − r epochs of 1 of m and r epochs of 1 of m + 1 steps,

    .. math:: ε^{(k,t)}_{dir}(α) \le (k - r)\,ε^{(1,m)}_{dir}(α) + r\,ε^{(1,m+1)}_{dir}(α),

    and the guarantee is the larger of the two directions (the reduction is stated and
    proved in docs/batch_schemes.md, "k of t").

    Args:
      orders: Rényi orders > 1, a concrete 1-D sequence (static).
      steps_per_pass: t ≥ k, integer (any shape, broadcast with ``noise_multiplier``).
      noise_multiplier: σ > 0 over the clipping norm (add/remove-one sensitivity).
      selected: k ≥ 1, the steps each record takes part in per epoch (a Python int; static).
      direction: ``"both"`` (default), ``"remove"`` (D_α(P‖Q)) or ``"add"`` (the bound on
        D_α(Q‖P)); static.

    Returns:
      float64 array ``batch + (k,)``; NaN under ``jit`` for invalid inputs.

    References:
      V. Feldman, M. Shenfeld, "Privacy amplification by random allocation", arXiv
      2502.08202 (the dominating pair; the multinomial form of the remove direction; k of t
      through 1 of ⌊t/k⌋ and ⌈t/k⌉); L. Chua et al., "Balls-and-bins sampling for DP-SGD",
      AISTATS 2025, arXiv 2412.16802; X. Lyu, "Composition theorems for interactive
      differential privacy", NeurIPS 2022 (concurrent composition of RDP).

    Examples:
      >>> import jaxdp
      >>> r = jaxdp.accounting.random_allocation_rdp([2.0, 8.0], 1, 2.0)  # t = 1: α/(2σ²)
      >>> [round(float(v), 12) for v in r]
      [0.25, 1.0]
      >>> r = jaxdp.accounting.random_allocation_rdp([2.0], 2, 1.0, direction="remove")
      >>> bool(abs(float(r[0]) - __import__("math").log((1 + __import__("math").e) / 2)) < 1e-10)  # exact + margin
      True
      >>> k2 = float(jaxdp.accounting.random_allocation_rdp([2.0], 100, 1.0, selected=2)[0])  # 2 of 100
      >>> k1 = float(jaxdp.accounting.random_allocation_rdp([2.0], 50, 1.0)[0])  # 1 of 50
      >>> abs(k2 - 2 * k1) < 1e-12  # twice 1 of 50
      True
    """
    orders_np = _validate.concrete_orders(orders)
    _validate.check_static_choice("direction", direction, _DIRECTIONS)
    _check_selected("selected", selected)
    _validate.check_integer("steps_per_pass", steps_per_pass, lo=1.0)
    _validate.check_not_above("selected", selected, "steps_per_pass", steps_per_pass)
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    _validate.check_broadcastable(steps_per_pass=steps_per_pass, noise_multiplier=noise_multiplier)
    return _alloc_rdp(orders_np, f64(steps_per_pass), f64(noise_multiplier), direction, int(selected))


def _alloc_dirs(orders_np, t, sigma, direction: str):
    """The curves of one (scalar) configuration, assumed valid: ``[remove, add]`` (or the one asked)."""
    orders = f64(orders_np)
    gauss = orders * (0.5 / sigma**2)
    out = []
    if direction in ("both", "remove"):
        ceil = np.maximum(np.ceil(orders_np), 2.0)
        exact = ceil <= REMOVE_EXACT_MAX
        rem = gauss
        if np.any(exact):
            ints = np.unique(ceil[exact]).astype(np.int64)
            eps_int = (_remove_log_moment(ints, t, sigma) + _TABLE_MARGIN) / f64(ints - 1.0)
            pos = np.searchsorted(ints, np.where(exact, ceil, ints[0]).astype(np.int64))
            per_order = jnp.stack([eps_int[p] for p in pos])
            rem = jnp.where(exact, jnp.minimum(per_order, gauss), gauss)
        out.append(jnp.where(t == 1, gauss, jnp.maximum(rem, 0.0)))
    if direction in ("both", "add"):
        betas = orders_np - 1.0
        amgm = 0.5 / sigma**2 + betas * (0.5 / (t * sigma**2))
        quad = _add_log_moment(betas, t, sigma) / f64(betas)
        quad = jnp.where(jnp.isnan(quad), jnp.inf, quad)
        out.append(jnp.maximum(jnp.minimum(amgm, quad), 0.0))
    return out


def _alloc_one(orders_np, t, sigma, direction: str):
    """The curve of one (scalar) configuration, assumed valid (k = 1)."""
    out = _alloc_dirs(orders_np, t, sigma, direction)
    return out[0] if len(out) == 1 else jnp.maximum(out[0], out[1])


@functools.lru_cache(maxsize=64)
def _map_body(orders_key: tuple, direction: str, both_directions: bool):
    """The lax.map body of :func:`_alloc_rdp`, one function object per orders grid and direction:
    eager calls then find the loop JAX compiled at the first one (a fresh lambda per call
    compiled it again). The same operations on the same values."""
    orders_np = np.asarray(orders_key, dtype=np.float64)
    if both_directions:
        return lambda ts: jnp.stack(_alloc_dirs(orders_np, ts[0], ts[1], direction))
    return lambda ts: _alloc_one(orders_np, ts[0], ts[1], direction)


def _alloc_rdp(orders_np, t, sigma, direction: str = "both", selected: int = 1):
    shape = jnp.broadcast_shapes(jnp.shape(t), jnp.shape(sigma))
    tf = jnp.broadcast_to(t, shape).reshape(-1)
    sf = jnp.broadcast_to(sigma, shape).reshape(-1)
    valid = (tf >= selected) & (tf == jnp.floor(tf)) & jnp.isfinite(tf) & (sf > 0) & jnp.isfinite(sf)
    t_s = jnp.where(valid, tf, float(selected))
    s_s = jnp.where(valid, sf, 1.0)
    if selected == 1:
        # One configuration at a time (a few MB of work arrays each), a few in parallel.
        curve = jax.lax.map(_map_body(tuple(orders_np.tolist()), direction, False), jnp.stack([t_s, s_s], axis=1),
                            batch_size=_MAP_BATCH)
    else:
        # k of t: k − r epochs of 1 of m and r of 1 of m + 1 steps, per direction (m = ⌊t/k⌋,
        # exact in float64 for t < 2^31; docs/batch_schemes.md, "k of t").
        m = jnp.floor(t_s / selected)
        r = t_s - selected * m
        n = t_s.shape[0]
        both = jax.lax.map(_map_body(tuple(orders_np.tolist()), direction, True),
                           jnp.stack([jnp.concatenate([m, m + 1.0]), jnp.concatenate([s_s, s_s])], axis=1),
                           batch_size=_MAP_BATCH)  # (2n, directions, orders)
        lo_w = (selected - r)[:, None, None]
        hi_w = r[:, None, None]
        dirs = lo_w * both[:n] + jnp.where(hi_w > 0, hi_w * both[n:], 0.0)
        curve = jnp.max(dirs, axis=1)
    curve = jnp.where(valid[:, None], curve, jnp.nan)
    return curve.reshape(shape + (len(orders_np),))


# =======================================================================================
# What the RDP accountant calls.
# =======================================================================================


def check_support(event, path: str) -> None:
    """Raise ``ValueError`` unless the inner event is the add/remove-one Gaussian the analysis covers."""
    inner = event.event
    if not isinstance(inner, Gaussian):
        raise ValueError(f"{path}: the RDP accountant supports RandomAllocation only of a Gaussian event; got "
                         f"RandomAllocation({type(inner).__name__}).")
    if inner.relation != "add_remove":
        raise ValueError(f"{path}: the RandomAllocation analysis covers relation 'add_remove' only; got relation "
                         f"{inner.relation!r}.")


def rdp_curve(event, orders: np.ndarray):
    """The RDP curve of one :class:`RandomAllocation` epoch (both directions)."""
    return _alloc_rdp(orders, f64(event.steps_per_pass), f64(event.event.noise_multiplier), "both", event.selected)


# =======================================================================================
# ε: the add direction's quadrature at the orders that can win only.
# =======================================================================================

# ε = min over the orders of the conversion of the composed curve. Any subset of the orders
# gives a certified ε (a minimum over fewer orders is never smaller). The quadrature of the
# add direction (the costly part after the order-free φ bound) runs at every
# _PRUNE_STRIDE-th order (and the last), then at the _PRUNE_K other orders with the
# smallest lower estimate of their ε: the exact remove direction (cheap, every order) and
# the add direction at the coarse order below (the true D_α is non-decreasing in α).
# 27 + 12 of dp_accounting's 156 orders. On 218 configurations checked (docs/batch_schemes.md,
# session 14) the minimising order was always among them; ε then equals the full-list
# value up to rounding of the same formula in another compiled program (≤ 3e-14 relative,
# both ways, as jit against eager) and, since session 15, the refined chords (≤ 3e-9 above).
_PRUNE_STRIDE = 6
_PRUNE_K = 12
_PRUNE_MIN_ORDERS = 48  # fewer orders: all of them are evaluated
# ε's chords (_add_chords_refined): the φ bound at every _REFINE_STRIDE-th u-node and the
# last (49), and at the _REFINE_K others of largest estimated chord gap: 177 of 385 nodes.
_REFINE_STRIDE = 8
_REFINE_K = 128


def _coarse_index(n: int) -> np.ndarray:
    return np.unique(np.concatenate([np.arange(0, n, _PRUNE_STRIDE), [n - 1]]))


def _pruned_one(orders_np, t, sigma, n, delta):
    """One epoch's curve (k = 1, both directions) with the quadrature at the coarse orders and
    at the :data:`_PRUNE_K` others of smallest lower estimate of ε, +inf at the rest."""
    orders = f64(orders_np)
    betas = orders - 1.0
    rem = _alloc_dirs(orders_np, t, sigma, "remove")[0]
    amgm = 0.5 / sigma**2 + betas * (0.5 / (t * sigma**2))
    lam, kappa = _add_chords_refined(t, sigma, 10.0 * float(np.max(orders_np)))

    def add_at(idx, amgm_at):
        quad = _add_cells_dynamic(betas[idx], lam, kappa, t, sigma) / betas[idx]
        quad = jnp.where(jnp.isnan(quad), jnp.inf, quad)
        return jnp.maximum(jnp.minimum(amgm_at, quad), 0.0)

    coarse = _coarse_index(len(orders_np))
    add_c = add_at(jnp.asarray(coarse), take(amgm, coarse))
    eps_c = improved_per_order(n * jnp.maximum(take(rem, coarse), add_c), orders[coarse], delta)
    eps_c = jax.lax.stop_gradient(jnp.where(jnp.isnan(eps_c), jnp.inf, eps_c))
    # Lower estimate of the curve at the other orders: the exact remove direction and the add
    # direction at the coarse order just below (D_α is non-decreasing in α).
    below = np.searchsorted(coarse, np.arange(len(orders_np)), side="right") - 1
    lower = jnp.maximum(rem, take(add_c, below))
    eps_low = improved_per_order(n * lower, orders, delta)
    is_coarse = np.isin(np.arange(len(orders_np)), coarse)
    eps_low = jnp.where(is_coarse, jnp.inf, jnp.where(jnp.isnan(eps_low), -jnp.inf, eps_low))
    pick = jax.lax.top_k(-jax.lax.stop_gradient(eps_low), _PRUNE_K)[1]
    # The curve: add_c at the coarse orders, the picked orders' values, +inf elsewhere (by
    # selects: differentiable with x64 off, see _select).
    at_coarse = np.minimum(np.searchsorted(coarse, np.arange(len(orders_np))), len(coarse) - 1)
    add = jnp.where(is_coarse, take(add_c, at_coarse), jnp.inf)
    hit = pick[None, :] == jnp.arange(len(orders_np))[:, None]
    add_p = add_at(pick, _select(pick, amgm))
    add = jnp.where(jnp.any(hit, axis=1), jnp.sum(jnp.where(hit, add_p[None, :], 0.0), axis=1), add)
    return jnp.maximum(rem, add)


def pruned_curve(event, orders: np.ndarray, target_delta):
    """The composed curve of ``[SelfComposed of] RandomAllocation(k = 1)`` for ε, or ``None`` if not that event.

    The add direction's quadrature is evaluated at the orders that can give the minimum
    only (see :data:`_PRUNE_K`), +inf at the others: its ε (the min over the orders) is a
    min over fewer orders, never below the full-list ε but for rounding; its chords come
    from the φ bound at 177 of the 385 u-nodes (:func:`_add_chords_refined`), so it is the
    full-list value up to a few 1e-9 relative above when the minimiser is evaluated.
    k > 1 and short order lists: ``None`` (the full curve).
    """
    count = 1.0
    if isinstance(event, SelfComposed):
        count, event = event.count, event.event
    if not isinstance(event, RandomAllocation) or event.selected != 1 or len(orders) < _PRUNE_MIN_ORDERS:
        return None
    check_support(event, "event")
    t, sigma, c, d = (f64(x) for x in (event.steps_per_pass, event.event.noise_multiplier, count, target_delta))
    shape = jnp.broadcast_shapes(t.shape, sigma.shape, c.shape, d.shape)
    tf, sf, cf, df = (jnp.broadcast_to(x, shape).reshape(-1) for x in (t, sigma, c, d))
    valid = (tf >= 1) & (tf == jnp.floor(tf)) & jnp.isfinite(tf) & (sf > 0) & jnp.isfinite(sf)
    n = jnp.ceil(jnp.where(cf >= 0, cf, 0.0))
    ok_d = (df >= 2.2250738585072014e-308) & (df < 1)
    rows = jnp.stack([jnp.where(valid, tf, 1.0), jnp.where(valid, sf, 1.0), n, jnp.where(ok_d, df, 0.5)], axis=1)
    curve = jax.lax.map(lambda r: _pruned_one(orders, r[0], r[1], r[2], r[3]), rows, batch_size=_MAP_BATCH)
    curve = jnp.where(valid[:, None], curve, jnp.nan)
    # As the RDP accountant composes (count = 0: nothing, even where the curve is +inf).
    out = jnp.where(n[:, None] > 0, n[:, None] * curve, 0.0)
    out = jnp.where((cf >= 0)[:, None], out, jnp.nan)
    return out.reshape(shape + (len(orders),))
