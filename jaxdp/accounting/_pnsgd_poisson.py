r"""Hidden-state Rényi DP of projected noisy SGD with Poisson batches (ε flat in the steps).

The run (only :math:`Y_T` released):

.. math::

    Y_{t+1} = \Pi_K\Big(Y_t - η\Big(\frac1b \sum_{x∈B_t} ∇ℓ(Y_t, x) + Z_t\Big)\Big),
    \qquad Z_t \sim N(0, σ^2 I),

with :math:`B_t` a Poisson sample (each record independently with probability q; cut to
a uniformly random ``max_batch_size`` = B records when more are drawn), a fixed public
denominator b, :math:`K` convex of diameter D, every :math:`ℓ(\cdot, x)` convex,
L-Lipschitz and β-smooth on K, and :math:`ηβB/b ≤ 2` (so the batch step is a contraction
for every batch that can occur; B = n + 1 when batches are not cut, as a neighbour may hold
n + 1 records). Neighbours: **add or remove one record** (the relation
of Poisson sampling; one record's term moves the step by at most :math:`h = ηL/b`).

Bound (derived in ``docs/hidden_state_poisson.md``, every lemma with its source): split
the parameter noise :math:`s = ησ` as :math:`s_1^2 = (1-θ)s^2`, :math:`s_2^2 = θ s^2`.
For each order α > 1,

.. math::

    ε_α(T) ≤ \min\Big( T\,S_α(σb/L),\;
        \min_{θ ∈ Θ}\,\min_{1 ≤ τ < T}\Big[τ\,S_α\big(σb\sqrt{1-θ}/L\big)
        + \frac{α D^2}{2 θ η^2 σ^2 τ}\Big]\Big),

where :math:`S_α(ν)` is the RDP of one Poisson-sampled (or truncated-Poisson) Gaussian
step at rate q with noise multiplier ν (:func:`sampled_gaussian_rdp`,
:func:`truncated_poisson_rdp`). The first term is plain composition (τ = T); the second
starts the coupling τ steps before the end, where any two iterates are within D, and
spends that shift evenly over the last τ steps. It does not depend on T once T exceeds
the best τ (the burn-in).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._numerics import f64, float64, min_and_first
from ._conversion import rdp_to_epsilon
from ._rdp import DEFAULT_ORDERS, _sgm_rdp, _plan
from ._pnsgd_shuffle import event_epsilon as shuffle_epsilon
from ._sampling_truncated import _tp_rdp

__all__ = ["poisson_pnsgd_rdp", "poisson_pnsgd_epsilon", "POISSON_PNSGD_SPLITS"]

# Fractions θ of the noise variance kept for the shift (W₂); θ = 0 (composition) is added
# separately. Any θ in (0, 1) gives a valid bound; the grid only affects tightness.
POISSON_PNSGD_SPLITS = tuple(float(x) for x in np.concatenate([np.geomspace(1e-3, 0.04, 10),
                                                               np.linspace(0.06, 0.96, 22)]))


def _largest_batch(num_records: int, max_batch_size: int | None) -> int:
    """B of the contraction condition ηβB/b ≤ 2: the largest batch either neighbour can draw.

    Under add/remove a neighbour may hold n + 1 records, so an uncut Poisson batch has up to n + 1.
    """
    return num_records + 1 if max_batch_size is None else min(max_batch_size, num_records + 1)


def _step_rdp(orders_np, q, nu, num_records, max_batch_size):
    """S_α(ν): one Poisson (truncated when B ≤ n) sampled Gaussian step, shape ν.shape + (k,)."""
    if max_batch_size is None or max_batch_size > num_records:
        plan = _plan(tuple(orders_np.tolist()))
        q_b, nu_b = jnp.broadcast_arrays(q, nu)
        return _sgm_rdp(plan, orders_np, q_b, nu_b)
    return _tp_rdp(orders_np, q, f64(float(num_records)), f64(float(max_batch_size)), nu)


def _min_over_splits(cost, tau):
    """(min over θ of the cost, the smallest τ among the θ attaining it), robust to XLA's rounding.

    The value is the plain min, with the first attaining θ's derivative; a cost within 8 ulps
    of the min counts as attaining it (:func:`jaxdp._numerics.min_and_first`: XLA may
    recompute the costs with other rounding for the comparison, and an exact pick then left
    τ = +inf). τ is the smallest τ among those θ (its cost is the min to 8 ulps).
    """
    best, near, _ = min_and_first(cost, axis=-2)
    return best, jnp.min(jnp.where(near, tau, jnp.inf), axis=-2)


def _core(orders_np, splits_np, q, lip, beta, eta, sig, dia, b, steps, num_records, max_batch_size):
    """The bound for broadcast scalars (any shape P): RDP of shape P + (k,), and the best τ."""
    shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in (q, lip, beta, eta, sig, dia, b, steps)))
    q, lip, beta, eta, sig, dia, b, steps = (jnp.broadcast_to(x, shape) for x in (q, lip, beta, eta, sig, dia, b,
                                                                                 steps))
    bmax = float(_largest_batch(num_records, max_batch_size))
    valid = ((q >= 0) & (q <= 1) & (lip >= 0) & jnp.isfinite(lip) & (beta >= 0) & jnp.isfinite(beta) & (eta > 0)
             & jnp.isfinite(eta) & (eta * beta * bmax <= 2.0 * b) & (sig > 0) & jnp.isfinite(sig) & (dia > 0)
             & jnp.isfinite(dia) & (b > 0) & jnp.isfinite(b) & _validate.is_int(steps))
    zero = valid & (lip == 0)
    ok = valid & ~zero
    q_s = jnp.where(ok, q, 0.5)
    lip_s, eta_s, sig_s = (jnp.where(ok, x, 1.0) for x in (lip, eta, sig))
    dia_s, b_s, t_s = (jnp.where(ok, x, 1.0) for x in (dia, b, steps))
    nu = sig_s * b_s / lip_s  # noise over one record's move ηL/b: (ησ)/(ηL/b)
    alpha = jnp.asarray(orders_np)
    s_full = _step_rdp(orders_np, q_s[..., None], nu[..., None], num_records, max_batch_size)[..., 0, :]
    comp = t_s[..., None] * s_full
    theta = jnp.asarray(splits_np)
    s_th = _step_rdp(orders_np, q_s[..., None], nu[..., None] * jnp.sqrt(1.0 - theta), num_records,
                     max_batch_size)  # P + (J, k)
    # Shift cost c/τ with c = αD²/(2θη²σ²): the best real τ is √(c/S); the cost is convex in
    # τ, so the best integer τ in [1, T-1] is the floor or the ceiling, clipped.
    c = alpha * (dia_s / (eta_s * sig_s))[..., None, None] ** 2 / (2.0 * theta[:, None])
    pos_s = s_th > 0
    tau_real = jnp.where(pos_s, jnp.sqrt(c / jnp.where(pos_s, s_th, 1.0)), jnp.inf)
    hi = jnp.maximum(t_s - 1.0, 1.0)[..., None, None]
    cands = jnp.stack([jnp.clip(jnp.floor(tau_real), 1.0, hi), jnp.clip(jnp.ceil(tau_real), 1.0, hi)])
    # Min-reductions, not argmin: argmin's variadic reduce fails inside the float64 scope's
    # staged rules (see _conversion.py).
    cost2 = cands * s_th + c / cands  # (2,) + P + (J, k)
    cost = jnp.minimum(cost2[0], cost2[1])
    tau = jnp.where(cost2[0] <= cost2[1], cands[0], cands[1])
    cost = jnp.where((t_s > 1)[..., None, None], cost, jnp.inf)  # τ < T needs T ≥ 2
    shifted, tau_best = _min_over_splits(cost, tau)
    rdp = jnp.minimum(comp, shifted)
    tau_best = jnp.where(shifted < comp, tau_best, t_s[..., None])
    rdp = jnp.where(zero[..., None], 0.0, rdp)
    rdp = jnp.where(valid[..., None], rdp, jnp.nan)
    return rdp, jnp.where(valid[..., None], tau_best, jnp.nan)


@functools.partial(jax.jit, static_argnums=(0, 1, 10, 11))
def _core_jit(orders_key, splits_key, q, lip, beta, eta, sig, dia, b, steps, num_records, max_batch_size):
    return _core(np.asarray(orders_key), np.asarray(splits_key), q, lip, beta, eta, sig, dia, b, steps, num_records,
                 max_batch_size)


def _check(q, lipschitz, smoothness, learning_rate, noise_std, diameter, batch_size, num_steps, num_records,
           max_batch_size):
    if isinstance(num_records, bool) or not isinstance(num_records, (int, np.integer)) or num_records < 1:
        raise ValueError(f"num_records must be a Python int >= 1 (it is static); got {num_records!r}.")
    if max_batch_size is not None and (isinstance(max_batch_size, bool)
                                       or not isinstance(max_batch_size, (int, np.integer)) or max_batch_size < 1):
        raise ValueError(f"max_batch_size must be None or a Python int >= 1 (it is static); got {max_batch_size!r}.")
    _validate.check_in_range("q", q, 0.0, 1.0)
    _validate.check_in_range("lipschitz", lipschitz, 0.0, math.inf)
    _validate.check_in_range("smoothness", smoothness, 0.0, math.inf)
    _validate.check_in_range("learning_rate", learning_rate, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("noise_std", noise_std, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("diameter", diameter, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("batch_size", batch_size, 0.0, math.inf, lo_open=True)
    _validate.check_integer("num_steps", num_steps)
    bmax = _largest_batch(num_records, max_batch_size)
    if all(_validate.is_concrete(x) for x in (learning_rate, smoothness, batch_size)):
        lhs = np.asarray(learning_rate, np.float64) * np.asarray(smoothness, np.float64) * bmax
        if np.any(lhs > 2.0 * np.asarray(batch_size, np.float64)):
            raise ValueError(
                f"learning_rate must be at most 2*batch_size/(smoothness*{bmax}) (the largest batch, "
                f"max_batch_size or num_records + 1, must give a contractive step: eta*beta*B/b <= 2); got "
                f"learning_rate={learning_rate!r}, smoothness={smoothness!r}, batch_size={batch_size!r}.")


@float64
def poisson_pnsgd_rdp(orders, q, lipschitz, smoothness, learning_rate, noise_std, diameter, batch_size,
                      num_steps, *, num_records: int, max_batch_size: int | None = None,
                      splits=POISSON_PNSGD_SPLITS, return_burn_in: bool = False):
    r"""Rényi DP of the last iterate of projected noisy SGD with Poisson batches (hidden state).

    For every order α > 1 (see the module docstring for the run and
    ``docs/hidden_state_poisson.md`` for the derivation):

    .. math::

        ε_α(T) = \min\Big(T S_α(ν),\ \min_{θ∈Θ,\,1≤τ<T}\Big[τ S_α(ν\sqrt{1-θ})
            + \frac{αD^2}{2θη^2σ^2τ}\Big]\Big),\qquad ν = \frac{σ b}{L},

    :math:`S_α` the RDP of one Poisson-sampled Gaussian step at rate q
    (:func:`sampled_gaussian_rdp`; :func:`truncated_poisson_rdp` when
    ``max_batch_size`` < n). It is flat in T once :math:`T > τ^*` (the returned burn-in).
    τ = T is plain composition, exactly DP-SGD's RDP with noise multiplier ν.

    Per record: pass an array of per-record Lipschitz bounds :math:`L_i` (the record's
    term moves the step by at most :math:`ηL_i/b`; the contraction still needs every
    record's loss β-smooth). With one L it is the worst record's bound.

    Assumptions (not checked by the library): for every record x, :math:`ℓ(\cdot, x)` is
    convex, L-Lipschitz and β-smooth on a compact convex K of diameter D; the start is
    data-independent; the noise is fresh, independent, isotropic Gaussian; the batch
    is secret; only :math:`Y_T` is released; add/remove-one neighbours. Checked:
    :math:`ηβB/b ≤ 2` with B = ``max_batch_size`` (or n + 1, the neighbour's size), which makes every batch's step
    :math:`y ↦ y - \frac{η}{b}\sum_{x∈B}∇ℓ(y, x)` 1-Lipschitz.

    Args:
      orders: Rényi orders α > 1 (static, concrete).
      q: q in [0, 1].
      lipschitz: L ≥ 0 (any shape: per record).
      smoothness: β ≥ 0 (0 for linear losses).
      learning_rate: η > 0 with ηβB/b ≤ 2.
      noise_std: σ > 0, the std of the noise on the averaged gradient (parameter noise ησ).
      diameter: D > 0 of K.
      batch_size: b > 0, the fixed denominator (typically the expected batch size qn).
      num_steps: T ≥ 1 (integer).
      num_records: n (static), for the truncation and the contraction check.
      max_batch_size: B (static) or None (no truncation: B = n).
      splits: the grid Θ of variance fractions θ in (0, 1) (static).
      return_burn_in: also return the best τ per order (T where composition is best).

    Returns:
      float64 array ``broadcast shape + (k,)``; with ``return_burn_in`` a pair. NaN under
      ``jit`` for invalid inputs (eagerly: ``ValueError`` naming the parameter).

    References:
      Feldman, Mironov, Talwar, Thakurta (arXiv:1808.06651), Lemmas 20-21, Theorem 22;
      Altschuler & Talwar (NeurIPS 2022, arXiv:2205.13710), the approach (shifted Rényi
      divergence plus the sampled Gaussian; their constants are not quoted here);
      Mironov, Talwar, Zhang (arXiv:1908.10530) for :math:`S_α`.

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> r = [A.poisson_pnsgd_rdp([8.0], 0.01, 1.0, 0.0, 0.5, 1.0, 1.0, 10.0, t, num_records=1000)[0]
      ...      for t in (10, 10_000, 1_000_000)]
      >>> bool(r[1] < 10_000 * A.sampled_gaussian_rdp([8.0], 0.01, 10.0)[0]), bool(r[1] == r[2])
      (True, True)
    """
    orders_np = _validate.concrete_orders(orders)
    splits_np = np.asarray(splits, np.float64).reshape(-1)
    if splits_np.size == 0 or np.any(~((splits_np > 0) & (splits_np < 1))):
        raise ValueError(f"splits must be a non-empty sequence of fractions in (0, 1); got {splits!r}.")
    _check(q, lipschitz, smoothness, learning_rate, noise_std, diameter, batch_size, num_steps,
           num_records, max_batch_size)
    rdp, tau = _core_jit(tuple(orders_np.tolist()), tuple(splits_np.tolist()), f64(q), f64(lipschitz),
                         f64(smoothness), f64(learning_rate), f64(noise_std), f64(diameter), f64(batch_size),
                         f64(num_steps), int(num_records), None if max_batch_size is None else int(max_batch_size))
    return (rdp, tau) if return_burn_in else rdp


@float64
def poisson_pnsgd_epsilon(delta, q, lipschitz, smoothness, learning_rate, noise_std, diameter,
                          batch_size, num_steps, *, num_records: int, max_batch_size: int | None = None,
                          orders=DEFAULT_ORDERS, splits=POISSON_PNSGD_SPLITS):
    r"""ε at δ of :func:`poisson_pnsgd_rdp` (the improved conversion, :func:`rdp_to_epsilon`).

    Args:
      delta: δ in (0, 1); the other arguments as :func:`poisson_pnsgd_rdp`.

    Returns:
      float64 ε of the broadcast shape (per record when ``lipschitz`` is per record).

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> e = A.poisson_pnsgd_epsilon(1e-5, 0.01, 1.0, 1.0, 0.5, 1.0, 1.0, 10.0, 100_000, num_records=1000,
      ...                             max_batch_size=20)
      >>> c = A.dpsgd_epsilon(0.01, 10.0, 100_000, 1e-5)
      >>> bool(e < c)
      True
    """
    _validate.check_delta(delta)
    rdp = poisson_pnsgd_rdp(orders, q, lipschitz, smoothness, learning_rate, noise_std, diameter,
                            batch_size, num_steps, num_records=num_records, max_batch_size=max_batch_size,
                            splits=splits)
    return rdp_to_epsilon(rdp, _validate.concrete_orders(orders), delta).epsilon


@float64
def _composition_rdp(orders_np, q, lip, sig, b, steps, num_records, max_batch_size):
    """T·S_α(σb/L): every iterate released (no convexity or contraction needed)."""
    q, lip, sig, b, steps = (f64(x) for x in (q, lip, sig, b, steps))
    valid = ((q >= 0) & (q <= 1) & (lip >= 0) & jnp.isfinite(lip) & (sig > 0) & jnp.isfinite(sig) & (b > 0)
             & _validate.is_int(steps))
    ok = valid & (lip > 0)
    nu = jnp.where(ok, sig * b / jnp.where(ok, lip, 1.0), 1.0)
    s = _step_rdp(orders_np, jnp.where(ok, q, 0.5), nu, num_records, max_batch_size)
    out = jnp.where(ok[..., None], steps[..., None] * s, 0.0)
    return jnp.where(valid[..., None], out, jnp.nan)


def event_rdp(ev, orders_np):
    """The RDP curve of a :class:`PNSGD` event with ``sampling="poisson"`` (every record alike)."""
    if ev.hidden:
        return poisson_pnsgd_rdp(orders_np, ev.q, ev.lipschitz, ev.smoothness, ev.learning_rate, ev.noise_std,
                                 ev.diameter, float(ev.batch_size), ev.num_steps, num_records=ev.num_records,
                                 max_batch_size=ev.max_batch_size)
    return _composition_rdp(orders_np, ev.q, ev.lipschitz, ev.noise_std, float(ev.batch_size), ev.num_steps,
                            ev.num_records, ev.max_batch_size)



_CAL_OCTAVES = 40.0  # the bracket: 2^±40 around σ = L/b (one record's move equals the noise)
_CAL_POINTS = 64
_CAL_ROUNDS = 4


def calibrate_event(epsilon, delta, ev, orders_np, analysis: str):
    r"""Smallest σ meeting (ε, δ) for a :class:`PNSGD` event with ``sampling="poisson"`` or ``"shuffle"`` (eager).

    ε(σ) decreases in σ (S_α falls with its noise multiplier, the shift cost with σ²), so the
    certified set is :math:`[σ^*, ∞)`. Four rounds of 64 geometric points narrow the bracket
    :math:`2^{±40} L/b` to a ratio of about 1 + 4e-6; the returned σ is a point where ε was
    evaluated and found ≤ the target (never above it). +inf when no σ in the bracket works.
    Values only: the search runs eagerly (a traced input raises ``ValueError``).
    ``analysis``: ``"best"`` (the hidden-state bound, which includes composition) or
    ``"composition"``.
    """
    if not all(_validate.is_concrete(x) for x in (epsilon, delta, ev.lipschitz, ev.smoothness, ev.learning_rate,
                                                   ev.diameter)):
        raise ValueError(f"calibrate_pnsgd_noise_std with sampling={ev.sampling!r} runs eagerly: epsilon, delta and "
                         "the event's leaves must be concrete (not traced by jit, vmap or grad).")
    _validate.check_in_range("epsilon", epsilon, 0.0, math.inf, lo_open=True)
    _validate.check_delta(delta)
    for name in ("lipschitz", "smoothness", "learning_rate", "diameter"):
        if np.ndim(getattr(ev, name)) != 0:
            raise ValueError(f"PNSGD.{name} must be a scalar to calibrate (got shape {np.shape(getattr(ev, name))}).")
    lip, b = float(ev.lipschitz), float(ev.batch_size)
    if lip == 0.0:
        return jnp.asarray(0.0, jnp.float64)
    n, cap = ev.num_records, ev.max_batch_size
    hidden = ev.hidden and analysis == "best"

    def eps(sig):
        if ev.sampling == "shuffle":  # the shuffled-batch bound (_pnsgd_shuffle.py), on the same grids
            return np.asarray(shuffle_epsilon(dataclasses.replace(ev, noise_std=f64(sig), hidden=hidden), delta,
                                              orders_np))
        if hidden:
            return np.asarray(poisson_pnsgd_epsilon(delta, ev.q, lip, ev.smoothness, ev.learning_rate, sig,
                                                    ev.diameter, b, ev.num_steps, num_records=n, max_batch_size=cap,
                                                    orders=orders_np))
        rdp = _composition_rdp(orders_np, ev.q, lip, f64(sig), b, ev.num_steps, n, cap)
        return np.asarray(rdp_to_epsilon(rdp, orders_np, delta).epsilon)

    lo, hi = math.log(lip / b) - _CAL_OCTAVES * math.log(2.0), math.log(lip / b) + _CAL_OCTAVES * math.log(2.0)
    best = math.inf
    for _ in range(_CAL_ROUNDS):
        grid = np.exp(np.linspace(lo, hi, _CAL_POINTS))
        ok = eps(grid) <= float(epsilon)
        if not ok.any():
            break
        k = int(np.argmax(ok))  # ε decreases in σ: the first accepted point
        best = min(best, float(grid[k]))
        if k == 0:
            break
        lo, hi = math.log(grid[k - 1]), math.log(grid[k])
    return jnp.asarray(best, jnp.float64)
