"""Streamed ε grids: millions of DP-SGD configurations in fixed-size chunks, resumable.

:func:`epsilon_grid` evaluates ε of DP-SGD (:func:`jaxdp.accounting.dpsgd_epsilon`, or the
PLD upper bound :func:`jaxdp.accounting.pld_epsilon`) on the Cartesian product of the
axes ``q × noise_multiplier × num_steps × delta`` (row-major: ``delta`` varies fastest).
The product is never built: each chunk of ``chunk_size`` flat indices is turned into its
four coordinates, padded to the static chunk length (one compilation for the whole grid),
split over all devices (``jax.sharding``; :func:`sharded_apply`) and evaluated by one
jitted call. Memory is bounded by the chunk, not the grid: the working set is about
``chunk_size × len(orders) × 8`` bytes times a small constant, plus 8 bytes per
configuration for the result, which lives in a memory-mapped file when a ``directory`` is
given.

Resuming: with a ``directory``, ε is written to ``chunks-<fingerprint>/epsilon.npy`` (a
memory-mapped float64 vector) and the index of every finished chunk is appended to
``done.txt`` after its values are flushed. Calling again with the same arguments skips the
finished chunks, so an interrupted grid resumes without recomputing or losing rows. The
fingerprint is a SHA-256 of every argument (axis values bit for bit, orders, method,
accountant, chunk size), so changed arguments never reuse another grid's chunks.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from . import _sharding, _validate
from . import accounting as A

__all__ = ["GridResult", "batch_mesh", "epsilon_grid", "shard_leading_axis", "sharded_apply", "write_grid_csv"]

# The batch axis of any elementwise accountant call over every device (public here).
batch_mesh = _sharding.batch_mesh
shard_leading_axis = _sharding.shard_leading_axis
sharded_apply = _sharding.sharded_apply

CSV_HEADER = "q,noise_multiplier,num_steps,delta,epsilon"
_DEFAULT_CHUNK = {"rdp": 16384, "pld": 16}


class GridResult(NamedTuple):
    """What :func:`epsilon_grid` computed.

    Attributes:
      epsilon: float64 ε of shape ``(len(q), len(noise_multiplier), len(num_steps), len(delta))``
        (a read-only memory map of ``directory``'s file when one was given).
      axes: the four axes as float64 arrays, in the order above.
      computed_chunks: chunks evaluated by this call.
      resumed_chunks: chunks found finished on disk and not recomputed.
      seconds: wall time of this call.
      directory: the chunk folder (``None`` in memory).
    """

    epsilon: np.ndarray
    axes: tuple
    computed_chunks: int
    resumed_chunks: int
    seconds: float
    directory: str | None


def _axis(name: str, value) -> np.ndarray:
    _validate.check_nonempty(name, value)
    _validate._check_numeric(name, value)  # a string is not a number, even when it parses as one
    arr = np.atleast_1d(np.asarray(value, dtype=np.float64))
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a scalar or a 1-D list of values; got shape {arr.shape}")
    return arr


def _fingerprint(axes: Sequence[np.ndarray], *, accountant: str, orders, method: str, chunk_size: int) -> str:
    """SHA-256 (hex) of everything that determines a grid's chunks, axis values bit for bit."""
    config = dict(
        axes=[np.asarray(a, dtype=np.float64).tobytes().hex() for a in axes],
        accountant=accountant, method=method, chunk_size=int(chunk_size),
        orders=None if accountant == "pld" else np.asarray(orders, dtype=np.float64).tobytes().hex(),
        version=1,
    )
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def epsilon_grid(q, noise_multiplier, num_steps, delta, *, directory: str | None = None,
                 chunk_size: int | None = None, accountant: str = "rdp", orders=A.DEFAULT_ORDERS,
                 method: str = "improved", progress: bool = False,
                 callback: Callable[[int, int], None] | None = None) -> GridResult:
    r"""ε of DP-SGD on the grid ``q × noise_multiplier × num_steps × delta``, chunk by chunk.

    Each configuration gets :math:`ε = \min_α \mathrm{conv}_δ(T\,ε_{q,σ}(α))`, exactly what
    :func:`jaxdp.accounting.dpsgd_epsilon` returns for it (``accountant="rdp"``), or the
    certified PLD upper bound of :func:`jaxdp.accounting.pld_epsilon` (``"pld"``).

    Args:
      q: sampling rates in [0, 1] (scalar or 1-D).
      noise_multiplier: noise multipliers in (0, inf), relative to the L2 sensitivity of the
        clipped sum (add/remove-one neighbours).
      num_steps: step counts in [0, inf) (fractional counts are rounded up).
      delta: target deltas in [2.2250738585072014e-308, 1).
      directory: folder for the resumable chunk files (``None``: in memory, not resumable).
      chunk_size: configurations per chunk (static; default 16384 for ``"rdp"``, 16 for
        ``"pld"``, whose FFT grid needs 2^16 bins per configuration; a grid smaller than
        that is one chunk of its own size).
      accountant: ``"rdp"`` or ``"pld"``.
      orders: Rényi orders for ``"rdp"`` (default: dp_accounting's 156).
      method: RDP → DP conversion, ``"improved"`` or ``"classic"``.
      progress: show a tqdm progress bar (on stderr).
      callback: called as ``callback(chunk_index, num_chunks)`` after each chunk is safely
        written (an exception from it stops the grid; finished chunks are kept).

    Returns:
      :class:`GridResult`; ``epsilon`` has shape ``(len(q), len(noise_multiplier),
      len(num_steps), len(delta))``.

    Raises:
      ValueError: an axis is empty or out of range, or an option is invalid (the parameter
        is named); without ``directory``, a result vector larger than the machine's memory.
      OSError: ``errno.ENOSPC`` naming ``epsilon.npy`` when its file system cannot hold the
        8 bytes per configuration (checked before the file is made, then its blocks are
        allocated, so a full disk never kills the process with SIGBUS).

    Examples:
      >>> import jaxdp.grids
      >>> res = jaxdp.grids.epsilon_grid([0.01, 0.02], 1.1, 1000, 1e-5, orders=(2.0, 4.0, 8.0, 16.0, 32.0))
      >>> res.epsilon.shape, res.epsilon[:, 0, 0, 0].round(4).tolist()
      ((2, 1, 1, 1), [1.7982, 4.0911])
    """
    start = time.perf_counter()
    _validate.check_static_choice("accountant", accountant, ("rdp", "pld"))
    _validate.check_static_choice("method", method, ("improved", "classic"))
    axes = tuple(_axis(n, v) for n, v in (("q", q), ("noise_multiplier", noise_multiplier),
                                            ("num_steps", num_steps), ("delta", delta)))
    _validate.check_in_range("q", axes[0], 0.0, 1.0)
    _validate.check_in_range("noise_multiplier", axes[1], 0.0, math.inf, lo_open=True)
    _validate.check_in_range("num_steps", axes[2], 0.0, math.inf)
    _validate.check_delta(axes[3])
    if accountant == "rdp":
        orders = tuple(float(o) for o in _validate.concrete_orders(orders))
    else:  # the PLD accountant has no orders
        orders = None
    chunk_size = _DEFAULT_CHUNK[accountant] if chunk_size is None else chunk_size
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1; got {chunk_size!r}")
    shape = tuple(len(a) for a in axes)
    total = math.prod(shape)
    chunk_size = min(int(chunk_size), total)  # a small grid is one chunk of its own size, not padded
    num_chunks = math.ceil(total / chunk_size)

    if directory is None:
        _check_memory(total)
        eps, done, folder = np.empty(total, dtype=np.float64), set(), None
    else:
        fp = _fingerprint(axes, accountant=accountant, orders=orders, method=method, chunk_size=chunk_size)
        folder = os.path.join(directory, f"chunks-{fp[:16]}")
        eps, done = _open_store(folder, fp, total, num_chunks, chunk_size, axes, accountant, method)
    resumed = len(done)

    mesh = _sharding.batch_mesh()
    length = _sharding.padded_length(chunk_size, mesh.size)
    fn = _chunk_function(accountant, orders, method)
    todo = [k for k in range(num_chunks) if k not in done]
    bar = _progress_bar(progress, num_chunks, resumed)
    try:
        for k in todo:
            lo, hi = k * chunk_size, min((k + 1) * chunk_size, total)
            # Padding repeats the last configuration: valid input, cut off below.
            idx = np.minimum(np.arange(lo, lo + length), hi - 1)
            coords = np.unravel_index(idx, shape)
            args = [_sharding.shard_leading_axis(ax[c], mesh) for ax, c in zip(axes, coords)]
            with jax.enable_x64(True):
                values = np.asarray(_sharding.to_host(fn(*args)), dtype=np.float64)
            eps[lo:hi] = values[: hi - lo]
            if folder is not None:
                eps.flush()  # the values reach the file before the chunk is marked done
                try:
                    with open(os.path.join(folder, "done.txt"), "a") as fh:
                        fh.write(f"{k}\n")
                        fh.flush()
                        os.fsync(fh.fileno())
                except OSError as exc:
                    if _is_disk_full(exc) and exc.filename is None:
                        raise _named(exc, os.path.join(folder, "done.txt")) from None
                    raise
            if bar is not None:
                bar.update(1)
            if callback is not None:
                callback(k, num_chunks)
    finally:
        if bar is not None:
            bar.close()
    if folder is not None:
        _remove_stale(directory, folder)
        eps = np.load(os.path.join(folder, "epsilon.npy"), mmap_mode="r")
    return GridResult(eps.reshape(shape), axes, len(todo), resumed, time.perf_counter() - start, folder)


def write_grid_csv(path: str, result: GridResult, *, chunk_size: int = 65536) -> None:
    """Write ``result`` as CSV (``q,noise_multiplier,num_steps,delta,epsilon``), streamed.

    Rows follow the grid's row-major order; values are written as Python's ``repr`` (the shortest
    text that reads back as the same float64). The file is written to ``path + ".tmp"`` and renamed, so a
    reader never sees half a file; on any failure (a full disk: ``OSError`` with ``errno.ENOSPC``
    naming ``path``) the temporary file is removed.
    """
    shape = result.epsilon.shape
    flat = result.epsilon.reshape(-1)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as fh:
            fh.write(CSV_HEADER + "\n")
            for lo in range(0, flat.size, chunk_size):
                idx = np.arange(lo, min(lo + chunk_size, flat.size))
                coords = np.unravel_index(idx, shape)
                cols = [ax[c].tolist() for ax, c in zip(result.axes, coords)]
                cols.append(np.asarray(flat[idx], dtype=np.float64).tolist())
                fh.write("".join(f"{a!r},{b!r},{c!r},{d!r},{e!r}\n" for a, b, c, d, e in zip(*cols)))
        os.replace(tmp, path)
    except BaseException as exc:
        # A full disk (or an interruption) must not leave the partial file behind: it would keep
        # the disk full for every rerun.
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if _is_disk_full(exc) and exc.filename is None:
            raise _named(exc, path) from None
        raise


@functools.cache
def _chunk_function(accountant: str, orders: tuple, method: str):
    if accountant == "pld":
        return jax.jit(lambda q, s, t, d: A.pld_epsilon(A.dpsgd_event(q, s, t), d))
    return _sharding._jit(functools.partial(A.dpsgd_epsilon, orders=orders, method=method))


def _open_store(folder, fp, total, num_chunks, chunk_size, axes, accountant, method):
    """The memory-mapped ε vector and the set of finished chunks of the grid ``fp``."""
    manifest = os.path.join(folder, "manifest.json")
    path = os.path.join(folder, "epsilon.npy")
    done_path = os.path.join(folder, "done.txt")
    existing = None
    if os.path.exists(manifest):
        try:
            with open(manifest) as fh:
                existing = json.load(fh).get("fingerprint")
        except (OSError, ValueError):
            existing = None
    if existing == fp and os.path.exists(path):
        eps = np.load(path, mmap_mode="r+")
        if eps.shape == (total,) and eps.dtype == np.float64:
            done = set()
            if os.path.exists(done_path):
                with open(done_path) as fh:
                    for line in fh:  # a line cut short by an interruption is ignored
                        if line.endswith("\n") and line.strip().isdigit() and int(line) < num_chunks:
                            done.add(int(line))
            return eps, done
        del eps
    # A new grid (or an unreadable one): start afresh.
    shutil.rmtree(folder, ignore_errors=True)
    _check_disk_space(os.path.dirname(folder) or ".", path, total)
    os.makedirs(folder)
    try:
        eps = np.lib.format.open_memmap(path, mode="w+", dtype=np.float64, shape=(total,))
        eps.flush()
        _reserve(path)
        open(done_path, "w").close()
        with open(manifest + ".tmp", "w") as fh:
            json.dump(dict(fingerprint=fp, configurations=total, chunk_size=chunk_size, accountant=accountant,
                           method=method, axis_lengths=[len(a) for a in axes]), fh)
        os.replace(manifest + ".tmp", manifest)  # written last: a folder without it is never resumed
    except BaseException as exc:
        shutil.rmtree(folder, ignore_errors=True)  # never a half-made folder
        if _is_disk_full(exc) and exc.filename is None:
            raise _named(exc, folder) from None
        raise
    return eps, set()


def _is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _named(exc: OSError, path: str) -> OSError:
    """The same error with the file it concerns (a full disk is reported with the path and its free space)."""
    return OSError(exc.errno, exc.strerror or os.strerror(exc.errno), path)


# Bytes of the .npy header of the memory-mapped vector (NumPy pads it to a multiple of 64; 128 today).
_NPY_HEADER_MAX = 4096


def _check_disk_space(directory: str, path: str, total: int) -> None:
    """Raise ``OSError(ENOSPC)`` naming ``path`` if its file system cannot hold ``total`` float64 values.

    The vector is memory-mapped: a write into a page the file system cannot back kills the
    process with SIGBUS, with no message, so the space is checked before the file exists.
    """
    need = 8 * total + _NPY_HEADER_MAX
    free = shutil.disk_usage(directory).free
    if need > free:
        raise OSError(errno.ENOSPC, f"the grid's {total} results need {need} bytes but the file system has {free} "
                                    f"bytes free", path)


def _reserve(path: str) -> None:
    """Allocate the file's blocks now (``posix_fallocate``), so no later write into the map can hit a full disk.

    Another process may fill the disk after the check above; with the blocks allocated the
    map never needs new ones. File systems without ``fallocate`` keep the sparse file.
    """
    if not hasattr(os, "posix_fallocate"):  # pragma: no cover - not Linux
        return
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    except OSError as exc:
        if _is_disk_full(exc):
            raise _named(exc, path) from None
        # EOPNOTSUPP, EINVAL: the file system cannot preallocate; the free-space check stands.
    finally:
        os.close(fd)


def _check_memory(total: int) -> None:
    """An in-memory grid's result vector (8 bytes per configuration) must fit the machine's memory."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return
    if 8 * total > memory:
        raise ValueError(f"the grid has {total} configurations ({8 * total} bytes of results) but the machine has "
                         f"{memory} bytes of memory; pass directory= to keep the results in a memory-mapped file")


def _remove_stale(directory: str, keep: str) -> None:
    """Remove chunk folders of other grids in ``directory`` (only folders this module made)."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if (name.startswith("chunks-") and os.path.abspath(path) != os.path.abspath(keep)
                and os.path.exists(os.path.join(path, "manifest.json"))):
            shutil.rmtree(path, ignore_errors=True)


def _progress_bar(progress: bool, total: int, initial: int):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="chunk", desc="epsilon grid", dynamic_ncols=True)
