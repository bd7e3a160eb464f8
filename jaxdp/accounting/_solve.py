r"""One bracketed search for every calibration and inversion, with an implicit derivative.

Every inversion in the accounting (smallest σ meeting an ε target, smallest ε meeting a δ
target, ...) is the threshold of a monotone predicate: ``accept(x)`` is false below the
root and true above it. :func:`search_decreasing` finds it with a fixed number of steps
(so it runs under ``jit`` and ``vmap``) and returns the smallest *accepted* point it
evaluated: the result is always on the safe side of the target, whatever the accuracy.
By default each step halves the bracket; a caller that knows more passes a ``propose``
function, and a proposal outside the open bracket falls back to the halving (a
safeguarded secant/Newton search). :func:`search_certified` is the model-guided variant
that stops per element once the threshold is certified to a width (the DP-SGD
calibration, which fits a model of every Rényi order at once).

:func:`implicit_root` attaches the derivative of the root by the implicit function
theorem, as a ``custom_jvp``: the rule (a linearisation of the constraint at the root) is
traced only when differentiating, and the search itself is never differentiated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["SearchResult", "search_decreasing", "CertifiedResult", "search_certified", "implicit_root", "solve_decreasing"]


class SearchResult(NamedTuple):
    """Outcome of :func:`search_decreasing` (values only, no derivative).

    Attributes:
      x: the smallest accepted point evaluated (``lo`` when ``lo`` is accepted), +inf when
        not even ``hi`` is accepted.
      aux: what ``accept`` returned alongside at ``x`` (at ``hi`` when nothing was found).
      found: ``accept(hi)``.
      at_low: ``accept(lo)``: the constraint does not bind inside the bracket.
    """

    x: jax.Array
    aux: Any
    found: jax.Array
    at_low: jax.Array


def _select(pred, a, b):
    """Elementwise ``where`` over two pytrees whose leaves may have trailing axes."""
    def pick(u, v):
        p = jnp.reshape(pred, pred.shape + (1,) * (jnp.ndim(u) - pred.ndim))
        return jnp.where(p, u, v)

    return jax.tree_util.tree_map(pick, a, b)


def search_decreasing(
    accept: Callable,
    lo: jax.Array,
    hi: jax.Array,
    iterations: int,
    *,
    propose: Callable | None = None,
    stack_ends: bool = True,
    ends_in_loop: bool = False,
) -> SearchResult:
    r"""Smallest x in [lo, hi] with ``accept(x)``, by a fixed-count safeguarded bracket search.

    ``accept(x)`` returns ``(ok, aux)``: ``ok`` a boolean array of ``x``'s shape, monotone in
    x (false below the threshold, true above), ``aux`` any pytree of arrays whose leading
    axes are ``x``'s shape (values a ``propose`` function can extrapolate). Both ends are
    evaluated first; then each of ``iterations`` steps evaluates one point inside the
    bracket and keeps the half that still contains the threshold. The point is the
    midpoint, or ``propose(x_prev, aux_prev, x_cur, aux_cur, lo, hi)`` (the last two points
    evaluated and the bracket) when that lies strictly inside the bracket.

    The returned x is always a point where ``accept`` was evaluated and returned true, so
    the result never violates the target: rounding and a short iteration count only cost
    tightness. Runs under ``jit`` and ``vmap``. Values only: wrap the result with
    :func:`implicit_root` for derivatives.

    Every element runs ``iterations`` steps (a ``fori_loop``); for an early stop at a
    certified width, see :func:`search_certified`.

    Args:
      accept: ``x -> (ok, aux)``, elementwise over x; with ``stack_ends`` it must accept a
        leading axis of size 2 in front of ``lo.shape``.
      lo, hi: bracket ends, same shape, lo < hi.
      iterations: number of steps after the two end evaluations (static).
      propose: optional extrapolation; non-finite or out-of-bracket proposals bisect.
      stack_ends: evaluate both ends in one call of ``accept`` (smaller program).
      ends_in_loop: evaluate the ends as the loop's first two steps (``hi``, then ``lo``),
        so that ``accept`` is traced once: for an expensive ``accept`` (a large compiled
        program), instead of a second copy for the ends. Same points, same result.

    Returns:
      :class:`SearchResult`.
    """
    lo = jax.lax.stop_gradient(jnp.asarray(lo))
    hi = jax.lax.stop_gradient(jnp.asarray(hi))
    lo, hi = jnp.broadcast_arrays(lo, hi)
    if ends_in_loop:
        return _search_ends_in_loop(accept, lo, hi, iterations, propose)
    if stack_ends:
        ok2, aux2 = accept(jnp.stack([lo, hi]))
        ok_lo, ok_hi = ok2[0], ok2[1]
        aux_lo = jax.tree_util.tree_map(lambda a: a[0], aux2)
        aux_hi = jax.tree_util.tree_map(lambda a: a[1], aux2)
    else:
        ok_lo, aux_lo = accept(lo)
        ok_hi, aux_hi = accept(hi)

    def body(_, state):
        x = _next_point(state, propose)
        ok, aux = accept(x)
        return _keep_bracket(state, x, ok, aux)

    one = jnp.ones(lo.shape)
    state = (lo, aux_lo, one, hi, aux_hi, one, jnp.zeros(lo.shape))
    _, _, _, b, aux_b, _, _ = jax.lax.fori_loop(0, iterations, body, state)
    x = jnp.where(ok_lo, lo, b)
    aux = _select(ok_lo, aux_lo, aux_b)
    x = jnp.where(ok_hi, x, jnp.inf)
    return SearchResult(x, aux, ok_hi, ok_lo)


def _next_point(state, propose):
    """The next point of a bracket search: the proposal when strictly inside, else the midpoint."""
    a, aux_a, w_a, b, aux_b, w_b, _ = state
    mid = 0.5 * (a + b)
    if propose is None:
        return mid
    cand = propose(a, aux_a, w_a, b, aux_b, w_b)
    inside = jnp.isfinite(cand) & (cand > a) & (cand < b)
    return jnp.where(inside, cand, mid)


def _keep_bracket(state, x, ok, aux):
    """The half of the bracket that still holds the threshold after evaluating ``x``."""
    a, aux_a, w_a, b, aux_b, w_b, side = state
    # Illinois: an end kept twice in a row has its weight halved (no one-sided stall).
    w_a = jnp.where(ok, jnp.where(side > 0, 0.5 * w_a, w_a), 1.0)
    w_b = jnp.where(ok, 1.0, jnp.where(side < 0, 0.5 * w_b, w_b))
    side = jnp.where(ok, 1.0, -1.0)
    aux_a = _select(ok, aux_a, aux)
    aux_b = _select(ok, aux, aux_b)
    return jnp.where(ok, a, x), aux_a, w_a, jnp.where(ok, x, b), aux_b, w_b, side


def _search_ends_in_loop(accept, lo, hi, iterations, propose):
    """:func:`search_decreasing` with one evaluation site: steps 0 and 1 evaluate hi and lo."""
    aux_shape = jax.eval_shape(accept, lo)[1]
    zeros = jax.tree_util.tree_map(lambda t: jnp.zeros(t.shape, t.dtype), aux_shape)
    one = jnp.ones(lo.shape)

    def body(k, carry):
        state, ok_lo, ok_hi = carry
        first, second = k == 0, k == 1
        x = jnp.where(first, hi, jnp.where(second, lo, _next_point(state, propose)))
        ok, aux = accept(x)
        a, aux_a, w_a, b, aux_b, w_b, side = state
        ends = (a, _select(second, aux, aux_a), w_a, b, _select(first, aux, aux_b), w_b, side)
        state = tuple(_select(first | second, u, v) for u, v in zip(ends, _keep_bracket(state, x, ok, aux)))
        return state, jnp.where(second, ok, ok_lo), jnp.where(first, ok, ok_hi)

    false = jnp.zeros(lo.shape, bool)
    state = (lo, zeros, one, hi, zeros, one, jnp.zeros(lo.shape))
    (a, aux_a, _, b, aux_b, _, _), ok_lo, ok_hi = jax.lax.fori_loop(0, iterations + 2, body, (state, false, false))
    # Where lo is accepted every later point is too, so the lower end (and its aux) stays lo's.
    x = jnp.where(ok_hi, jnp.where(ok_lo, lo, b), jnp.inf)
    return SearchResult(x, _select(ok_lo, aux_a, aux_b), ok_hi, ok_lo)


# A candidate this close outside the bracket (in x) is taken as the end itself.
_NEAR = 1e-3
# One-sided model steps (from the third point on) longer than this fraction of the last
# one count as creeping.
_CREEP = 0.5
_CREEP_FROM = 3
# Bracketed steps longer than this fraction of the step before last bisect instead.
_BRENT = 1.0


class CertifiedResult(NamedTuple):
    """Outcome of :func:`search_certified` (values only, no derivative).

    Attributes:
      x: the smallest accepted point evaluated; +inf when none was (``hi`` rejected, or the
        step cap reached before any point was accepted).
      value: the ``value`` that ``evaluate`` returned at x (+inf where x is +inf).
      found: an accepted point was evaluated.
      at_low: ``lo`` itself was evaluated and accepted (the threshold is at or below it).
      certified: a rejected point lies within ``tol`` below x (or x = lo, or ``hi`` was
        rejected): the threshold is pinned down; false only where the cap stopped the search.
      steps: evaluations made per element (the loop ran ``max(steps)`` times).
    """

    x: jax.Array
    value: jax.Array
    found: jax.Array
    at_low: jax.Array
    certified: jax.Array
    steps: jax.Array


def search_certified(
    evaluate: Callable,
    propose: Callable,
    start: jax.Array,
    info_init: Any,
    lo: float,
    hi: float,
    tol: float,
    iterations: int,
    value_init: Any = None,
) -> CertifiedResult:
    r"""Smallest accepted x in [lo, hi], certified to ``tol``, one evaluation per step.

    ``evaluate(x)`` returns ``(ok, value, info)``: ``ok`` boolean of ``x``'s shape and
    monotone in x (false below the threshold, true above), ``value`` an array of x's shape
    (returned at the result), ``info`` any pytree with x's leading shape that
    ``propose(x_prev, info_prev, x_cur, info_cur, have_prev)`` turns into the next
    candidate (a model's predicted threshold from the last two points; ``have_prev`` is
    false after the first evaluation). The first point is ``start``.

    Safeguards: a candidate outside the current bracket (or not finite) is replaced by the
    bracket's midpoint, or, while only one side is known, by a unit step away from it;
    candidates are clipped to [lo, hi] and kept ``tol/2`` inside a bracket wider than
    ``tol``, so that once the model has converged the next point certifies the threshold.
    The search stops per element when a rejected point lies within ``tol`` below an
    accepted one, when ``lo`` is accepted, or when ``hi`` is rejected; ``iterations`` caps
    the steps. The ends are evaluated only when the search reaches them.

    One ``while_loop`` whose body calls ``evaluate`` once (one traced copy of it in the
    program); under ``vmap`` every lane runs until the slowest is done (finished lanes keep
    their state). The returned x is a point where ``evaluate`` accepted, evaluated in the
    caller's shape (never a shifted or stacked copy), so ``value`` is the value at x.

    Args:
      evaluate: ``x -> (ok, value, info)``, elementwise over x.
      propose: ``(x_prev, info_prev, x_cur, info_cur, have_prev) -> candidate``.
      start: first point, x's shape.
      info_init: a pytree shaped like ``info`` (its values are not used).
      lo, hi: bracket ends (static floats), lo < hi.
      tol: certified bracket width (static).
      iterations: cap on the evaluations (static).
      value_init: a pytree shaped like ``value`` when it is not an array of x's shape
        (leaves with x's leading shape, any trailing axes; its values are not used);
        every leaf of the result's ``value`` is +inf where nothing was accepted.

    Returns:
      :class:`CertifiedResult`.
    """
    start = jax.lax.stop_gradient(jnp.asarray(start))
    shape = start.shape
    ninf, pinf = jnp.full(shape, -jnp.inf), jnp.full(shape, jnp.inf)
    zeros_info = jax.tree_util.tree_map(jnp.zeros_like, info_init)
    half = 0.5 * tol

    def done_of(xa, xb, at_low, no_hi):
        return ((xb - xa) <= tol) | at_low | no_hi

    def cond(c):
        k, xa, xb, _, _, _, _, _, at_low, no_hi, _, _, _ = c
        return (k < iterations) & jnp.any(~done_of(xa, xb, at_low, no_hi))

    def body(c):
        k, xa, xb, vb, xp, ip, xc, ic, at_low, no_hi, step1, step2, steps = c
        done = done_of(xa, xb, at_low, no_hi)
        cand = jnp.where(k == 0, start, propose(xp, ip, xc, ic, k >= 2))
        has_a, has_b = jnp.isfinite(xa), jnp.isfinite(xb)
        fin = jnp.isfinite(cand)
        # A candidate just outside the bracket says the threshold is at that end: probe
        # tol/2 inside it (the clip below), which certifies it if the model is right.
        cand = jnp.where(fin & has_a & (cand <= xa) & (xa - cand < _NEAR), xa, cand)
        cand = jnp.where(fin & has_b & (cand >= xb) & (cand - xb < _NEAR), xb, cand)
        good = fin & (cand >= xa) & (cand <= xb)
        # One side known and the model creeping towards the other (a step not much shorter
        # than the last): at least double the last step, to bracket the threshold quickly.
        last = xc - xp
        creep = (k >= _CREEP_FROM) & (has_a ^ has_b) & (jnp.abs(cand - xc) > _CREEP * jnp.abs(last))
        grow = xc + 2.0 * last
        cand = jnp.where(creep & has_a & (last > 0), jnp.maximum(cand, grow), cand)
        cand = jnp.where(creep & has_b & (last < 0), jnp.minimum(cand, grow), cand)
        mid = 0.5 * (jnp.where(has_a, xa, 0.0) + jnp.where(has_b, xb, 0.0))
        fallback = jnp.where(has_a & has_b, mid, jnp.where(has_a, xa + 1.0, jnp.where(has_b, xb - 1.0, 0.0)))
        # Bracketed and the step longer than _BRENT times the step before last: bisect (as Brent's
        # method; a model converging from one side has fast-shrinking steps).
        slow = has_a & has_b & (jnp.abs(cand - xc) > _BRENT * step2)
        x = jnp.where(good & ~slow, cand, fallback)
        # Keep tol/2 inside the bracket: a converged model then certifies on the next step.
        x = jnp.where(has_a, jnp.maximum(x, xa + half), x)
        x = jnp.where(has_b, jnp.minimum(x, xb - half), x)
        x = jnp.clip(x, lo, hi)
        ok, v, info = evaluate(x)
        live = ~done
        acc = live & ok
        rej = live & ~ok
        xb_n = jnp.where(acc, x, xb)
        vb_n = _select(acc, v, vb)
        xa_n = jnp.where(rej, jnp.maximum(x, xa), xa)
        at_low_n = at_low | (acc & (x <= lo))
        no_hi_n = no_hi | (rej & (x >= hi))
        xp_n = jnp.where(live, xc, xp)
        ip_n = _select(live, ic, ip)
        xc_n = jnp.where(live, x, xc)
        ic_n = _select(live, info, ic)
        step2_n = jnp.where(live, step1, step2)
        step1_n = jnp.where(live, jnp.abs(x - xc), step1)
        return (k + 1, xa_n, xb_n, vb_n, xp_n, ip_n, xc_n, ic_n, at_low_n, no_hi_n, step1_n, step2_n, steps + live)

    false = jnp.zeros(shape, bool)
    if value_init is None:
        vb_init = jnp.full(shape, jnp.inf, start.dtype)
    else:
        vb_init = jax.tree_util.tree_map(lambda v: jnp.full(jnp.shape(v), jnp.inf, jnp.result_type(v)), value_init)
    init = (jnp.asarray(0), ninf, pinf, vb_init, start, zeros_info, start, zeros_info,
            false, false, pinf, pinf, jnp.zeros(shape, jnp.int32))
    _, xa, xb, vb, _, _, _, _, at_low, no_hi, _, _, steps = jax.lax.while_loop(cond, body, init)
    found = jnp.isfinite(xb)
    return CertifiedResult(xb, vb, found, at_low, done_of(xa, xb, at_low, no_hi), steps)


def implicit_root(fn: Callable, x, value, target, params, binds, fixed, *, closed: bool = False):
    r"""x (and ``value``) unchanged, with derivatives from the implicit function theorem.

    Where ``binds``, x is the root of :math:`f(x, p) = t` (``fn(x, *params)``, decreasing in
    x), so :math:`dx = (dt - ∂_p f\cdot dp)/∂_x f` and the value :math:`f(x, p)` moves with
    the target. Where ``fixed`` (the root sits at a bracket end that does not move) x is
    constant and the value moves with the parameters, :math:`∂_p f\cdot dp`. Elsewhere
    (not found) nothing moves. The rule is a ``custom_jvp``: the linearisation of ``fn`` at
    x is traced only when differentiating. Masks depend on primal values only, so the
    rule transposes for reverse mode.

    Args:
      fn: ``(x, *params) -> f``, elementwise (values it closes over are hoisted by
        ``jax.closure_convert``).
      x: the root from :func:`search_decreasing` (values only).
      value: ``fn`` at x as the search computed it (returned unchanged; pass zeros when
        unused).
      target: t, broadcastable with x.
      params: tuple of arrays.
      binds, fixed: boolean masks of x's shape.
      closed: ``fn`` closes over no traced values (only static ones): skip
        ``jax.closure_convert``, which traces ``fn`` once more on every call (a second
        trace of a large accountant costs compile-time seconds).

    Returns:
      ``(x, value)``.
    """
    params = tuple(params)
    if closed:
        return _implicit(fn, x, value, target, params, binds, fixed)
    # Values ``fn`` closes over (tracers of an enclosing jit or derivative) become explicit
    # arguments, so that the custom_jvp rule sees them as inputs rather than constants.
    conv, consts = jax.closure_convert(lambda x_, *p_: fn(x_, *p_), x, *params)
    return _implicit(conv, x, value, target, params + tuple(consts), binds, fixed)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _implicit(fn, x, value, target, params, binds, fixed):
    del fn, target, params, binds, fixed
    return x, value


@_implicit.defjvp
def _implicit_jvp(fn, primals, tangents):
    x, value, target, params, binds, fixed = primals
    _, _, d_target, d_params, _, _ = tangents
    live = binds | fixed
    x_at = jnp.where(live, x, 1.0)  # a harmless stand-in where x is +inf

    def f(x_, p_):
        return fn(x_, *p_)

    _, lin = jax.linearize(f, x_at, params)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    df_dx = lin(jnp.ones_like(x_at), zeros)
    df_dp = lin(jnp.zeros_like(x_at), d_params)
    d_target = jnp.broadcast_to(d_target, x.shape)
    use = binds & jnp.isfinite(df_dx) & (df_dx < 0)
    dx = jnp.where(use, (d_target - df_dp) / jnp.where(use, df_dx, -1.0), 0.0)
    d_value = jnp.where(use, d_target, jnp.where(fixed & ~binds, df_dp, 0.0))
    return (x, value), (dx, jnp.broadcast_to(d_value, jnp.shape(value)).astype(jnp.result_type(value)))


def solve_decreasing(
    fn: Callable, params, target, lo, hi, iterations: int, *, accept_target=None, ends_in_loop: bool = False
) -> jax.Array:
    r"""Smallest x in [lo, hi] with ``fn(x, *params) ≤ target``: bisection, implicit derivative.

    ``fn`` must be non-increasing in x. The value is the upper end of the final bracket
    of :func:`search_decreasing` (so ``fn(x) ≤ target`` was checked at the returned x),
    ``lo`` when ``fn(lo) ≤ target``, +inf when not even ``fn(hi) ≤ target``; after n
    halvings the bracket is (hi − lo)/2^n wide. Derivatives with respect to ``params`` and
    ``target`` come from :func:`implicit_root` (the search sees stopped values).

    Args:
      fn: ``(x, *params) -> value``, elementwise; pass every differentiated value in
        ``params`` rather than closing over it.
      params: tuple of arrays broadcastable with x.
      target: the level, broadcastable with x.
      lo, hi: bracket, lo < hi.
      iterations: halvings (static).
      accept_target: level used to accept a point, when it differs from ``target`` (a
        safety margin below it); defaults to ``target``. The derivative uses ``target``.
      ends_in_loop: evaluate the bracket ends inside the search loop, so that ``fn`` is
        compiled once (see :func:`search_decreasing`; same points, same result).

    Returns:
      x, float array of the broadcast shape of lo and hi.

    Examples:
      >>> import jax, jax.numpy as jnp, math
      >>> from jaxdp.accounting._solve import solve_decreasing
      >>> with jax.enable_x64(True):
      ...     f = lambda x, a: jnp.exp(-a * x)
      ...     x = solve_decreasing(f, (1.0,), 0.5, 0.0, 10.0, 64)
      ...     dx = jax.grad(lambda a: solve_decreasing(f, (a,), 0.5, 0.0, 10.0, 64))(1.0)
      >>> abs(float(x) - math.log(2)) < 1e-12, float(x) >= math.log(2), round(float(dx), 9)
      (True, True, -0.693147181)
    """
    params = tuple(params)
    p_sg = jax.lax.stop_gradient(params)
    t_acc = jax.lax.stop_gradient(target if accept_target is None else accept_target)

    def accept(x):
        return fn(x, *p_sg) <= t_acc, ()

    res = search_decreasing(accept, lo, hi, iterations, ends_in_loop=ends_in_loop)
    x, _ = implicit_root(fn, res.x, jnp.zeros_like(res.x), target, params, res.found & ~res.at_low, res.at_low)
    return x
