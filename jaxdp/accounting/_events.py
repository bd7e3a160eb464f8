r"""Privacy events: a pipeline described as data, evaluated under ``jit``, ``vmap`` and ``grad``.

An *event* says what a pipeline did with the data, in the vocabulary of dp_accounting's
``DpEvent`` tree: a Gaussian or Laplace mechanism, Poisson sampling of an event, an
event repeated ``count`` times, a composition of events, and a projected noisy SGD run.
Events are immutable JAX pytrees: their numeric fields (noise multipliers, rates, counts,
the PNSGD constants) are leaves, and everything that fixes a shape or an analysis (the
kind of event, the number of composed events, the record and batch counts of a PNSGD
run, the neighbouring relation) is static. So

* ``jax.jit(lambda ev: epsilon(ev, 1e-5))`` compiles once per tree structure, whatever
  the values;
* an event whose leaves carry a leading axis is a *batch* of events, and every
  evaluation broadcasts over it (or ``jax.vmap`` maps over it);
* ``jax.grad`` of ε with respect to any leaf is available.

Every event carries the neighbouring relation under which its noise multiplier is
measured (``"add_remove"``: add or remove one record; ``"replace_one"``: replace one
record), and an analysis that does not cover the relation raises ``ValueError`` naming
it. A :class:`Composed` event must have one relation throughout (see :func:`relation_of`).

Evaluation: :func:`rdp` (the RDP curve), :func:`epsilon` and :func:`delta` (through the
accountant named by ``accountant=``, default ``"rdp"``; :func:`register_accountant` adds
another, for example a PLD accountant).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._numerics import f64, float64
from .._program_cache import persistent
from .._pytree import register_dataclass
from ._contraction import (
    pnsgd_contraction_delta,
    step_contraction,
    stop_pnsgd_contraction_delta,
    stop_pnsgd_contraction_epsilon,
)
from ._conversion import rdp_to_delta, rdp_to_epsilon
from ._dpsbcd import dpsbcd_rdp
from ._hockey_stick import gaussian_hockey_stick
from ._iteration import linear_rdp_delta, pnsgd_iteration_rdp, stop_pnsgd_iteration_rdp
from ._pnsgd import pnsgd_privacy
from ._rdp import DEFAULT_ORDERS, gaussian_rdp, laplace_rdp, sampled_gaussian_rdp
from ._shifted import pnsgd_shifted_gdp

__all__ = [
    "Event",
    "Gaussian",
    "Laplace",
    "PoissonSampled",
    "SelfComposed",
    "Composed",
    "PNSGD",
    "DPSBCD",
    "dpsgd_event",
    "relation_of",
    "rdp",
    "epsilon",
    "delta",
    "pnsgd_record_epsilon",
    "register_accountant",
    "RELATIONS",
]

RELATIONS = ("add_remove", "replace_one")
_SCHEDULES = ("fixed", "random_stop")


# =======================================================================================
# CALLS INTO THE PRIMITIVES.
# Every call from the event layer into the accounting primitives is in this section, and
# nowhere else. Primitives are called positionally where their signature allows, so that
# a renaming of their keyword parameters touches only the keyword calls below (marked
# "keywords:").
# =======================================================================================


def _p_gaussian_rdp(orders, noise_multiplier):
    return gaussian_rdp(orders, noise_multiplier)


def _p_laplace_rdp(orders, noise_multiplier):
    return laplace_rdp(orders, noise_multiplier)


def _p_sampled_gaussian_rdp(orders, q, noise_multiplier):
    return sampled_gaussian_rdp(orders, q, noise_multiplier)


def _p_rdp_to_epsilon(curve, orders, target_delta):
    return rdp_to_epsilon(curve, orders, target_delta).epsilon


def _p_rdp_to_delta(curve, orders, target_epsilon):
    return rdp_to_delta(curve, orders, target_epsilon).delta


def _p_step_contraction(learning_rate, smoothness, strong_convexity):
    return step_contraction(learning_rate, smoothness, strong_convexity)


def _p_gaussian_hockey_stick(eps, r):
    return gaussian_hockey_stick(eps, r)


def _p_linear_rdp_delta(eps, coefficient):
    return linear_rdp_delta(eps, coefficient)


def _p_pnsgd_privacy(ev: PNSGD, target_delta, positions=None):
    # pnsgd_privacy is keyword-only.
    return pnsgd_privacy(
        lipschitz=ev.lipschitz,
        smoothness=ev.smoothness,
        learning_rate=ev.learning_rate,
        noise_std=ev.noise_std,
        diameter=ev.diameter,
        num_records=ev.num_records,
        delta=target_delta,
        strong_convexity=ev.strong_convexity,
        batch_size=ev.batch_size,
        passes=ev.passes,
        positions=positions,
    )


def _p_dpsbcd_rdp(orders, ev: DPSBCD):
    # keyword-only constants.
    return dpsbcd_rdp(orders, ev.noise_temperature, learning_rate=ev.learning_rate, sensitivity=ev.sensitivity,
                      contraction=ev.contraction, prox_lipschitz=ev.prox_lipschitz, num_records=ev.num_records,
                      batch_size=ev.batch_size)


def _p_pnsgd_iteration_rdp(orders, position, ev: PNSGD):
    # keyword arguments: batch_size, passes.
    return pnsgd_iteration_rdp(
        orders, position, ev.num_records, ev.lipschitz, ev.noise_std, batch_size=ev.batch_size, passes=ev.passes
    )


def _p_pnsgd_shifted_gdp(position, ev: PNSGD):
    # keyword arguments: smoothness, strong_convexity, batch_size, passes.
    return pnsgd_shifted_gdp(
        position, ev.num_records, ev.lipschitz, ev.noise_std, ev.learning_rate, ev.diameter,
        smoothness=ev.smoothness, strong_convexity=ev.strong_convexity, batch_size=ev.batch_size, passes=ev.passes,
    )


def _p_pnsgd_contraction_delta(eps, position, ev: PNSGD, contraction):
    # keyword arguments: batch_size, passes.
    return pnsgd_contraction_delta(
        eps, position, ev.num_records, ev.lipschitz, ev.noise_std, ev.learning_rate, ev.diameter, contraction,
        batch_size=ev.batch_size, passes=ev.passes,
    )


def _p_stop_pnsgd_iteration_rdp(orders, position, ev: PNSGD):
    # keyword arguments: positions, form.
    return stop_pnsgd_iteration_rdp(orders, ev.num_records, ev.lipschitz, ev.noise_std, positions=position,
                                    form="logmeanexp")


def _p_stop_pnsgd_contraction_epsilon(target_delta, position, ev: PNSGD, contraction):
    # keyword argument: positions.
    return stop_pnsgd_contraction_epsilon(
        target_delta, ev.num_records, ev.lipschitz, ev.noise_std, ev.learning_rate, ev.diameter, contraction,
        positions=position,
    )


def _p_stop_pnsgd_contraction_delta(eps, position, ev: PNSGD, contraction):
    # keyword argument: positions.
    return stop_pnsgd_contraction_delta(
        eps, ev.num_records, ev.lipschitz, ev.noise_std, ev.learning_rate, ev.diameter, contraction,
        positions=position,
    )


# =======================================================================================
# Events.
# =======================================================================================


def _event(data: tuple[str, ...], meta: tuple[str, ...]):
    """Frozen dataclass registered as a pytree: ``data`` fields are children, ``meta`` static."""

    def wrap(cls):
        cls = dataclasses.dataclass(frozen=True, eq=False)(cls)
        # Not jax.tree_util.register_dataclass: its structures of Gaussian and Laplace compare
        # equal, so a compiled program of one could run on the other (see jaxdp/_pytree.py).
        return register_dataclass(cls, data, meta)

    return wrap


class Event:
    """Base class of privacy events (immutable pytrees; see the module docstring)."""

    __slots__ = ()


def _check_relation(owner: str, relation: str) -> None:
    _validate.check_static_choice(f"{owner}.relation", relation, RELATIONS)


@_event(data=("noise_multiplier",), meta=("relation",))
class Gaussian(Event):
    r"""The Gaussian mechanism :math:`f(D) + N(0, σ^2 Δ_2^2 I)`.

    Attributes:
      noise_multiplier: σ > 0, the noise standard deviation over the L2 sensitivity
        :math:`Δ_2 = \sup \|f(D) - f(D')\|_2` taken over neighbouring data sets D, D'
        under ``relation`` (a leaf; any shape, for a batch).
      relation: ``"add_remove"`` (default) or ``"replace_one"`` (static).
    """

    noise_multiplier: Any
    relation: str = "add_remove"

    def __post_init__(self):
        _check_relation("Gaussian", self.relation)


@_event(data=("noise_multiplier",), meta=("relation",))
class Laplace(Event):
    r"""The Laplace mechanism :math:`f(D) + \mathrm{Lap}(λ Δ_1)` per coordinate.

    Attributes:
      noise_multiplier: λ > 0, the Laplace scale b over the L1 sensitivity
        :math:`Δ_1 = \sup \|f(D) - f(D')\|_1` under ``relation`` (a leaf).
      relation: ``"add_remove"`` (default) or ``"replace_one"`` (static).
    """

    noise_multiplier: Any
    relation: str = "add_remove"

    def __post_init__(self):
        _check_relation("Laplace", self.relation)


@_event(data=("q", "event"), meta=())
class PoissonSampled(Event):
    """``event`` run on a Poisson sample: every record is kept independently with probability q.

    Attributes:
      q: sampling rate in [0, 1] (a leaf).
      event: the event applied to the sample; its noise multiplier is relative to the
        sensitivity of one record, under the inner event's relation.
    """

    q: Any
    event: Event

    def __post_init__(self):
        if not isinstance(self.event, Event) and _is_structural(self.event):
            raise TypeError(f"PoissonSampled.event must be an Event; got {type(self.event).__name__}.")


@_event(data=("event", "count"), meta=())
class SelfComposed(Event):
    """``event`` run ``count`` times on the same data (adaptive composition).

    Attributes:
      event: the repeated event.
      count: number of repetitions ≥ 0 (a leaf; a fractional count is charged as the next
        integer, never rounded down).
    """

    event: Event
    count: Any

    def __post_init__(self):
        if not isinstance(self.event, Event) and _is_structural(self.event):
            raise TypeError(f"SelfComposed.event must be an Event; got {type(self.event).__name__}.")


@_event(data=("events",), meta=())
class Composed(Event):
    """Adaptive composition of several events (a tuple; its length is static).

    All parts must share one neighbouring relation (:func:`relation_of`).
    """

    events: tuple

    def __post_init__(self):
        object.__setattr__(self, "events", tuple(self.events))
        for i, e in enumerate(self.events):
            if not isinstance(e, Event) and _is_structural(e):
                raise TypeError(f"Composed.events[{i}] must be an Event; got {type(e).__name__}.")


@_event(
    data=("lipschitz", "smoothness", "learning_rate", "noise_std", "diameter", "strong_convexity"),
    meta=("num_records", "batch_size", "passes", "schedule", "hidden", "relation"),
)
class PNSGD(Event):
    r"""A projected noisy SGD run :math:`Y ← Π_K(Y - η(\frac1b\sum_{x∈B}∇ℓ(Y, x) + Z))`.

    :math:`Z \sim N(0, σ^2 I)` with σ = ``noise_std`` (absolute). Under replace-one
    neighbours the averaged gradient of a batch of b has L2 sensitivity 2L/b, so the noise
    is :math:`σ b/(2L)` times that sensitivity. The n = ``num_records`` records are visited
    in consecutive batches of ``batch_size`` in a fixed order for ``passes`` passes.

    Analyses (worst record unless per record is asked for with
    :func:`pnsgd_record_epsilon`):

    * ``schedule="fixed"``, ``hidden=True`` (only the final iterate released): the best of
      the contraction, amplification-by-iteration, strongly convex and composition
      analyses of :func:`pnsgd_privacy`, and the shifted-interpolation GDP bound of Bok
      et al. (:func:`pnsgd_shifted_gdp`); its RDP curve (for composing with other events)
      is the smaller of Feldman et al.'s (:func:`pnsgd_iteration_rdp`) and the GDP
      bound's :math:`αμ^2/2` (:func:`pnsgd_shifted_rdp`) at each order.
    * ``schedule="fixed"``, ``hidden=False`` (every iterate released): the exact
      composition of the record's ``passes`` Gaussian steps (the ``composition`` analysis).
    * ``schedule="random_stop"``, ``hidden=True``: a uniformly random, secret number of
      steps in 1..n; the better of the contraction bound (Asoodeh et al. Theorem 5) and
      Feldman et al.'s Theorem 26 RDP (``form="logmeanexp"``). Needs ``batch_size=1`` and
      ``passes=1``.

    Attributes:
      lipschitz, smoothness, learning_rate, noise_std, diameter, strong_convexity: L ≥ 0,
        β > 0, 0 < η < 2/(β+ρ), σ > 0, D > 0, ρ in [0, β] (leaves).
      num_records, batch_size, passes: n ≥ 1, b ≥ 1, k ≥ 1 (static Python ints).
      schedule: ``"fixed"`` or ``"random_stop"`` (static).
      hidden: whether intermediate iterates are hidden (static).
      relation: ``"replace_one"`` (the only relation these analyses cover; static).

    Assumptions: convex, L-Lipschitz, β-smooth, ρ-strongly convex loss on a convex set of
    diameter D; data-independent start; fixed record order (see :func:`pnsgd_privacy`).
    """

    lipschitz: Any
    smoothness: Any
    learning_rate: Any
    noise_std: Any
    diameter: Any
    num_records: int
    strong_convexity: Any = 0.0
    batch_size: int = 1
    passes: int = 1
    schedule: str = "fixed"
    hidden: bool = True
    relation: str = "replace_one"

    def __post_init__(self):
        _check_relation("PNSGD", self.relation)
        _validate.check_static_choice("PNSGD.schedule", self.schedule, _SCHEDULES)
        for name in ("num_records", "batch_size", "passes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"PNSGD.{name} must be a Python int >= 1 (it is static); got {v!r}.")
        if not isinstance(self.hidden, bool):
            raise ValueError(f"PNSGD.hidden must be True or False; got {self.hidden!r}.")


@_event(
    data=("noise_temperature", "learning_rate", "sensitivity", "contraction", "prox_lipschitz"),
    meta=("num_records", "batch_size", "relation"),
)
class DPSBCD(Event):
    r"""A DP-SBCD run (Chen & Liu 2024): noisy proximal block-coordinate steps, final weights released.

    Its RDP curve is :func:`~jaxdp.accounting.dpsbcd_rdp` (the hidden-state bound of
    Theorem 4.6, summed over the layers as the paper claims in Section 4.2 **without
    proof**; see there for every assumption). Leaves carry trailing axes of their own
    (passes, layers), so a batch of these events is evaluated with ``jax.vmap``.

    Attributes:
      noise_temperature: o > 0, shape ``(passes,)`` or ``(passes, num_records // batch_size)``.
      learning_rate, sensitivity, contraction, prox_lipschitz: η > 0, S_g ≥ 0, L_F > 0,
        L_T > 0 (per layer or one for all; no defaults: the paper states none).
      num_records, batch_size: n, a multiple of b (static Python ints).
      relation: ``"replace_one"`` (S_g bounds the gradients of two different records).
    """

    noise_temperature: Any
    learning_rate: Any
    sensitivity: Any
    contraction: Any
    prox_lipschitz: Any
    num_records: int
    batch_size: int
    relation: str = "replace_one"

    def __post_init__(self):
        _validate.check_static_choice("DPSBCD.relation", self.relation, ("replace_one",))
        for name in ("num_records", "batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"DPSBCD.{name} must be a Python int >= 1 (it is static); got {v!r}.")


def _is_structural(x) -> bool:
    # jax.tree_util builds events with placeholder children (object(), None, tracers) when
    # it flattens or maps; only reject values that are plainly numbers or arrays.
    return isinstance(x, (int, float, complex, np.ndarray, jax.Array)) and not isinstance(x, jax.core.Tracer)


def dpsgd_event(q, noise_multiplier, num_steps) -> SelfComposed:
    r"""The DP-SGD event: ``num_steps`` Poisson-sampled Gaussian steps (add/remove-one).

    ``SelfComposed(PoissonSampled(q, Gaussian(noise_multiplier)), num_steps)``; so
    ``epsilon(dpsgd_event(q, s, T), delta)`` equals ``dpsgd_epsilon(q, s, T, delta)``.

    Args:
      q: sampling rate in [0, 1].
      noise_multiplier: noise std over the L2 clipping norm (add/remove-one sensitivity).
      num_steps: number of steps ≥ 0 (rounded up).

    Returns:
      A :class:`SelfComposed` event (a batch of events if the arguments have shape).

    Examples:
      >>> import jaxdp
      >>> ev = jaxdp.accounting.dpsgd_event(256 / 60000, 1.1, 14040)
      >>> round(float(jaxdp.accounting.epsilon(ev, 1e-5)), 6)
      2.594363
    """
    _validate.check_broadcastable(q=q, noise_multiplier=noise_multiplier, num_steps=num_steps)
    return SelfComposed(PoissonSampled(q, Gaussian(noise_multiplier)), num_steps)


# =======================================================================================
# Structure: relations, support, eager validation.
# =======================================================================================


def relation_of(event: Event) -> str:
    """The neighbouring relation of an event tree.

    Mechanisms and PNSGD runs carry their own; sampling and repetition inherit it from the
    inner event; a :class:`Composed` event must have one relation throughout. Mixed
    relations raise ``ValueError``: a guarantee under add/remove-one and one under
    replace-one bound different pairs of data sets, and neither combination is the other
    relation's guarantee without a conversion (group privacy) that the caller must choose.
    Express every part under one relation (for example a replace-one sensitivity is at
    most twice the add/remove-one sensitivity, so halve the noise multiplier).

    Examples:
      >>> import jaxdp
      >>> jaxdp.accounting.relation_of(jaxdp.accounting.dpsgd_event(0.01, 1.0, 100))
      'add_remove'
    """
    if isinstance(event, (Gaussian, Laplace, PNSGD, DPSBCD)):
        return event.relation
    if isinstance(event, (PoissonSampled, SelfComposed)):
        return relation_of(event.event)
    if isinstance(event, Composed):
        if not event.events:
            raise ValueError("Composed.events is empty: an empty composition has no relation.")
        rels = [relation_of(e) for e in event.events]
        if len(set(rels)) > 1:
            raise ValueError(
                f"Composed mixes neighbouring relations {sorted(set(rels))}: express every part under one "
                "relation (the guarantees bound different pairs of data sets)."
            )
        return rels[0]
    raise TypeError(f"not a privacy event: {type(event).__name__}")


def _check_rdp_support(event: Event, path: str = "event") -> None:
    """Raise ``ValueError`` if the RDP accountant has no analysis for a part of the tree."""
    if isinstance(event, (Gaussian, Laplace, DPSBCD)):
        return
    if isinstance(event, PNSGD):
        _check_pnsgd_support(event, path)
        return
    if isinstance(event, PoissonSampled):
        inner = event.event
        if not isinstance(inner, Gaussian):
            raise ValueError(
                f"{path}: the RDP accountant supports PoissonSampled only of a Gaussian event (the sampled "
                f"Gaussian analysis); got PoissonSampled({type(inner).__name__})."
            )
        if inner.relation != "add_remove":
            raise ValueError(
                f"{path}: the Poisson-sampled Gaussian RDP analysis covers relation 'add_remove' only; got "
                f"relation {inner.relation!r}."
            )
        return
    if isinstance(event, SelfComposed):
        _check_rdp_support(event.event, f"{path}.event")
        return
    if isinstance(event, Composed):
        for i, e in enumerate(event.events):
            _check_rdp_support(e, f"{path}.events[{i}]")
        return
    raise TypeError(f"{path}: not a privacy event: {type(event).__name__}")


def _check_pnsgd_support(ev: PNSGD, path: str) -> None:
    if ev.relation != "replace_one":
        raise ValueError(
            f"{path}: the PNSGD analyses cover relation 'replace_one' only (records replaced in a fixed "
            f"order); got relation {ev.relation!r}."
        )
    if ev.schedule == "random_stop":
        if not ev.hidden:
            raise ValueError(
                f"{path}: PNSGD with schedule='random_stop' and hidden=False is not supported (releasing "
                "every iterate reveals the stopping time)."
            )
        if ev.batch_size != 1 or ev.passes != 1:
            raise ValueError(
                f"{path}: the random-stop PNSGD analyses need batch_size=1 and passes=1; got batch_size="
                f"{ev.batch_size}, passes={ev.passes}."
            )


def _validate_leaves(event: Event, path: str = "event") -> None:
    """Eager checks of concrete leaves, naming the field (tracers pass unchecked)."""
    chk = _validate.check_in_range
    if isinstance(event, (Gaussian, Laplace)):
        chk(f"{path}.noise_multiplier ({type(event).__name__})", event.noise_multiplier, 0.0, math.inf, lo_open=True)
    elif isinstance(event, PoissonSampled):
        chk(f"{path}.q (PoissonSampled)", event.q, 0.0, 1.0)
        _validate_leaves(event.event, f"{path}.event")
    elif isinstance(event, SelfComposed):
        chk(f"{path}.count (SelfComposed)", event.count, 0.0, math.inf)
        _validate_leaves(event.event, f"{path}.event")
    elif isinstance(event, Composed):
        for i, e in enumerate(event.events):
            _validate_leaves(e, f"{path}.events[{i}]")
    elif isinstance(event, PNSGD):
        p = f"{path}.{{}} (PNSGD)"
        chk(p.format("lipschitz"), event.lipschitz, 0.0, math.inf)
        chk(p.format("smoothness"), event.smoothness, 0.0, math.inf, lo_open=True)
        chk(p.format("noise_std"), event.noise_std, 0.0, math.inf, lo_open=True)
        chk(p.format("diameter"), event.diameter, 0.0, math.inf, lo_open=True)
        chk(p.format("strong_convexity"), event.strong_convexity, 0.0, math.inf)
        chk(p.format("learning_rate"), event.learning_rate, 0.0, math.inf, lo_open=True)
        leaves = (event.learning_rate, event.smoothness, event.strong_convexity)
        if _validate.is_concrete(list(leaves)):
            eta, beta, rho = (np.asarray(x, dtype=np.float64) for x in leaves)
            if np.any(rho > beta):
                raise ValueError(f"{path}.strong_convexity (PNSGD) must be <= smoothness; got {rho} > {beta}.")
            if np.any(eta * (beta + rho) >= 2.0):
                raise ValueError(
                    f"{path}.learning_rate (PNSGD) must be < 2/(smoothness + strong_convexity); got {eta}."
                )
    elif isinstance(event, DPSBCD):
        _p_dpsbcd_rdp([2.0], event)  # eager validation, naming the parameter
    else:
        raise TypeError(f"{path}: not a privacy event: {type(event).__name__}")


def _prepare(event: Event) -> None:
    if not isinstance(event, Event):
        raise TypeError(f"event must be a privacy event (Gaussian, PoissonSampled, ...); got {type(event).__name__}.")
    relation_of(event)
    _check_rdp_support(event)
    _validate_leaves(event)


# =======================================================================================
# RDP curves.
# =======================================================================================


def _pnsgd_step_ok(ev: PNSGD):
    eta, beta, rho = f64(ev.learning_rate), f64(ev.smoothness), f64(ev.strong_convexity)
    return (eta > 0) & (beta > 0) & (rho >= 0) & (rho <= beta) & (eta * (beta + rho) < 2.0)


def _last_batch(ev: PNSGD) -> int:
    n, b = ev.num_records, ev.batch_size
    return n - (-(-n // b) - 1) * b


def _pnsgd_rdp(ev: PNSGD, orders: np.ndarray):
    n = ev.num_records
    if ev.schedule == "random_stop":
        curve = _p_stop_pnsgd_iteration_rdp(orders, 1, ev)
    elif ev.hidden:
        # The last record is the worst for both curves (each is non-decreasing in the
        # position); at each order the smaller of two valid RDP bounds is valid.
        curve = _p_pnsgd_iteration_rdp(orders, n, ev)
        mu = _p_pnsgd_shifted_gdp(n, ev)
        curve = jnp.minimum(curve, 0.5 * f64(orders) * (mu**2)[..., None])
    else:
        # Every iterate released: the record's k steps, each a Gaussian mechanism with
        # sensitivity 2L/b_n over noise σ, compose to one with ratio r = 2L√k/(b_n σ).
        r = 2.0 * f64(ev.lipschitz) * math.sqrt(ev.passes) / (_last_batch(ev) * f64(ev.noise_std))
        ok = (f64(ev.lipschitz) >= 0) & (r >= 0) & jnp.isfinite(r)
        curve = jnp.where(ok[..., None], f64(orders) * (0.5 * jnp.where(ok, r, 0.0) ** 2)[..., None], jnp.nan)
    return jnp.where(_pnsgd_step_ok(ev)[..., None], curve, jnp.nan)


def _rdp_tree(event: Event, orders: np.ndarray):
    if isinstance(event, Gaussian):
        return _p_gaussian_rdp(orders, event.noise_multiplier)
    if isinstance(event, Laplace):
        return _p_laplace_rdp(orders, event.noise_multiplier)
    if isinstance(event, PoissonSampled):
        return _p_sampled_gaussian_rdp(orders, event.q, event.event.noise_multiplier)
    if isinstance(event, SelfComposed):
        count = f64(event.count)
        inner = _rdp_tree(event.event, orders)
        n = jnp.ceil(jnp.where(count >= 0, count, 0.0))[..., None]
        # count = 0 composes nothing (0, even where the inner curve is +inf).
        out = jnp.where(n > 0, n * inner, 0.0)
        return jnp.where((count >= 0)[..., None], out, jnp.nan)
    if isinstance(event, Composed):
        total = jnp.zeros((len(orders),))
        for e in event.events:
            total = total + _rdp_tree(e, orders)
        return total
    if isinstance(event, PNSGD):
        return _pnsgd_rdp(event, orders)
    if isinstance(event, DPSBCD):
        return _p_dpsbcd_rdp(orders, event)
    raise TypeError(f"not a privacy event: {type(event).__name__}")


@float64
def rdp(event: Event, orders=DEFAULT_ORDERS) -> jax.Array:
    r"""The RDP curve of an event: :math:`ε(α)` at each order, composed additively.

    Gaussian: :math:`α/(2σ^2)`; Laplace: :func:`laplace_rdp`; Poisson-sampled Gaussian
    (add/remove-one only): :func:`sampled_gaussian_rdp`; ``SelfComposed``: ⌈count⌉ times
    the inner curve; ``Composed``: the sum (Mironov 2017, Proposition 1); PNSGD: the
    worst record's curve (see :class:`PNSGD`).

    Args:
      event: a privacy event (a batch if its leaves have leading axes; they broadcast).
      orders: Rényi orders > 1, a concrete 1-D sequence (static), default dp_accounting's 156.

    Returns:
      float64 array of shape ``batch + (k,)``; NaN under ``jit`` for invalid leaves.

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> [round(float(v), 6) for v in A.rdp(A.SelfComposed(A.Gaussian(2.0), 3), [2.0, 8.0])]
      [0.75, 3.0]
    """
    _prepare(event)
    orders_np = _validate.concrete_orders(orders)
    return _rdp_tree(event, orders_np)


def _map_pnsgd(fn, ev: PNSGD, *args):
    """Apply ``fn(ev, *args)`` (scalar leaves) over the broadcast batch of ``ev`` and ``args``."""
    leaves, treedef = jax.tree_util.tree_flatten(ev)
    vals = [f64(x) for x in leaves] + [f64(a) for a in args]
    shape = jnp.broadcast_shapes(*(v.shape for v in vals))
    if shape == ():
        return fn(jax.tree_util.tree_unflatten(treedef, vals[: len(leaves)]), *vals[len(leaves):])
    flat = [jnp.broadcast_to(v, shape).reshape(-1) for v in vals]

    def one(*xs):
        return fn(jax.tree_util.tree_unflatten(treedef, list(xs[: len(leaves)])), *xs[len(leaves):])

    out = jax.vmap(one)(*flat)
    return out.reshape(shape + out.shape[1:])


# =======================================================================================
# The "rdp" accountant.
# =======================================================================================


def _pnsgd_epsilon_one(ev: PNSGD, target_delta, orders):
    """ε of the worst record of one (scalar) PNSGD run."""
    n = ev.num_records
    if ev.schedule == "random_stop":
        m_c = _p_step_contraction(ev.learning_rate, ev.smoothness, ev.strong_convexity)
        e_c = _p_stop_pnsgd_contraction_epsilon(target_delta, 1, ev, m_c)
        e_r = _p_rdp_to_epsilon(_p_stop_pnsgd_iteration_rdp(orders, 1, ev), orders, target_delta)
        out = jnp.minimum(e_c, e_r)
        return jnp.where(_pnsgd_step_ok(ev), out, jnp.nan)
    res = _p_pnsgd_privacy(ev, target_delta, positions=jnp.asarray([float(n)]))
    return (res.best if ev.hidden else res.composition)[0]


def _pnsgd_delta_one(ev: PNSGD, target_epsilon, orders):
    n = ev.num_records
    m_c = _p_step_contraction(ev.learning_rate, ev.smoothness, ev.strong_convexity)
    if ev.schedule == "random_stop":
        d_c = _p_stop_pnsgd_contraction_delta(target_epsilon, 1, ev, m_c)
        d_r = _p_rdp_to_delta(_p_stop_pnsgd_iteration_rdp(orders, 1, ev), orders, target_epsilon)
        out = jnp.minimum(d_c, d_r)
    else:
        r = 2.0 * ev.lipschitz * math.sqrt(ev.passes) / (_last_batch(ev) * ev.noise_std)
        d_g = _p_gaussian_hockey_stick(target_epsilon, r)  # composition: every iterate released
        if ev.hidden:
            d_c = _p_pnsgd_contraction_delta(target_epsilon, n, ev, m_c)
            # Feldman et al.'s RDP is linear in the order: the classic conversion at the best
            # continuous order, and the improved one on the orders grid.
            curve = _p_pnsgd_iteration_rdp(orders, n, ev)
            coef = _p_pnsgd_iteration_rdp(np.array([2.0]), n, ev)[..., 0] / 2.0
            d_i = jnp.minimum(_p_linear_rdp_delta(target_epsilon, coef),
                              _p_rdp_to_delta(curve, orders, target_epsilon))
            # Shifted interpolation: μ-GDP, exact δ(ε) = θ_{e^ε}(μ).
            d_s = _p_gaussian_hockey_stick(target_epsilon, _p_pnsgd_shifted_gdp(n, ev))
            out = jnp.minimum(jnp.minimum(jnp.minimum(d_c, d_i), d_g), d_s)
        else:
            out = d_g
    return jnp.where(_pnsgd_step_ok(ev), out, jnp.nan)


def _rdp_epsilon(event: Event, target_delta, orders: np.ndarray):
    if isinstance(event, PNSGD):
        # A lone PNSGD run gets its own (ε, δ) analyses, tighter than its RDP curve.
        return _map_pnsgd(lambda ev, d: _pnsgd_epsilon_one(ev, d, orders), event, target_delta)
    return _p_rdp_to_epsilon(_rdp_tree(event, orders), orders, target_delta)


def _rdp_delta(event: Event, target_epsilon, orders: np.ndarray):
    if isinstance(event, PNSGD):
        return _map_pnsgd(lambda ev, e: _pnsgd_delta_one(ev, e, orders), event, target_epsilon)
    return _p_rdp_to_delta(_rdp_tree(event, orders), orders, target_epsilon)


class _Accountant(NamedTuple):
    epsilon: Callable
    delta: Callable


_BUILTIN_RDP = _Accountant(_rdp_epsilon, _rdp_delta)
_ACCOUNTANTS: dict[str, _Accountant] = {"rdp": _BUILTIN_RDP}


def register_accountant(name: str, *, epsilon: Callable, delta: Callable) -> None:
    """Make an accountant available to :func:`epsilon` and :func:`delta` as ``accountant=name``.

    Args:
      name: the accountant's name (a new one; ``"rdp"`` is built in and cannot be replaced).
      epsilon: ``epsilon(event, delta, orders) -> ε`` (δ broadcast against the event batch).
      delta: ``delta(event, epsilon, orders) -> δ``.

    Each function receives a validated event (relations consistent, concrete leaves in
    range) and must raise ``ValueError`` naming any event type or relation it does not
    cover. It should return +inf (ε) or 1 (δ) where it cannot certify a bound.

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> A.register_accountant("pure", epsilon=lambda ev, d, o: 1.0 / ev.noise_multiplier,
      ...                       delta=lambda ev, e, o: 0.0)
      >>> float(A.epsilon(A.Laplace(2.0), 1e-5, accountant="pure"))
      0.5
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string; got {name!r}.")
    if name == "rdp":
        raise ValueError("accountant 'rdp' is built in and cannot be replaced.")
    if not (callable(epsilon) and callable(delta)):
        raise TypeError("epsilon and delta must be callables.")
    _ACCOUNTANTS[name] = _Accountant(epsilon, delta)


def _lookup(accountant: str) -> _Accountant:
    if accountant not in _ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {', '.join(repr(k) for k in _ACCOUNTANTS)}; got {accountant!r}.")
    return _ACCOUNTANTS[accountant]


@float64
def epsilon(event: Event, delta, *, orders=DEFAULT_ORDERS, accountant: str = "rdp") -> jax.Array:
    r"""ε at which the event is (ε, δ)-DP under its neighbouring relation.

    With ``accountant="rdp"``: the RDP curves of the tree compose additively and convert
    once, :math:`ε = \min_α \mathrm{conv}_δ(\sum ε_i(α))` (:func:`rdp_to_epsilon`, the
    improved conversion); a lone :class:`PNSGD` event uses its own analyses (see there).
    ``epsilon(dpsgd_event(q, s, T), δ) == dpsgd_epsilon(q, s, T, δ)``.

    Args:
      event: a privacy event (a batch of events if its leaves have leading axes).
      delta: target δ in (0, 1), broadcast against the batch.
      orders: Rényi orders (static), default the 156 of dp_accounting.
      accountant: a registered accountant name (static), default ``"rdp"``.

    Returns:
      float64 ε ≥ 0 of the broadcast batch shape. Unsupported event types or relations
      raise ``ValueError`` (also under ``jit``: they are structural); invalid leaf values
      raise ``ValueError`` naming the field when concrete, and give NaN under ``jit``.

    References:
      I. Mironov, "Rényi Differential Privacy", CSF 2017, Proposition 1 (composition);
      C. Canonne, G. Kamath, T. Steinke, NeurIPS 2020, Proposition 12 (conversion).

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> ev = A.Composed((A.dpsgd_event(0.01, 1.0, 1000), A.Gaussian(10.0)))
      >>> round(float(A.epsilon(ev, 1e-5)), 4)
      2.1404
    """
    acc = _lookup(accountant)
    _prepare(event)
    _validate.check_delta(delta)
    orders_np = _validate.concrete_orders(orders)
    if acc is _BUILTIN_RDP:  # validated above: one compiled program (see _rdp_jit)
        return _rdp_jit(event, f64(delta), tuple(orders_np.tolist()), "epsilon")
    return acc.epsilon(event, f64(delta), orders_np)


@float64
def delta(event: Event, epsilon, *, orders=DEFAULT_ORDERS, accountant: str = "rdp") -> jax.Array:
    r"""δ at which the event is (ε, δ)-DP for the given ε (the inverse of :func:`epsilon`).

    With ``accountant="rdp"``: :func:`rdp_to_delta` of the composed RDP curve; a lone
    :class:`PNSGD` event takes the smallest δ of its analyses (contraction, composition,
    and the RDP analyses converted on the ``orders`` grid; the strongly convex analysis is
    not inverted). Where :func:`epsilon` took a PNSGD ε from an RDP bound optimised over
    continuous orders or from the strongly convex analysis, δ at that ε can exceed the
    target slightly: each value is a valid bound, the pair is not an exact inverse.

    Args:
      event: a privacy event (batches broadcast).
      epsilon: ε ≥ 0.
      orders, accountant: as in :func:`epsilon`.

    Returns:
      float64 δ in [0, 1], batch shape (NaN under ``jit`` for invalid leaves).

    Examples:
      >>> import jaxdp
      >>> A = jaxdp.accounting
      >>> float(A.delta(A.dpsgd_event(256 / 60000, 1.1, 14040), 2.594364)) <= 1e-5
      True
    """
    acc = _lookup(accountant)
    _prepare(event)
    _validate.check_in_range("epsilon", epsilon, 0.0, math.inf)
    orders_np = _validate.concrete_orders(orders)
    if acc is _BUILTIN_RDP:
        return _rdp_jit(event, f64(epsilon), tuple(orders_np.tolist()), "delta")
    return acc.delta(event, f64(epsilon), orders_np)


@persistent("event_rdp", static_argnums=(2, 3))
@functools.partial(jax.jit, static_argnums=(2, 3))
def _rdp_jit(event: Event, value, orders_key: tuple, which: str):
    # The built-in RDP accountant as one compiled program per event structure and orders
    # grid: an eager call then compiles once instead of dispatching (and compiling) each
    # operation separately (first call 3.5 s -> under 2 s). The event was validated eagerly
    # by the caller; inside a caller's jit/vmap/grad this jit is inlined.
    orders = np.asarray(orders_key, dtype=np.float64)
    return (_rdp_epsilon if which == "epsilon" else _rdp_delta)(event, value, orders)


@float64
def pnsgd_record_epsilon(event: PNSGD, delta, *, orders=DEFAULT_ORDERS) -> jax.Array:
    """ε of every record position 1..n of a PNSGD run (the per-record vector).

    The analyses are those of :class:`PNSGD`; the last entry (fixed schedule) or the first
    (random stop) is the worst record, which :func:`epsilon` reports.

    Args:
      event: a :class:`PNSGD` event (a batch if its leaves have leading axes).
      delta: target δ in (0, 1).
      orders: Rényi orders (static), used by the random-stop RDP analysis.

    Returns:
      float64 array ``batch + (num_records,)``.

    Examples:
      >>> import jaxdp
      >>> ev = jaxdp.accounting.PNSGD(1.0, 0.5, 0.5, 2.0, 1.0, num_records=40)
      >>> e = jaxdp.accounting.pnsgd_record_epsilon(ev, 1e-5)
      >>> [round(float(e[i]), 6) for i in (0, 38, 39)]
      [0.0, 2.754009, 4.377178]
    """
    if not isinstance(event, PNSGD):
        raise ValueError(f"pnsgd_record_epsilon needs a PNSGD event; got {type(event).__name__}.")
    _prepare(event)
    _validate.check_delta(delta)
    orders_np = _validate.concrete_orders(orders)
    positions = jnp.arange(1, event.num_records + 1, dtype=jnp.float64)

    def one(ev, d):
        if ev.schedule == "random_stop":
            m_c = _p_step_contraction(ev.learning_rate, ev.smoothness, ev.strong_convexity)
            e_c = _p_stop_pnsgd_contraction_epsilon(d, positions, ev, m_c)
            e_r = _p_rdp_to_epsilon(_p_stop_pnsgd_iteration_rdp(orders_np, positions, ev), orders_np, d)
            return jnp.where(_pnsgd_step_ok(ev), jnp.minimum(e_c, e_r), jnp.nan)
        res = _p_pnsgd_privacy(ev, d, positions=positions)
        return res.best if ev.hidden else res.composition

    return _map_pnsgd(one, event, f64(delta))


# The "pld" accountant: privacy loss distributions composed by FFT (see _pld.py).
from ._pld import _accountant_delta, _accountant_epsilon  # noqa: E402

register_accountant("pld", epsilon=_accountant_epsilon, delta=_accountant_delta)
