r"""Closed-form per-example gradients of norm layers and LoRA adapters: what a recorded call needs.

``nnx.LayerNorm`` / ``nnx.RMSNorm`` (scale and bias gradients per example are sums over
positions of :math:`\hat x \odot \delta` and :math:`\delta`) and ``nnx.LoRA`` (two
outer-product layers) are recorded whole by :mod:`jaxdp.training._ghost`; this module decides
whether a call has a closed form and computes the normalised input :math:`\hat x`. The norms
and sums themselves are in :mod:`jaxdp.training._ghost_norms`. Calls without a closed form
take :func:`_per_layer_grads`, the per-layer vmap of the module's own backward pass.
:func:`_live` and :func:`_live_rows` give a recorded call's own use of a parameter its
gradient (the instrumented copy holds every trainable parameter behind ``stop_gradient``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as _flax_dtypes

from ._per_example import _up


@jax.custom_jvp
def _live(param_value, real):
    """``param_value`` with the gradient of ``real`` added (``real`` broadcast to its shape).

    The value is ``param_value`` itself, with no arithmetic: the same as adding the exact
    zero ``real - stop_gradient(real)``, which XLA would compute (an elementwise pass over
    the kernel, or over the layer's output for a bias, at every call) because ``x - x`` is
    not zero for every float. The tangent is ``param_value``'s plus ``real``'s.
    """
    del real
    return param_value


@_live.defjvp
def _live_jvp(primals, tangents):
    param_value, _ = primals
    value_dot, real_dot = tangents
    return param_value, value_dot + jnp.broadcast_to(real_dot.astype(param_value.dtype), param_value.shape)


@jax.custom_jvp
def _live_rows(out, table, ids):
    """``out`` with the gradient of the rows ``table[ids]`` added (ids outside the table read nothing).

    The value is ``out`` itself; the tangent is ``out``'s plus ``table``'s rows at ``ids``:
    the same as adding ``jnp.take(table - stop_gradient(table), ids)``, an exact zero, without
    computing it (``table - table`` is a pass over the whole table, and a table-sized
    temporary, at every call).
    """
    del table, ids
    return out


@_live_rows.defjvp
def _live_rows_jvp(primals, tangents):
    out, _, ids = primals
    out_dot, table_dot, _ = tangents
    rows = jnp.take(table_dot, ids, axis=0, mode="fill", fill_value=0)
    return out, out_dot + rows.astype(out_dot.dtype)


def _state_key(key_path) -> tuple:
    return tuple(k.key for k in key_path if isinstance(k, jax.tree_util.DictKey))


def _canonical_axes(axes, ndim: int) -> tuple:
    return tuple(sorted({int(a) % ndim for a in (axes if isinstance(axes, tuple | list) else (axes,))}))


def _closed_form(cls, m, args, kwargs, out, params) -> dict:
    """The record's extra fields when ``m``'s per-example gradients have a closed form, else ``{}``.

    ``nnx.LayerNorm`` / ``nnx.RMSNorm`` with local statistics (no ``axis_name``) and the
    batch axis neither normalised over nor a feature axis: ``closed="norm"`` and the feature
    axes (see ``_ghost_norms._affine_norm_grads``). ``nnx.LoRA`` with flax's dtype promotion
    on one input ``(b, ..., d)``: ``closed="lora"`` and the adapters' values (see
    ``_ghost_norms._lora_factors``). Anything else keeps the per-layer vmap (exact, costlier).
    """
    if len(args) != 1 or not isinstance(out, jax.Array) or args[0].ndim < 2:
        return {}
    x = args[0]
    if cls in (nnx.LayerNorm, nnx.RMSNorm):
        if m.axis_name is not None or out.shape != x.shape or not set(params) <= {"scale", "bias"}:
            return {}
        feature = _canonical_axes(m.feature_axes, x.ndim)
        if 0 in feature or 0 in _canonical_axes(m.reduction_axes, x.ndim):
            return {}
        return {"closed": "norm", "feature_axes": feature}
    if cls is nnx.LoRA:
        if m.promote_dtype is not _flax_dtypes.promote_dtype or not set(params) <= {"lora_a", "lora_b"}:
            return {}
        return {"closed": "lora", "lora_ab": (m.lora_a.get_value(), m.lora_b.get_value())}
    return {}


def _normalised_input(rec):
    r"""``∂y/∂scale`` of a recorded norm layer in the direction of ones: the normalised input :math:`\hat x`.

    One forward-mode pass of the layer's own code on the whole batch (its dtype handling,
    mask and variance formula included), in float32 at least; None without a trainable scale.
    """
    if "scale" not in rec["recorder"].params:
        return None
    gdef, state, kwargs = rec["gdef"], rec["state"], rec["kwargs"]
    args = tuple(_up(a) if jnp.issubdtype(a.dtype, jnp.inexact) else a for a in rec["args"])
    theta = jax.tree.map(_up, rec["theta"])
    tangent = jax.tree_util.tree_map_with_path(
        lambda kp, v: (jnp.ones_like if _state_key(kp)[-1] == "scale" else jnp.zeros_like)(v), theta)
    return jax.jvp(lambda th: nnx.merge(gdef, th, state)(*args, **kwargs), (theta,), (tangent,))[1]


def _per_layer_grads(rec, delta):
    """Per-example gradients of one per-layer module's own parameters: vmap of its backward pass.

    Example ``i``'s gradient is the vector-Jacobian product of the module's forward pass on
    its recorded inputs (a batch of one) with its output gradients ``δ_i``: exact for a
    module whose output row ``i`` depends on input row ``i`` only (the loss's assumption).
    """
    gdef, kwargs, state = rec["gdef"], rec["kwargs"], rec["state"]

    def one(args_i, delta_i):
        def f(theta):
            return nnx.merge(gdef, theta, state)(*(a[None] for a in args_i), **kwargs)

        out, pull = jax.vjp(f, rec["theta"])
        return pull(delta_i[None].astype(out.dtype))[0]

    return jax.vmap(one)(rec["args"], delta)
