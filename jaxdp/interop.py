"""Conversion between jaxdp's privacy events and dp_accounting's ``DpEvent`` trees.

dp_accounting is optional: it is imported when a conversion runs, and a missing install
raises ``ImportError`` saying how to get it. dp_accounting's events carry no
neighbouring relation (its accountants take one), so :func:`from_dp_event` takes the
relation to attach, and :func:`to_dp_event` returns the relation beside the tree.

Supported: ``GaussianDpEvent``, ``LaplaceDpEvent``, ``PoissonSampledDpEvent``,
``SelfComposedDpEvent``, ``ComposedDpEvent``, ``SampledWithoutReplacementDpEvent`` and
``SampledWithReplacementDpEvent`` (replace-one only), ``TruncatedSubsampledGaussianDpEvent``
(add/remove-one only), ``RandomizedResponseDpEvent`` (replace-one only), ``ZCDpEvent`` and
``SingleEpochTreeAggregationDpEvent`` (dp_accounting accounts the last under
``REPLACE_SPECIAL``; jaxdp attaches the relation you pass). A
:class:`~jaxdp.accounting.PNSGD` event has no dp_accounting counterpart.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from . import accounting as ev

__all__ = ["from_dp_event", "to_dp_event", "DpEventWithRelation"]

_SUPPORTED = ("GaussianDpEvent, LaplaceDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent, ComposedDpEvent, "
              "SampledWithoutReplacementDpEvent, SampledWithReplacementDpEvent, TruncatedSubsampledGaussianDpEvent, "
              "RandomizedResponseDpEvent, ZCDpEvent, SingleEpochTreeAggregationDpEvent")


def _dp_event_module():
    try:
        from dp_accounting import dp_event
    except ImportError as exc:  # pragma: no cover - exercised only without the package
        raise ImportError(
            "jaxdp.interop needs the optional package dp-accounting (pip install dp-accounting)."
        ) from exc
    return dp_event


class DpEventWithRelation(NamedTuple):
    """A dp_accounting ``DpEvent`` and the neighbouring relation its accountant must use.

    ``relation`` is ``"add_remove"`` (dp_accounting's ``NeighboringRelation.ADD_OR_REMOVE_ONE``)
    or ``"replace_one"`` (``NeighboringRelation.REPLACE_ONE``).
    """

    dp_event: Any
    relation: str


def from_dp_event(dp_event, relation: str = "add_remove") -> ev.Event:
    """A jaxdp event equal to a dp_accounting ``DpEvent`` tree.

    Args:
      dp_event: a ``GaussianDpEvent``, ``LaplaceDpEvent``, ``PoissonSampledDpEvent``,
        ``SelfComposedDpEvent`` or ``ComposedDpEvent`` tree.
      relation: the neighbouring relation under which the tree's noise multipliers are
        measured (the relation of the dp_accounting accountant it was meant for):
        ``"add_remove"`` (default) or ``"replace_one"``.

    Returns:
      The jaxdp event (leaves are Python floats).

    Raises:
      ValueError: for an event type jaxdp does not model, naming it.

    Examples:
      >>> import dp_accounting, jaxdp.interop
      >>> e = dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.1))
      >>> jaxdp.interop.from_dp_event(dp_accounting.SelfComposedDpEvent(e, 100))
      SelfComposed(event=PoissonSampled(q=0.01, event=Gaussian(noise_multiplier=1.1, relation='add_remove')), count=100)
    """
    dpe = _dp_event_module()
    if relation not in ev.RELATIONS:
        raise ValueError(f"relation must be one of {', '.join(map(repr, ev.RELATIONS))}; got {relation!r}.")
    if isinstance(dp_event, dpe.GaussianDpEvent):
        return ev.Gaussian(dp_event.noise_multiplier, relation=relation)
    if isinstance(dp_event, dpe.LaplaceDpEvent):
        return ev.Laplace(dp_event.noise_multiplier, relation=relation)
    if isinstance(dp_event, dpe.PoissonSampledDpEvent):
        return ev.PoissonSampled(dp_event.sampling_probability, from_dp_event(dp_event.event, relation))
    if isinstance(dp_event, dpe.SelfComposedDpEvent):
        return ev.SelfComposed(from_dp_event(dp_event.event, relation), dp_event.count)
    if isinstance(dp_event, dpe.ComposedDpEvent):
        return ev.Composed(tuple(from_dp_event(e, relation) for e in dp_event.events))
    fixed = (dpe.SampledWithoutReplacementDpEvent, dpe.SampledWithReplacementDpEvent)
    if isinstance(dp_event, fixed):
        name = type(dp_event).__name__
        if relation != "replace_one":
            raise ValueError(f"from_dp_event: {name} is analysed under replace-one neighbours (dp_accounting's "
                             f"REPLACE_ONE); pass relation='replace_one', got {relation!r}.")
        inner = from_dp_event(dp_event.event, relation)
        if isinstance(dp_event, dpe.SampledWithoutReplacementDpEvent):
            return ev.SampledWithoutReplacement(dp_event.source_dataset_size, dp_event.sample_size, inner)
        return ev.SampledWithReplacement(dp_event.source_dataset_size, int(dp_event.sample_size), inner)
    if isinstance(dp_event, dpe.TruncatedSubsampledGaussianDpEvent):
        if relation != "add_remove":
            raise ValueError("from_dp_event: jaxdp analyses TruncatedSubsampledGaussianDpEvent under add/remove-one "
                             f"neighbours only; pass relation='add_remove', got {relation!r}.")
        return ev.TruncatedPoissonSampled(dp_event.sampling_probability, dp_event.dataset_size,
                                          dp_event.truncated_batch_size, ev.Gaussian(dp_event.noise_multiplier))
    if isinstance(dp_event, dpe.RandomizedResponseDpEvent):
        if relation != "replace_one":
            raise ValueError("from_dp_event: jaxdp analyses RandomizedResponseDpEvent under replace-one neighbours "
                             f"(dp_accounting's REPLACE_ONE) only; pass relation='replace_one', got {relation!r}.")
        return ev.RandomizedResponse(dp_event.noise_parameter, dp_event.num_buckets)
    if isinstance(dp_event, dpe.ZCDpEvent):
        return ev.ZCDP(dp_event.rho, dp_event.xi, relation=relation)
    if isinstance(dp_event, dpe.SingleEpochTreeAggregationDpEvent):
        counts = dp_event.step_counts
        counts = (counts,) if np.isscalar(counts) else tuple(counts)
        return ev.SingleEpochTreeAggregation(dp_event.noise_multiplier, tuple(int(c) for c in counts), relation=relation)
    raise ValueError(
        f"from_dp_event: unsupported dp_accounting event type {type(dp_event).__name__}; supported: {_SUPPORTED}."
    )


def _scalar(name: str, value) -> float:
    arr = np.asarray(value)
    if arr.ndim != 0:
        raise ValueError(f"to_dp_event: {name} must be a scalar (a batch of events has no DpEvent); got shape "
                         f"{arr.shape}.")
    return float(arr)


def _whole(name: str, value) -> int:
    v = _scalar(name, value)
    if not (math.isfinite(v) and v == math.floor(v) and v >= 0):
        raise ValueError(f"to_dp_event: {name} must be a whole number >= 0; got {v}.")
    return int(v)


def to_dp_event(event: ev.Event) -> DpEventWithRelation:
    """The dp_accounting ``DpEvent`` tree of a jaxdp event, with its neighbouring relation.

    Leaves must be concrete scalars (not traced, not a batch). A ``SelfComposed`` count is
    rounded up to an integer, as jaxdp charges it.

    Returns:
      :class:`DpEventWithRelation` ``(dp_event, relation)``; compose ``dp_event`` into an
      accountant built with the matching ``NeighboringRelation``.

    Raises:
      ValueError: for a :class:`~jaxdp.accounting.PNSGD` or :class:`~jaxdp.accounting.ApproxDP` event
        (no counterpart in dp_accounting 0.6), a batch,
        or mixed relations.

    Examples:
      >>> import jaxdp, jaxdp.interop
      >>> out = jaxdp.interop.to_dp_event(jaxdp.accounting.dpsgd_event(0.01, 1.1, 100))
      >>> out.relation, type(out.dp_event).__name__, out.dp_event.count
      ('add_remove', 'SelfComposedDpEvent', 100)
    """
    dpe = _dp_event_module()
    relation = ev.relation_of(event)

    def conv(e, path):
        if isinstance(e, ev.Gaussian):
            return dpe.GaussianDpEvent(_scalar(f"{path}.noise_multiplier", e.noise_multiplier))
        if isinstance(e, ev.Laplace):
            return dpe.LaplaceDpEvent(_scalar(f"{path}.noise_multiplier", e.noise_multiplier))
        if isinstance(e, ev.PoissonSampled):
            return dpe.PoissonSampledDpEvent(_scalar(f"{path}.q", e.q), conv(e.event, f"{path}.event"))
        if isinstance(e, ev.SelfComposed):
            count = _scalar(f"{path}.count", e.count)
            if not (count >= 0 and math.isfinite(count)):
                raise ValueError(f"to_dp_event: {path}.count must be a finite number >= 0; got {count}.")
            return dpe.SelfComposedDpEvent(conv(e.event, f"{path}.event"), int(math.ceil(count)))
        if isinstance(e, ev.Composed):
            return dpe.ComposedDpEvent([conv(x, f"{path}.events[{i}]") for i, x in enumerate(e.events)])
        if isinstance(e, ev.SampledWithoutReplacement):
            return dpe.SampledWithoutReplacementDpEvent(
                _whole(f"{path}.num_records", e.num_records), _whole(f"{path}.batch_size", e.batch_size),
                conv(e.event, f"{path}.event"))
        if isinstance(e, ev.SampledWithReplacement):
            return dpe.SampledWithReplacementDpEvent(
                _whole(f"{path}.num_records", e.num_records), int(e.batch_size), conv(e.event, f"{path}.event"))
        if isinstance(e, ev.TruncatedPoissonSampled):
            if not isinstance(e.event, ev.Gaussian):
                raise ValueError(f"to_dp_event: {path}.event must be a Gaussian event (dp_accounting's "
                                 "TruncatedSubsampledGaussianDpEvent).")
            return dpe.TruncatedSubsampledGaussianDpEvent(
                _whole(f"{path}.num_records", e.num_records), _scalar(f"{path}.q", e.q),
                _whole(f"{path}.max_batch_size", e.max_batch_size),
                _scalar(f"{path}.event.noise_multiplier", e.event.noise_multiplier))
        if isinstance(e, ev.RandomizedResponse):
            return dpe.RandomizedResponseDpEvent(_scalar(f"{path}.noise_parameter", e.noise_parameter),
                                                 _whole(f"{path}.num_buckets", e.num_buckets))
        if isinstance(e, ev.ZCDP):
            return dpe.ZCDpEvent(_scalar(f"{path}.rho", e.rho), _scalar(f"{path}.xi", e.xi))
        if isinstance(e, ev.SingleEpochTreeAggregation):
            counts = list(e.step_counts)
            return dpe.SingleEpochTreeAggregationDpEvent(_scalar(f"{path}.noise_multiplier", e.noise_multiplier),
                                                         counts[0] if len(counts) == 1 else counts)
        raise ValueError(f"to_dp_event: {path} is a {type(e).__name__} event, which has no dp_accounting counterpart.")

    return DpEventWithRelation(conv(event, "event"), relation)
