"""Log-space numerics shared by the accountants.

Everything here is a pure function of arrays that is safe under ``jit``, ``vmap`` and
``grad``. Accountants call these inside a float64 scope (see :func:`float64`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

F = TypeVar("F", bound=Callable)

_LOG_2PI_HALF = 0.5 * math.log(2.0 * math.pi)


def _x64_enabled() -> bool:
    """Whether 64-bit types are enabled here (the global flag or an ``enable_x64`` scope)."""
    return jax.dtypes.canonicalize_dtype(np.float64) == np.float64


def _in_x64(fn: Callable) -> Callable:
    """``fn`` with its body run inside ``jax.enable_x64(True)``."""

    def run(*args):
        with jax.enable_x64(True):
            return fn(*args)

    return run


def _call_guarded(fn: Callable, args: list) -> object:
    """``fn(*args)`` in the float64 scope, staged so that JAX's later rules re-enter it.

    ``fn`` takes the traced leaves only (everything concrete is closed over). With no tracer
    among ``args`` the body simply runs in the scope. Otherwise the call is wrapped in a
    ``custom_jvp`` (outside) around a ``custom_vmap`` (inside), whose rules run again in the
    scope; see :func:`float64`.
    """
    if not any(isinstance(a, jax.core.Tracer) for a in args):
        return _in_x64(fn)(*args)
    return _guarded(fn)(*args)


def _guarded(fn: Callable) -> Callable:
    body = _in_x64(fn)

    @jax.custom_batching.custom_vmap
    def batchable(*args):
        return body(*args)

    @batchable.def_vmap
    def _vmap_rule(axis_size, in_batched, *args):
        in_axes = [0 if b else None for b in in_batched]
        batched = jax.vmap(fn, in_axes=in_axes, axis_size=axis_size)
        # The batched function is guarded again, so that a further vmap, jit or grad of the
        # result also runs its rules in the scope (one wrapper per level, built lazily).
        out = _call_guarded(batched, list(args))
        return out, jax.tree_util.tree_map(lambda _: True, out)

    @jax.custom_jvp
    def differentiable(*args):
        return batchable(*args)

    @differentiable.defjvp
    def _jvp_rule(primals, tangents):
        if _differentiated(primals):
            raise SecondDerivativeX64Error(SECOND_DERIVATIVE_X64_MESSAGE)
        with jax.enable_x64(True):  # (a Python number primal is float64 here: so is its tangent)
            tangents = _tangents_like(primals, tangents)
        return _linearized(fn, primals, tangents)

    return differentiable


def _linearized(fn: Callable, primals, tangents) -> tuple:
    """``jax.jvp(fn, primals, tangents)``, its non-linear part staged to re-enter the scope.

    The value and the residuals of ``jax.linearize(fn)`` are one guarded call (see
    :func:`_call_guarded`): where a program holding this rule's equations is batched
    later, outside the scope (``vmap`` of ``grad(jit(f))`` or of ``jit(grad(f))``), the
    batching rule vmaps them inside it again; re-bound outside, float64 equations break
    (batching an FFT truncates its operand to float32, other rules add float32 constants).
    Only the linear map is left outside the call: the products and sums of tangents with
    residuals that reverse mode transposes, and that rules re-bind in their operands'
    dtypes. (custom_vmap cannot be transposed, so the tangent cannot go through it.)
    """
    if not any(isinstance(p, jax.core.Tracer) for p in primals):
        # Concrete primals: nothing is staged that a later rule could re-bind (an outer vmap
        # or jit would make them tracers); eager linearize would compile more programs.
        with jax.enable_x64(True):
            return jax.jvp(fn, tuple(primals), tuple(tangents))
    structure = []

    def nonlinear(*values):
        out, lin = jax.linearize(fn, *values)
        residuals, tree = jax.tree_util.tree_flatten(lin)
        # A Python number primal is float64 here, float32 outside (its tangent's dtype).
        # (The array's own dtype: jnp.result_type would promote a weak float32 here.)
        structure.append((tree, [v.dtype if hasattr(v, "dtype") else jnp.result_type(v) for v in values]))
        return out, residuals

    out, residuals = _call_guarded(nonlinear, list(primals))
    # Every trace of ``nonlinear`` (the call, its batching rule) has the same linear map of
    # one example; the first is used.
    tree, dtypes = structure[0]
    lin = jax.tree_util.tree_unflatten(tree, residuals)
    with jax.enable_x64(True):
        # (Exact: a float32 tangent widened to its float64 primal's dtype.)
        tangents = [jax.lax.convert_element_type(t, dt) if jnp.issubdtype(dt, jnp.inexact) and t.dtype != dt
                    else t for t, dt in zip(tangents, dtypes)]
        return out, lin(*tangents)


def _tangents_like(primals, tangents) -> list:
    """Each tangent in its primal's dtype (float0 tangents of integer primals untouched).

    Under ``jit`` with x64 off, a ``jvp`` whose tangent is a Python number can reach the rule
    with a float32 primal and a float64 tangent (or the reverse); ``jax.jvp`` requires equal
    dtypes. The cast is exact where it widens, and rounds once where it narrows.
    """
    out = []
    for p, t in zip(primals, tangents):
        # The array's own dtype: jnp.result_type would promote a weak float32 to float64 here.
        dt = p.dtype if hasattr(p, "dtype") else jnp.result_type(p)
        if jnp.issubdtype(dt, jnp.inexact) and getattr(t, "dtype", None) != dt:
            t = jax.lax.convert_element_type(t, dt)
        out.append(t)
    return out


SECOND_DERIVATIVE_X64_MESSAGE = (
    "second derivatives (jax.hessian, grad of grad, jacfwd of jacrev) of jaxdp's accountants need 64-bit "
    "types: with jax_enable_x64 off, the first derivative's transposed program runs outside the float64 "
    "scope and cannot be differentiated again in float64. Enable it with "
    "jax.config.update('jax_enable_x64', True) or call inside `with jax.enable_x64(True):`.")


class SecondDerivativeX64Error(TypeError):
    """A second derivative of an accountant was asked for with 64-bit types off."""


def _differentiated(primals) -> bool:
    """True when the primals of a JVP rule are themselves being differentiated (2nd order)."""
    from jax._src.interpreters import ad

    kinds = tuple(k for k in (getattr(ad, "JVPTracer", None), getattr(ad, "LinearizeTracer", None)) if k)
    return any(isinstance(p, kinds) for p in jax.tree_util.tree_leaves(primals))


def float64(fn: F) -> F:
    r"""Run ``fn`` with 64-bit JAX types enabled, whatever the user's x64 flag says.

    ``jax.enable_x64(True)`` alone covers a call that is traced or run directly. It does
    not cover JAX rules applied later to an already traced program: ``vmap(jit(f))``
    batches, and ``grad(jit(f))`` differentiates, the equations of ``f`` under the caller's
    x64-off setting, where rules create float32 constants next to float64 operands
    (``TypeError: lax.mul requires arguments to have the same dtypes``). So:

    * with x64 already enabled (the global flag, a user's scope, or our own scope when one
      accountant calls another), ``fn`` is called directly: nothing can go wrong;
    * else the arguments are split into pytree leaves that are JAX tracers and everything
      else (Python and NumPy numbers, concrete arrays, tuples of orders, strings); the
      latter are passed through untouched, so eager validation and static choices behave
      as before. With no tracer, ``fn`` runs in the scope;
    * with tracers, ``fn`` of the traced leaves is wrapped in a ``jax.custom_jvp`` whose
      rule takes ``jax.linearize`` of it in a call wrapped the same way (value and
      residuals; only the linear map, products and sums of tangents, is applied outside),
      around a ``jax.custom_batching.custom_vmap`` whose rule vmaps it inside the scope (and
      wraps the batched function the same way, for nested ``vmap``). Every later
      transformation of the staged call therefore runs through a rule that re-enters the
      scope, ``vmap`` of a jitted derivative included (see :func:`_linearized`).

    Dtype policy (docs/dtype_policy.md): values are float64 in every form; a gradient has
    the dtype of the argument it is taken with respect to (JAX's rule), computed in
    float64 and rounded once to that dtype.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _x64_enabled():
            return fn(*args, **kwargs)
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        traced = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.core.Tracer)]
        if not traced:
            with jax.enable_x64(True):
                return fn(*args, **kwargs)

        def of_traced(*values):
            full = list(leaves)
            for i, v in zip(traced, values):
                full[i] = v
            a, k = jax.tree_util.tree_unflatten(treedef, full)
            return fn(*a, **k)

        return _call_guarded(of_traced, [leaves[i] for i in traced])

    return wrapper  # type: ignore[return-value]


def f64(x) -> jax.Array:
    """``x`` as a float64 array (call inside a :func:`float64` scope).

    A Python number is converted by NumPy first (the same rounding): ``jnp.asarray`` of a
    Python scalar compiles a small XLA program of its own, a cost a fresh process feels.
    """
    if type(x) is float or (type(x) is int and abs(x) <= 2**53):  # (exact in float64)
        x = np.asarray(x, dtype=np.float64)  # (a 0-d array: a NumPy scalar would compile too)
    return jnp.asarray(x, dtype=jnp.float64)


def where(cond, x, y) -> jax.Array:
    """``jnp.where(cond, x, y)`` for a boolean ``cond``: the same promotion, broadcasts and ``select``.

    ``jnp.where`` is a jitted function: inside a traced program each call goes through ``jit``'s
    dispatch, traces a small program of its own for every new shape, and stays a nested call
    that lowering emits as a function of its own (XLA inlines it again). Here the broadcasts
    and the select are emitted in place: the compiled program is the same, traced and lowered
    faster (the PLD's program has 150 of them). Operands of one float dtype (arrays, or Python
    numbers taking the arrays' dtype) only; anything else goes to ``jnp.where``.
    """
    arrays = [v for v in (x, y) if type(v) not in (int, float)]
    if (not isinstance(cond, jax.Array) or cond.dtype != bool or not arrays
            or any(not isinstance(v, jax.Array) or jax.typeof(v).weak_type for v in arrays)
            or any(v.dtype != arrays[0].dtype or not jnp.issubdtype(v.dtype, jnp.floating) for v in arrays)):
        return jnp.where(cond, x, y)
    dtype = arrays[0].dtype
    shape = jnp.broadcast_shapes(*(jnp.shape(v) for v in (cond, x, y))) if cond.ndim else \
        jnp.broadcast_shapes(*(jnp.shape(v) for v in arrays))
    if cond.ndim:
        cond = _broadcast(cond, shape, bool)
    return jax.lax.select(cond, _broadcast(x, shape, dtype), _broadcast(y, shape, dtype))


def _broadcast(v, shape, dtype):
    """``v`` (an array of ``dtype`` or a Python number) broadcast to ``shape`` (NumPy's rules)."""
    if type(v) in (int, float):
        return jax.lax.full(shape, v, dtype)
    if v.shape == shape:
        return v
    # NumPy's rules: trailing axes aligned, axes of size 1 stretched (as broadcast_in_dim does).
    return jax.lax.broadcast_in_dim(v, shape, tuple(range(len(shape) - v.ndim, len(shape))))


def log_ndtr(x: jax.Array) -> jax.Array:
    r"""``log Φ(x)`` for the standard normal CDF, accurate in both tails.

    For :math:`x > -37` it is ``log(erfc(-x/√2)/2)`` (``erfc`` keeps full relative precision
    there; near :math:`x \gg 0` the log of a value close to 1 is accurate in absolute
    terms, which is what a log-space sum needs). Below, ``erfc`` underflows and the
    asymptotic Mills-ratio series
    :math:`\log Φ(x) = -x^2/2 - \log(-x) - \tfrac12\log 2π + \log(1 - x^{-2} + 3x^{-4} - 15x^{-6} + 105x^{-8})`
    is used; its relative error at :math:`|x| ≥ 37` is below :math:`945/37^{10} < 10^{-12}`.
    It is about five times faster than ``jax.scipy.special.log_ndtr`` on CPU, which
    matters because the fractional-order accountant evaluates it for every series term.

    Its derivative is the inverse Mills ratio :math:`φ(x)/Φ(x) = \exp(-x^2/2 - \log\sqrt{2π}
    - \log Φ(x))` (a custom JVP, for :math:`x > -37`; below, the series' own derivative),
    so that every order of derivative is finite: differentiating ``log(erfc)`` twice
    divides by :math:`\mathrm{erfc}^2`, which underflows to 0 for :math:`x < -26` (0/0).
    """
    return _log_ndtr(x)


_NDTR_CUT = -37.0


def _log_ndtr_branches(x):
    x_hi = where(x > _NDTR_CUT, x, 0.0)  # double-where: keep the unused branch finite
    x_lo = where(x > _NDTR_CUT, _NDTR_CUT - 1.0, x)
    hi = jnp.log(0.5 * jax.scipy.special.erfc(-x_hi / math.sqrt(2.0)))
    return x_hi, x_lo, hi


def _log_ndtr_series(x_lo):
    z = 1.0 / (x_lo * x_lo)
    series = 1.0 - z * (1.0 - z * (3.0 - z * (15.0 - 105.0 * z)))
    return -0.5 * x_lo * x_lo - jnp.log(-x_lo) - _LOG_2PI_HALF + jnp.log(series)


@jax.custom_jvp
def _log_ndtr(x):
    _, x_lo, hi = _log_ndtr_branches(x)
    return where(x > _NDTR_CUT, hi, _log_ndtr_series(x_lo))


@_log_ndtr.defjvp
def _log_ndtr_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    x_hi, x_lo, _ = _log_ndtr_branches(x)
    value = _log_ndtr(x)
    # φ/Φ from logs: finite for every x > -37, and differentiable again through _log_ndtr.
    mills_hi = jnp.exp(-0.5 * x_hi * x_hi - _LOG_2PI_HALF - _log_ndtr(x_hi))
    lo, dlo = jax.jvp(_log_ndtr_series, (x_lo,), (jnp.ones_like(x_lo),))
    slope = where(x > _NDTR_CUT, mills_hi, dlo)
    return value, slope * t


# Cephes' rational approximations of the error function (S. L. Moshier, Cephes Math Library
# 2.2, ``ndtr.c``; the same ones XLA's ``erf``/``erfc`` evaluate in float64), highest degree
# first: erf(t) = t T(t²)/U(t²) on |t| < 1, erfc(t) = e^{-t²} P(t)/Q(t) on [1, 8) and
# e^{-t²} R(t)/S(t) on [8, ∞) (U, Q, S monic).
_ERF_T = (9.60497373987051638749E0, 9.00260197203842689217E1, 2.23200534594684319226E3,
          7.00332514112805075473E3, 5.55923013010394962768E4)
_ERF_U = (1.0, 3.35617141647503099647E1, 5.21357949780152679795E2, 4.59432382970980127987E3,
          2.26290000613890934246E4, 4.92673942608635921086E4)
_ERFC_P = (2.46196981473530512524E-10, 5.64189564831068821977E-1, 7.46321056442269912687E0,
           4.86371970985681366614E1, 1.96520832956077098242E2, 5.26445194995477358631E2,
           9.34528527171957607540E2, 1.02755188689515710272E3, 5.57535335369399327526E2)
_ERFC_Q = (1.0, 1.32281951154744992508E1, 8.67072140885989742329E1, 3.54937778887819891062E2,
           9.75708501743205489753E2, 1.82390916687909736289E3, 2.24633760818710981792E3,
           1.65666309194161350182E3, 5.57535340817727675546E2)
_ERFC_R = (5.64189583547755073984E-1, 1.27536670759978104416E0, 5.01905042251180477414E0,
           6.16021097993053585195E0, 7.40974269950448939160E0, 2.97886665372100240670E0)
_ERFC_S = (1.0, 2.26052863220117276590E0, 9.39603524938001434673E0, 1.20489539808096656605E1,
           1.70814450747565897222E1, 9.60896809063285878198E0, 3.36907645100081516050E0)


def _horner(coefs, x):
    """Σ coefs[k] x^{n-k} (highest degree first)."""
    acc = x + coefs[1] if coefs[0] == 1.0 else coefs[0] * x + coefs[1]
    for c in coefs[2:]:
        acc = acc * x + c
    return acc


def erfc_parts(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""``(num, den, mid)`` with num/den = erfc(t) where ``mid`` (t < 1), else erfc(t)e^{t²}; t = |x|/√2.

    So :math:`Φ(-|x|) = \tfrac12\,\mathrm{num}/\mathrm{den}` on ``mid`` and
    :math:`\tfrac12 e^{-x^2/2}\,\mathrm{num}/\mathrm{den}` elsewhere: finite for every x (no
    underflow, no ``log``; the caller divides, once for several such ratios). Cephes' rational
    approximations of the error function (Moshier, Cephes Math Library, ``ndtr``; the ones
    XLA's ``erfc`` evaluates): :math:`1 - t\,T(t^2)/U(t^2)` on t < 1, :math:`P(t)/Q(t)` on
    [1, 8) and :math:`R(t)/S(t)` above, that one in :math:`1/t` (finite up to t = ∞); den > 0.
    Relative error of the ratio against mpmath ≤ 7e-16 measured for |x| ≤ 140, ≤ 3e-15
    beyond (R's leading coefficient is 1/√π to 2e-15); docs/pld.md, "Cost per bin".
    """
    t = jnp.abs(x) * math.sqrt(0.5)
    mid = t < 1.0
    big = t >= 8.0
    t_e = where(mid, t, 0.5)  # double-where: each branch's argument in its range
    t_e2 = t_e * t_e
    u = _horner(_ERF_U, t_e2)
    t_p = jnp.minimum(jnp.maximum(t, 1.0), 8.0)
    z = 1.0 / jnp.maximum(t, 8.0)  # R(t)/S(t) = z R̃(z)/S̃(z), z = 1/t
    num = where(mid, u - t_e * _horner(_ERF_T, t_e2),
                where(big, z * _horner(_ERFC_R[::-1], z), _horner(_ERFC_P, t_p)))
    den = where(mid, u, where(big, _horner(_ERFC_S[::-1], z), _horner(_ERFC_Q, t_p)))
    return num, den, mid


def one_output(*values: jax.Array) -> tuple[jax.Array, ...]:
    """``values`` unchanged, produced by XLA as one stacked output (same shape and dtype).

    Several results of one large elementwise computation (log θ with its slopes) used by
    different consumers make XLA's CPU fusion split the computation into many small
    kernels, which more than doubles its compile time. Stacked and behind an optimisation
    barrier they are one kernel's output, read back by slices; the values are the same.
    """
    stacked = jax.lax.optimization_barrier(jnp.stack(jnp.broadcast_arrays(*values)))
    return tuple(stacked[i] for i in range(len(values)))


# The picks below count a value within this relative margin of the min as attaining it
# (8 ulps of float64).
PICK_MARGIN = 2.0**-49


def at_min(values: jax.Array, best: jax.Array, margin: float = PICK_MARGIN) -> jax.Array:
    """The entries of ``values`` that attain their min ``best`` (broadcast): :math:`v ≤ b + |b|·\\text{margin}`.

    The tolerant form of ``values <= best`` for picks by the minimum (why: see
    :func:`min_and_first`); b = ±∞ matches only ±∞, and a NaN min matches nothing.
    """
    return values <= best * jnp.where(best >= 0, 1.0 + margin, 1.0 - margin)


def min_and_first(values: jax.Array, axis: int = -1, margin: float = PICK_MARGIN):
    """``(best, near, first)``: the min over ``axis`` and the entries attaining it, robust to XLA's rounding.

    ``best`` is the plain min of ``values`` (its value exactly ``jnp.min``'s) with the
    derivative of the first entry attaining it. ``near`` marks, along ``axis``, the entries
    :math:`v ≤ b + |b|·\\text{margin}` (b = the min; b = ±∞ matches only ±∞), and ``first``
    the first of them (all False where none is, e.g. a NaN min); both keep ``axis`` with
    length 1 in ``best``'s place for broadcasting, so they have ``values``' shape.

    Why a margin: a pick written as "the entries equal to the min" compares each value with
    the reduction's result, but XLA may compute ``values`` once more in the comparison's
    fusion with other rounding than in the reduction's (on CPU its backend contracted
    ``a·b + c`` into an FMA in one fusion and not the other, leaving every entry 1 ulp above
    the min; its CPU pipeline also drops ``jax.lax.optimization_barrier``). The exact pick
    then matches nothing, and so does ``jnp.min``'s derivative, which divides by the number
    of entries equal to the min (0/0). With the margin the pick is an entry whose value is
    the min to 8 ulps; where values tie within 8 ulps, the first of them is picked, not
    necessarily the exact minimiser (a caller's value is the plain min either way).

    The derivative is taken through a select of the first entry (``jnp.min``'s would
    multiply every entry's tangent by a 0/1 mask, so a NaN tangent at an infinite entry would
    poison it); an infinite first entry carries none. Min-reductions, not ``argmin``, whose
    variadic reduce fails inside the float64 scope under an outer float32 ``jit``.
    """
    axis = axis % values.ndim
    v_sg = jax.lax.stop_gradient(values)
    best = jnp.min(v_sg, axis=axis, keepdims=True)
    near = at_min(v_sg, best, margin)
    shape = [1] * values.ndim
    shape[axis] = values.shape[axis]
    pos = jnp.arange(values.shape[axis], dtype=values.dtype).reshape(shape)
    first = pos == jnp.min(jnp.where(near, pos, jnp.inf), axis=axis, keepdims=True)
    hit = first & jnp.isfinite(v_sg)
    best = best + jnp.sum(jnp.where(hit, values - v_sg, 0.0), axis=axis, keepdims=True)  # + 0, carrying the tangent
    return jnp.squeeze(best, axis), near, first


def take(x: jax.Array, indices, axis: int = -1) -> jax.Array:
    """``jnp.take(x, indices, axis)`` for a static integer index array, safe in reverse mode.

    The value is the same gather. Its derivative is built from static slices instead. The
    reason: JAX transposes a gather into a scatter-add onto zeros made with ``lax.full``,
    which, when the caller differentiates outside our float64 scope with x64 off, are
    created as float32. The scatter then fails on mixed dtypes. Slices transpose to pads,
    which keep the cotangent's dtype.
    """
    idx = np.asarray(indices, dtype=np.int64)
    axis = axis % x.ndim
    flat = idx.reshape(-1)
    # Runs of consecutive indices become one slice each.
    breaks = np.nonzero(np.diff(flat) != 1)[0] + 1
    runs = [(int(r[0]), int(r[-1]) + 1) for r in np.split(flat, breaks)] if flat.size else []

    @jax.custom_jvp
    def gather(v):
        return jnp.take(v, idx, axis=axis)

    @gather.defjvp
    def _gather_jvp(primals, tangents):
        (v,), (t,) = primals, tangents
        parts = [jax.lax.slice_in_dim(t, a, b, axis=axis) for a, b in runs]
        picked = jnp.concatenate(parts, axis=axis) if parts else jnp.take(t, idx, axis=axis)
        shape = t.shape[:axis] + idx.shape + t.shape[axis + 1:]
        return gather(v), picked.reshape(shape)

    return gather(x)


def take_windows(x: jax.Array, rows, starts, width: int) -> jax.Array:
    """``x[..., rows[n], starts[n] + i]`` for ``i < width``: shape ``(..., len(rows), width)``.

    ``x`` has shape ``(..., U, T)``; ``rows`` and ``starts`` are static integer arrays. The
    value is one gather, as :func:`take`. The derivative is built without a gather (see
    :func:`take`) and without one slice per window, which for many windows makes hundreds
    of kernels and multiplies the compile time of every derivative: each window's row is
    picked by a select and a sum over the U rows (one nonzero term, exact), then its start
    by one static slice per distinct start, selected and summed the same way.
    """
    rows = np.asarray(rows, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    n_rows, n_cols = x.shape[-2:]
    flat = (rows * n_cols + starts)[:, None] + np.arange(width)[None, :]
    row_of = (np.arange(n_rows)[None, :] == rows[:, None])[:, :, None]  # (n, U, 1)

    @jax.custom_jvp
    def gather(v):
        return jnp.take(v.reshape(v.shape[:-2] + (n_rows * n_cols,)), flat, axis=-1)

    @gather.defjvp
    def _gather_jvp(primals, tangents):
        (v,), (t,) = primals, tangents
        picked = jnp.sum(jnp.where(row_of, t[..., None, :, :], 0.0), axis=-2)  # (..., n, T)
        parts = [jnp.where((starts == s)[:, None], picked[..., s:s + width], 0.0) for s in np.unique(starts)]
        return gather(v), functools.reduce(jnp.add, parts)

    return gather(x)


def log_expm1(x: jax.Array) -> jax.Array:
    """``log(exp(x) - 1) = x + log(1 - e^{-x})`` for ``x > 0``, without overflow.

    ``-expm1(-x)`` keeps full relative precision both for tiny ``x`` (where it is ≈ x) and
    for large ``x`` (where it is 1 - e^{-x}), so one branch serves every x > 0.
    """
    return x + jnp.log(-jnp.expm1(-x))


def signed_logsumexp(log_abs: jax.Array, signs: jax.Array, axis: int = -1, *, return_abs: bool = False):
    """``log|Σ s_i e^{a_i}|`` and the sign of the sum, along ``axis``.

    Entries with ``log_abs = -inf`` contribute nothing. Returns ``(-inf, 0)`` for an empty
    (all ``-inf``) sum. With ``return_abs`` also ``log Σ |s_i| e^{a_i}``, the scale against
    which the rounding error of the signed sum is measured.
    """
    # The shift m cancels, so it carries no gradient. Differentiating the max would divide
    # by the number of entries equal to it; under jit XLA may recompute those entries in
    # another fusion, round them differently, find none equal, and give 0/0 = NaN.
    m = jax.lax.stop_gradient(jnp.max(log_abs, axis=axis, keepdims=True))
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(log_abs - m_safe)
    total = jnp.sum(signs * e, axis=axis)
    m_safe = jnp.squeeze(m_safe, axis=axis)
    sign = jnp.sign(total)
    abs_total = jnp.abs(total)
    pos = abs_total > 0
    log_total = jnp.where(pos, m_safe + jnp.log(jnp.where(pos, abs_total, 1.0)), -jnp.inf)
    if not return_abs:
        return log_total, sign
    mag = jnp.sum(jnp.abs(signs) * e, axis=axis)
    log_mag = jnp.where(mag > 0, m_safe + jnp.log(jnp.where(mag > 0, mag, 1.0)), -jnp.inf)
    return log_total, sign, log_mag


def read_only(obj):
    """Mark every NumPy array in ``obj`` read-only (through dataclasses, tuples and lists); return ``obj``.

    For what a ``functools`` cache returns: every later call shares those arrays, so an
    in-place change would silently alter later results; read-only, it raises instead.
    """
    if isinstance(obj, np.ndarray):
        obj.setflags(write=False)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            read_only(getattr(obj, field.name))
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            read_only(item)
    return obj


@functools.cache
def crvz_weights(n: int) -> tuple[np.ndarray, float]:
    r"""Weights of Cohen–Rodriguez Villegas–Zagier acceleration for alternating series.

    For :math:`a_k = \int_0^1 x^k\,dμ(x)` with a positive measure μ (a Hausdorff moment
    sequence), :math:`S = \sum_{k≥0} (-1)^k a_k` is approximated by
    :math:`S_n = \sum_{k<n} w_k a_k` with :math:`|S - S_n| ≤ 2S/(3+\sqrt 8)^n ≤ 2a_0/(3+\sqrt 8)^n`.

    Returns ``(w, bound)`` where ``w`` already contains the alternating signs and
    ``bound = 2/(3+√8)^n`` is the relative error factor to add for a certified upper bound.

    Reference: H. Cohen, F. Rodriguez Villegas, D. Zagier, "Convergence acceleration of
    alternating series", Experimental Mathematics 9 (2000), Algorithm 1 and Proposition 1.
    """
    d = (3.0 + math.sqrt(8.0)) ** n
    d = (d + 1.0 / d) / 2.0
    b = -1.0
    c = -d
    w = np.zeros(n)
    for k in range(n):
        c = b - c
        w[k] = c / d  # the paper's c_k carry the alternating sign: S_n = Σ c_k a_k / d
        b = (k + n) * (k - n) * b / ((k + 0.5) * (k + 1.0))
    return read_only(w), 2.0 / (3.0 + math.sqrt(8.0)) ** n
