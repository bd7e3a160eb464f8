"""Eager validators, in one place.

Every public function calls these on its inputs. A validator checks only values that are
concrete (Python numbers, NumPy arrays, concrete JAX arrays); tracers pass through
unchecked, because their values are unknown while tracing. Under ``jit`` the public
functions instead mask invalid inputs to NaN with :func:`valid_mask`, so an invalid value
can never produce a finite, optimistic result.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "is_concrete",
    "check_in_range",
    "check_orders",
    "check_static_choice",
    "concrete_orders",
]


def is_concrete(x: Any) -> bool:
    """True when ``x`` holds known values (not a tracer inside jit/vmap/grad)."""
    if isinstance(x, jax.core.Tracer):
        return False
    if isinstance(x, (list, tuple)):
        return all(is_concrete(v) for v in x)
    return True


def _fmt(lo: float, hi: float, lo_open: bool, hi_open: bool) -> str:
    left = "(" if lo_open or lo == -math.inf else "["
    right = ")" if hi_open or hi == math.inf else "]"
    lo_s = "-inf" if lo == -math.inf else f"{lo:g}"
    hi_s = "inf" if hi == math.inf else f"{hi:g}"
    return f"{left}{lo_s}, {hi_s}{right}"


def check_in_range(
    name: str,
    value: Any,
    lo: float = -math.inf,
    hi: float = math.inf,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    allow_inf: bool = False,
) -> None:
    """Raise ``ValueError`` naming ``name`` if a concrete ``value`` leaves the interval.

    NaN is always rejected; infinities are rejected unless ``allow_inf``.
    """
    if not is_concrete(value):
        return
    arr = np.asarray(value, dtype=np.float64)
    interval = _fmt(lo, hi, lo_open, hi_open)
    if np.any(np.isnan(arr)):
        raise ValueError(f"{name} must be a number in {interval}; got NaN.")
    if not allow_inf and np.any(np.isinf(arr)):
        raise ValueError(f"{name} must be finite, in {interval}; got {_first_bad(arr, np.isinf(arr))}.")
    bad = (arr < lo) | (arr > hi)
    if lo_open:
        bad |= arr == lo
    if hi_open:
        bad |= arr == hi
    if np.any(bad):
        raise ValueError(f"{name} must be in {interval}; got {_first_bad(arr, bad)}.")


def _first_bad(arr: np.ndarray, bad: np.ndarray) -> str:
    flat = np.ravel(arr)[np.ravel(bad)]
    extra = f" (and {flat.size - 1} more invalid values)" if flat.size > 1 else ""
    return f"{flat[0]:g}{extra}"


def check_static_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise ``ValueError`` if a static string option is not one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}.")


def concrete_orders(orders: Any, *, name: str = "orders", max_order: float = 2.0**16) -> np.ndarray:
    """Return ``orders`` as a validated 1-D float64 NumPy array.

    The Rényi orders of the sampled Gaussian accountant are *static*: how many series
    terms each order needs depends on its value, so the grid must be known when the
    function is traced (pass a list or NumPy array; inside ``jit`` close over it).
    """
    if not is_concrete(orders):
        raise TypeError(
            f"{name} must be concrete (a list, tuple or NumPy array), not a traced value: the number "
            "of series terms per order is fixed when the function is traced. Close over the orders "
            "inside jit instead of passing them as a traced argument."
        )
    arr = np.asarray(orders, dtype=np.float64)
    if arr.ndim == 0:
        arr = arr[None]
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of Rényi orders; got shape {arr.shape}.")
    check_orders(name, arr, max_order=max_order)
    return arr


def check_orders(name: str, orders: Any, *, max_order: float = math.inf) -> None:
    """Rényi orders must lie in (1, max_order]."""
    check_in_range(name, orders, 1.0, max_order, lo_open=True)


def valid_mask(*conditions: jax.Array) -> jax.Array:
    """Logical AND of traced validity conditions (used to mask outputs to NaN under jit)."""
    out = jnp.asarray(True)
    for c in conditions:
        out = out & c
    return out


def check_integer(name: str, value: Any, lo: float = 1.0, hi: float = math.inf) -> None:
    """A concrete ``value`` must be a whole number in [lo, hi] (a count, such as num_steps)."""
    check_in_range(name, value, lo, hi)
    if not is_concrete(value):
        return
    arr = np.asarray(value, dtype=np.float64)
    bad = arr != np.floor(arr)
    if np.any(bad):
        raise ValueError(f"{name} must be a whole number in {_fmt(lo, hi, False, False)}; got {_first_bad(arr, bad)}.")


def check_probability_vectors(name: str, p: Any, *, atol: float = 1e-6) -> None:
    """Concrete ``p`` must hold probability vectors along its last axis.

    Entries must be finite and ≥ 0 and each vector must sum to 1 within ``atol`` (loose
    enough for float32 inputs).
    """
    if not is_concrete(p):
        return
    arr = np.asarray(p, dtype=np.float64)
    if arr.ndim == 0:
        raise ValueError(f"{name} must have a last axis holding a probability vector; got a scalar.")
    check_in_range(name, arr, 0.0, math.inf)
    sums = arr.sum(axis=-1)
    bad = np.abs(sums - 1.0) > atol
    if np.any(bad):
        raise ValueError(
            f"{name} must sum to 1 along its last axis (within {atol:g}); got a sum of {_first_bad(sums, bad)}."
        )
