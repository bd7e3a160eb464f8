r"""Hidden-state Rényi DP of projected noisy SGD with shuffled batches (a fresh secret permutation every pass).

The run (only :math:`Y_T` released, :math:`T = km`):

.. math::

    Y_{t+1} = \Pi_K\Big(Y_t - η\Big(\frac1{b_t} \sum_{x∈B_t} ∇ℓ(Y_t, x) + Z_t\Big)\Big),
    \qquad Z_t \sim N(0, σ^2 I),

where every pass draws a secret, uniformly random permutation of the n records, independent
of everything else, and cuts it into :math:`m = \lceil n/b\rceil` consecutive batches
(:math:`b_j = b`, the last :math:`n - (m-1)b`); K is convex of diameter D; every
:math:`ℓ(\cdot, x)` is convex, L-Lipschitz and β-smooth on K, and ηβ ≤ 2. Neighbours:
**replace one record**.

Bound (derived in ``docs/hidden_state_poisson.md`` §8, every lemma with its source). Couple
the two runs' permutations so that the differing record has the same position; given the
permutations the run is a fixed-order run, and :math:`(P, Q) ↦ e^{(α-1)D_α(P\|Q)}` is jointly
convex, so with :math:`w_j = b_j/n` the probability that the record is in batch j of the
last pass,

.. math::

    ε_α ≤ \frac1{α-1}\log\sum_{j=1}^m w_j\,\exp\Big((α-1)\frac{α A_j}{2σ^2}\Big),

with :math:`A_j` the least shift energy (in units of the gradient, :math:`Δ_j = 2L/b_j`,
:math:`d = D/η`, :math:`r = m - j` later steps) of Feldman et al.'s Theorem 22 for a record
in batch j of the last pass:

* one pass (k = 1), from the common start: :math:`Δ_j^2/(r+1)` (Theorem 23);
* any k, r ≥ 1, coupling started after the record's step at distance D: :math:`d^2/r`;
* any k, coupling started at distance D at the last pass's start: :math:`(d+Δ_j)^2/m` when
  :math:`(j-1)(d+Δ_j) ≤ dm`, and :math:`d^2/(j-1) + Δ_j^2/(r+1)` when j ≥ 2;
* any k: :math:`kΔ_{\max}^2` (the record's k steps composed; :math:`Δ_{\max} = 2L/b_{\min}`).

The result is also capped by composition (every iterate released):
:math:`k\cdot\frac1{α-1}\log\sum_j w_j e^{(α-1)αΔ_j^2/(2σ^2)}`. For k ≥ 2 the shifted terms do
not depend on k, so the bound is flat in the number of passes once they beat composition.

:func:`shuffle_pnsgd_epsilon` also mixes the same schedules as hockey-stick divergences: the
record in batch j is :math:`\sqrt{A_j}/σ`-GDP (shifted interpolation, Bok, Su & Altschuler), and
:math:`δ(ε) ≤ \sum_j w_j θ_{e^ε}(\sqrt{A_j}/σ)`; it returns the smaller ε.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp

from .. import _validate
from .._numerics import f64, float64
from ._contraction_common import _eps_bracket, _solve_eps
from ._conversion import rdp_to_delta, rdp_to_epsilon
from ._hockey_stick import _log_theta_and_complement
from ._rdp import DEFAULT_ORDERS

__all__ = ["shuffle_pnsgd_rdp", "shuffle_pnsgd_epsilon"]


def _geometry(num_records: int, batch_size: int):
    """(m, b_j for j = 1..m, w_j = b_j/n) of one pass cut into consecutive batches (NumPy, static)."""
    m = -(-num_records // batch_size)
    sizes = np.full(m, float(batch_size))
    sizes[-1] = num_records - (m - 1) * batch_size
    return m, sizes, sizes / num_records


def _energies(m, sizes, passes, lip, dia_over_eta):
    """A_j of the module docstring (shape P + (m,)) for broadcast scalars ``lip``, ``dia_over_eta`` (shape P)."""
    j = jnp.arange(1, m + 1, dtype=jnp.float64)
    later = m - j  # r
    delta = 2.0 * lip[..., None] / jnp.asarray(sizes)  # Δ_j
    d = dia_over_eta[..., None]
    inf = jnp.inf
    cap = passes * (2.0 * lip[..., None] / float(sizes.min())) ** 2
    a = jnp.broadcast_to(cap, delta.shape)
    if passes == 1:
        a = jnp.minimum(a, delta**2 / (later + 1.0))
    after = jnp.where(later >= 1, d**2 / jnp.maximum(later, 1.0), inf)
    a = jnp.minimum(a, after)
    straight_ok = (j - 1.0) * (d + delta) <= d * m
    straight = jnp.where(straight_ok, (d + delta) ** 2 / m, inf)
    kinked = jnp.where(j >= 2, d**2 / jnp.maximum(j - 1.0, 1.0) + delta**2 / (later + 1.0), inf)
    a = jnp.minimum(a, jnp.minimum(straight, kinked))
    return a, delta


def _setup(lip, beta, eta, sig, dia, num_records, batch_size, passes):
    """(valid, σ stand-in, A_j, δ_j, w_j) for broadcast leaves (shape P; the batches on a last axis)."""
    shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in (lip, beta, eta, sig, dia)))
    lip, beta, eta, sig, dia = (jnp.broadcast_to(x, shape) for x in (lip, beta, eta, sig, dia))
    valid = ((lip >= 0) & jnp.isfinite(lip) & (beta >= 0) & jnp.isfinite(beta) & (eta > 0) & jnp.isfinite(eta)
             & (eta * beta <= 2.0) & (sig > 0) & jnp.isfinite(sig) & (dia > 0) & jnp.isfinite(dia))
    lip_s, eta_s, sig_s, dia_s = (jnp.where(valid, x, 1.0) for x in (lip, eta, sig, dia))
    m, sizes, weights = _geometry(num_records, batch_size)
    a, delta = _energies(m, sizes, passes, lip_s, dia_s / eta_s)
    return valid, sig_s, a, delta, weights


def _core(orders_np, lip, beta, eta, sig, dia, num_records, batch_size, passes):
    valid, sig_s, a, delta, weights = _setup(lip, beta, eta, sig, dia, num_records, batch_size, passes)
    alpha = jnp.asarray(orders_np)
    log_w = jnp.asarray(np.log(weights))
    scale = (alpha * (alpha - 1.0))[None, :] / (2.0 * sig_s[..., None, None] ** 2)  # P + (1, k)

    def lme(energy):  # (1/(α−1)) log Σ_j w_j exp((α−1) α energy_j/(2σ²)), shape P + (k,)
        x = energy[..., :, None] * scale + log_w[:, None]
        return logsumexp(x, axis=-2) / (alpha - 1.0)

    hidden = lme(a)
    comp = passes * lme(delta**2)
    rdp = jnp.maximum(jnp.minimum(hidden, comp), 0.0)  # rounding of the log-sum-exp at L = 0
    return jnp.where(valid[..., None], rdp, jnp.nan)


def _log_delta_mixture(eps, mu, log_w):
    """log Σ_j w_j θ_{e^ε}(μ_j): the hockey-stick divergence of the mixture over the record's batch."""
    lt, _ = _log_theta_and_complement(eps[..., None], mu)
    return logsumexp(lt + log_w, axis=-1)


def _gdp_parts(lip, beta, eta, sig, dia, num_records, batch_size, passes):
    """(valid, μ_j, log w_j): μ_j = √A_j/σ, the record in batch j of the last pass μ_j-GDP."""
    valid, sig_s, a, _, weights = _setup(lip, beta, eta, sig, dia, num_records, batch_size, passes)
    pos = a > 0
    mu = jnp.where(pos, jnp.sqrt(jnp.where(pos, a, 1.0)), 0.0) / sig_s[..., None]
    return valid, mu, jnp.asarray(np.log(weights))


@functools.partial(jax.jit, static_argnums=(6, 7, 8))
def _gdp_epsilon_jit(log_target, lip, beta, eta, sig, dia, num_records, batch_size, passes):
    """The smallest ε (bisection, certified end, implicit derivative) with the mixture's δ at most the target."""
    valid, mu, log_w = _gdp_parts(lip, beta, eta, sig, dia, num_records, batch_size, passes)
    log_t = jnp.broadcast_to(log_target, valid.shape)
    eps = _solve_eps(_log_delta_mixture, (mu, log_w), log_t, _eps_bracket(jnp.max(mu, axis=-1), log_t))
    return jnp.where(valid, eps, jnp.nan)


@functools.partial(jax.jit, static_argnums=(6, 7, 8))
def _gdp_delta_jit(eps, lip, beta, eta, sig, dia, num_records, batch_size, passes):
    valid, mu, log_w = _gdp_parts(lip, beta, eta, sig, dia, num_records, batch_size, passes)
    return jnp.where(valid, jnp.exp(_log_delta_mixture(jnp.broadcast_to(eps, valid.shape), mu, log_w)), jnp.nan)


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8))
def _core_jit(orders_key, lip, beta, eta, sig, dia, num_records, batch_size, passes):
    return _core(np.asarray(orders_key), lip, beta, eta, sig, dia, num_records, batch_size, passes)


def _check(lipschitz, smoothness, learning_rate, noise_std, diameter, num_records, batch_size, passes):
    for name, v in (("num_records", num_records), ("batch_size", batch_size), ("passes", passes)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a Python int >= 1 (it is static); got {v!r}.")
    if batch_size > num_records:
        raise ValueError(f"batch_size must be <= num_records ({num_records}); got {batch_size}.")
    _validate.check_in_range("lipschitz", lipschitz, 0.0, math.inf)
    _validate.check_in_range("smoothness", smoothness, 0.0, math.inf)
    _validate.check_in_range("learning_rate", learning_rate, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("noise_std", noise_std, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("diameter", diameter, 0.0, math.inf, lo_open=True)
    if all(_validate.is_concrete(x) for x in (learning_rate, smoothness)):
        lhs = np.asarray(learning_rate, np.float64) * np.asarray(smoothness, np.float64)
        if np.any(lhs > 2.0):
            raise ValueError(f"learning_rate must be at most 2/smoothness (every batch's step must be a contraction: "
                             f"eta*beta <= 2); got learning_rate={learning_rate!r}, smoothness={smoothness!r}.")


@float64
def shuffle_pnsgd_rdp(orders, lipschitz, smoothness, learning_rate, noise_std, diameter, *, num_records: int,
                      batch_size: int, passes: int = 1):
    r"""Rényi DP of the last iterate of projected noisy SGD with batches reshuffled every pass (hidden state).

    Each of the k passes cuts a fresh, secret, uniformly random permutation of the n records
    into :math:`m = \lceil n/b\rceil` consecutive batches (the last one smaller when b does
    not divide n), and averages each batch's gradients over its size :math:`b_j`. For every
    order α > 1 (derivation in ``docs/hidden_state_poisson.md`` §8):

    .. math::

        ε_α ≤ \min\Big(\frac1{α-1}\log\sum_j w_j e^{(α-1)αA_j/(2σ^2)},\
            \frac{k}{α-1}\log\sum_j w_j e^{(α-1)αΔ_j^2/(2σ^2)}\Big),

    with :math:`w_j = b_j/n`, :math:`Δ_j = 2L/b_j` and :math:`A_j` the shift energy of
    Feldman et al.'s Theorem 22 for a record in batch j of the last pass (module docstring):
    the log-mean-exp over the record's secret position of the fixed-order bound, by joint
    convexity of :math:`e^{(α-1)D_α}`. For k ≥ 2 only the last pass is analysed (the coupling
    starts at distance D at its start or after the record's step), so the bound does not
    grow with k once it is below composition.

    Assumptions (not checked by the library): for every record x, :math:`ℓ(\cdot, x)` is
    convex, L-Lipschitz and β-smooth on a compact convex K of diameter D; the start is
    data-independent; the noise is fresh, independent, isotropic Gaussian; the
    permutations are secret, uniform and independent of each other and of the noise; only
    :math:`Y_T` is released; replace-one neighbours. Checked: ηβ ≤ 2, which makes every
    batch's averaged gradient step 1-Lipschitz.

    Args:
      orders: Rényi orders α > 1 (static, concrete).
      lipschitz: L ≥ 0.
      smoothness: β ≥ 0 (0 for linear losses).
      learning_rate: η > 0 with ηβ ≤ 2.
      noise_std: σ > 0, the std of the noise on the averaged gradient (parameter noise ησ).
      diameter: D > 0 of K.
      num_records: n (static Python int).
      batch_size: b in 1..n (static Python int).
      passes: k ≥ 1 (static Python int).

    Returns:
      float64 array ``broadcast shape + (k,)`` (orders last); NaN under ``jit`` for invalid
      inputs (eagerly: ``ValueError`` naming the parameter).

    References:
      Feldman, Mironov, Talwar, Thakurta, "Privacy Amplification by Iteration", FOCS 2018
      (arXiv:1808.06651), Theorems 22-23 and the log-mean-exp step of Lemma 25/Theorem 26;
      Mironov, "Rényi Differential Privacy" (CSF 2017), Proposition 1 (composition).

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> r = [float(A.shuffle_pnsgd_rdp([8.0], 1.0, 1.0, 0.5, 1.0, 1.0, num_records=1000, batch_size=10,
      ...                                 passes=k)[0]) for k in (3, 10, 100)]
      >>> r[0] == r[1] == r[2]
      True
    """
    orders_np = _validate.concrete_orders(orders)
    _check(lipschitz, smoothness, learning_rate, noise_std, diameter, num_records, batch_size, passes)
    return _core_jit(tuple(orders_np.tolist()), f64(lipschitz), f64(smoothness), f64(learning_rate), f64(noise_std),
                     f64(diameter), int(num_records), int(batch_size), int(passes))


@float64
def shuffle_pnsgd_epsilon(delta, lipschitz, smoothness, learning_rate, noise_std, diameter, *, num_records: int,
                          batch_size: int, passes: int = 1, orders=DEFAULT_ORDERS):
    r"""ε at δ of the shuffled run: the smaller of two conversions of the same mixture.

    * :func:`shuffle_pnsgd_rdp` converted with the improved conversion (:func:`rdp_to_epsilon`);
    * the hockey-stick mixture :math:`δ(ε) ≤ \sum_j w_j θ_{e^ε}(\sqrt{A_j}/σ)`: the record in
      batch j of the last pass is :math:`\sqrt{A_j}/σ`-GDP by the shifted-interpolation
      version of the same shift schedules (Bok, Su & Altschuler, the lemma
      :func:`pnsgd_shifted_gdp` uses; row (v) is the exact composition of k Gaussian steps),
      and the hockey-stick divergence is jointly convex; inverted by bisection (certified end,
      implicit derivative).

    Args:
      delta: δ in (0, 1); the other arguments as :func:`shuffle_pnsgd_rdp`.

    Returns:
      float64 ε of the broadcast shape of the leaves.

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> e = [float(A.shuffle_pnsgd_epsilon(1e-5, 1.0, 1.0, 0.5, 1.0, 1.0, num_records=1000, batch_size=10,
      ...                                    passes=k)) for k in (1, 10, 100)]
      >>> e[1] == e[2]
      True
    """
    _validate.check_delta(delta)
    rdp = shuffle_pnsgd_rdp(orders, lipschitz, smoothness, learning_rate, noise_std, diameter,
                            num_records=num_records, batch_size=batch_size, passes=passes)
    eps_rdp = rdp_to_epsilon(rdp, _validate.concrete_orders(orders), delta).epsilon
    eps_gdp = _gdp_epsilon_jit(jnp.log(f64(delta)), f64(lipschitz), f64(smoothness), f64(learning_rate),
                               f64(noise_std), f64(diameter), int(num_records), int(batch_size), int(passes))
    return jnp.minimum(eps_rdp, eps_gdp)


def event_epsilon(ev, delta, orders_np):
    """ε of a :class:`PNSGD` event with ``sampling="shuffle"`` (hidden: :func:`shuffle_pnsgd_epsilon`)."""
    eps_rdp = rdp_to_epsilon(event_rdp(ev, orders_np), orders_np, delta).epsilon
    if not ev.hidden:
        return eps_rdp
    return jnp.minimum(eps_rdp, _gdp_epsilon_jit(jnp.log(f64(delta)), *_leaves(ev), *_static(ev)))


def event_delta(ev, epsilon, orders_np):
    """δ at ε of a :class:`PNSGD` event with ``sampling="shuffle"`` (the RDP and, hidden, the GDP mixture)."""
    d_rdp = rdp_to_delta(event_rdp(ev, orders_np), orders_np, epsilon).delta
    if not ev.hidden:
        return d_rdp
    return jnp.minimum(d_rdp, _gdp_delta_jit(f64(epsilon), *_leaves(ev), *_static(ev)))


def gdp_epsilon(ev, delta):
    """The hockey-stick mixture's ε alone (``pnsgd_privacy``'s ``shifted_gdp`` for shuffled batches)."""
    return _gdp_epsilon_jit(jnp.log(f64(delta)), *_leaves(ev), *_static(ev))


def _leaves(ev):
    return tuple(f64(x) for x in (ev.lipschitz, ev.smoothness, ev.learning_rate, ev.noise_std, ev.diameter))


def _static(ev):
    return int(ev.num_records), int(ev.batch_size), int(ev.passes)


def event_rdp(ev, orders_np):
    """The RDP curve of a :class:`PNSGD` event with ``sampling="shuffle"`` (every record alike)."""
    lip, sig = f64(ev.lipschitz), f64(ev.noise_std)
    if ev.hidden:
        return _core_jit(tuple(np.asarray(orders_np, np.float64).tolist()), *_leaves(ev), *_static(ev))
    return _composition_rdp(orders_np, lip, sig, ev.num_records, ev.batch_size, ev.passes)


@float64
def _composition_rdp(orders_np, lip, sig, num_records, batch_size, passes):
    """Every iterate released: k passes composed, each a mixture over the record's batch of one Gaussian step."""
    m, sizes, weights = _geometry(num_records, batch_size)
    alpha = jnp.asarray(orders_np)
    valid = (lip >= 0) & jnp.isfinite(lip) & (sig > 0) & jnp.isfinite(sig)
    sig_s = jnp.where(valid, sig, 1.0)
    delta = 2.0 * jnp.where(valid, lip, 0.0)[..., None] / jnp.asarray(sizes)
    x = (delta**2)[..., :, None] * (alpha * (alpha - 1.0) / (2.0 * sig_s[..., None, None] ** 2)) \
        + jnp.log(jnp.asarray(weights))[:, None]
    rdp = jnp.maximum(passes * logsumexp(x, axis=-2) / (alpha - 1.0), 0.0)
    return jnp.where(valid[..., None], rdp, jnp.nan)
