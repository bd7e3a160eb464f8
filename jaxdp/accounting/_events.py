r"""Privacy events: a pipeline described as data (the tree only).

An *event* says what a pipeline did with the data, in the vocabulary of dp_accounting's
``DpEvent`` tree: a Gaussian or Laplace mechanism, Poisson sampling of an event, an
event repeated ``count`` times, a composition of events, a projected noisy SGD run and a
DP-SBCD run. Events are immutable JAX pytrees: their numeric fields (noise multipliers,
rates, counts, the PNSGD constants) are leaves, and everything that fixes a shape or an
analysis (the kind of event, the number of composed events, the record and batch counts
of a PNSGD run, the neighbouring relation) is static. So

* ``jax.jit(lambda ev: epsilon(ev, 1e-5))`` compiles once per tree structure, whatever
  the values;
* an event whose leaves carry a leading axis is a *batch* of events, and every
  evaluation broadcasts over it (or ``jax.vmap`` maps over it);
* ``jax.grad`` of ε with respect to any leaf is available.

Every event carries the neighbouring relation under which its noise multiplier is
measured (``"add_remove"``: add or remove one record; ``"replace_one"``: replace one
record), and an analysis that does not cover the relation raises ``ValueError`` naming
it. A :class:`Composed` event must have one relation throughout (see :func:`relation_of`).

This module holds the tree, its relation and the eager checks of its leaves; it knows no
accountant. Evaluation (:func:`~jaxdp.accounting.epsilon`, ``delta``, ``rdp``) and the
accountant registry are in ``_accountants.py``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from .. import _validate
from .._pytree import register_dataclass
from ._dpsbcd import _check as _check_dpsbcd

__all__ = [
    "Event",
    "Gaussian",
    "Laplace",
    "ApproxDP",
    "PoissonSampled",
    "SelfComposed",
    "Composed",
    "PNSGD",
    "DPSBCD",
    "RELATIONS",
    "dpsgd_event",
    "relation_of",
]

# Event types defined in other modules (the sampling schemes of _sampling.py): their
# relation and eager leaf checks, registered by that module (this one imports no other).
_EXTENSIONS: dict[type, tuple] = {}


def register_event_type(cls: type, *, relation, check) -> None:
    """Let :func:`relation_of` and :func:`check_leaves` handle an event type defined elsewhere.

    ``relation(event) -> str``; ``check(event, path, check_in_range, recurse)`` checks the
    concrete leaves (``recurse(inner, path)`` checks an inner event).
    """
    _EXTENSIONS[cls] = (relation, check)

RELATIONS = ("add_remove", "replace_one")
_SCHEDULES = ("fixed", "random_stop")
_SAMPLINGS = ("sequential", "poisson", "shuffle")


def _check_pnsgd_sampling(ev) -> None:
    """The static fields of a PNSGD run's batch sampling (see :class:`PNSGD`)."""
    extra = {"q": ev.q, "num_steps": ev.num_steps, "max_batch_size": ev.max_batch_size}
    if ev.sampling in ("sequential", "shuffle"):
        given = [k for k, v in extra.items() if v is not None]
        if given:
            raise ValueError(f"PNSGD.{given[0]} is a field of Poisson sampling only; set sampling='poisson' or "
                             f"leave it None.")
        if ev.sampling == "shuffle" and (ev.relation != "replace_one" or ev.schedule != "fixed"):
            raise ValueError("PNSGD with sampling='shuffle' is analysed under relation='replace_one' and "
                             f"schedule='fixed'; got relation {ev.relation!r}, schedule {ev.schedule!r}.")
        return
    if ev.relation != "add_remove":
        raise ValueError("PNSGD with sampling='poisson' is analysed under relation='add_remove' (the relation of "
                         f"Poisson sampling); got relation {ev.relation!r}.")
    if ev.schedule != "fixed" or ev.passes != 1:
        raise ValueError("PNSGD with sampling='poisson' takes num_steps (schedule='fixed', passes=1); got "
                         f"schedule={ev.schedule!r}, passes={ev.passes}.")
    q = ev.q
    if isinstance(q, bool) or not isinstance(q, (int, float, np.integer, np.floating)) or not 0.0 <= float(q) <= 1.0:
        raise ValueError(f"PNSGD.q must be a Python number in [0, 1] with sampling='poisson' (it is static); "
                         f"got {q!r}.")
    for name in ("num_steps", "max_batch_size"):
        v = getattr(ev, name)
        if name == "max_batch_size" and v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"PNSGD.{name} must be a Python int >= 1 with sampling='poisson' (it is static); got "
                             f"{v!r}.")


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


@_event(data=("epsilon", "delta"), meta=("relation",))
class ApproxDP(Event):
    r"""An external (ε, δ)-DP guarantee (a mechanism known only by its privacy parameters).

    Its dominating pair (Kairouz, Oh, Viswanath 2015; dp_accounting's
    ``from_privacy_parameters``): P puts δ on a point Q misses, and (1 - δ)e^ε/(1 + e^ε),
    (1 - δ)/(1 + e^ε) on two points where Q puts them swapped; every (ε, δ)-DP mechanism is
    a post-processing of it, so it composes exactly under the PLD accountant
    (``accountant="pld"``, also Poisson-sampled). It has no RDP curve for δ > 0.

    Attributes:
      epsilon: ε ≥ 0 (a leaf).
      delta: δ in [0, 1) (a leaf).
      relation: ``"add_remove"`` (default) or ``"replace_one"`` (static): the relation the
        guarantee holds under.
    """

    epsilon: Any
    delta: Any
    relation: str = "add_remove"

    def __post_init__(self):
        _check_relation("ApproxDP", self.relation)


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
    meta=("num_records", "batch_size", "passes", "schedule", "hidden", "relation", "sampling", "q", "num_steps",
          "max_batch_size"),
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
      Feldman et al.'s Theorem 26 RDP (``form="logmeanexp"``), and per record the
      composition bound too. Needs ``passes=1``; with ``batch_size`` b > 1 the batches are
      the steps (Lipschitz constant L/b_min, see :func:`pnsgd_privacy`).
    * ``sampling="shuffle"`` (``passes`` passes, each over a fresh secret uniformly random
      permutation cut into consecutive batches of ``batch_size``; ``relation="replace_one"``,
      ``schedule="fixed"``): with ``hidden=True`` the hidden-state bound of
      :func:`shuffle_pnsgd_rdp` (log-mean-exp over the record's secret batch; flat in the
      passes once below composition), which includes composition, and its hockey-stick
      mixture (:func:`shuffle_pnsgd_epsilon`) for ε and δ; with
      ``hidden=False`` the passes composed. Every record gets the same ε.
    * ``sampling="poisson"`` (``num_steps`` T steps, each on a Poisson sample at rate ``q``,
      cut to ``max_batch_size`` B records when more are drawn, the gradient sum divided by
      the fixed ``batch_size`` b; ``relation="add_remove"``): with ``hidden=True`` the
      hidden-state bound of :func:`poisson_pnsgd_rdp` (flat in T after a burn-in), which
      includes plain composition; with ``hidden=False`` the composition of the T sampled
      steps. Every record gets the same ε. Needs :math:`ηβB/b ≤ 2` (B = n + 1 when uncut).

    Attributes:
      lipschitz, smoothness, learning_rate, noise_std, diameter, strong_convexity: L ≥ 0,
        β > 0, 0 < η < 2/(β+ρ), σ > 0, D > 0, ρ in [0, β] (leaves).
      num_records, batch_size, passes: n ≥ 1, b ≥ 1, k ≥ 1 (static Python ints).
      schedule: ``"fixed"`` or ``"random_stop"`` (static).
      hidden: whether intermediate iterates are hidden (static).
      relation: ``"replace_one"`` (fixed-order analyses) or ``"add_remove"`` (Poisson
        sampling; static).
      sampling: ``"sequential"`` (consecutive batches in a fixed order; default),
        ``"shuffle"`` (a fresh secret permutation every pass) or ``"poisson"`` (static).
      q, num_steps, max_batch_size: Poisson sampling only: the rate in [0, 1], T ≥ 1 and
        B ≥ 1 or None (static Python numbers).

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
    sampling: str = "sequential"
    q: Any = None
    num_steps: int | None = None
    max_batch_size: int | None = None

    def __post_init__(self):
        _check_relation("PNSGD", self.relation)
        _validate.check_static_choice("PNSGD.schedule", self.schedule, _SCHEDULES)
        _validate.check_static_choice("PNSGD.sampling", self.sampling, _SAMPLINGS)
        _check_pnsgd_sampling(self)
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
# Structure: relations and eager leaf checks (the accountants check their own support).
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
    if isinstance(event, (Gaussian, Laplace, ApproxDP, PNSGD, DPSBCD)):
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
    if type(event) in _EXTENSIONS:
        return _EXTENSIONS[type(event)][0](event)
    raise TypeError(f"not a privacy event: {type(event).__name__}")


def check_leaves(event: Event, path: str = "event") -> None:
    """Eager checks of concrete leaves, naming the field (tracers pass unchecked)."""
    chk = _validate.check_in_range
    if isinstance(event, (Gaussian, Laplace)):
        chk(f"{path}.noise_multiplier ({type(event).__name__})", event.noise_multiplier, 0.0, math.inf, lo_open=True)
    elif isinstance(event, ApproxDP):
        chk(f"{path}.epsilon (ApproxDP)", event.epsilon, 0.0, math.inf)
        chk(f"{path}.delta (ApproxDP)", event.delta, 0.0, 1.0, hi_open=True)
    elif isinstance(event, PoissonSampled):
        chk(f"{path}.q (PoissonSampled)", event.q, 0.0, 1.0)
        check_leaves(event.event, f"{path}.event")
    elif isinstance(event, SelfComposed):
        chk(f"{path}.count (SelfComposed)", event.count, 0.0, math.inf)
        check_leaves(event.event, f"{path}.event")
    elif isinstance(event, Composed):
        for i, e in enumerate(event.events):
            check_leaves(e, f"{path}.events[{i}]")
    elif isinstance(event, PNSGD):
        p = f"{path}.{{}} (PNSGD)"
        chk(p.format("lipschitz"), event.lipschitz, 0.0, math.inf)
        chk(p.format("smoothness"), event.smoothness, 0.0, math.inf, lo_open=event.sampling != "poisson")
        chk(p.format("noise_std"), event.noise_std, 0.0, math.inf, lo_open=True)
        chk(p.format("diameter"), event.diameter, 0.0, math.inf, lo_open=True)
        chk(p.format("strong_convexity"), event.strong_convexity, 0.0, math.inf)
        chk(p.format("learning_rate"), event.learning_rate, 0.0, math.inf, lo_open=True)
        leaves = (event.learning_rate, event.smoothness, event.strong_convexity)
        if event.sampling == "poisson":
            chk(p.format("q"), event.q, 0.0, 1.0)
            if event.hidden and _validate.is_concrete(list(leaves)):
                # Every batch's step must be a contraction: ηβB/b ≤ 2, B the largest batch.
                eta, beta = (np.asarray(x, dtype=np.float64) for x in leaves[:2])
                cap = event.num_records + 1 if event.max_batch_size is None else min(event.max_batch_size,
                                                                                     event.num_records + 1)
                if np.any(eta * beta * cap > 2.0 * event.batch_size):
                    raise ValueError(
                        f"{path}.learning_rate (PNSGD, Poisson batches) must be at most "
                        f"2*batch_size/(smoothness*{cap}) (the largest batch must give a contractive step); got {eta}.")
        elif _validate.is_concrete(list(leaves)):
            eta, beta, rho = (np.asarray(x, dtype=np.float64) for x in leaves)
            if np.any(rho > beta):
                raise ValueError(f"{path}.strong_convexity (PNSGD) must be <= smoothness; got {rho} > {beta}.")
            if np.any(eta * (beta + rho) >= 2.0):
                raise ValueError(
                    f"{path}.learning_rate (PNSGD) must be < 2/(smoothness + strong_convexity); got {eta}."
                )
    elif isinstance(event, DPSBCD):
        # dpsbcd_rdp's own checks, naming the parameter.
        _check_dpsbcd(event.noise_temperature, event.learning_rate, event.sensitivity, event.contraction,
                      event.prox_lipschitz, event.num_records, event.batch_size, None)
    elif type(event) in _EXTENSIONS:
        _EXTENSIONS[type(event)][1](event, path, chk, check_leaves)
    else:
        raise TypeError(f"{path}: not a privacy event: {type(event).__name__}")


def check_event(event: Event) -> str:
    """Eager checks every accountant needs: an event, one relation, concrete leaves in range.

    Returns the relation (:func:`relation_of`). What an accountant supports is its own check.
    """
    if not isinstance(event, Event):
        raise TypeError(f"event must be a privacy event (Gaussian, PoissonSampled, ...); got {type(event).__name__}.")
    rel = relation_of(event)
    check_leaves(event)
    return rel
