r"""The remaining dp_accounting 0.6.0 events: randomized response, zCDP, single-epoch tree aggregation.

Each is an event with an RDP curve (the RDP accountant composes it with every other RDP
event), computed as dp_accounting 0.6.0's ``RdpAccountant`` computes it:

* :class:`RandomizedResponse`: k-ary randomized response with noise parameter p (keep the
  input bucket with probability 1 − p, else output a uniform bucket), **replace-one**
  neighbours (one record's bucket changed). The pair is P = (1 − p + p/k, p/k, …),
  Q = (p/k, 1 − p + p/k, p/k, …), and

  .. math:: ε(α) = \frac{1}{α-1}\log\Big[(1-p+\tfrac pk)^α(\tfrac pk)^{1-α}
            + (\tfrac pk)^α(1-p+\tfrac pk)^{1-α} + (k-2)\tfrac pk\Big]

  exactly (the pair is symmetric). dp_accounting's other relation for it, "replace with a
  special record", is not one jaxdp models.
* :class:`ZCDP`: a mechanism satisfying (ξ, ρ)-zCDP (Bun & Steinke 2016), i.e. RDP
  ε(α) = ξ + ρα at every order, under the event's relation.
* :class:`SingleEpochTreeAggregation`: the tree aggregation protocol restarted between
  trees, each record in at most one leaf across all trees (Kairouz et al. 2021, Appendix
  D): a record touches at most d = ⌈log₂(max step count + 1)⌉ nodes, each a Gaussian
  mechanism with noise multiplier σ, so ε(α) = αd/(2σ²). dp_accounting accounts it under
  "replace with a special record"; the curve holds under whichever relation σ is measured
  in, which the event states.

No PLD here: dp_accounting's PLD accountant has randomized response only under the
relation jaxdp does not model.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._numerics import f64
from ._events import Event, RELATIONS, _event, register_event_type
from .. import _validate

__all__ = ["RandomizedResponse", "ZCDP", "SingleEpochTreeAggregation"]


@_event(data=("noise_parameter", "num_buckets"), meta=("relation",))
class RandomizedResponse(Event):
    """k-ary randomized response: the input bucket with probability 1 − p, else a uniform one of k.

    Attributes:
      noise_parameter: p in [0, 1] (a leaf; p = 0 releases the bucket, p = 1 nothing).
      num_buckets: k ≥ 1 (a leaf; a whole number).
      relation: ``"replace_one"`` (the only one covered; static).

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> round(float(A.epsilon(A.SelfComposed(A.RandomizedResponse(0.3, 5), 10), 1e-5)), 4)
      25.3906
    """

    noise_parameter: Any
    num_buckets: Any
    relation: str = "replace_one"

    def __post_init__(self):
        _validate.check_static_choice("RandomizedResponse.relation", self.relation, ("replace_one",))


@_event(data=("rho", "xi"), meta=("relation",))
class ZCDP(Event):
    """A mechanism satisfying (ξ, ρ)-zCDP: RDP ε(α) = ξ + ρα at every order α > 1.

    Attributes:
      rho: ρ ≥ 0 (a leaf).
      xi: ξ ≥ 0 (a leaf; default 0, ρ-zCDP).
      relation: the relation the guarantee holds under (static; default ``"add_remove"``).

    Examples:
      >>> import jaxdp
      >>> round(float(jaxdp.accounting.epsilon(jaxdp.accounting.ZCDP(0.1), 1e-5)), 4)
      1.9142
    """

    rho: Any
    xi: Any = 0.0
    relation: str = "add_remove"

    def __post_init__(self):
        _validate.check_static_choice("ZCDP.relation", self.relation, RELATIONS)


@_event(data=("noise_multiplier",), meta=("step_counts", "relation"))
class SingleEpochTreeAggregation(Event):
    """Tree aggregation over one or more trees, each record in at most one leaf across all trees.

    Attributes:
      noise_multiplier: σ > 0, the noise per node over the sensitivity of one record's
        leaf under ``relation`` (a leaf).
      step_counts: the steps (leaves) of each tree, a tuple of whole numbers ≥ 0 (static;
        a single int for one tree).
      relation: ``"add_remove"`` (default) or ``"replace_one"`` (static).

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> round(float(A.epsilon(A.SingleEpochTreeAggregation(2.0, (1000,)), 1e-5)), 4)  # 10 nodes of σ = 2
      8.0794
    """

    noise_multiplier: Any
    step_counts: tuple
    relation: str = "add_remove"

    def __post_init__(self):
        _validate.check_static_choice("SingleEpochTreeAggregation.relation", self.relation, RELATIONS)
        counts = self.step_counts
        if isinstance(counts, (int, np.integer)) and not isinstance(counts, bool):
            counts = (counts,)
        try:
            counts = tuple(counts)
        except TypeError:
            counts = None
        if (not counts or any(isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0 for c in counts)):
            raise ValueError("SingleEpochTreeAggregation.step_counts must be a non-empty tuple of Python ints >= 0 "
                             f"(it is static); got {self.step_counts!r}.")
        object.__setattr__(self, "step_counts", tuple(int(c) for c in counts))


PARITY_EVENTS = (RandomizedResponse, ZCDP, SingleEpochTreeAggregation)


def _check_rr(ev, path, chk, rec):
    chk(f"{path}.noise_parameter (RandomizedResponse)", ev.noise_parameter, 0.0, 1.0)
    _validate.check_integer(f"{path}.num_buckets (RandomizedResponse)", ev.num_buckets, lo=1.0)


def _check_zcdp(ev, path, chk, rec):
    chk(f"{path}.rho (ZCDP)", ev.rho, 0.0, math.inf)
    chk(f"{path}.xi (ZCDP)", ev.xi, 0.0, math.inf)


def _check_tree(ev, path, chk, rec):
    chk(f"{path}.noise_multiplier (SingleEpochTreeAggregation)", ev.noise_multiplier, 0.0, math.inf, lo_open=True)


for _cls, _chk in zip(PARITY_EVENTS, (_check_rr, _check_zcdp, _check_tree)):
    register_event_type(_cls, relation=lambda ev: ev.relation, check=_chk)


def tree_depth(step_counts: tuple) -> int:
    """d = ⌈log₂(max step count + 1)⌉, the nodes of a tree one leaf's record touches."""
    return math.ceil(math.log2(max(step_counts) + 1))


def _rr_rdp(orders, p, k):
    orders = f64(orders)
    p, k = f64(p)[..., None], f64(k)[..., None]
    valid = (p >= 0) & (p <= 1) & (k >= 1) & (k == jnp.floor(k))
    trivial = (k == 1) | (p == 1)
    inf = p == 0
    mid = valid & ~trivial & ~inf
    ps = jnp.where(mid, p, 0.5)
    ks = jnp.where(mid, k, 2.0)
    # log of the likelihood ratio at the input bucket, log((1 - p + p/k)/(p/k)) = log(k/p - k + 1).
    lr = jnp.log1p(ks / ps - ks)
    w_up = jnp.log(ps / ks)
    w_down = jnp.log1p(-ps + ps / ks)
    rest = (1.0 - 2.0 / ks) * ps
    w_rest = jnp.where(rest > 0, jnp.log(jnp.where(rest > 0, rest, 1.0)), -jnp.inf)
    terms = jnp.stack(jnp.broadcast_arrays(orders * lr + w_up, -orders * lr + w_down, w_rest + 0.0 * orders), -1)
    out = jax.nn.logsumexp(terms, axis=-1) / (orders - 1.0)
    out = jnp.maximum(out, 0.0)
    out = jnp.where(trivial, 0.0, jnp.where(inf, jnp.inf, out))
    return jnp.where(valid, out, jnp.nan)


def rdp_curve(event, orders: np.ndarray):
    """The RDP curve of one parity event, ``batch + (k,)``."""
    o = f64(orders)
    if isinstance(event, RandomizedResponse):
        return _rr_rdp(orders, event.noise_parameter, event.num_buckets)
    if isinstance(event, ZCDP):
        rho, xi = f64(event.rho)[..., None], f64(event.xi)[..., None]
        return jnp.where((rho >= 0) & (xi >= 0), xi + rho * o, jnp.nan)
    sigma = f64(event.noise_multiplier)[..., None]
    d = float(tree_depth(event.step_counts))
    return jnp.where(sigma > 0, o * d / (2.0 * jnp.where(sigma > 0, sigma, 1.0) ** 2), jnp.nan)
