r"""Per-example gradients by ``vmap(grad)``, per-example clipping, and the general clipped sum.

The general path of :func:`jaxdp.training.clipped_grad_sum`: exact for any model, it
materialises ``b`` copies of the parameter pytree. The conventions (batches, per-example
loss functions, global L2 norms) are those of :mod:`jaxdp.training._clipping`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .. import _validate
from ._canonical_conv import _canonical_convs

PyTree = Any
LossFn = Callable[..., jax.Array]


# ----------------------------------------------------------------------------------------
# Clipping
# ----------------------------------------------------------------------------------------


def _safe_clip_factor(sq_norms: jax.Array, clip_norm) -> tuple[jax.Array, jax.Array]:
    """Return ``(norms, min(1, C/norms))`` with finite values and gradients everywhere.

    Double-``where``: ``sqrt`` has an infinite derivative at 0 and ``C/norm`` is
    infinite there, and JAX differentiates both branches of a ``where``. So the unused
    branch is fed a harmless 1 before the operation that could blow up.
    """
    # Written as ~(x <= y) so that a NaN norm stays NaN and counts as above C: a NaN
    # gradient must fail the run-time check "no gradient exceeded C", never pass it as 0.
    positive = ~(sq_norms <= 0)
    safe_sq = jnp.where(positive, sq_norms, jnp.ones_like(sq_norms))
    norms = jnp.where(positive, jnp.sqrt(safe_sq), jnp.zeros_like(sq_norms))
    clip_norm = jnp.asarray(clip_norm, dtype=norms.dtype)
    over = ~(norms <= clip_norm)
    safe_norms = jnp.where(over, norms, jnp.ones_like(norms))
    factor = jnp.where(over, clip_norm / safe_norms, jnp.ones_like(norms))
    return norms, factor


def _per_example_sq_norms(per_example: PyTree) -> jax.Array:
    leaves = jax.tree.leaves(per_example)
    if not leaves:
        raise ValueError("per_example_grads must contain at least one array leaf.")
    b = leaves[0].shape[0]
    total = None
    for leaf in leaves:
        if leaf.ndim == 0 or leaf.shape[0] != b:
            raise ValueError(
                "per_example_grads leaves must share a leading batch axis; got shapes "
                f"{[tuple(x.shape) for x in leaves]}."
            )
        sq = jnp.sum(jnp.square(leaf).reshape(b, -1), axis=1)
        total = sq if total is None else total + sq.astype(total.dtype)
    return total


def clip_per_example_grads(per_example_grads: PyTree, clip_norm) -> tuple[PyTree, jax.Array]:
    r"""Clip each example's gradient to global L2 norm at most ``clip_norm``.

    .. math::

        \bar g_i = \min\Bigl(1, \frac{C}{\lVert g_i\rVert}\Bigr) g_i,\qquad
        \lVert g_i\rVert^2 = \sum_{\text{leaves } l} \lVert g_{i,l}\rVert^2 .

    The factor is computed without NaN or infinity at :math:`\lVert g_i\rVert = 0`
    (the example is left unchanged), and gradients through this function are finite.

    Args:
      per_example_grads: pytree whose leaves all have a leading batch axis of size ``b``.
      clip_norm: the clip norm :math:`C > 0` (concrete values are validated).

    Returns:
      ``(clipped, norms)``: the clipped pytree (same structure, shapes and dtypes) and the
      unclipped per-example norms, shape ``(b,)``.

    Raises:
      ValueError: if ``clip_norm`` is not positive and finite, or the leaves do not share
        a leading axis.

    Examples:
      >>> import jax.numpy as jnp
      >>> g = {"w": jnp.array([[3.0, 4.0], [0.3, 0.4]]), "b": jnp.zeros((2, 1))}
      >>> clipped, norms = clip_per_example_grads(g, 1.0)
      >>> norms.tolist()
      [5.0, 0.5]
      >>> [[round(float(v), 3) for v in row] for row in clipped["w"]]
      [[0.6, 0.8], [0.3, 0.4]]
    """
    _validate.check_in_range("clip_norm", clip_norm, 0.0, math.inf, lo_open=True)
    sq = _per_example_sq_norms(per_example_grads)
    norms, factor = _safe_clip_factor(sq, clip_norm)

    def scale(leaf):
        f = factor.astype(leaf.dtype).reshape((-1,) + (1,) * (leaf.ndim - 1))
        return leaf * f

    return jax.tree.map(scale, per_example_grads), norms


# ----------------------------------------------------------------------------------------
# Per-example gradients: the general path, vmap(grad)
# ----------------------------------------------------------------------------------------


def _pure(loss_fn: LossFn, model_or_params, wrt=nnx.Param) -> tuple[PyTree, Callable]:
    """Return ``(params, f)`` with ``f(params, x, y)`` the per-example loss vector.

    For an NNX module the parameters are its trainable state (``wrt``, an nnx filter,
    default every ``nnx.Param``); every other variable (frozen parameters, batch
    statistics, RNG state, ...) is held fixed.
    """
    if isinstance(model_or_params, nnx.Module):
        graphdef, params, rest = nnx.split(model_or_params, wrt, ...)

        def f(p, x, y):
            return loss_fn(nnx.merge(graphdef, p, rest), x, y)

        return params, f
    return model_or_params, loss_fn


def _check_batch(batch) -> tuple[jax.Array, jax.Array]:
    try:
        x, y = batch
    except (TypeError, ValueError):
        raise ValueError("batch must be a pair (x, y) of arrays with a leading batch axis.") from None
    x, y = jnp.asarray(x), jnp.asarray(y)
    if x.ndim == 0 or y.ndim == 0 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"batch (x, y) must share a leading batch axis; got shapes {x.shape} and {y.shape}."
        )
    return x, y


def per_example_grads(loss_fn: LossFn, model_or_params, batch) -> PyTree:
    r"""Per-example gradients :math:`g_i = \nabla_\theta \ell_i(\theta)` via ``vmap(grad)``.

    Each example is passed to ``loss_fn`` as a batch of one, so the result is exact for
    any model (it materialises ``b`` copies of the parameter pytree).

    Args:
      loss_fn: ``loss_fn(model, x, y) -> (b,)`` per-example losses (see module docs).
      model_or_params: a Flax NNX module (gradients are taken with respect to its
        ``nnx.Param`` variables) or a parameter pytree (then ``loss_fn(params, x, y)``).
      batch: ``(x, y)`` with a leading batch axis ``b``.

    Returns:
      A pytree like the parameters (``nnx.State`` for a module) whose leaves have a
      leading axis ``b``.

    Examples:
      >>> import jax.numpy as jnp
      >>> loss = lambda w, x, y: 0.5 * (x @ w - y) ** 2
      >>> g = per_example_grads(loss, jnp.zeros(2), (jnp.eye(2), jnp.array([1.0, 2.0])))
      >>> g.tolist()
      [[-1.0, -0.0], [-0.0, -2.0]]
    """
    x, y = _check_batch(batch)
    if isinstance(model_or_params, nnx.Module):
        graphdef, params, rest = nnx.split(model_or_params, nnx.Param, ...)
        return _per_example_grads_module(loss_fn, graphdef, params, rest, x, y)
    return _per_example_grads_pytree(loss_fn, model_or_params, x, y)


def _per_example_grads(loss_fn, model_or_params, x, y, wrt=nnx.Param):
    params, f = _pure(loss_fn, model_or_params, wrt)

    def one(p, xi, yi):
        return f(p, xi[None], yi[None])[0]

    return jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(params, x, y)


@functools.partial(jax.jit, static_argnames=("loss_fn", "graphdef"))
def _per_example_grads_module(loss_fn, graphdef, params, rest, x, y):
    return _per_example_grads(loss_fn, nnx.merge(graphdef, params, rest), x, y)


@functools.partial(jax.jit, static_argnames=("loss_fn",))
def _per_example_grads_pytree(loss_fn, params, x, y):
    return _per_example_grads(loss_fn, params, x, y)


def accumulation_dtype(dtype):
    """The dtype per-example norms and clipped sums are formed in: the parameters' own, float32 at least.

    A clipping factor or a sum rounded to bfloat16 (8 bits) could exceed the clip norm by
    0.4%: the sensitivity would no longer be C. float32 and float64 are kept (bit-identical
    to the parameters' dtype).
    """
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
        return jnp.dtype(jnp.float32)
    return dtype


def _up(a: jax.Array) -> jax.Array:
    """``a`` in :func:`accumulation_dtype` (no-op at float32 and above)."""
    return a.astype(accumulation_dtype(a.dtype))


def _masked(factor: jax.Array, mask) -> jax.Array:
    return factor if mask is None else factor * jnp.asarray(mask).astype(factor.dtype)


def _vmap_clipped(loss_fn, model_or_params, x, y, clip_norm, mask=None, wrt=nnx.Param) -> tuple[PyTree, jax.Array]:
    """``(Σ_i c_i g_i, norms)`` by ``vmap(grad)``: the general path of ``clipped_grad_sum``."""
    if isinstance(model_or_params, nnx.Module) and any(isinstance(m, nnx.Conv)
                                                       for _, m in nnx.iter_modules(model_or_params)):
        graphdef, params, rest = nnx.split(model_or_params, wrt, ...)
        # Canonical convolutions: fast inside loops too (see _canonical_conv).
        grads = _canonical_convs(lambda p, r, x, y: _per_example_grads_module(loss_fn, graphdef, p, r, x, y))(
            params, rest, x, y)
    else:
        grads = _per_example_grads(loss_fn, model_or_params, x, y, wrt)
    grads = jax.tree.map(_up, grads)  # norms and sum in float32 at least (no-op at float32 and above)
    sq = _per_example_sq_norms(grads)
    norms, factor = _safe_clip_factor(sq, clip_norm)
    factor = _masked(factor, mask)

    def weighted_sum(leaf):
        return jnp.tensordot(factor.astype(leaf.dtype), leaf, axes=1)

    return jax.tree.map(weighted_sum, grads), norms
