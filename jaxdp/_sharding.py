"""A batch axis split over every device with JAX's own sharding (``Mesh`` + ``NamedSharding``).

Accountants are elementwise over their batch axes, so a batch of configurations splits
over devices without communication: the leading axis is padded to a multiple of the
device count (with copies of its last element, so the padding is valid input), placed
with ``NamedSharding(Mesh(devices, ("batch",)), PartitionSpec("batch"))``, and the
computation follows the data (``jax.jit`` partitions it the same way). The padding is cut
off the result. One device works the same way (a mesh of one).

Multi-host: after ``jax.distributed.initialize()`` on every host, ``jax.devices()`` lists
the devices of all hosts and the same calls split the batch over all of them (each host
must run the same program on the same arguments); :func:`to_host` gathers a result whose
shares live on other hosts (``process_allgather``). Tested on one host with 8 CPU devices
only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

BATCH_AXIS = "batch"


def batch_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh named ``"batch"`` over ``devices`` (default: all of ``jax.devices()``)."""
    devs = list(jax.devices() if devices is None else devices)
    if not devs:
        raise ValueError("devices must name at least one device")
    return Mesh(np.asarray(devs, dtype=object), (BATCH_AXIS,))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The sharding that splits the leading axis over the mesh's ``"batch"`` axis."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXIS))


def padded_length(n: int, num_devices: int) -> int:
    """``n`` rounded up to a multiple of ``num_devices`` (at least ``num_devices``)."""
    return max(1, math.ceil(n / num_devices)) * num_devices


def pad_leading_axis(x: np.ndarray, length: int) -> np.ndarray:
    """``x`` padded along axis 0 to ``length`` rows with copies of its last row."""
    x = np.asarray(x)
    if x.shape[0] == length:
        return x
    if x.shape[0] == 0:
        raise ValueError("cannot pad an empty batch")
    return np.concatenate([x, np.repeat(x[-1:], length - x.shape[0], axis=0)], axis=0)


def shard_leading_axis(x, mesh: Mesh | None = None) -> jax.Array:
    """``x`` padded to a multiple of the device count and split over devices on axis 0.

    Args:
      x: array-like with a leading batch axis (length ≥ 1). Float64 values stay float64
        (the placement runs in a 64-bit scope).
      mesh: the mesh to split over (default: :func:`batch_mesh` over all devices).

    Returns:
      A ``jax.Array`` of ``padded_length(len(x), devices)`` rows with sharding
      ``NamedSharding(mesh, PartitionSpec("batch"))``; rows past ``len(x)`` repeat the last.
    """
    mesh = batch_mesh() if mesh is None else mesh
    x = np.asarray(x)
    if x.ndim == 0:
        raise ValueError("shard_leading_axis needs an array with a leading axis; got a scalar")
    x = pad_leading_axis(x, padded_length(x.shape[0], mesh.size))
    with jax.enable_x64(True):
        return jax.device_put(x, batch_sharding(mesh))


def sharded_apply(fn: Callable, *args, devices: Sequence[jax.Device] | None = None) -> np.ndarray:
    """``fn(*args)`` for an elementwise ``fn``, its batch split over devices.

    The arguments are broadcast together and flattened into one batch axis, which is padded
    and sharded (:func:`shard_leading_axis`); ``jax.jit(fn)`` runs on every device's share
    and the result comes back as a float64 NumPy array of the broadcast shape.

    Args:
      fn: a function of arrays that is elementwise over its (common) leading axis, e.g.
        ``jaxdp.accounting.dpsgd_epsilon`` with its options bound by ``functools.partial``.
      *args: array-likes that broadcast together (at least one element).
      devices: the devices to split over (default: all).

    Returns:
      ``np.ndarray`` of the broadcast shape of ``args``.

    Examples:
      >>> import functools, jaxdp
      >>> from jaxdp.grids import sharded_apply
      >>> f = functools.partial(jaxdp.accounting.dpsgd_epsilon, orders=(2.0, 4.0, 8.0, 16.0, 32.0), method="improved")
      >>> sharded_apply(f, [0.01, 0.02], 1.1, 1000, 1e-5).round(4).tolist()
      [1.7982, 4.0911]
    """
    arrays = np.broadcast_arrays(*[np.asarray(a, dtype=np.float64) for a in args])
    shape = arrays[0].shape
    n = int(np.prod(shape))
    if n == 0:
        raise ValueError("sharded_apply needs at least one element; got an empty batch")
    mesh = batch_mesh(devices)
    sharded = [shard_leading_axis(a.reshape(-1), mesh) for a in arrays]
    with jax.enable_x64(True):
        out = _jit(fn)(*sharded)
        return to_host(out)[:n].reshape(shape)


def to_host(x: jax.Array) -> np.ndarray:
    """The whole of ``x`` as a NumPy array on this host (gathered from other hosts if needed)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


_JITTED: dict = {}


def _jit(fn: Callable) -> Callable:
    """One ``jax.jit`` wrapper per function (compiled once per shape and sharding)."""
    key = fn if not hasattr(fn, "func") else (fn.func, tuple(fn.args), tuple(sorted(fn.keywords.items())))
    try:
        return _JITTED[key]
    except TypeError:  # unhashable options: no cache
        return jax.jit(fn)
    except KeyError:
        _JITTED[key] = jax.jit(fn)
        return _JITTED[key]
