"""Eager validators, in one place.

Every public function calls these on its inputs. A validator checks only values that are
concrete (Python numbers, NumPy arrays, concrete JAX arrays); tracers pass through
unchecked, because their values are unknown while tracing. Under ``jit`` the public
functions instead mask invalid inputs to NaN with :func:`valid_mask`, so an invalid value
can never produce a finite, optimistic result.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import jax

# JAX is imported lazily: the command validates its arguments with these checks before it
# imports JAX (a value cannot be a tracer while JAX is not even loaded).

__all__ = [
    "is_concrete",
    "check_broadcastable",
    "check_in_range",
    "check_delta",
    "check_integer",
    "check_nonempty",
    "DELTA_MIN",
    "check_positions",
    "check_not_above",
    "check_learning_rate",
    "check_orders",
    "check_static_choice",
    "concrete_orders",
    "is_int",
    "learning_rate_valid",
    "nan_unless",
    "valid_mask",
]


def is_concrete(x: Any) -> bool:
    """True when ``x`` holds known values (not a tracer inside jit/vmap/grad)."""
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.core.Tracer):
        return False
    if isinstance(x, (list, tuple)):
        return all(is_concrete(v) for v in x)
    return True


# The smallest δ accepted: the smallest normal float64. A subnormal δ has lost relative
# precision and XLA on CPU flushes subnormals to zero (log δ = -inf), so it is refused.
DELTA_MIN = float(np.finfo(np.float64).tiny)  # 2.2250738585072014e-308


def _check_numeric(name: str, value: Any) -> None:
    """Real numbers only: a string, a bool or a complex number is not one, even when it converts.

    ``True`` would otherwise be taken as 1 (``dpsgd_epsilon(True, ...)`` as q = 1) and a
    complex value either loses its imaginary part or fails deep inside NumPy without naming
    the parameter.
    """
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{name} must be a number, not a string; got {value!r}.")
    items = value if isinstance(value, (list, tuple)) else (value,)
    if any(isinstance(v, (str, bytes)) for v in items):
        raise ValueError(f"{name} must hold numbers, not strings; got {value!r}.")
    if any(isinstance(v, (bool, np.bool_)) for v in items):
        raise ValueError(f"{name} must hold real numbers, not booleans; got {value!r}.")
    if any(isinstance(v, (complex, np.complexfloating)) for v in items):
        raise ValueError(f"{name} must hold real numbers, not complex ones; got {value!r}.")
    kind = getattr(value, "dtype", None)
    if kind is not None and np.dtype(kind).kind in "USOVbc":
        raise ValueError(f"{name} must hold real numbers; got an array of dtype {np.dtype(kind)}.")


def _shape(value: Any) -> tuple:
    """The shape ``jnp.asarray(value)`` would have, without converting (a list may hold tracers)."""
    if hasattr(value, "shape"):
        return tuple(value.shape)
    if isinstance(value, (list, tuple)):
        return (len(value), *(_shape(value[0]) if value else ()))
    return ()


def check_broadcastable(**arrays: Any) -> None:
    """The named arguments' shapes must broadcast together (NumPy's rule); the error names two of them.

    Shapes are known while tracing too, so this checks tracers as well.
    """
    shapes = {name: _shape(v) for name, v in arrays.items()}
    try:
        np.broadcast_shapes(*shapes.values())
    except ValueError:
        seen: dict[str, tuple] = {}
        for name, shape in shapes.items():
            for other, other_shape in seen.items():
                try:
                    np.broadcast_shapes(other_shape, shape)
                except ValueError:
                    raise ValueError(
                        f"{other} (shape {other_shape}) and {name} (shape {shape}) must broadcast together (equal "
                        "lengths, or 1, along each trailing axis)."
                    ) from None
            seen[name] = shape
        raise ValueError(f"the shapes of {', '.join(shapes)} must broadcast together; got "
                         f"{', '.join(str(s) for s in shapes.values())}.") from None


def check_nonempty(name: str, value: Any) -> None:
    """A concrete array argument must hold at least one value (an empty batch has no answer)."""
    if not is_concrete(value):
        return
    if np.size(np.asarray(value, dtype=object) if isinstance(value, (list, tuple)) else value) == 0:
        raise ValueError(f"{name} must hold at least one value; got an empty array.")


def check_delta(value: Any, name: str = "delta") -> None:
    """δ must lie in [DELTA_MIN, 1): the smallest normal float64 up to 1, excluded."""
    check_in_range(name, value, 0.0, 1.0, lo_open=True, hi_open=True)
    if not is_concrete(value):
        return
    arr = np.asarray(value, dtype=np.float64)
    bad = arr < DELTA_MIN
    if np.any(bad):
        raise ValueError(f"{name} must be in [2.2250738585072014e-308, 1) (the smallest normal float64 up to 1; "
                         f"a subnormal delta has no reliable logarithm); got {float(arr[bad].ravel()[0])!r}.")


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
    _check_numeric(name, value)
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
    import jax.numpy as jnp

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
        raise ValueError(f"{name} must be an integer in {_fmt(lo, hi, False, False)}; got {_first_bad(arr, bad)}.")


def check_not_above(name: str, value: Any, bound_name: str, bound: Any) -> None:
    """Concrete ``value`` must not exceed the concrete ``bound`` (element-wise, broadcast)."""
    if not (is_concrete(value) and is_concrete(bound)):
        return
    v = np.asarray(value, dtype=np.float64)
    b = np.asarray(bound, dtype=np.float64)
    shape = np.broadcast_shapes(v.shape, b.shape)
    bad = np.broadcast_to(v > b, shape)
    if np.any(bad):
        vb = np.broadcast_to(v, shape)[bad][0]
        bb = np.broadcast_to(b, shape)[bad][0]
        raise ValueError(f"{name} must be ≤ {bound_name}; got {name} {vb:g} with {bound_name} {bb:g}.")


def check_positions(positions: Any, num_records: Any, name: str = "positions") -> None:
    """1-based record positions: integers in 1..num_records (num_records an integer ≥ 1)."""
    check_integer(name, positions)
    check_integer("num_records", num_records)
    check_not_above(name, positions, "num_records", num_records)


def check_learning_rate(learning_rate: Any, smoothness: Any, strong_convexity: Any = 0.0) -> None:
    r"""The one step-size rule of the library: :math:`0 < η ≤ 2/(β + ρ)`, with β > 0, 0 ≤ ρ ≤ β.

    Why this rule. For a convex β-smooth loss the gradient step :math:`ψ(y) = y - η∇ℓ(y)` is
    non-expansive for :math:`0 < η ≤ 2/β` (co-coercivity:
    :math:`\|ψ(x) - ψ(y)\|^2 ≤ \|x - y\|^2 - η(2/β - η)\|∇ℓ(x) - ∇ℓ(y)\|^2`). If ℓ is also
    ρ-strongly convex, Bubeck's Lemma 3.11,
    :math:`⟨g_x - g_y, x - y⟩ ≥ \frac{βρ}{β+ρ}\|x-y\|^2 + \frac{1}{β+ρ}\|g_x - g_y\|^2`, gives
    :math:`\|ψ(x) - ψ(y)\|^2 ≤ (1 - \frac{2ηβρ}{β+ρ})\|x-y\|^2 + η(η - \frac{2}{β+ρ})\|g_x - g_y\|^2`,
    so the contraction :math:`M = \sqrt{1 - 2ηβρ/(β+ρ)}` of :func:`step_contraction` holds
    exactly when :math:`η ≤ 2/(β+ρ)`; the boundary is included (the last term is then 0).
    With ρ = 0 the rule is η ≤ 2/β. Every analysis (contraction, iteration, strongly
    convex) and the training loop use this one rule. (For ρ > 0, steps in
    (2/(β+ρ), 2/β] are still non-expansive but M's formula does not hold there; they are
    rejected rather than accounted with a second rule.)

    Raises ``ValueError`` naming ``learning_rate``, ``smoothness`` or ``strong_convexity``.
    """
    check_in_range("smoothness", smoothness, 0.0, math.inf, lo_open=True)
    check_in_range("strong_convexity", strong_convexity, 0.0, math.inf)
    check_in_range("learning_rate", learning_rate, 0.0, math.inf, lo_open=True)
    if not (is_concrete(smoothness) and is_concrete(strong_convexity)):
        return
    b = np.asarray(smoothness, dtype=np.float64)
    rho = np.asarray(strong_convexity, dtype=np.float64)
    shape = np.broadcast_shapes(rho.shape, b.shape)
    bad = np.broadcast_to(rho > b, shape)
    if np.any(bad):
        raise ValueError(
            "strong_convexity must be ≤ smoothness (a ρ-strongly convex, β-smooth loss has ρ ≤ β); "
            f"got strong_convexity {np.broadcast_to(rho, shape)[bad][0]:g} > "
            f"smoothness {np.broadcast_to(b, shape)[bad][0]:g}."
        )
    if not is_concrete(learning_rate):
        return
    eta = np.asarray(learning_rate, dtype=np.float64)
    shape = np.broadcast_shapes(eta.shape, shape)
    # The same float64 test as learning_rate_valid, so eager and traced agree.
    bad = np.broadcast_to(eta * (b + rho) > 2.0, shape)
    if np.any(bad):
        limit = np.broadcast_to(2.0 / (b + rho), shape)[bad][0]
        raise ValueError(
            "learning_rate must be ≤ 2/(smoothness + strong_convexity) (then the gradient step is "
            f"non-expansive, with the contraction of step_contraction); got learning_rate "
            f"{np.broadcast_to(eta, shape)[bad][0]:g} > {limit:g}."
        )


def learning_rate_valid(learning_rate: jax.Array, smoothness: jax.Array, strong_convexity: jax.Array) -> jax.Array:
    """Traced form of :func:`check_learning_rate` (True where the rule holds)."""
    import jax.numpy as jnp

    eta, beta, rho = learning_rate, smoothness, strong_convexity
    return (
        (beta > 0) & jnp.isfinite(beta) & (rho >= 0) & (rho <= beta) & (eta > 0) & (eta * (beta + rho) <= 2.0)
    )


def is_int(x: jax.Array, lo: float = 1.0) -> jax.Array:
    """Traced: ``x`` is a finite integer ≥ ``lo``."""
    import jax.numpy as jnp

    return (x >= lo) & (x == jnp.floor(x)) & jnp.isfinite(x)


def nan_unless(valid: jax.Array, value: jax.Array) -> jax.Array:
    """``value`` where ``valid``, NaN elsewhere (invalid inputs under jit never give a number)."""
    import jax.numpy as jnp

    return jnp.where(valid, value, jnp.nan)


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
