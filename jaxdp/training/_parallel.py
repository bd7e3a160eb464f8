r"""Data parallelism over devices with JAX's own sharding: per-example work split, noise drawn once.

A private step computes the clipped-gradient sum of a batch and adds Gaussian noise to it:

.. math::

    S + Z = \sum_{i \in B} \min\Bigl(1, \frac{C}{\lVert g_i\rVert}\Bigr) g_i + Z,
    \qquad Z \sim \mathcal N(0, s^2 I).

Over :math:`D` devices of a one-axis :class:`jax.sharding.Mesh` (axis ``"data"``), the
batch rows are split into :math:`D` equal blocks :math:`B_1, \dots, B_D`; device :math:`d`
clips its own rows and sums them, and ``jax.lax.psum`` adds the :math:`D` partial sums
(:func:`parallel_clipped_grad_sum`, a ``jax.shard_map``). The noise is **not** part of that
map: the optax transformation that adds it (``pnsgd``/``dpsgd``) runs on the summed,
replicated gradient, from the one replicated noise key, so :math:`Z` is drawn once for the
global batch, the same draw as on one device. (Noise drawn per device and then summed would
have variance :math:`D s^2` for independent keys, or be :math:`D` copies of one draw
(std :math:`Ds`) after a ``psum``; and noise drawn per device but *not* summed would leave the
per-device copies different: either way not the analysed mechanism.)

Padding: a batch whose size is not a multiple of :math:`D` gets extra rows (copies of its
first row) with mask 0, which contribute exactly nothing; padding rows are never sampled, so
the sampling (and the guarantee) is unchanged.

Placement: the parameters, the optimizer state (noise key included) and the training set
are replicated on every device of the mesh (:func:`replicate`); only the per-example work
of each batch is split. The result of a step is replicated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import _validate
from ._clipping import ClippedGrads, clipped_grad_sum

__all__ = ["data_parallel_mesh", "parallel_clipped_grad_sum", "replicate"]

AXIS = "data"


def data_parallel_mesh(devices: int | Sequence[Any] | Mesh | None = None) -> Mesh:
    """A one-axis mesh ``("data",)`` over devices, for data-parallel private training.

    Args:
      devices: ``None`` (every device of ``jax.devices()``, all processes), an integer
        :math:`k \\ge 1` (the first :math:`k` of ``jax.devices()``), a sequence of devices, or
        a :class:`jax.sharding.Mesh` that has a ``"data"`` axis (returned as is; the batch is
        split over that axis and replicated over any other).

    Returns:
      A :class:`jax.sharding.Mesh` with axis ``"data"``.

    Raises:
      ValueError: naming ``devices``, for a count outside ``1..jax.device_count()``, an empty
        sequence, or a mesh without a ``"data"`` axis.

    Examples:
      >>> mesh = data_parallel_mesh(1)
      >>> mesh.axis_names, mesh.shape["data"]
      (('data',), 1)
    """
    if isinstance(devices, Mesh):
        if AXIS not in devices.axis_names:
            raise ValueError(f"devices: a Mesh must have a {AXIS!r} axis to split the batch over; got axes "
                             f"{devices.axis_names}.")
        return devices
    available = jax.devices()
    if devices is None:
        chosen = available
    elif isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
        if not 1 <= int(devices) <= len(available):
            raise ValueError(f"devices must be an integer in [1, {len(available)}] (jax.device_count()), a "
                             f"sequence of devices or a Mesh; got {devices}.")
        chosen = available[: int(devices)]
    else:
        try:
            chosen = list(devices)
        except TypeError:
            raise ValueError(f"devices must be None, an integer, a sequence of devices or a Mesh; got "
                             f"{devices!r}.") from None
        if not chosen or not all(isinstance(d, jax.Device) for d in chosen):
            raise ValueError(f"devices must be a non-empty sequence of jax devices; got {devices!r}.")
    return Mesh(np.asarray(chosen, dtype=object), (AXIS,))


def replicate(tree: Any, mesh: Mesh) -> Any:
    """``tree`` placed on every device of ``mesh`` (``NamedSharding(mesh, P())``).

    Single process: ``jax.device_put``. Several processes (``jax.distributed``): every process
    must pass the same values (the replicas are assembled from each process's own copy).

    Examples:
      >>> import jax.numpy as jnp
      >>> replicate(jnp.arange(3.0), data_parallel_mesh(1)).sharding.is_fully_replicated
      True
    """
    sharding = NamedSharding(mesh, P())
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)

    def put(a):
        a = np.asarray(jax.random.key_data(a)) if _is_key(a) else np.asarray(a)
        return jax.make_array_from_process_local_data(sharding, a, a.shape)

    def put_leaf(a):
        if _is_key(a):
            return jax.random.wrap_key_data(put(a), impl=jax.random.key_impl(a))
        return put(a)

    return jax.tree.map(put_leaf, tree)


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def parallel_clipped_grad_sum(loss_fn, model_or_params, batch, clip_norm, mesh: Mesh, *, mask=None,
                              use_fast_path: bool | None = None, wrt=nnx.Param) -> ClippedGrads:
    r""":func:`~jaxdp.training.clipped_grad_sum` with the batch split over the ``"data"`` axis of ``mesh``.

    .. math::

        S = \sum_{d=1}^{D}\ \sum_{i \in B_d} m_i \min\Bigl(1, \frac{C}{\lVert g_i\rVert}\Bigr) g_i ,

    each device clipping and summing its block :math:`B_d` of rows (``jax.shard_map``), the
    :math:`D` partial sums added by ``jax.lax.psum``. The batch is padded to a multiple of
    :math:`D` rows with masked copies of its first row (mask :math:`m_i = 0`: they add exact
    zeros). No noise is added here: add it once, to the returned sum, outside (the optax
    transformations ``pnsgd``/``dpsgd`` do, from a replicated key), never per device.

    Equal to :func:`~jaxdp.training.clipped_grad_sum` up to the order of the floating-point
    additions. Jittable; ``clip_norm`` may be traced.

    Args:
      loss_fn: ``loss_fn(model, x, y) -> (b,)`` per-example losses.
      model_or_params: Flax NNX module or parameter pytree (as for ``clipped_grad_sum``).
      batch: ``(x, y)`` with a leading batch axis ``b``.
      clip_norm: :math:`C > 0`.
      mesh: a mesh with a ``"data"`` axis (:func:`data_parallel_mesh`).
      mask: optional ``(b,)`` booleans or 0/1 weights; ``False`` rows are padding.
      use_fast_path: as for ``clipped_grad_sum``.
      wrt: the trainable parameters' nnx filter, as for ``clipped_grad_sum``.

    Returns:
      :class:`~jaxdp.training.ClippedGrads`: ``grad_sum`` replicated over the mesh, ``norms``
      of shape ``(b,)`` (the unclipped per-example norms, split over the mesh).

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxdp.models import LogisticRegression, binary_logistic_loss
      >>> model = LogisticRegression(3, rngs=nnx.Rngs(0))
      >>> x, y = jnp.ones((5, 3)), jnp.array([0, 1, 0, 1, 1])
      >>> out = parallel_clipped_grad_sum(binary_logistic_loss, model, (x, y), 0.5, data_parallel_mesh(1))
      >>> out.norms.tolist()
      [1.0, 1.0, 1.0, 1.0, 1.0]
    """
    _validate.check_in_range("clip_norm", clip_norm, 0.0, math.inf, lo_open=True)
    if not isinstance(mesh, Mesh) or AXIS not in mesh.axis_names:
        raise ValueError(f"mesh must be a jax.sharding.Mesh with a {AXIS!r} axis (data_parallel_mesh()); got "
                         f"{mesh!r}.")
    try:
        x, y = batch
    except (TypeError, ValueError):
        raise ValueError("batch must be a pair (x, y) of arrays with a leading batch axis.") from None
    x, y = jnp.asarray(x), jnp.asarray(y)
    b = x.shape[0]
    valid = jnp.ones((b,), jnp.float32) if mask is None else jnp.asarray(mask)
    if valid.shape != (b,):
        raise ValueError(f"mask must have shape ({b},), one entry per example; got {valid.shape}.")
    pad = (-b) % mesh.shape[AXIS]
    if pad:
        # Copies of a real row (finite loss), weighted 0: exactly nothing is added.
        x = jnp.concatenate([x, jnp.broadcast_to(x[:1], (pad,) + x.shape[1:])])
        y = jnp.concatenate([y, jnp.broadcast_to(y[:1], (pad,) + y.shape[1:])])
        valid = jnp.concatenate([valid, jnp.zeros((pad,), valid.dtype)])
    if isinstance(model_or_params, nnx.Module):
        graphdef, params, rest = nnx.split(model_or_params, wrt, ...)

        def rebuild(p, r):
            return nnx.merge(graphdef, p, r)
    else:
        params, rest = model_or_params, None

        def rebuild(p, r):
            return p

    def local(p, r, c, xb, yb, mb):
        cg = clipped_grad_sum(loss_fn, rebuild(p, r), (xb, yb), c, mask=mb, use_fast_path=use_fast_path, wrt=wrt)
        return jax.lax.psum(cg.grad_sum, AXIS), cg.norms

    # check_vma=False: with replication typing, autodiff inside the body would sum over devices
    # the gradients with respect to replicated values (the parameters, the fast path's zero
    # probes: the transpose of their implicit broadcast is a psum), mixing the devices'
    # examples before clipping. Untyped, every device differentiates its own rows only, and the
    # one psum below is the only reduction.
    mapped = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P(AXIS), P(AXIS), P(AXIS)),
                           out_specs=(P(), P(AXIS)), check_vma=False)
    grad_sum, norms = mapped(params, rest, jnp.asarray(clip_norm), x, y, valid)
    return ClippedGrads(grad_sum, norms[:b])


def _same_secret_on_all_processes(key: jax.Array) -> jax.Array:
    """The secret key of process 0 on every process (multi-host); the key itself on one process.

    Each process draws its own OS entropy, so without this the hosts would hold different
    noise keys for what must be one replicated draw. The key travels between the processes
    through JAX's collective (``broadcast_one_to_all``), never through a file or a log.
    """
    if jax.process_count() == 1:
        return key
    from jax.experimental import multihost_utils  # lazy: only with several processes

    data = multihost_utils.broadcast_one_to_all(np.asarray(jax.random.key_data(key)))
    return jax.random.wrap_key_data(jnp.asarray(data), impl=jax.random.key_impl(key))


def _check_same_data(fingerprint: str) -> None:
    """Multi-host: every process must hold the same training set (refused otherwise)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils  # lazy: only with several processes

    digest = np.frombuffer(bytes.fromhex(fingerprint), dtype=np.uint8)
    try:
        multihost_utils.assert_equal(digest)  # on every process: all raise, none waits
    except AssertionError:
        raise ValueError("devices: with several processes every process must load the same training set "
                         "(the fingerprints of the processes' data differ).") from None
