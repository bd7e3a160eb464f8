"""Frozen, validated configurations: the mechanisms and the run options share these checks.

A configuration is a keyword-only frozen dataclass whose ``__post_init__`` validates every
field once; a keyword the class does not have is refused in one line that names it (and
the configuration that has it), instead of Python's ``TypeError`` about ``__init__``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from .. import _validate

# Which configuration owns a field, for the one-line refusal of a field given to another.
_OWNERS: dict[str, list[str]] = {}


def frozen_config(cls):
    """``cls`` as a keyword-only frozen dataclass that refuses unknown fields with a ValueError."""
    cls = dataclasses.dataclass(frozen=True, kw_only=True, eq=False)(cls)
    names = tuple(f.name for f in dataclasses.fields(cls))
    for name in names:
        _OWNERS.setdefault(name, []).append(cls.__name__)
    init = cls.__init__
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if args:
            raise ValueError(f"{cls.__name__} takes keyword arguments only (e.g. {names[0]}=...); got "
                             f"{len(args)} positional.")
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            owners = [o for o in _OWNERS.get(unknown[0], []) if o != cls.__name__]
            where = f" (it belongs to {' and '.join(owners)})" if owners else ""
            raise ValueError(f"{unknown[0]} is not a field of {cls.__name__}{where}; its fields are "
                             f"{', '.join(names)}.")
        missing = [k for k in required if kwargs.get(k) is None]
        if missing:
            raise ValueError(f"{missing[0]} is required by {cls.__name__} (no default: the run or its guarantee "
                             f"depends on it); required: {', '.join(required)}.")
        init(self, **kwargs)

    cls.__init__ = __init__
    return cls


def replace(config, **changes):
    """A copy of ``config`` with ``changes`` (validated again)."""
    return dataclasses.replace(config, **changes)


def fields_dict(config) -> dict[str, Any]:
    """The fields of ``config`` as a dict (shallow)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def check_count(name: str, value: Any, lo: int = 1) -> int:
    """A static count (a Python or NumPy integer, not a bool) ``>= lo``, as an ``int``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}; got {value!r}.")
    return int(value)


def check_positive(name: str, value: Any) -> None:
    """A finite number > 0."""
    _validate.check_in_range(name, value, 0.0, math.inf, lo_open=True)


def check_noise_or_target(owner: str, noise_name: str, noise: Any, target_epsilon: Any) -> None:
    """Exactly one of the noise level and ``target_epsilon``; the target a finite number > 0."""
    if (noise is None) == (target_epsilon is None):
        raise ValueError(f"{owner} needs exactly one of {noise_name} and target_epsilon; got "
                         f"{'both' if noise is not None else 'neither'}.")
    if target_epsilon is not None:
        check_positive("target_epsilon", target_epsilon)


def check_optional_positive(**values) -> None:
    """Each value given (not None) is a finite number > 0."""
    for name, value in values.items():
        if value is not None:
            check_positive(name, value)


def check_callable(name: str, value: Any, how: str) -> None:
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be callable as {how}; got {value!r}.")


def check_flag(name: str, value: Any, allow_none: bool = False) -> None:
    if (value is None and allow_none) or isinstance(value, (bool, np.bool_)):
        return
    raise ValueError(f"{name} must be True or False{' or None' if allow_none else ''}; got {value!r}.")


@frozen_config
class RunOptions:
    r"""How :func:`~jaxdp.training.train` runs a mechanism: none of these changes the guarantee.

    Validated once, at construction, the same way for every mechanism.

    Attributes:
      steps_per_call: steps per jitted ``lax.scan`` call (default: one pass). An integer >= 1.
      checkpoint_dir: if given, save an atomic, integrity-checked orbax checkpoint every
        ``checkpoint_every`` steps (default: every pass) and at the end. Checkpoints hold the
        secret noise key: keep them as private as the data.
      checkpoint_every: steps between checkpoints (rounded up to a call boundary); an integer >= 1.
      resume: continue from the newest intact checkpoint in ``checkpoint_dir`` (same mechanism,
        model and data; the stored ledger is recomputed and any disagreement refused). Without
        it a non-empty ``checkpoint_dir`` is an error, so no run silently restarts and spends
        its budget twice. The folder is locked while a run holds it.
      checkpoint_key: a secret (str or bytes, >= 16 characters; default
        ``$JAXDP_CHECKPOINT_KEY``) that signs every checkpoint with HMAC-SHA-256; a resumed run
        then refuses checkpoints without a valid signature. Never shown in the options' repr.
      progress: a tqdm bar with ε as training goes, and the final report printed.
      account: compute the final :class:`~jaxdp.training.PrivacyReport`.
      callback: ``callback(state, ledger)`` after every jitted call (and checkpoint); ``state``
        is the mechanism's state (it holds the secret key: never log it), ``ledger`` the
        :class:`~jaxdp.training.PrivacyLedger`-like record, whose ``public()`` may be logged.
      devices: ``None`` (one device), an integer :math:`k` (the first :math:`k` devices), a
        sequence of devices or a ``Mesh`` with a ``"data"`` axis: data parallelism
        (:func:`~jaxdp.training.data_parallel_mesh`), the noise drawn once for the global batch.

    Examples:
      >>> RunOptions(steps_per_call=10, progress=False).steps_per_call
      10
      >>> RunOptions(steps_per_call=0)
      Traceback (most recent call last):
      ...
      ValueError: steps_per_call must be an integer >= 1; got 0.
    """

    steps_per_call: int | None = None
    checkpoint_dir: Any = None
    checkpoint_every: int | None = None
    resume: bool = False
    checkpoint_key: Any = dataclasses.field(default=None, repr=False)
    progress: bool = True
    account: bool = True
    callback: Any = None
    devices: Any = None

    def __post_init__(self):
        for name in ("steps_per_call", "checkpoint_every"):
            if getattr(self, name) is not None:
                check_count(name, getattr(self, name))
        for name in ("resume", "progress", "account"):
            check_flag(name, getattr(self, name))
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume=True needs a checkpoint_dir to resume from.")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir to write to.")
        check_callable("callback", self.callback, "callback(state, ledger)")
        if isinstance(self.devices, (bool, np.bool_)) or (
                isinstance(self.devices, (int, np.integer)) and self.devices < 1):
            raise ValueError(f"devices must be None, an integer >= 1, a sequence of devices or a Mesh; "
                             f"got {self.devices!r}.")
