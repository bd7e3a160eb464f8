r"""Conversions from Rényi DP to (ε, δ)-DP, reduced over the orders axis."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import _validate
from .._numerics import f64, float64, min_and_first
from .._program_cache import persistent

__all__ = ["EpsilonResult", "DeltaResult", "rdp_to_epsilon", "rdp_to_delta"]

_METHODS = ("improved", "classic")
# dp_accounting applies the improved bound only above this order (it is unstable as α → 1).
_IMPROVED_MIN_ORDER = 1.01


class EpsilonResult(NamedTuple):
    """ε and the Rényi order that attains it (a pytree: passes through jit and vmap).

    ``order`` is the first order whose ε is within 8 ulps of the min (robust to XLA's rounding).
    """

    epsilon: jax.Array
    order: jax.Array


class DeltaResult(NamedTuple):
    """δ and the Rényi order that attains it (the first whose log δ is within 8 ulps of the min)."""

    delta: jax.Array
    order: jax.Array


def _check(rdp, orders, name, value, lo, hi, lo_open, hi_open, method):
    _validate.check_static_choice("method", method, _METHODS)
    _validate.check_orders("orders", orders)
    _validate.check_in_range("rdp", rdp, 0.0, math.inf, allow_inf=True)
    _validate.check_nonempty("rdp", rdp)
    _validate.check_broadcastable(rdp=rdp, orders=orders)
    if name == "delta":
        _validate.check_delta(value)
    else:
        _validate.check_in_range(name, value, lo, hi, lo_open=lo_open, hi_open=hi_open)


@float64
def rdp_to_epsilon(rdp, orders, delta, *, method: str = "improved") -> EpsilonResult:
    r"""Smallest ε over the orders such that RDP curve ``rdp`` implies (ε, δ)-DP.

    ``method="improved"`` (default, as dp_accounting) uses, per order α > 1.01,

    .. math:: ε(α) = r_α + \log(1 - 1/α) - \frac{\log(δ α)}{α - 1}

    (Canonne, Kamath, Steinke 2020, Proposition 12; Asoodeh et al. 2021, Eq. 20), and
    ε = 0 at an order where :math:`δ ≥ \sqrt{1 - e^{-r_α}}` (the total-variation bound
    via KL ≤ D_α). Orders ≤ 1.01 give +inf (the formula is unstable there).
    ``method="classic"`` is Mironov 2017, Proposition 3: :math:`ε(α) = r_α + \log(1/δ)/(α-1)`.

    Args:
      rdp: RDP values, shape ``batch + (k,)`` (orders on the last axis), each ≥ 0.
      orders: Rényi orders > 1, shape ``(k,)``.
      delta: target δ in [2.2250738585072014e-308, 1) (from the smallest normal float64:
        a subnormal δ is refused), broadcastable with ``batch``.
      method: ``"improved"`` or ``"classic"`` (static).

    Returns:
      ``EpsilonResult(epsilon, order)`` with shapes ``batch``; ε ≥ 0 is float64. Under
      ``jit`` an invalid δ (subnormal included) or a negative/NaN RDP value gives NaN
      (never an optimistic ε).

    References:
      C. Canonne, G. Kamath, T. Steinke, "The Discrete Gaussian for Differential Privacy",
      NeurIPS 2020 (arXiv:2004.00010), Proposition 12. I. Mironov, "Rényi Differential
      Privacy", CSF 2017, Proposition 3.

    Examples:
      >>> import jaxdp
      >>> orders = jaxdp.accounting.DEFAULT_ORDERS
      >>> rdp = jaxdp.accounting.gaussian_rdp(orders, 5.0)
      >>> round(float(jaxdp.accounting.rdp_to_epsilon(rdp, orders, 1e-5).epsilon), 6)
      0.794522
    """
    _check(rdp, orders, "delta", delta, 0.0, 1.0, True, True, method)
    return _rdp_to_epsilon_jit(method, f64(rdp), f64(orders), f64(delta))


@persistent("rdp_to_epsilon", static_argnums=(0,))
@functools.partial(jax.jit, static_argnums=0)
def _rdp_to_epsilon_jit(method, rdp, orders, delta):
    # One compiled program for an eager call (validated above); inlined when traced.
    delta = delta[..., None]
    ok_delta = (delta >= _validate.DELTA_MIN) & (delta < 1)
    bad = ~ok_delta | jnp.any(~(rdp >= 0), axis=-1, keepdims=True)
    r = jnp.where(rdp >= 0, rdp, 0.0)
    d = jnp.where(ok_delta, delta, 0.5)
    if method == "classic":
        eps = r - jnp.log(d) / (orders - 1.0)
    else:
        eps = improved_per_order(r, orders, d)
    best, order = _min_and_order(eps, orders)
    best = jnp.maximum(best, 0.0)
    best = jnp.where(jnp.any(bad, axis=-1), jnp.nan, best)
    return EpsilonResult(best, order)


def improved_per_order(r, orders, delta):
    """The improved conversion's ε at each order (before the min; r ≥ 0, δ valid): +inf at α ≤ 1.01."""
    formula = r + jnp.log1p(-1.0 / orders) - jnp.log(delta * orders) / (orders - 1.0)
    formula = jnp.where(orders > _IMPROVED_MIN_ORDER, formula, jnp.inf)
    return jnp.where(delta**2 + jnp.expm1(-r) > 0, 0.0, formula)


def _min_and_order(values, orders):
    """(min over the last axis, the first order attaining it), with a safe derivative.

    NaN counts as +∞. The value is the plain min, with the derivative of the first order
    attaining it; an order whose value is within 8 ulps of the min counts as attaining it
    (:func:`jaxdp._numerics.min_and_first`: XLA may recompute ``values`` with other rounding
    for the comparison, where an exact pick matched no order, reported order 0 and a zero
    derivative). At a tie within 8 ulps the reported order is the first of the tied ones.
    """
    best, _, first = min_and_first(jnp.where(jnp.isnan(values), jnp.inf, values), axis=-1)
    return best, jnp.sum(jnp.where(first, orders, 0.0), axis=-1)


@float64
def rdp_to_delta(rdp, orders, epsilon, *, method: str = "improved") -> DeltaResult:
    r"""Smallest δ over the orders such that RDP curve ``rdp`` implies (ε, δ)-DP.

    ``method="improved"`` (default, as dp_accounting): per order,
    :math:`\log δ_α = \min\{\tfrac12\log(1 - e^{-r_α}),\ (α-1)(r_α - ε + \log(1 - 1/α)) - \log α\}`,
    the second bound only for α > 1.01 (Canonne, Kamath, Steinke 2020, Proposition 12,
    and the KL total-variation bound). ``method="classic"``:
    :math:`δ_α = e^{(α-1)(r_α - ε)}` (Mironov 2017, Proposition 3). δ is capped at 1.

    Args:
      rdp: RDP values, shape ``batch + (k,)``, each ≥ 0.
      orders: Rényi orders > 1, shape ``(k,)``.
      epsilon: target ε ≥ 0, broadcastable with ``batch``.
      method: ``"improved"`` or ``"classic"`` (static).

    Returns:
      ``DeltaResult(delta, order)``; NaN under ``jit`` for invalid inputs.

    Examples:
      >>> import jaxdp
      >>> orders = jaxdp.accounting.DEFAULT_ORDERS
      >>> rdp = jaxdp.accounting.gaussian_rdp(orders, 5.0)
      >>> float(jaxdp.accounting.rdp_to_delta(rdp, orders, 0.794522033).delta) < 1.0001e-5
      True
    """
    _check(rdp, orders, "epsilon", epsilon, 0.0, math.inf, False, False, method)
    rdp = f64(rdp)
    orders = f64(orders)
    epsilon = f64(epsilon)[..., None]
    bad = ~(epsilon >= 0) | jnp.isinf(epsilon) | jnp.any(~(rdp >= 0), axis=-1, keepdims=True)
    r = jnp.where(rdp >= 0, rdp, 0.0)
    e = jnp.where(epsilon >= 0, epsilon, 0.0)
    if method == "classic":
        log_delta = (orders - 1.0) * (r - e)
    else:
        r_pos = jnp.where(r > 0, r, 1.0)
        kl = jnp.where(r > 0, 0.5 * jnp.log1p(-jnp.exp(-r_pos)), -jnp.inf)
        ckS = (orders - 1.0) * (r - e + jnp.log1p(-1.0 / orders)) - jnp.log(orders)
        log_delta = jnp.where(orders > _IMPROVED_MIN_ORDER, jnp.minimum(kl, ckS), kl)
    best, order = _min_and_order(log_delta, orders)
    delta = jnp.minimum(jnp.exp(best), 1.0)
    delta = jnp.where(jnp.any(bad, axis=-1), jnp.nan, delta)
    return DeltaResult(delta, order)
