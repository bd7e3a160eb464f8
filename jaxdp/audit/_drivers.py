r"""Audit drivers: simulate a mechanism many times (``vmap`` over runs) and compare the
empirical lower bound on ε with the accountant's claim.

Every driver takes the secret noise key from the caller (``key``); without one it draws a
fresh key from the operating system's entropy (as ``jaxdp.training.train`` does). Keys are
never printed or stored.
"""

from __future__ import annotations

import math
import secrets
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .. import accounting as A
from ._bounds import epsilon_lower_bound
from ._one_run import one_run_audit

__all__ = [
    "AuditResult",
    "audit_dpsgd",
    "audit_dpsgd_one_run",
    "audit_gaussian",
    "audit_pnsgd",
    "dpsgd_one_run_scores",
    "dpsgd_scores",
    "gaussian_scores",
    "pnsgd_scores",
]


class AuditResult(NamedTuple):
    """The accountant's claim next to the audit's lower bound (float64; arrays per position for PNSGD).

    Attributes:
      claimed_epsilon: the accountant's ε at δ (an upper bound if the analysis is right).
      lower_bound: the empirical lower bound on ε (valid with the stated confidence).
      ratio: ``lower_bound / claimed_epsilon`` (≤ 1 when the claim holds; 0 for a 0 claim
        with a 0 bound, +inf for a 0 claim with evidence).
    """

    claimed_epsilon: jax.Array
    lower_bound: jax.Array
    ratio: jax.Array


def _entropy_key() -> jax.Array:
    """A fresh PRNG key filled from the OS entropy (never derived from anything printed)."""
    like = jax.random.key_data(jax.random.key(0))
    words = np.frombuffer(secrets.token_bytes(like.size * like.dtype.itemsize), dtype=like.dtype)
    return jax.random.wrap_key_data(jnp.asarray(words.reshape(like.shape)))


def _key(key):
    if key is None:
        return _entropy_key()
    if isinstance(key, int) and not isinstance(key, bool):
        return jax.random.key(key)
    return key


def _check_runs(runs) -> int:
    if isinstance(runs, bool) or not isinstance(runs, (int, np.integer)) or runs < 2:
        raise ValueError(f"runs must be a Python int >= 2 (it sets array shapes); got {runs!r}.")
    return int(runs)


def _with_scores(result, s_in, s_out, return_scores):
    return (result, s_in, s_out) if return_scores else result


def _ratio(lower, claimed):
    lower, claimed = np.asarray(lower, np.float64), np.asarray(claimed, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(claimed > 0, lower / np.where(claimed > 0, claimed, 1.0), np.where(lower > 0, np.inf, 0.0))


# ---------------------------------------------------------------------------------------
# Gaussian and Poisson-sampled Gaussian mechanisms
# ---------------------------------------------------------------------------------------


def _gaussian_run(key, noise_multiplier, q, num_steps, with_canary):
    """One run of ``num_steps`` sampled Gaussian releases y_t = B_t + σ Z_t (sensitivity 1)."""
    kb, kz = jax.random.split(key)
    b = jax.random.bernoulli(kb, q, (num_steps,)).astype(jnp.float64) * with_canary
    y = b + noise_multiplier * jax.random.normal(kz, (num_steps,), jnp.float64)
    # Neyman-Pearson score: the log likelihood ratio of the release,
    # sum_t log(1 - q + q exp((2 y_t - 1) / (2 σ^2))), in log space (log(1 - q) = -inf at q = 1).
    log_q = jnp.log(q)
    log_1mq = jnp.where(q < 1, jnp.log1p(-jnp.where(q < 1, q, 0.0)), -jnp.inf)
    return jnp.sum(jnp.logaddexp(log_1mq, log_q + (2.0 * y - 1.0) / (2.0 * noise_multiplier**2)))


def gaussian_scores(noise_multiplier, runs: int, *, q=1.0, num_steps: int = 1, key=None):
    r"""Likelihood-ratio scores of ``runs`` runs of the (Poisson-sampled) Gaussian mechanism, with and without the canary.

    Each run releases :math:`y_t = B_t + σ Z_t` for t = 1..T, where the canary's
    contribution :math:`B_t \sim \mathrm{Bernoulli}(q)` (0 without the canary), the
    sensitivity is 1 (add/remove) and :math:`Z_t \sim N(0, 1)`. The score is the log
    likelihood ratio :math:`\sum_t \log(1 - q + q\,e^{(2y_t - 1)/(2σ^2)})`, the most
    powerful test (Neyman–Pearson).

    Args:
      noise_multiplier: σ > 0 of the simulated mechanism.
      runs: runs per side (Python int ≥ 2).
      q: Poisson sampling rate in (0, 1].
      num_steps: T ≥ 1 (Python int).
      key: secret PRNG key (default: fresh OS entropy).

    Returns:
      ``(scores_in, scores_out)``, float64 arrays of shape ``(runs,)``.
    """
    runs = _check_runs(runs)
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("q", q, 0.0, 1.0, lo_open=True)
    _validate.check_integer("num_steps", num_steps)
    with jax.enable_x64(True):
        k_in, k_out = jax.random.split(_key(key))
        sigma, qq = jnp.float64(noise_multiplier), jnp.float64(q)
        one = jax.jit(jax.vmap(_gaussian_run, in_axes=(0, None, None, None, None)), static_argnums=3)
        s_in = one(jax.random.split(k_in, runs), sigma, qq, int(num_steps), 1.0)
        s_out = one(jax.random.split(k_out, runs), sigma, qq, int(num_steps), 0.0)
    return s_in, s_out


def _claimed_gaussian(noise_multiplier, delta, q, num_steps):
    if q == 1.0:  # T Gaussian releases = one Gaussian with σ/√T: the exact curve
        return float(A.gaussian_mechanism_epsilon(delta, noise_multiplier / math.sqrt(num_steps)))
    return float(A.epsilon(A.dpsgd_event(q, noise_multiplier, num_steps), delta, accountant="pld"))


def audit_gaussian(noise_multiplier, delta, *, q=1.0, num_steps: int = 1, runs: int = 100_000,
                   confidence=0.95, key=None, return_scores: bool = False):
    r"""Audit the (Poisson-sampled) Gaussian mechanism against jaxdp's ε.

    The claim is the exact ε of the Gaussian mechanism (:func:`~jaxdp.accounting.gaussian_mechanism_epsilon`
    at σ/√T) when q = 1, else the PLD upper bound of ``dpsgd_event(q, σ, T)``
    (:func:`~jaxdp.accounting.epsilon` with ``accountant="pld"``). The lower bound is
    :func:`epsilon_lower_bound` of :func:`gaussian_scores`.

    Args:
      noise_multiplier: σ > 0; delta: δ in (0, 1); q: sampling rate in (0, 1];
      num_steps: T ≥ 1; runs: runs per side; confidence: c in (0, 1); key: secret key;
      return_scores: also return the scores (for :func:`empirical_tradeoff`).

    Returns:
      An :class:`AuditResult` (scalars); with ``return_scores``, ``(result, scores_in, scores_out)``.

    Examples:
      >>> import jax
      >>> res = audit_gaussian(2.0, 1e-5, runs=20_000, key=jax.random.key(0))
      >>> bool(res.lower_bound <= res.claimed_epsilon)
      True
    """
    _validate.check_delta(delta)
    s_in, s_out = gaussian_scores(noise_multiplier, runs, q=q, num_steps=num_steps, key=key)
    lower = float(epsilon_lower_bound(s_in, s_out, delta, confidence).epsilon)
    claimed = _claimed_gaussian(float(noise_multiplier), float(delta), float(q), int(num_steps))
    return _with_scores(AuditResult(np.float64(claimed), np.float64(lower), _ratio(lower, claimed)[()]), s_in, s_out,
                        return_scores)


# ---------------------------------------------------------------------------------------
# PNSGD: one canary record at a chosen position, last iterate released
# ---------------------------------------------------------------------------------------


PNSGD_ATTACKS = ("zero", "boundary", "nonconvex")


def pnsgd_scores(positions, num_records: int, learning_rate, noise_multiplier, clip_norm, radius, runs: int, *,
                 attack: str = "zero", key=None):
    r"""Final iterates of 1-D PNSGD runs with a canary record at each position (and its neighbour).

    The loss is linear, :math:`\ell(θ, x) = -xθ` with :math:`|x| \le C` (convex,
    C-Lipschitz, β-smooth for every β > 0). The record at ``position`` is the canary
    x = +C in one data set and its replace-one neighbour x = −C in the other; every other
    record is x = 0. The run is ``jaxdp.training.pnsgd`` (batch size 1, one pass, start
    θ₀ = 0): :math:`θ ← Π_{[-R, R]}(θ − η(g + Z))`, :math:`Z \sim N(0, (2Cν)^2)`. Only the
    last iterate :math:`θ_n` is released; it is the score (the canary pushes it up).

    ``attack`` chooses the other records (the hidden-state adversary crafts their
    gradients too, within the analysis' assumptions: linear losses are convex,
    C-Lipschitz and β-smooth for every β):

    * ``"zero"``: every other record is x = 0 (gradient 0): the iterate diffuses from 0;
    * ``"boundary"``: every other record is x = +C, whose gradient −C drives the iterate
      into the boundary +R, where the projection pins it. With the canary (x = +C) the
      run stays pinned, a nearly deterministic output; its neighbour (x = −C) pushes the
      iterate off the boundary once, and the later records cannot quite bring it back.
      Pinning defeats the noise the hidden iterates accumulate. (Cebere, Bellet & Papernot
      2025 let the adversary craft the canary's gradient at every step; here it also
      chooses the other records' linear losses. Of pushes +C, 0 and −C before and after
      the canary, this one audited highest on the settings of `jaxdp audit`, 10⁵ runs.)
    * ``"nonconvex"`` (outside the analysis: it shows why jaxdp refuses hidden-state
      accounting for non-convex losses): the records *after* the canary have the concave
      Huber loss :math:`\ell(θ) = -C\,h_{ηC}(θ - c)` (C-Lipschitz, 1/η-smooth), whose
      step doubles the distance to the centre c in its quadratic zone and pushes away by
      ηC outside it, so the last iterate keeps the side of c the canary's step left it on
      (Annamalai 2024 builds such losses). The centre
      :math:`c = ηC(8ν - 1)` is four noise standard deviations above the mean of the
      canary's step without the canary (its step starts from 0, at position 1): the test
      "θ_n above c" then reads the canary step's far tail, where composition is tight. The
      radius must exceed c for the iterate to stay on its side. Records before the canary
      are x = 0.

    Args:
      positions: 1-based positions in 1..n (a sequence of ints).
      num_records: n ≥ 1; learning_rate: η > 0; noise_multiplier: ν > 0 (relative to 2C);
      clip_norm: C > 0; radius: R > 0; runs: runs per side and position;
      attack: ``"zero"`` (default), ``"boundary"`` or ``"nonconvex"`` (static); key: secret key.

    Returns:
      ``(scores_in, scores_out)`` of shape ``(len(positions), runs)``, float32 (the
      training dtype).

    Examples:
      >>> import jax
      >>> s_in, s_out = pnsgd_scores([1, 4], 4, 0.5, 0.5, 1.0, 1.0, 1000, key=jax.random.key(0))
      >>> s_in.shape, bool(abs(s_in).max() <= 1.0 + 1e-6)  # in the ball of radius 1 (float32 rounding)
      ((2, 1000), True)
    """
    from .. import training as T

    runs = _check_runs(runs)
    pos = np.atleast_1d(np.asarray(positions))
    _validate.check_integer("num_records", num_records)
    _validate.check_positions(pos, num_records)
    _validate.check_static_choice("attack", attack, PNSGD_ATTACKS)
    n = int(num_records)
    eta, nu, c, r = float(learning_rate), float(noise_multiplier), float(clip_norm), float(radius)
    before = c if attack == "boundary" else 0.0  # the records before the canary
    after = c if attack == "boundary" else 0.0  # and after it (the non-convex attack: below)
    centre = eta * c * (8.0 * nu - 1.0)  # the non-convex attack's centre (see the docstring)
    T.pnsgd(eta, nu, c, r, jax.random.key(0))  # validates the run's parameters (this key draws nothing)

    def one_run(key, position, sign):
        tx = T.pnsgd(eta, nu, c, r, key)
        theta = jnp.zeros((1,), jnp.float32)

        def step(carry, t):
            theta, state = carry
            x = jnp.where(t == position - 1, sign * c, jnp.where(t < position - 1, before, after))
            grad = jnp.full((1,), -x, jnp.float32)  # gradient of -x·θ; batch of one: the average
            if attack == "nonconvex":  # after the canary: -C·clip((θ - c)/(ηC), -1, 1)
                push = -c * jnp.clip((theta - centre) / (eta * c), -1.0, 1.0)
                grad = jnp.where(t > position - 1, push, grad).astype(jnp.float32)
            updates, state = tx.update(grad, state, theta)
            return (theta + updates, state), None

        (theta, _), _ = jax.lax.scan(step, (theta, tx.init(theta)), jnp.arange(n))
        return theta[0]

    runs_fn = jax.jit(jax.vmap(jax.vmap(one_run, in_axes=(0, None, None)), in_axes=(0, 0, None)))
    k_in, k_out = jax.random.split(_key(key))
    keys_in = jax.random.split(k_in, (pos.size, runs))
    keys_out = jax.random.split(k_out, (pos.size, runs))
    p = jnp.asarray(pos, jnp.int32)
    return runs_fn(keys_in, p, 1.0), runs_fn(keys_out, p, -1.0)


def audit_pnsgd(positions, num_records: int, learning_rate, noise_multiplier, clip_norm, radius, delta, *,
                runs: int = 20_000, confidence=0.95, attack: str = "zero", key=None, return_scores: bool = False):
    r"""Audit jaxdp's per-position ε of PNSGD (hidden iterates) with the runs of :func:`pnsgd_scores`.

    The claim at each position is :func:`~jaxdp.accounting.pnsgd_record_epsilon` of
    ``PNSGD(lipschitz=C, smoothness=1/η, learning_rate=η, noise_std=2Cν, diameter=2R,
    num_records=n)`` (the linear loss is β-smooth for every β, and η = 1/β meets the
    step-size rule). Later positions are amplified less, so both the claim and the audit
    grow with the position.

    Returns:
      An :class:`AuditResult` of arrays of shape ``(len(positions),)``; with
      ``return_scores``, ``(result, scores_in, scores_out)`` (scores of shape
      ``(len(positions), runs)``).

    Examples:
      >>> import jax
      >>> res = audit_pnsgd([1, 6], 6, 0.5, 0.5, 1.0, 1.0, 1e-3, key=jax.random.key(0))  # doctest: +SKIP
      >>> bool((res.lower_bound <= res.claimed_epsilon).all())  # doctest: +SKIP
      True

      (Skipped in the doctests: compiling the per-record accountant takes ~30 s on a small
      CPU; ``tests/audit/test_drivers.py`` runs it with ``JAXDP_SLOW=1``.)
    """
    from .. import training as T

    _validate.check_delta(delta)
    s_in, s_out = pnsgd_scores(positions, num_records, learning_rate, noise_multiplier, clip_norm, radius, runs,
                               attack=attack, key=key)
    lower = np.array([float(epsilon_lower_bound(a, b, delta, confidence).epsilon) for a, b in zip(s_in, s_out)])
    eta, c = float(learning_rate), float(clip_norm)
    event = A.PNSGD(lipschitz=c, smoothness=1.0 / eta, learning_rate=eta,
                    noise_std=T.pnsgd_noise_std(float(noise_multiplier), c, 1), diameter=2.0 * float(radius),
                    num_records=int(num_records))
    per_record = np.asarray(A.pnsgd_record_epsilon(event, delta), np.float64)
    claimed = per_record[np.atleast_1d(np.asarray(positions)) - 1]
    return _with_scores(AuditResult(claimed, lower, _ratio(lower, claimed)), s_in, s_out, return_scores)


# ---------------------------------------------------------------------------------------
# DP-SGD with a gradient canary
# ---------------------------------------------------------------------------------------


def _dpsgd_run(key, q, noise_multiplier, clip_norm, num_steps, included, learning_rate, canary_steps=None):
    """Final model update of DP-SGD (``jaxdp.training.dpsgd``) with Dirac gradient canaries.

    ``included`` (shape (d,)) marks the canaries present; canary i's clipped gradient is
    C·e_i, Poisson-sampled at rate q at every step. Other records contribute 0 to the
    canaries' coordinates (their gradients lie elsewhere), so they are left out.
    """
    from .. import training as T

    k_noise, k_sample = jax.random.split(key)
    d = included.shape[0]
    tx = T.dpsgd(learning_rate, noise_multiplier, clip_norm, 1.0, k_noise)
    theta0 = jnp.zeros((d,), jnp.float32)

    # The canary's gradient enters only at the chosen steps (all by default).
    at = np.zeros(num_steps, bool)
    at[list(canary_steps) if canary_steps is not None else slice(None)] = True

    def step(carry, xs):
        k, present = xs
        theta, state = carry
        sampled = jax.random.bernoulli(k, q, (d,)) & included & present
        grad_sum = clip_norm * sampled.astype(jnp.float32)
        updates, state = tx.update(grad_sum, state, theta)
        return (theta + updates, state), None

    (theta, _), _ = jax.lax.scan(step, (theta0, tx.init(theta0)), (jax.random.split(k_sample, num_steps),
                                                                   jnp.asarray(at)))
    return -(theta - theta0) / learning_rate  # the score: the canary direction of the update, up to a scale


def _check_canary_steps(canary_steps, num_steps) -> tuple | None:
    if canary_steps is None:
        return None
    steps = tuple(int(s) for s in np.atleast_1d(np.asarray(canary_steps)))
    if not steps or any(not 0 <= s < int(num_steps) for s in steps):
        raise ValueError(f"canary_steps must be a non-empty sequence of step indices in [0, num_steps - 1] = "
                         f"[0, {int(num_steps) - 1}]; got {canary_steps!r}.")
    return steps


def dpsgd_scores(q, noise_multiplier, num_steps: int, runs: int, *, clip_norm=1.0, canary_steps=None, key=None):
    r"""Scores of ``runs`` DP-SGD runs with and without one Dirac gradient canary.

    Each run is ``num_steps`` steps of ``jaxdp.training.dpsgd`` on a model whose first
    coordinate only the canary touches: its clipped gradient C·e₁ enters a step with
    probability q (Poisson sampling), the noise is N(0, ν²C²) per coordinate. The score is
    the first coordinate of −(θ_T − θ₀)/η (the dot product of the final update with the
    canary direction).

    ``canary_steps`` (0-based step indices, static) inserts the canary's gradient at those
    steps only (Cebere, Bellet & Papernot 2025: a canary gradient at every step, the
    default, is their strongest hidden-state attack on DP-SGD; at chosen steps, e.g. the
    last, it measures what the hidden intermediate models hide).

    Returns:
      ``(scores_in, scores_out)``, float32 arrays of shape ``(runs,)``.
    """
    runs = _check_runs(runs)
    _validate.check_in_range("q", q, 0.0, 1.0, lo_open=True)
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("clip_norm", clip_norm, 0.0, math.inf, lo_open=True)
    _validate.check_integer("num_steps", num_steps)
    steps = _check_canary_steps(canary_steps, num_steps)
    k_in, k_out = jax.random.split(_key(key))
    fn = jax.jit(jax.vmap(lambda k, inc: _dpsgd_run(k, float(q), float(noise_multiplier), float(clip_norm),
                                                     int(num_steps), inc, 1.0, steps)[0], in_axes=(0, None)))
    s_in = fn(jax.random.split(k_in, runs), jnp.ones((1,), bool))
    s_out = fn(jax.random.split(k_out, runs), jnp.zeros((1,), bool))
    return s_in, s_out


def audit_dpsgd(q, noise_multiplier, num_steps: int, delta, *, runs: int = 20_000, confidence=0.95,
                clip_norm=1.0, canary_steps=None, key=None, return_scores: bool = False):
    """Audit ``dpsgd_epsilon(q, ν, T, δ)`` with the many-run gradient-canary experiment of :func:`dpsgd_scores`.

    Only the final model is used, so the bound is typically well below the claim (which
    holds even when every intermediate model is released). With ``return_scores`` it
    returns ``(result, scores_in, scores_out)``.

    Examples:
      >>> import jax
      >>> res = audit_dpsgd(0.5, 1.0, 4, 1e-5, key=jax.random.key(0))
      >>> bool(res.lower_bound <= res.claimed_epsilon)
      True
    """
    _validate.check_delta(delta)
    s_in, s_out = dpsgd_scores(q, noise_multiplier, num_steps, runs, clip_norm=clip_norm, canary_steps=canary_steps,
                               key=key)
    lower = float(epsilon_lower_bound(s_in, s_out, delta, confidence).epsilon)
    claimed = float(A.dpsgd_epsilon(q, noise_multiplier, num_steps, delta))
    return _with_scores(AuditResult(np.float64(claimed), np.float64(lower), _ratio(lower, claimed)[()]), s_in, s_out,
                        return_scores)


def dpsgd_one_run_scores(q, noise_multiplier, num_steps: int, num_canaries: int, *, clip_norm=1.0, key=None):
    r"""One DP-SGD run with ``num_canaries`` Dirac gradient canaries, each included with probability 1/2.

    Canary i has clipped gradient C·e_i; it is in the data set with probability 1/2
    (independently, drawn from the key) and then Poisson-sampled at rate q at each step.

    Returns:
      ``(scores, included)``: the score of each canary (its coordinate of the final update)
      and which canaries were included, shape ``(num_canaries,)``.
    """
    _validate.check_in_range("q", q, 0.0, 1.0, lo_open=True)
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    _validate.check_integer("num_steps", num_steps)
    if isinstance(num_canaries, bool) or not isinstance(num_canaries, (int, np.integer)) or num_canaries < 1:
        raise ValueError(f"num_canaries must be a Python int >= 1; got {num_canaries!r}.")
    k_inc, k_run = jax.random.split(_key(key))
    included = jax.random.bernoulli(k_inc, 0.5, (int(num_canaries),))
    fn = jax.jit(lambda k, inc: _dpsgd_run(k, float(q), float(noise_multiplier), float(clip_norm), int(num_steps),
                                            inc, 1.0))
    return fn(k_run, included), included


def audit_dpsgd_one_run(q, noise_multiplier, num_steps: int, delta, *, num_canaries: int = 1000, confidence=0.95,
                        clip_norm=1.0, key=None) -> AuditResult:
    """Audit ``dpsgd_epsilon(q, ν, T, δ)`` from one run with many canaries (Steinke, Nasr & Jagielski 2023).

    Examples:
      >>> import jax
      >>> res = audit_dpsgd_one_run(1.0, 1.0, 1, 1e-5, num_canaries=1000, key=jax.random.key(0))
      >>> bool(0 < res.lower_bound <= res.claimed_epsilon)
      True
    """
    _validate.check_delta(delta)
    scores, included = dpsgd_one_run_scores(q, noise_multiplier, num_steps, num_canaries, clip_norm=clip_norm,
                                            key=key)
    lower = float(one_run_audit(scores, included, delta, confidence).epsilon)
    claimed = float(A.dpsgd_epsilon(q, noise_multiplier, num_steps, delta))
    return AuditResult(np.float64(claimed), np.float64(lower), _ratio(lower, claimed)[()])
