r"""Trade-off curves of privacy events: the best test's true-positive rate at each false-positive rate.

A test between the neighbouring outputs P (record in) and Q (record out) has a
false-positive rate α = Q(S) and a true-positive rate P(S). The *trade-off curve* of the
event is the largest TPR any test (randomised tests included) reaches at each FPR, in
either order of the pair; :func:`tradeoff` bounds it from above (the guarantee) and, for
the PLD, from below. Three accountants (Dong, Roth & Su 2022 write the same object as the
type-II error β = 1 − TPR, the f-DP tradeoff function):

* ``"gdp"``: events with a Gaussian-DP parameter μ (Gaussian mechanisms and their
  compositions, exact; PNSGD by shifted interpolation, an upper bound):
  :math:`\mathrm{TPR} = Φ(Φ^{-1}(α) + μ)`;
* ``"pld"``: the privacy profile δ(ε) of the PLD accountant (read through the public
  :func:`~jaxdp.accounting.delta`) on a grid of ε, each (ε, δ(ε)) pair a valid
  statement for both orders of the pair:
  :math:`\mathrm{TPR} \le \min_k \min\{e^{ε_k}α + δ_k,\ 1 - e^{-ε_k}(1 - δ_k - α)\}`;
  its ``estimate="lower"`` profile gives a certified lower bound by the convex duality
  below;
* ``"rdp"``: the RDP curve ε(a) of the event at each order a: the test's indicator is a
  post-processing, so :math:`D_a(\mathrm{Bern}(\mathrm{TPR})\,\|\,\mathrm{Bern}(α)) \le
  ε(a)` and the same with the two swapped; the largest TPR meeting every order.

Duality used by the lower bound. Let R be the set of (FPR, TPR) pairs of all tests in
both orders of the pair, F the upper boundary of its convex hull (what randomised tests
reach; for a symmetric pair, such as Gaussian, Laplace and PNSGD, the best test's TPR),
and δ(γ) = sup_{(u,v)∈R} v − γu the profile at γ = e^ε, the largest δ over the two orders,
as jaxdp reports it. Then F(α) = inf_{γ ≥ 0} γα + δ(γ) (Fenchel duality; F(1) = 1), δ is
non-increasing, and R is symmetric under (u, v) ↦ (1 − v, 1 − u) (the complement test in
the other order), so δ(γ) ≥ 1 − γ + γ δ(1/γ) for γ < 1. With a lower profile δ_lo on a grid
0 = ε_1 < … < ε_K: for γ ∈ [e^{ε_k}, e^{ε_{k+1}}], γα + δ(γ) ≥ e^{ε_k}α + δ_lo(ε_{k+1});
for γ ∈ [e^{-ε_{k+1}}, e^{-ε_k}], γα + δ(γ) ≥ 1 − γ(1 − α − δ_lo(ε_{k+1})), least at an end
of the interval; beyond the grid, e^{ε_K}α and 1 − e^{-ε_K}(1 − α). The minimum of these
lines is a certified lower bound on F(α) (its deficit is first order in the grid step).

References:
  J. Dong, A. Roth, W. Su, "Gaussian Differential Privacy", JRSS-B 84(1), 2022
  (Definition 2.1, Proposition 2.12 for the (ε, δ) ↔ tradeoff duality, Eq. (6) for G_μ);
  J. Bok, W. Su, J. Altschuler, "Shifted Interpolation for Differential Privacy", ICML 2024
  (μ-GDP of PNSGD); B. Balle, G. Barthe, M. Gaboardi, J. Hsu, T. Sato, "Hypothesis
  Testing Interpretations and Rényi Differential Privacy", AISTATS 2020 (RDP constrains
  every test through the Rényi divergence of two Bernoulli distributions);
  P. Kairouz, S. Oh, P. Viswanath, "The composition theorem for differential privacy",
  ICML 2015 (the (ε, δ) region of a test).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import ndtr, ndtri

from .. import _validate
from .._numerics import f64, float64
from ._accountants import _pnsgd_step_ok, _with_fields
from ._accountants import delta as _delta
from ._accountants import rdp as _rdp
from ._events import PNSGD, Composed, Event, Gaussian, SelfComposed, check_leaves, relation_of
from ._rdp import DEFAULT_ORDERS
from ._shifted import pnsgd_shifted_gdp

__all__ = ["TRADEOFF_ACCOUNTANTS", "TRADEOFF_EPSILONS", "gdp_mu", "tradeoff"]

TRADEOFF_ACCOUNTANTS = ("rdp", "pld", "gdp")

# The ε grid on which the PLD profile is read (static): 0 first (the lower bound needs it),
# steps of 0.05 up to 4 and 0.2 up to 40. The upper bound is valid on any grid; its excess
# over the envelope of the whole profile is second order in the step (the profile is
# smooth), and the lower bound's deficit first order. 221 PLD evaluations: ~5 s on a
# 2-core CPU at grid_size 2^12.
TRADEOFF_EPSILONS = np.unique(np.concatenate([np.linspace(0.0, 4.0, 81), np.linspace(4.0, 40.0, 181)]))
TRADEOFF_EPSILONS.setflags(write=False)

# Bisection of the Rényi constraint in t ∈ [α, 1]: 2^-64 is below float64's resolution of 1.
_RDP_BISECTIONS = 64


# =======================================================================================
# Gaussian DP: μ of an event, where it has one.
# =======================================================================================


def _mu(event: Event, path: str):
    if isinstance(event, Gaussian):
        sigma = f64(event.noise_multiplier)
        return jnp.where(sigma > 0, 1.0 / jnp.where(sigma > 0, sigma, 1.0), jnp.nan)
    if isinstance(event, SelfComposed):
        count = f64(event.count)
        n = jnp.ceil(jnp.where(count >= 0, count, 0.0))
        return jnp.where(count >= 0, jnp.sqrt(n) * _mu(event.event, f"{path}.event"), jnp.nan)
    if isinstance(event, Composed):
        parts = [_mu(e, f"{path}.events[{i}]") for i, e in enumerate(event.events)]
        return jnp.sqrt(sum(p**2 for p in parts))
    if isinstance(event, PNSGD) and event.schedule == "fixed" and event.sampling == "sequential":
        if event.relation != "replace_one":
            raise ValueError(f"{path}: the PNSGD analyses cover relation 'replace_one' only; got {event.relation!r}.")
        if event.hidden:
            # Shifted interpolation (Bok, Su & Altschuler 2024): the worst record, the last.
            mu = _with_fields(pnsgd_shifted_gdp, event, event.num_records)
        else:
            # Every iterate released: the last record's k steps compose to r = 2L√k/(b_m σ).
            n, b = event.num_records, event.batch_size
            last = n - (-(-n // b) - 1) * b
            lip, sig = f64(event.lipschitz), f64(event.noise_std)
            ok = (lip >= 0) & (sig > 0)
            mu = jnp.where(ok, 2.0 * lip * math.sqrt(event.passes) / (last * jnp.where(ok, sig, 1.0)), jnp.nan)
        return jnp.where(_pnsgd_step_ok(event), mu, jnp.nan)
    raise ValueError(
        f"{path}: {type(event).__name__} has no Gaussian-DP parameter in jaxdp (only Gaussian mechanisms, their "
        "compositions and fixed-order PNSGD do; PNSGD with Poisson batches has an RDP curve); use accountant='pld' or "
        "'rdp'."
    )


@float64
def gdp_mu(event: Event) -> jax.Array:
    r"""The μ for which the event is μ-GDP (its trade-off curve lies above :math:`G_μ`).

    Gaussian mechanism with noise multiplier σ: μ = 1/σ (exact); ``SelfComposed``:
    :math:`\sqrt{⌈k⌉}\,μ`; ``Composed``: :math:`\sqrt{\sum μ_i^2}` (Dong, Roth & Su 2022,
    Corollary 3.3, exact); fixed-order :class:`PNSGD` with hidden iterates: the worst
    record's :func:`pnsgd_shifted_gdp` (an upper bound), with every iterate released the
    composition :math:`2L\sqrt{k}/(b_m σ)`. Other events raise ``ValueError``.

    Args:
      event: a privacy event (a batch if its leaves have leading axes).

    Returns:
      float64 μ ≥ 0 of the batch shape (NaN under ``jit`` for invalid leaves).

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> float(A.gdp_mu(A.SelfComposed(A.Gaussian(2.0), 4)))
      1.0
    """
    _check_event(event)
    return _mu(event, "event")


def _check_event(event) -> None:
    if not isinstance(event, Event):
        raise TypeError(f"event must be a privacy event (Gaussian, PoissonSampled, ...); got {type(event).__name__}.")
    relation_of(event)
    check_leaves(event)


# =======================================================================================
# The three conversions.
# =======================================================================================


def _gdp_curve(mu, fpr):
    # Φ(Φ⁻¹(α) + μ); Φ⁻¹(0) = -inf gives 0 and Φ⁻¹(1) = +inf gives 1 (no NaN at the ends).
    return ndtr(ndtri(fpr) + mu)


def _profile_upper(eps, deltas, fpr):
    """min over the grid of both (ε, δ) lines; ``deltas`` is ``batch + (K,)``, ``fpr`` broadcasts with batch."""
    a = fpr[..., None]
    d = jnp.clip(deltas, 0.0, 1.0)
    forward = jnp.exp(eps) * a + d
    backward = 1.0 - jnp.exp(-eps) * (1.0 - d - a)
    return jnp.clip(jnp.min(jnp.minimum(forward, backward), axis=-1), 0.0, 1.0)


def _profile_lower(eps, deltas, fpr):
    """The duality lower bound of the module docstring (``eps[0] == 0``)."""
    a = fpr[..., None]
    d_next = jnp.clip(deltas, 0.0, 1.0)[..., 1:]  # δ_lo(ε_{k+1}), k < K
    lo, hi = eps[:-1], eps[1:]
    # γ ∈ [e^{ε_k}, e^{ε_{k+1}}]: γα + δ(γ) ≥ e^{ε_k}α + δ_lo(ε_{k+1}); beyond e^{ε_K}: ≥ e^{ε_K}α.
    forward = jnp.concatenate([jnp.exp(lo) * a + d_next, jnp.exp(eps[-1:]) * a], axis=-1)
    # γ ∈ [e^{-ε_{k+1}}, e^{-ε_k}]: by the pair's symmetry δ(γ) ≥ 1 - γ + γ δ_lo(ε_{k+1}), so
    # γα + δ(γ) ≥ 1 - γ c with c = 1 - α - δ_lo(ε_{k+1}), smallest at an end; below e^{-ε_K}: c ≤ 1 - α.
    c = 1.0 - a - d_next
    backward = jnp.concatenate([1.0 - jnp.maximum(jnp.exp(-lo) * c, jnp.exp(-hi) * c),
                                1.0 - jnp.exp(-eps[-1:]) * (1.0 - a)], axis=-1)
    return jnp.clip(jnp.min(jnp.minimum(forward, backward), axis=-1), 0.0, 1.0)


def _log_binary_renyi(t, x, order):
    r"""(a − 1)·D_a(Bern(t) ‖ Bern(x)) = log(t^a x^{1−a} + (1−t)^a (1−x)^{1−a}), in log space."""

    def term(p, q):
        # p^a q^(1-a): 0 when p = 0; +inf when q = 0 < p. Double where keeps the logs finite.
        pos_p, pos_q = p > 0, q > 0
        lp = jnp.log(jnp.where(pos_p, p, 1.0))
        lq = jnp.log(jnp.where(pos_q, q, 1.0))
        val = order * lp + (1.0 - order) * lq
        return jnp.where(pos_p, jnp.where(pos_q, val, jnp.inf), -jnp.inf)

    return jnp.logaddexp(term(t, x), term(1.0 - t, 1.0 - x))


def _rdp_curve(curve, orders, fpr):
    """Largest t ∈ [α, 1] with both Bernoulli Rényi divergences within ε(a) at every order.

    ``curve`` is ``batch + (k,)``; the answer is the bisection bracket's upper end (never
    too low), with the implicit-function derivative attached (one Newton step whose value
    is stopped), so ``grad`` flows to the event's leaves and to α.
    """
    x = jnp.clip(fpr, 0.0, 1.0)[..., None]
    a = f64(orders)
    budget = (a - 1.0) * curve  # batch + (k,)
    x_b, budget_b = jnp.broadcast_arrays(x, budget)
    xs, bs = jax.lax.stop_gradient(x_b), jax.lax.stop_gradient(budget_b)

    def excess(t, xx, bb):
        g1 = _log_binary_renyi(t, xx, a)
        g2 = _log_binary_renyi(xx, t, a)
        return jnp.maximum(g1, g2) - bb

    def body(_, lohi):
        lo, hi = lohi
        mid = 0.5 * (lo + hi)
        over = excess(mid, xs, bs) > 0
        return jnp.where(over, lo, mid), jnp.where(over, mid, hi)

    lo, hi = jax.lax.fori_loop(0, _RDP_BISECTIONS, body, (xs, jnp.ones_like(xs)))
    # hi = 1 means the constraint never binds (t = 1 allowed); curve = +inf also lands here.
    t0 = hi
    binding = (t0 < 1.0) & (t0 > xs)
    # Implicit derivative: t = t0 - (G(t0, x, b) - 0)/∂_t G, value stopped at t0.
    t_s = jax.lax.stop_gradient(t0)
    g = lambda tt: excess(tt, x_b, budget_b)  # noqa: E731
    _, g_t = jax.jvp(lambda tt: excess(tt, xs, bs), (t_s,), (jnp.ones_like(t_s),))
    safe_gt = jnp.where(binding & (g_t > 0), g_t, 1.0)
    corr = -jnp.where(binding & (g_t > 0), g(t_s), 0.0) / safe_gt
    # x itself is a valid TPR (t = α always meets the constraints); where t0 = α the value is α.
    t = t_s + (corr - jax.lax.stop_gradient(corr)) + jnp.where(t0 <= xs, x_b - jax.lax.stop_gradient(x_b), 0.0)
    return jnp.clip(jnp.min(t, axis=-1), 0.0, 1.0)


# =======================================================================================
# The public door.
# =======================================================================================


@float64
def tradeoff(event: Event, fpr, *, accountant: str = "rdp", estimate: str = "upper", epsilons=None,
             orders=DEFAULT_ORDERS, grid_size: int | None = None, tail_bound: float | None = None) -> jax.Array:
    r"""The true-positive rate of the best test at each false-positive rate: the event's trade-off curve.

    For neighbouring inputs with outputs P (record in) and Q (record out), every test S
    has :math:`\mathrm{TPR} = P(S) \le \mathrm{tradeoff}(α)` at :math:`α = Q(S)`, in both
    orders of the pair (randomised tests included). One minus it is Dong, Roth & Su's
    tradeoff function :math:`f(α)`.

    * ``accountant="gdp"``: :math:`Φ(Φ^{-1}(α) + μ)` with μ = :func:`gdp_mu` (exact for
      Gaussian mechanisms and their compositions; shifted interpolation for PNSGD);
    * ``accountant="pld"``: from the PLD profile δ(ε) on the grid ``epsilons``,
      :math:`\min_k \min\{e^{ε_k}α + δ_k,\ 1 - e^{-ε_k}(1 - δ_k - α)\}` for
      ``estimate="upper"``; ``estimate="lower"`` reads the lower PLD profile and returns
      a certified lower bound on the best (randomised) test's TPR (the duality of the
      module docstring), so the true curve lies between the two;
    * ``accountant="rdp"`` (default): the largest t ≥ α with
      :math:`D_a(\mathrm{Bern}(t)\|\mathrm{Bern}(α)) \le ε(a)` and
      :math:`D_a(\mathrm{Bern}(α)\|\mathrm{Bern}(t)) \le ε(a)` at every order a of the
      event's RDP curve (:func:`rdp`), found by bisection.

    Args:
      event: a privacy event (a batch if its leaves have leading axes).
      fpr: false-positive rates α in [0, 1], broadcast against the event batch.
      accountant: ``"rdp"`` (default), ``"pld"`` or ``"gdp"`` (static).
      estimate: ``"upper"`` (default; the guarantee) or, with ``"pld"`` only, ``"lower"``.
      epsilons: ``"pld"`` only: the static grid of ε ≥ 0 on which the profile is read,
        starting at 0 (default :data:`TRADEOFF_EPSILONS`).
      orders: ``"rdp"`` only: Rényi orders (static), default dp_accounting's 156.
      grid_size, tail_bound: ``"pld"`` only: as in :func:`epsilon`.

    Returns:
      float64 TPR in [α, 1] of the broadcast shape of the batch and ``fpr``. Unsupported
      events raise ``ValueError``; invalid values raise ``ValueError`` when concrete and
      give NaN under ``jit``.

    References:
      J. Dong, A. Roth, W. Su, "Gaussian Differential Privacy", JRSS-B 2022 (Eq. (6),
      Proposition 2.12); B. Balle et al., "Hypothesis Testing Interpretations and Rényi
      Differential Privacy", AISTATS 2020; J. Bok, W. Su, J. Altschuler, ICML 2024.

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> ev = A.Gaussian(1.0)
      >>> round(float(A.tradeoff(ev, 0.05, accountant="gdp")), 6)  # Φ(Φ⁻¹(0.05) + 1)
      0.259511
      >>> bool(A.tradeoff(ev, 0.05) >= A.tradeoff(ev, 0.05, accountant="gdp"))  # RDP: an upper bound
      True
    """
    _validate.check_static_choice("accountant", accountant, TRADEOFF_ACCOUNTANTS)
    _validate.check_static_choice("estimate", estimate, ("upper", "lower"))
    if estimate == "lower" and accountant != "pld":
        raise ValueError(f"estimate='lower' is available with accountant='pld' only; got accountant={accountant!r}.")
    if accountant != "pld" and (epsilons is not None or grid_size is not None or tail_bound is not None):
        raise ValueError("epsilons, grid_size and tail_bound are options of accountant='pld' only.")
    _validate.check_in_range("fpr", fpr, 0.0, 1.0)
    _check_event(event)
    fpr = f64(fpr)
    return jnp.where((fpr >= 0) & (fpr <= 1), _curve(event, fpr, accountant, estimate, epsilons, orders, grid_size,
                                                     tail_bound), jnp.nan)


def _curve(event, fpr, accountant, estimate, epsilons, orders, grid_size, tail_bound):
    if accountant == "gdp":
        return _gdp_curve(_mu(event, "event"), fpr)
    if accountant == "rdp":
        orders_np = _validate.concrete_orders(orders)
        return _rdp_curve(_rdp(event, orders_np), orders_np, fpr)
    eps = _epsilon_grid(epsilons)
    batch = jnp.broadcast_shapes(*(jnp.shape(x) for x in jax.tree_util.tree_leaves(event)))
    options = {k: v for k, v in (("grid_size", grid_size), ("tail_bound", tail_bound)) if v is not None}
    grid = jnp.asarray(eps).reshape((eps.size,) + (1,) * len(batch))
    deltas = jnp.moveaxis(_delta(event, grid, accountant="pld", estimate=estimate, **options), 0, -1)
    return (_profile_upper if estimate == "upper" else _profile_lower)(jnp.asarray(eps), deltas, fpr)


def _epsilon_grid(epsilons) -> np.ndarray:
    if epsilons is None:
        return TRADEOFF_EPSILONS
    if not _validate.is_concrete(epsilons):
        raise ValueError("epsilons must be a concrete 1-D sequence (it sets the grid's shape).")
    eps = np.asarray(epsilons, np.float64)
    if eps.ndim != 1 or eps.size < 2 or eps[0] != 0.0 or np.any(np.diff(eps) <= 0) or not np.all(np.isfinite(eps)):
        raise ValueError("epsilons must be a finite, strictly increasing 1-D grid of at least 2 values starting at 0; "
                         f"got {np.asarray(epsilons)!r}.")
    return eps
