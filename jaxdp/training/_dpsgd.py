r"""DP-SGD with true Poisson sampling, as optax transformations and one pure step.

The update that the sampled-Gaussian accountant analyses is

.. math::

    \theta_{t+1} = \theta_t - \mathrm{opt}\Bigl(\frac{1}{q N}\Bigl(\sum_{i \in B_t}
        \min\bigl(1, C/\lVert g_i\rVert\bigr) g_i + Z_t\Bigr)\Bigr),\qquad
    Z_t \sim \mathcal N(0, \nu^2 C^2 I),

where every record enters :math:`B_t` independently with probability :math:`q` (Poisson
sampling), :math:`C` is the clip norm, :math:`\nu` the noise multiplier relative to the
add/remove sensitivity :math:`C` of the clipped sum, and ``opt`` is any optax optimizer
(post-processing, free of privacy cost). Its guarantee is the sampled Gaussian mechanism
composed over the steps: :func:`jaxdp.accounting.dpsgd_epsilon` with the same
:math:`(q, \nu, T)`.

**Static shapes for a random batch size.** A Poisson batch has a Binomial(N, q) size. The
step draws the sample as a mask over all N records, lists the sampled indices first
(a running count and one scatter, into a static size), and runs the clipped-gradient sum over chunks of a
static ``capacity`` in a ``lax.while_loop``: one chunk when the batch fits (the common case,
:func:`batch_capacity` makes overflow rare), more when it does not. No sampled record is
ever dropped, so the capacity affects speed only, never the guarantee.

The sampling key and the noise key are secret (see :func:`jaxdp.training.train`): whoever
knows which records were sampled, or the noise, loses the amplification or the privacy.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from .. import _validate
from ._clipping import clipped_grad_sum
from ._parallel import AXIS, parallel_clipped_grad_sum
from ._per_example import accumulation_dtype
from ._transforms import add_gaussian_noise

__all__ = ["DPSGDStepOutput", "batch_capacity", "dpsgd", "dpsgd_step", "poisson_sample"]


def batch_capacity(num_records: int, q: float, overflow: float = 1e-6) -> int:
    r"""A static padded batch size that a Poisson batch exceeds with probability ≤ ``overflow``.

    The smallest :math:`c` with :math:`P(\mathrm{Binomial}(N, q) > c) \le` ``overflow``,
    from the exact binomial tail (SciPy). Overflow never drops records (the step then runs
    a second chunk), so this only sets how often a step takes longer.

    Args:
      num_records: :math:`N \ge 1`.
      q: sampling rate in (0, 1].
      overflow: target probability of needing more than one chunk, in (0, 1).

    Examples:
      >>> batch_capacity(60000, 256 / 60000)  # mean 256, sd 16: about mean + 4.9 sd
      335
    """
    from scipy.stats import binom  # lazy: SciPy's stats costs ~0.5 s to import, needed once per run

    _check_num_records(num_records)
    _validate.check_in_range("q", q, 0.0, 1.0, lo_open=True)
    _validate.check_in_range("overflow", overflow, 0.0, 1.0, lo_open=True, hi_open=True)
    c = int(binom.isf(overflow, int(num_records), float(q)))
    while c < num_records and binom.sf(c, int(num_records), float(q)) > overflow:  # isf rounds
        c += 1
    return max(1, min(int(num_records), c))


def _check_num_records(num_records) -> None:
    if isinstance(num_records, bool) or not isinstance(num_records, (int, np.integer)) or num_records < 1:
        raise ValueError(f"num_records must be a positive integer; got {num_records!r}.")


def poisson_sample(key: jax.Array, num_records: int, q) -> tuple[jax.Array, jax.Array]:
    r"""Poisson sampling: each of ``num_records`` records is taken with probability ``q``.

    Returns ``(indices, size)``: ``indices`` has the static shape ``(num_records,)`` and lists
    the sampled records first, in increasing order, then zeros; ``size`` (``int32``) is the
    realised batch size, distributed as :math:`\mathrm{Binomial}(N, q')`. Jittable; ``q``
    may be traced. The realised rate :math:`q' = \lfloor q\,2^{32}\rfloor/2^{32}` never
    exceeds ``q`` (a concrete ``q`` exactly; a traced one within :math:`2^{-23}` below it),
    so the ε accounted at ``q`` is an upper bound (ε grows with the sampling rate).

    Examples:
      >>> import jax
      >>> idx, size = poisson_sample(jax.random.key(0), 10, 0.5)
      >>> idx.shape, int(size) <= 10
      ((10,), True)
    """
    _check_num_records(num_records)
    _validate.check_in_range("q", q, 0.0, 1.0)
    bits = jax.random.bits(key, (num_records,), jnp.uint32)
    if _validate.is_concrete(q) and np.ndim(q) == 0:
        # Exact on the host: P(bits < t) = t / 2^32 with t = floor(q 2^32) <= q 2^32, so the
        # realised rate never exceeds the q the accountant is told (a float32 uniform compared
        # with q would give ceil(q 2^23)/2^23 >= q: a slightly larger rate, an under-reported eps).
        t = math.floor(float(q) * 2.0**32)
        taken = jnp.ones((num_records,), bool) if t >= 2**32 else bits < jnp.uint32(t)
    else:
        # Traced q: the threshold in q's own precision, lowered by 2^9 (more than one float32
        # ulp at 2^32) so that rounding cannot raise the rate above q.
        qf = jnp.asarray(q, jnp.float32)
        t = jnp.floor(qf * 2.0**32) - 512.0
        taken = jnp.where(qf >= 1.0, True,
                          bits.astype(jnp.float32) < t)
    return _compact(taken)


def _compact(taken: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(indices, size)``: the positions where ``taken`` holds, first and in increasing order, then zeros."""
    # jnp.nonzero(taken, size=n, fill_value=0), written as a running count and one scatter,
    # which XLA on CPU runs about 3x faster (0.27 -> 0.09 ms at 10,000 records).
    num_records = taken.shape[0]
    pos = jnp.cumsum(taken, dtype=jnp.int32)
    size = pos[-1]
    slot = jnp.where(taken, pos - 1, num_records)  # out of range: dropped
    indices = jnp.zeros((num_records,), jnp.int32).at[slot].set(
        jnp.arange(num_records, dtype=jnp.int32), mode="drop", unique_indices=True)
    return indices, size


def dpsgd(optimizer, noise_multiplier, clip_norm, batch_size, key) -> optax.GradientTransformation:
    r"""DP-SGD's transformation of the clipped-gradient *sum* of a Poisson batch.

    .. math::

        S \mapsto \mathrm{opt}\Bigl(\frac{S + Z}{qN}\Bigr),\qquad Z \sim \mathcal N(0, \nu^2 C^2 I).

    ``chain(add_gaussian_noise(ν·C, key), scale(1/(qN)), optimizer)``. Dividing by the
    *expected* batch size :math:`qN` (not the realised one, which is private) is what
    Opacus does for Poisson sampling. The noise multiplier is relative to the add/remove
    sensitivity :math:`C` of the clipped sum, so :math:`\nu` means the same as in Opacus and
    dp_accounting, and the run's ε is ``dpsgd_epsilon(q, ν, T, δ)``.

    Args:
      optimizer: an ``optax.GradientTransformation`` (e.g. ``optax.sgd(0.1)``,
        ``optax.adam(1e-3)``; schedules allowed), or a learning rate or an optax schedule
        ``count -> rate``, meaning ``optax.sgd(learning_rate)``. The guarantee does not
        depend on the learning rate, so any schedule is free.
      noise_multiplier: :math:`\nu \ge 0` (array-like; may be traced).
      clip_norm: :math:`C > 0` (array-like; may be traced).
      batch_size: the expected batch size :math:`qN > 0` of Poisson sampling (the
        glossary's one name for records per step; array-like, may be traced).
      key: PRNG key of the noise (secret; split off a key from the OS entropy).

    Returns:
      An ``optax.GradientTransformation``; its first state holds the noise key.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> tx = dpsgd(optax.sgd(0.1), 1.0, 1.0, 64.0, jax.random.key(0))
      >>> u, _ = tx.update(jnp.zeros(3), tx.init(jnp.zeros(3)))
      >>> u.shape
      (3,)
    """
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf)
    _validate.check_in_range("clip_norm", clip_norm, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("batch_size", batch_size, 0.0, math.inf, lo_open=True)
    if not isinstance(optimizer, optax.GradientTransformation):
        if not callable(optimizer):  # a schedule count -> rate is free: the guarantee does not depend on it
            _validate.check_in_range("learning_rate", optimizer, 0.0, math.inf, lo_open=True)
        optimizer = optax.sgd(optimizer)
    noise_std = jnp.asarray(noise_multiplier) * jnp.asarray(clip_norm)
    return optax.chain(
        add_gaussian_noise(noise_std, key),
        optax.scale(1.0 / jnp.asarray(batch_size)),
        optimizer,
    )


def _micro_batches(capacity: int, micro_batch_size: int, devices: int) -> tuple[int, int]:
    """``(m, k)``: the micro-batch size rounded up to a multiple of ``devices``, and the
    number ``k`` of micro-batches that cover ``capacity`` rows (all run in every step)."""
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, (int, np.integer)) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be an integer >= 1; got {micro_batch_size!r}.")
    m = -(-int(micro_batch_size) // devices) * devices
    return m, -(-int(capacity) // m)


class DPSGDStepOutput(NamedTuple):
    """What one :func:`dpsgd_step` returns beside the new state.

    Attributes:
      batch_size: the realised Poisson batch size (private: do not publish per step).
      max_grad_norm: the largest unclipped per-example gradient norm in the batch.
      chunks: padded chunks the step ran (1 unless the batch exceeded the capacity).
      clipped: sampled per-example gradients whose norm was not at most :math:`C` (NaN
        counted), ``int32``: PNSGD with Poisson batches needs none clipped for its
        hidden-state guarantee.
    """

    batch_size: jax.Array
    max_grad_norm: jax.Array
    chunks: jax.Array
    clipped: jax.Array | None = None


def dpsgd_step(loss_fn, graphdef, rest, tx: optax.GradientTransformation, params: Any, opt_state: Any,
               sample_key: jax.Array, x: jax.Array, y: jax.Array, q, clip_norm, capacity: int, *,
               use_fast_path: bool | None = None, mesh=None, micro_batch_size: int | None = None, wrt=nnx.Param,
               batch: tuple[jax.Array, jax.Array] | None = None):
    r"""One DP-SGD step on the whole training set ``(x, y)``: sample, clip, sum, update.

    Pure and jittable (``capacity`` is static); scan it over steps. The Poisson sample comes
    from ``sample_key`` (:func:`poisson_sample`); the clipped-gradient sum runs over
    ``capacity``-sized chunks of the sampled indices until every sampled record is in
    (padding rows are masked out); ``tx`` (from :func:`dpsgd`) adds the noise and applies
    the optimizer.

    With ``mesh`` (a ``jax.sharding.Mesh`` with a ``"data"`` axis,
    :func:`~jaxdp.training.data_parallel_mesh`), each chunk's rows are split over the
    devices (:func:`~jaxdp.training.parallel_clipped_grad_sum`): the capacity is rounded up
    to a multiple of the device count (extra rows are masked padding, never sampled: the
    sample and the guarantee are unchanged) and the partial sums are added by a ``psum``;
    ``tx`` then adds the noise **once** to the global sum, from its replicated key (the
    same draw as on one device). Pass replicated ``params``/``opt_state``/``x``/``y``
    (:func:`~jaxdp.training.replicate`).

    **Gradient accumulation** (``micro_batch_size`` :math:`m`, static): the sampled indices
    are processed in micro-batches of :math:`m` rows, :math:`\lceil c/m\rceil` of them in a
    ``lax.scan`` (``c`` the capacity), then more in the ``while_loop`` only if the batch
    exceeds :math:`m\lceil c/m\rceil`. Each micro-batch's clipped sum is added to one
    accumulator, and ``tx`` adds the noise once, to the whole sum: the same update as
    without micro-batches, up to the order of the floating-point additions, and the same
    sample and noise for the same keys (the guarantee does not change). Memory is that of
    one micro-batch. With ``mesh``, :math:`m` is rounded up to a multiple of the device count.

    **Precision**: the clipped sum is accumulated in float32 at least (bfloat16 or float16
    parameters get float32 gradients sums, and the noise of ``tx`` is then drawn in float32);
    float32 and float64 parameters keep their dtype.

    ``wrt``: the nnx filter of the trainable parameters (``params`` holds exactly these;
    the frozen ones are in ``rest``): only they are clipped, summed and noised.

    ``batch``: another scheme's sample ``(indices, size)`` (a sampler of
    :mod:`jaxdp.training.samplers`: the first ``size`` entries of ``indices`` are the batch,
    duplicates counted as often as they appear); then ``sample_key`` and ``q`` are unused.
    Its guarantee is that sampler's event, not the Poisson one.

    Returns:
      ``(params, opt_state, DPSGDStepOutput)``.
    """
    if micro_batch_size is not None:
        capacity, fixed = _micro_batches(capacity, micro_batch_size, 1 if mesh is None else mesh.shape[AXIS])
    elif mesh is not None:
        devices = mesh.shape[AXIS]
        capacity = -(-int(capacity) // devices) * devices
    n = x.shape[0]
    indices, size = poisson_sample(sample_key, n, q) if batch is None else batch
    padded = jnp.concatenate([indices, jnp.zeros((capacity,), indices.dtype)])
    model = nnx.merge(graphdef, params, rest)
    chunks = (size + capacity - 1) // capacity

    def body(carry):
        k, acc, maxn, clipped = carry
        idx = jax.lax.dynamic_slice(padded, (k * capacity,), (capacity,))
        valid = k * capacity + jnp.arange(capacity) < size
        if mesh is None:
            cg = clipped_grad_sum(loss_fn, model, (x[idx], y[idx]), clip_norm, mask=valid, use_fast_path=use_fast_path,
                                  wrt=wrt)
        else:
            cg = parallel_clipped_grad_sum(loss_fn, model, (x[idx], y[idx]), clip_norm, mesh, mask=valid,
                                           use_fast_path=use_fast_path, wrt=wrt)
        acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, cg.grad_sum)
        maxn = jnp.maximum(maxn, jnp.max(jnp.where(valid, cg.norms, 0.0)).astype(maxn.dtype))
        over = valid & ~(cg.norms <= jnp.asarray(clip_norm, cg.norms.dtype))
        return k + 1, acc, maxn, clipped + jnp.sum(over).astype(jnp.int32)

    zero = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=accumulation_dtype(p.dtype)), params)
    if micro_batch_size is None:
        # The first chunk runs outside the loop (a padded empty batch adds exact zeros): the
        # common one-chunk step is then straight-line code, which matters on CPU, where XLA runs
        # convolutions inside a while loop about 10x slower than outside.
        first = body((jnp.zeros((), jnp.int32), zero, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)))
    else:
        # Fixed-shape micro-batches covering the capacity in a scan; the rare overflow after.
        first = jax.lax.scan(lambda c, _: (body(c), None), (jnp.zeros((), jnp.int32), zero,
                             jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)), None, length=fixed)[0]
    _, grad_sum, maxn, clipped = jax.lax.while_loop(lambda c: c[0] < chunks, body, first)
    updates, opt_state = tx.update(grad_sum, _drawn_after(opt_state, maxn), params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, DPSGDStepOutput(size, maxn, chunks, clipped)


def _drawn_after(opt_state, x):
    """``opt_state`` with the same values, its PRNG keys made to depend on ``x``.

    The noise's random bits depend on the key alone, so XLA may schedule their generation
    (threefry) before the clipped sum and keep the bits, about twice the parameters' size,
    alive through the sum's peak (planned memory 1.30x the non-private step instead of
    1.16x on a small transformer encoder). Selecting the key's data with a predicate
    that is always false but opaque to XLA (``x != x`` and ``x == x``: NaN makes the two
    compares unfoldable) draws the same bits after ``x`` is known. Typed keys and raw
    ``uint32[..., 2]`` keys (the two kinds :func:`add_gaussian_noise` accepts) are tied; other
    leaves are left as they are. The values never change, only the schedule.
    """
    never = (x != x) & (x == x)

    def after(leaf):
        if not isinstance(leaf, jax.Array):
            return leaf
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            data = jax.random.key_data(leaf)
            return jax.random.wrap_key_data(jnp.where(never, jnp.zeros_like(data), data),
                                            impl=jax.random.key_impl(leaf))
        if leaf.dtype == jnp.uint32 and leaf.shape[-1:] == (2,):
            return jnp.where(never, jnp.zeros_like(leaf), leaf)
        return leaf

    return jax.tree.map(after, opt_state)
