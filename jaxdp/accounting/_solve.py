r"""One bracketed search for every calibration and inversion, with an implicit derivative.

Every inversion in the accounting (smallest σ meeting an ε target, smallest ε meeting a δ
target, ...) is the threshold of a monotone predicate: ``accept(x)`` is false below the
root and true above it. :func:`search_decreasing` finds it with a fixed number of steps
(so it runs under ``jit`` and ``vmap``) and returns the smallest *accepted* point it
evaluated: the result is always on the safe side of the target, whatever the accuracy.
By default each step halves the bracket; a caller that knows more (the DP-SGD calibration
extrapolates every Rényi order at once) passes a ``propose`` function, and a proposal
outside the open bracket falls back to the halving (a safeguarded secant/Newton search).

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

__all__ = ["SearchResult", "search_decreasing", "implicit_root", "solve_decreasing"]


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
    tol: float | None = None,
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

    With ``tol`` the search stops early, once every element's bracket is at most ``tol``
    wide (a rejected point within ``tol`` below the accepted one: the threshold is then
    certified to lie in that interval), and ``iterations`` is the cap. A proposal search
    converges on the accepted side and never moves its rejected end, so when an accepted
    point moved the upper end by less than ``tol`` (converged), the next point evaluated is
    ``tol`` below it (a certificate: rejected, the search is done; accepted, it is a better
    point). Without ``tol`` every element runs ``iterations`` steps (a ``fori_loop``).

    Args:
      accept: ``x -> (ok, aux)``, elementwise over x; with ``stack_ends`` it must accept a
        leading axis of size 2 in front of ``lo.shape``.
      lo, hi: bracket ends, same shape, lo < hi.
      iterations: number of steps after the two end evaluations (static).
      propose: optional extrapolation; non-finite or out-of-bracket proposals bisect.
      stack_ends: evaluate both ends in one call of ``accept`` (smaller program).
      tol: optional certified bracket width (static) for an early stop; ``None`` runs
        exactly ``iterations`` steps.

    Returns:
      :class:`SearchResult`.
    """
    lo = jax.lax.stop_gradient(jnp.asarray(lo))
    hi = jax.lax.stop_gradient(jnp.asarray(hi))
    lo, hi = jnp.broadcast_arrays(lo, hi)
    low_probe_gap = 0.5 * tol if tol is not None else 0.0
    if stack_ends:
        ok2, aux2 = accept(jnp.stack([lo, hi]))
        ok_lo, ok_hi = ok2[0], ok2[1]
        aux_lo = jax.tree_util.tree_map(lambda a: a[0], aux2)
        aux_hi = jax.tree_util.tree_map(lambda a: a[1], aux2)
    else:
        ok_lo, aux_lo = accept(lo)
        ok_hi, aux_hi = accept(hi)

    def body(_, state, low_probe=None):
        a, aux_a, w_a, b, aux_b, w_b, side = state
        mid = 0.5 * (a + b)
        if propose is None:
            x = mid
        else:
            cand = propose(a, aux_a, w_a, b, aux_b, w_b)
            inside = jnp.isfinite(cand) & (cand > a) & (cand < b)
            x = jnp.where(inside, cand, mid)
        if low_probe is not None:
            x = jnp.where(low_probe, jnp.maximum(b - low_probe_gap, mid), x)
        ok, aux = accept(x)
        # Illinois: an end kept twice in a row has its weight halved (no one-sided stall).
        w_a = jnp.where(ok, jnp.where(side > 0, 0.5 * w_a, w_a), 1.0)
        w_b = jnp.where(ok, 1.0, jnp.where(side < 0, 0.5 * w_b, w_b))
        side = jnp.where(ok, 1.0, -1.0)
        aux_a = _select(ok, aux_a, aux)
        aux_b = _select(ok, aux, aux_b)
        return jnp.where(ok, a, x), aux_a, w_a, jnp.where(ok, x, b), aux_b, w_b, side

    one = jnp.ones(lo.shape)
    state = (lo, aux_lo, one, hi, aux_hi, one, jnp.zeros(lo.shape))
    if tol is None:
        _, _, _, b, aux_b, _, _ = jax.lax.fori_loop(0, iterations, body, state)
    else:
        b, aux_b = _search_until(body, state, ok_lo | ~ok_hi, iterations, float(tol), propose)
    x = jnp.where(ok_lo, lo, b)
    aux = _select(ok_lo, aux_lo, aux_b)
    x = jnp.where(ok_hi, x, jnp.inf)
    return SearchResult(x, aux, ok_hi, ok_lo)


def _search_until(body, state, finished, iterations, tol, propose):
    """The steps of :func:`search_decreasing` in a ``while_loop`` that stops at width ``tol``.

    ``finished`` marks elements with nothing to search (threshold at or beyond an end).
    Elements that are done keep their state (the loop runs while any is not done, at most
    ``iterations`` steps). Returns the accepted end and its aux.
    """
    def width_ok(st):
        return (st[3] - st[0]) <= tol

    def cond(carry):
        k, st, moved = carry
        return (k < iterations) & jnp.any(~(finished | width_ok(st)))

    def step(carry):
        k, st, moved = carry
        done = finished | width_ok(st)
        # Converged from above (the accepted end moved by less than tol): certify from below.
        low = (moved < tol) if propose is not None else None
        new = body(k, st, low)
        new = tuple(_select(done, u, v) for u, v in zip(st, new))
        # How far an accepted proposal moved the upper end; +inf after a rejection or a
        # certifying probe (an accepted one resumes the proposals).
        shrunk = new[3] < st[3]
        if low is not None:
            shrunk = shrunk & ~low
        moved = jnp.where(done, moved, jnp.where(shrunk, st[3] - new[3], jnp.inf))
        return k + 1, new, moved

    init = (jnp.asarray(0), state, jnp.full(state[0].shape, jnp.inf))
    _, st, _ = jax.lax.while_loop(cond, step, init)
    return st[3], st[4]


def implicit_root(fn: Callable, x, value, target, params, binds, fixed):
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

    Returns:
      ``(x, value)``.
    """
    params = tuple(params)
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


def solve_decreasing(fn: Callable, params, target, lo, hi, iterations: int, *, accept_target=None) -> jax.Array:
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

    res = search_decreasing(accept, lo, hi, iterations)
    x, _ = implicit_root(fn, res.x, jnp.zeros_like(res.x), target, params, res.found & ~res.at_low, res.at_low)
    return x
