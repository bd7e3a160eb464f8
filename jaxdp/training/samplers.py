r"""Batch samplers for DP-SGD, with fixed shapes for ``jit``, each with the privacy event it makes true.

A sampler picks the records of each step. Every one returns the batch as ``(indices, size)``:
a static-length ``int32`` index array whose first ``size`` entries are the batch (the rest
padding, masked out by the step), so the compiled step has one shape whatever the batch
size. No sampled record is ever dropped, except by :class:`TruncatedPoisson`, whose scheme
drops the records beyond its cap. The keys are secret (whoever knows the batches loses
the amplification); they come from the run's secret key.

* :class:`Poisson` (default): each record independently with probability q; add/remove-one;
  ``dpsgd_event(q, ν, T)``.
* :class:`TruncatedPoisson`: Poisson, then a uniform ``max_batch_size`` of the batch if more
  were drawn; add/remove-one; ``TruncatedPoissonSampled``.
* :class:`FixedSize`: ``batch_size`` uniform records without (or with) replacement;
  replace-one; ``SampledWithoutReplacement`` (``SampledWithReplacement``).
* :class:`BallsInBins`: each pass (epoch), each record in one (or ``selected`` = k)
  uniformly random of the ``steps_per_pass`` batches; add/remove-one;
  ``random_allocation_event`` (k = 1: ``balls_in_bins_event``).
* :class:`Shuffle`: each pass, a uniform permutation cut into batches of ``batch_size`` (the
  last one smaller); replace-one; ``shuffled_event`` (no amplification).

The noise multiplier ν is always relative to the clip norm C on the clipped sum (as in
Opacus and dp_accounting); under replace-one neighbours the sum moves by 2C, so the
replace-one events hold a Gaussian of multiplier ν/2. :meth:`Sampler.event` is the one
place where a scheme becomes an event: the trainer's ledger, its reports and its
``target_epsilon`` calibration all call it.

A size left ``None`` is taken from :class:`~jaxdp.training.DPSGDMechanism`'s ``batch_size``
``b`` (q = b/N, b records, or ⌈N/b⌉ steps per pass).

Examples:
  >>> import jax
  >>> from jaxdp.training.samplers import Shuffle
  >>> s = Shuffle(4).bind(10)
  >>> s.steps_per_pass, s.capacity
  (3, 4)
  >>> key = s.init_key(jax.random.key(0))
  >>> [int(s.sample(key, step)[2]) for step in range(3)]  # batch sizes: 4, 4, then the last 2
  [4, 4, 2]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from ..accounting import (
    Gaussian,
    SampledWithoutReplacement,
    SampledWithReplacement,
    SelfComposed,
    TruncatedPoissonSampled,
    balls_in_bins_event,
    dpsgd_event,
    random_allocation_event,
    shuffled_event,
)
from ._config import check_count, check_flag
from ._dpsgd import _compact, batch_capacity, poisson_sample

__all__ = ["BallsInBins", "FixedSize", "Poisson", "Sampler", "Shuffle", "TruncatedPoisson", "from_spec", "by_name"]

# The padded batch of the variable-size samplers exceeds its capacity in about 1% of the
# steps (a second chunk then runs: speed only, no record is dropped); as DP-SGD's default.
OVERFLOW = 1e-2

# The first line of a report whose scheme has no certified amplification (never a Poisson ε).
NO_AMPLIFICATION = "{what}: no amplification is certified; ε below is the bound without amplification"
_ONCE = ("each record in exactly one step per epoch: the Gaussian mechanism of multiplier nu/2 (replace-one) "
         "composed over the epochs started")


def _check_q(q) -> None:
    if q is not None and (isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 < float(q) <= 1.0):
        raise ValueError(f"q must be a number in (0, 1]; got {q!r}.")


@dataclasses.dataclass(frozen=True)
class Sampler:
    """A batch scheme (the base class). Bind it to a data set size with :meth:`bind`.

    A bound sampler (``num_records`` set) has static ``steps_per_pass``, ``capacity`` (rows
    of one padded chunk) and ``expected_batch_size`` (DP-SGD divides the noisy sum by it;
    public), and a jittable :meth:`sample`. ``relation`` is the neighbouring relation of its
    :meth:`event`; ``note`` the line a report leads with when no amplification is certified.
    """

    name: ClassVar[str] = ""
    relation: ClassVar[str] = "add_remove"
    num_records: int | None = dataclasses.field(default=None, kw_only=True)

    # ---- the pieces each scheme defines ----
    def _bind(self, n: int, batch_size: int | None) -> Sampler:
        raise NotImplementedError

    @property
    def steps_per_pass(self) -> int:
        raise NotImplementedError

    @property
    def capacity(self) -> int:
        raise NotImplementedError

    @property
    def expected_batch_size(self) -> float:
        raise NotImplementedError

    def sample(self, key: jax.Array, step) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(next_key, indices, size)`` for step ``step`` (jittable; ``step`` may be traced)."""
        raise NotImplementedError

    def event(self, noise_multiplier, num_steps: int, dataset_size: int | None = None):
        """The accounting event of ``num_steps`` steps of this scheme with noise ν·C on the clipped sum."""
        raise NotImplementedError

    def describe(self) -> str:
        """The scheme and its analysis, one clause, for the report's reason."""
        raise NotImplementedError

    #: The line a report leads with (schemes without certified amplification), or None.
    note: ClassVar[str | None] = None

    # ---- shared ----
    def bind(self, num_records: int, batch_size: int | None = None) -> Sampler:
        """This sampler for ``num_records`` records, sizes left ``None`` taken from ``batch_size``."""
        n = check_count("num_records", num_records)
        if batch_size is not None:
            check_count("batch_size", batch_size)
        return self._bind(n, batch_size)

    def init_key(self, key: jax.Array) -> jax.Array:
        """The state's sampling key from the run's (secret) sampling key."""
        return key

    def spec(self) -> dict[str, Any]:
        """The bound sampler as JSON (the ledger and the checkpoint configuration hold it)."""
        return {"name": self.name, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    def _n(self, dataset_size) -> int:
        n = self.num_records if dataset_size is None else int(dataset_size)
        if n is None:
            raise ValueError(f"{type(self).__name__}.event needs dataset_size (or a bound sampler).")
        return n

    def _need_bound(self):
        if self.num_records is None:
            raise ValueError(f"{type(self).__name__} is not bound to a data set: call .bind(num_records) first.")


def _need(name: str, value, batch_size, derive):
    if value is not None:
        return value
    if batch_size is None:
        raise ValueError(f"{name} is not set and no batch_size to derive it from.")
    return derive(batch_size)


@dataclasses.dataclass(frozen=True)
class Poisson(Sampler):
    r"""Poisson sampling: every record independently with probability ``q`` (DP-SGD's default).

    Bit-identical to :class:`~jaxdp.training.DPSGDMechanism`'s sampling without a sampler
    (:func:`~jaxdp.training.poisson_sample` on a key split off every step). Event:
    ``dpsgd_event(q, ν, T)`` (add/remove-one, Abadi et al. 2016; Mironov et al. 2019).

    Attributes:
      q: the sampling rate in (0, 1]; ``None``: ``batch_size / N``.
    """

    name: ClassVar[str] = "poisson"
    q: float | None = None

    def __post_init__(self):
        _check_q(self.q)

    def _bind(self, n, batch_size):
        return dataclasses.replace(self, q=float(_need("q", self.q, batch_size, lambda b: b / n)),
                                   num_records=n)

    @property
    def steps_per_pass(self):
        return math.ceil(1.0 / self.q - 1e-9)

    @property
    def capacity(self):
        self._need_bound()
        return batch_capacity(self.num_records, self.q, overflow=OVERFLOW)

    @property
    def expected_batch_size(self):
        return self.q * self.num_records

    def sample(self, key, step):
        key, k = jax.random.split(key)
        indices, size = poisson_sample(k, self.num_records, self.q)
        return key, indices, size

    def event(self, noise_multiplier, num_steps, dataset_size=None):
        return dpsgd_event(self.q, noise_multiplier, num_steps)

    def describe(self):
        return f"Poisson sampling q={self.q:.6g}, add/remove neighbours: sampled-Gaussian RDP"


@dataclasses.dataclass(frozen=True)
class TruncatedPoisson(Sampler):
    r"""Poisson sampling at rate ``q``, cut to a uniformly random ``max_batch_size`` records when more are drawn.

    The records beyond the cap are dropped (the scheme's own choice; nothing else is).
    Event: ``TruncatedPoissonSampled(q, N, B, Gaussian(ν))`` (add/remove-one; see
    :func:`jaxdp.accounting.truncated_poisson_rdp`). The batch is at most ``max_batch_size``
    rows: one chunk, never an overflow.

    Attributes:
      max_batch_size: B ≥ 1.
      q: the sampling rate in (0, 1]; ``None``: ``batch_size / N``.
    """

    name: ClassVar[str] = "truncated-poisson"
    max_batch_size: int = None  # type: ignore[assignment]  (required: checked in __post_init__)
    q: float | None = None

    def __post_init__(self):
        check_count("max_batch_size", self.max_batch_size)
        _check_q(self.q)

    def _bind(self, n, batch_size):
        return dataclasses.replace(self, q=float(_need("q", self.q, batch_size, lambda b: b / n)),
                                   num_records=n)

    @property
    def steps_per_pass(self):
        return math.ceil(1.0 / self.q - 1e-9)

    @property
    def capacity(self):
        self._need_bound()
        return min(int(self.max_batch_size), self.num_records)

    @property
    def expected_batch_size(self):
        return self.q * self.num_records

    def sample(self, key, step):
        n, cap = self.num_records, self.capacity
        key, k = jax.random.split(key)
        k_mask, k_keep = jax.random.split(k)
        indices, size = poisson_sample(k_mask, n, self.q)
        # A uniformly random order of the sampled records (the restriction of a uniform
        # permutation's distinct ranks to them), then its first B: a uniform B-subset.
        rank = jax.random.permutation(k_keep, n).astype(jnp.int32)
        pos = jnp.arange(n, dtype=jnp.int32)
        order = jnp.argsort(jnp.where(pos < size, rank, n + pos))[:cap]
        return key, indices[order], jnp.minimum(size, cap).astype(jnp.int32)

    def event(self, noise_multiplier, num_steps, dataset_size=None):
        n = self._n(dataset_size)
        return SelfComposed(TruncatedPoissonSampled(self.q, n, self.max_batch_size, Gaussian(noise_multiplier)),
                            num_steps)

    def describe(self):
        return (f"truncated Poisson sampling q={self.q:.6g} capped at {self.max_batch_size} records, add/remove "
                "neighbours: truncated-Poisson RDP")


@dataclasses.dataclass(frozen=True)
class _FixedBatch(Sampler):
    """A sampler whose steps take ``batch_size`` records each (the last of a pass may take fewer):
    the size checks, the binding and the shapes that :class:`FixedSize` and :class:`Shuffle` share.
    Replace-one neighbours (n public)."""

    relation: ClassVar[str] = "replace_one"
    batch_size: int | None = None

    def __post_init__(self):
        if self.batch_size is not None:
            check_count("batch_size", self.batch_size)

    def _bind(self, n, batch_size):
        b = int(_need("batch_size", self.batch_size, batch_size, int))
        if b > n:
            raise ValueError(f"batch_size must be <= the number of training examples ({n}); got {b}.")
        return dataclasses.replace(self, batch_size=b, num_records=n)

    @property
    def steps_per_pass(self):
        return math.ceil(self.num_records / self.batch_size)

    @property
    def capacity(self):
        return int(self.batch_size)

    @property
    def expected_batch_size(self):
        return float(self.batch_size)


@dataclasses.dataclass(frozen=True)
class FixedSize(_FixedBatch):
    r"""``batch_size`` records drawn uniformly every step, without (default) or with replacement.

    Events (replace-one neighbours, N public; the clipped sum moves by 2C, hence ν/2):
    ``SampledWithoutReplacement(N, b, Gaussian(ν/2, "replace_one"))`` (Wang, Balle &
    Kasiviswanathan 2019, Thm 27) or ``SampledWithReplacement(N, b, Gaussian(ν/2,
    "replace_one"))`` (a record drawn k times counts k times), composed over the steps.

    Attributes:
      batch_size: b in [1, N]; ``None``: the mechanism's.
      replace: draw with replacement.
    """

    name: ClassVar[str] = "fixed-size"
    replace: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_flag("replace", self.replace)

    def sample(self, key, step):
        key, k = jax.random.split(key)
        n, b = self.num_records, self.batch_size
        if self.replace:
            indices = jax.random.randint(k, (b,), 0, n, dtype=jnp.int32)
        else:
            indices = jax.random.choice(k, n, (b,), replace=False).astype(jnp.int32)
        return key, indices, jnp.asarray(b, jnp.int32)

    def event(self, noise_multiplier, num_steps, dataset_size=None):
        n = self._n(dataset_size)
        inner = Gaussian(noise_multiplier / 2.0, relation="replace_one")
        ev = (SampledWithReplacement(n, int(self.batch_size), inner) if self.replace
              else SampledWithoutReplacement(n, self.batch_size, inner))
        return SelfComposed(ev, num_steps)

    def describe(self):
        how = "with" if self.replace else "without"
        return (f"fixed-size sampling {how} replacement, {self.batch_size} of {self.num_records} records per step, "
                f"replace-one neighbours: sampled-{how}-replacement RDP")


def _epoch_key(key, step, steps_per_pass):
    epoch = jnp.asarray(step, jnp.int32) // steps_per_pass
    return jax.random.fold_in(key, epoch), jnp.asarray(step, jnp.int32) % steps_per_pass


def _uniform_subsets(key, n: int, t: int, k: int) -> jax.Array:
    """``(n, k)`` int32: per row a uniformly random k-subset of {0, …, t − 1}, independently (Floyd's algorithm).

    For j = t − k, …, t − 1: draw r uniform in {0, …, j}; take r, or j if r was taken
    already. Each k-subset comes out with probability 1/C(t, k) (Bentley & Floyd, "A
    sample of brilliance", CACM 1987).
    """
    cols = []
    for i, kk in enumerate(jax.random.split(key, k)):
        j = t - k + i
        r = jax.random.randint(kk, (n,), 0, j + 1, dtype=jnp.int32)
        taken = functools.reduce(jnp.logical_or, [c == r for c in cols], jnp.zeros((n,), bool))
        cols.append(jnp.where(taken, jnp.int32(j), r))
    return jnp.stack(cols, axis=1)


@dataclasses.dataclass(frozen=True)
class BallsInBins(Sampler):
    r"""Each epoch, every record goes to ``selected`` = k uniformly random of ``steps_per_pass`` = t batches.

    Random allocation: per epoch each record takes part in a uniformly random k-subset of
    the t steps, independently across records and epochs (k = 1, the default: one batch
    per epoch, balls-in-bins). Batches have Binomial(N, k/t) sizes (padded, overflow in a
    second chunk, nothing dropped); the allocation of an epoch comes from the sampling key
    folded with the epoch (the state's key never changes: resume is exact). Event:
    :func:`~jaxdp.accounting.random_allocation_event` ``(ν, t, k, epochs)`` over the
    epochs started (k = 1: :func:`~jaxdp.accounting.balls_in_bins_event`; add/remove-one
    neighbours: a record's steps do not depend on the other records, so adding one moves
    nobody), certified in both directions by :func:`~jaxdp.accounting.random_allocation_rdp`
    (Feldman & Shenfeld 2025; Chua et al., AISTATS 2025). A started epoch counts whole: its
    first steps are a post-processing of the whole epoch's release.

    Attributes:
      steps_per_pass: t ≥ k; ``None``: ⌈kN/b⌉ (a mean batch of at most b).
      selected: k ≥ 1, the steps each record takes part in per epoch (default 1).
    """

    name: ClassVar[str] = "balls-in-bins"
    relation: ClassVar[str] = "add_remove"
    steps_per_pass: int | None = None
    selected: int = 1

    def __post_init__(self):
        check_count("selected", self.selected)
        if self.steps_per_pass is not None:
            check_count("steps_per_pass", self.steps_per_pass)
            self._check_selected(self.steps_per_pass)

    def _check_selected(self, t):
        if self.selected > t:
            raise ValueError(f"selected must be <= steps_per_pass ({t}); got {self.selected}.")

    def _bind(self, n, batch_size):
        k = int(self.selected)
        t = int(_need("steps_per_pass", self.steps_per_pass, batch_size, lambda b: math.ceil(k * n / b)))
        self._check_selected(t)
        return dataclasses.replace(self, steps_per_pass=t, num_records=n)

    @property
    def capacity(self):
        self._need_bound()
        return batch_capacity(self.num_records, self.selected / self.steps_per_pass, overflow=OVERFLOW)

    @property
    def expected_batch_size(self):
        if self.selected == 1:
            return self.num_records / self.steps_per_pass
        return self.num_records * self.selected / self.steps_per_pass

    def sample(self, key, step):
        ek, j = _epoch_key(key, step, self.steps_per_pass)
        if self.selected == 1:
            bins = jax.random.randint(ek, (self.num_records,), 0, self.steps_per_pass, dtype=jnp.int32)
            indices, size = _compact(bins == j)
        else:
            steps = _uniform_subsets(ek, self.num_records, int(self.steps_per_pass), int(self.selected))
            indices, size = _compact(jnp.any(steps == j, axis=1))
        return key, indices, size

    def event(self, noise_multiplier, num_steps, dataset_size=None):
        epochs = -(-int(num_steps) // int(self.steps_per_pass))
        if self.selected == 1:
            return balls_in_bins_event(noise_multiplier, int(self.steps_per_pass), epochs)
        return random_allocation_event(noise_multiplier, int(self.steps_per_pass), int(self.selected), epochs)

    def spec(self):
        # k = 1 writes the spec it wrote before k existed (ledgers and checkpoints unchanged).
        out = super().spec()
        if out["selected"] == 1:
            del out["selected"]
        return out

    def describe(self):
        if self.selected == 1:
            return (f"balls-in-bins batches, {self.steps_per_pass} per epoch of {self.num_records} records, "
                    "add/remove neighbours: each record in one uniformly random step per epoch (random "
                    "allocation, both directions certified)")
        return (f"random allocation, {self.steps_per_pass} batches per epoch of {self.num_records} records, "
                f"add/remove neighbours: each record in {self.selected} uniformly random steps per epoch (both "
                f"directions certified through {self.selected} epochs of 1 of about "
                f"{self.steps_per_pass // self.selected} steps)")


@dataclasses.dataclass(frozen=True)
class Shuffle(_FixedBatch):
    r"""Each epoch, a uniformly random permutation cut into batches of ``batch_size`` (the last one smaller).

    The permutation of an epoch comes from the sampling key folded with the epoch (the
    state's key never changes: resume is exact). Event: :func:`~jaxdp.accounting.shuffled_event`
    over the epochs started: no amplification is certified (no tight analysis of shuffling
    is known, and it can cost far more than Poisson at the same noise: Chua et al., ICML
    2024), so a shuffled run never reports a Poisson ε.

    Attributes:
      batch_size: b in [1, N]; ``None``: the mechanism's.
    """

    name: ClassVar[str] = "shuffle"

    def sample(self, key, step):
        n, b, m = self.num_records, self.batch_size, self.steps_per_pass
        ek, j = _epoch_key(key, step, m)
        perm = jnp.concatenate([jax.random.permutation(ek, n).astype(jnp.int32),
                                jnp.zeros((m * b - n,), jnp.int32)])
        indices = jax.lax.dynamic_slice(perm, (j * b,), (b,))
        return key, indices, jnp.minimum(b, n - j * b).astype(jnp.int32)

    def event(self, noise_multiplier, num_steps, dataset_size=None):
        epochs = -(-int(num_steps) // self.steps_per_pass)
        return shuffled_event(noise_multiplier, epochs)

    note: ClassVar[str] = NO_AMPLIFICATION.format(what="shuffled batches")

    def describe(self):
        return (f"shuffled batches of {self.batch_size} of {self.num_records} records, replace-one neighbours: "
                f"{_ONCE}")


_BY_NAME = {cls.name: cls for cls in (Poisson, TruncatedPoisson, FixedSize, BallsInBins, Shuffle)}


def by_name(name: str, **kwargs) -> Sampler:
    """The sampler called ``name`` (``"poisson"``, ``"truncated-poisson"``, ``"fixed-size"``,
    ``"balls-in-bins"``, ``"shuffle"``) with ``kwargs``.

    Examples:
      >>> by_name("fixed-size", replace=True)
      FixedSize(num_records=None, batch_size=None, replace=True)
    """
    if name not in _BY_NAME:
        raise ValueError(f"sampler must be one of {', '.join(_BY_NAME)}; got {name!r}.")
    return _BY_NAME[name](**kwargs)


def from_spec(spec: dict[str, Any]) -> Sampler:
    """Inverse of :meth:`Sampler.spec`."""
    spec = dict(spec)
    return by_name(spec.pop("name"), **spec)
