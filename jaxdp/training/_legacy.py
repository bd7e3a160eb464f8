"""The deprecated keyword door of ``train`` (kept for one release), as a table onto the new API.

``train(model, data, algorithm="dpsgd", clip_norm=1.0, ..., checkpoint_dir=d)`` becomes
``train(model, data, DPSGDMechanism(clip_norm=1.0, ...), options=RunOptions(checkpoint_dir=d))``:
:data:`DEPRECATIONS` says where every old keyword went, :func:`translate` builds the new
objects from the old keywords (warning once per call, as optax's ``_deprecations`` does), and
:func:`legacy_result` gives the old :class:`TrainState` (ledger inside) back, so the same
seeds give the same numbers through either door.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .. import _validate
from ._config import RunOptions
from ._dpsbcd import DPSBCDMechanism, DPSBCDState
from ._dpsgd_mechanism import DPSGDMechanism, DPSGDState
from ._pnsgd import PNSGDMechanism

__all__ = ["DEPRECATIONS", "TrainState"]

_MECHANISMS = {"pnsgd": PNSGDMechanism, "dpsgd": DPSGDMechanism, "dpsbcd": DPSBCDMechanism}
_RUN_OPTIONS = ("steps_per_call", "checkpoint_dir", "checkpoint_every", "resume", "checkpoint_key", "progress",
                "account", "callback", "devices")
# Every keyword of the old train(...) with its default there (a default given to a mechanism
# without that field was ignored by the old door and is dropped here; any other value is refused).
_OLD_DEFAULTS = {
    "learning_rate": None, "noise_multiplier": None, "radius": None, "optimizer": None, "batch_size": 64,
    "passes": 1, "schedule": "fixed", "loss_fn": None, "clip_norm": None, "lipschitz": None, "smoothness": None,
    "strong_convexity": None, "convex": None, "drop_remainder": True, "return_intermediates": False,
    "use_fast_path": None, "noise_temperature": None, "contraction": None, "weight_decay": 0.0, "penalty": 1.0,
}

#: Old keyword of ``train`` -> where it lives now.
DEPRECATIONS: dict[str, str] = {
    "algorithm": "the mechanism: PNSGDMechanism, DPSGDMechanism or DPSBCDMechanism",
    **{name: f"RunOptions({name}=...)" for name in _RUN_OPTIONS},
    **{name: f"a field of the mechanism ({', '.join(c.__name__ for c in _MECHANISMS.values() if name in c.__dataclass_fields__)})"
       for name in _OLD_DEFAULTS},
}


class TrainState(NamedTuple):
    """Deprecated: the state the keyword door of ``train`` returns (every mechanism's fields, the ledger inside).

    The new door returns the mechanism's own state (:class:`~jaxdp.training.PNSGDState`,
    :class:`~jaxdp.training.DPSGDState`, :class:`~jaxdp.training.DPSBCDState`) and the
    ledger as :attr:`TrainResult.ledger <jaxdp.training.TrainResult>`.

    Attributes:
      params: the parameters (DP-SBCD: the kernels).
      opt_state: the optimiser state (DP-SBCD: power vectors, activations, pre-activations, key).
      step: steps done.
      order: the public order (DP-SGD: a placeholder of shape ``(1,)``).
      total_steps: steps the run does (secret with random stopping).
      max_grad_norm: largest unclipped per-example gradient norm seen.
      clipped: gradients above the clip norm (DP-SGD: 0).
      ledger: the ledger.
      sample_key: DP-SGD's secret sampling key (``None`` otherwise).
    """

    params: Any
    opt_state: Any
    step: jax.Array
    order: jax.Array
    total_steps: jax.Array
    max_grad_norm: jax.Array
    clipped: jax.Array
    ledger: Any
    sample_key: Any = None


def translate(kwargs: dict[str, Any], options: RunOptions | None, stacklevel: int):
    """``(mechanism, options)`` for the old keywords ``kwargs``; warns that the door is deprecated."""
    kwargs = dict(kwargs)
    algorithm = kwargs.pop("algorithm", "pnsgd")
    _validate.check_static_choice("algorithm", algorithm, tuple(_MECHANISMS))
    unknown = [k for k in kwargs if k not in _OLD_DEFAULTS and k not in _RUN_OPTIONS]
    if unknown:
        raise TypeError(f"train() got an unexpected keyword argument {unknown[0]!r}.")
    cls = _MECHANISMS[algorithm]
    new = cls.__name__
    run_kw = {k: kwargs.pop(k) for k in _RUN_OPTIONS if k in kwargs}
    if options is not None and run_kw:
        raise ValueError(f"pass the run options in options=RunOptions(...) only; got {sorted(run_kw)[0]} as well.")
    if algorithm == "dpsbcd" and kwargs.get("passes") == 1:
        kwargs.pop("passes")  # the old default: the length of noise_temperature
    fields = cls.__dataclass_fields__
    mech_kw = {}
    for name, value in kwargs.items():
        if name in fields:
            mech_kw[name] = value
        elif not _is_default(value, _OLD_DEFAULTS[name]):
            raise ValueError(f"{name} is not used by algorithm={algorithm!r} (not a field of {new}); leave it out.")
    warnings.warn(
        f"train(model, data, algorithm={algorithm!r}, **keywords) is deprecated and will be removed in the next "
        f"release: use train(model, data, {new}(...), options=RunOptions(...)) (docs/training.md, 'Migrating to "
        "mechanisms').", DeprecationWarning, stacklevel=stacklevel)
    mechanism = cls(**mech_kw)
    if options is None:
        options = RunOptions(**{k: v for k, v in run_kw.items() if k != "callback"})
        callback = run_kw.get("callback")
        if callback is not None:
            options = RunOptions(**{k: v for k, v in run_kw.items() if k != "callback"},
                                 callback=lambda state, ledger: callback(legacy_state(state, ledger)))
    return mechanism, options


def _is_default(value, default) -> bool:
    return value is default or (isinstance(value, (bool, int, float, str)) and value == default)


def legacy_state(state, ledger) -> TrainState:
    """The deprecated :class:`TrainState` of a mechanism's state and ledger."""
    if isinstance(state, DPSGDState):
        return TrainState(state.params, state.opt_state, state.step, jnp.zeros((1,), jnp.int32),
                          jnp.asarray(ledger.total_steps, jnp.int32), state.max_grad_norm, jnp.zeros((), jnp.int32),
                          ledger, state.sample_key)
    if isinstance(state, DPSBCDState):
        return TrainState(state.kernels, (state.power_vectors, state.activations, state.preactivations, state.key),
                          state.step, state.order, jnp.asarray(ledger.total_steps, jnp.int32), state.max_grad_norm,
                          state.clipped, ledger)
    return TrainState(state.params, state.opt_state, state.step, state.order, state.total_steps, state.max_grad_norm,
                      state.clipped, ledger)


def legacy_result(result):
    """``result`` with its ``state`` as the deprecated :class:`TrainState`."""
    return result._replace(state=legacy_state(result.state, result.ledger))
