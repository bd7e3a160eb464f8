r"""Convolutions in XLA's canonical form, for the clipping paths.

XLA on CPU runs a convolution fast (Eigen/YNNPACK) only in its canonical form: input
(batch, spatial..., feature), kernel (spatial..., in, out), output (batch, spatial...,
feature). Its pass that rewrites other forms into that one (transposes around a canonical
convolution) visits the entry computation only, so a non-canonical convolution inside a
``while`` or ``cond`` body (a ``lax.scan`` over steps, the overflow chunk of a DP-SGD
step) falls back to a naive loop nest, 10-25x slower. JAX's transpose rules emit exactly
such convolutions (the filter gradient, the input gradient). The functions below write
every convolution of the clipping paths in the canonical form themselves: the same
arithmetic (the transposes only move data), fast in any context.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp


def _canonical_conv(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                    dimension_numbers=None, feature_group_count=1, batch_group_count=1, precision=None,
                    preferred_element_type=None):
    """``lax.conv_general_dilated`` computed as a canonical convolution between transposes."""
    dn = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    ls, rs, os_ = dn
    nsp = len(ls) - 2
    spatial = tuple(range(1, nsp + 1))
    canonical = jax.lax.ConvDimensionNumbers((0, nsp + 1, *spatial), (nsp + 1, nsp, *range(nsp)),
                                             (0, nsp + 1, *spatial))
    out = jax.lax.conv_general_dilated(
        jnp.transpose(lhs, (ls[0], *ls[2:], ls[1])), jnp.transpose(rhs, (*rs[2:], rs[1], rs[0])),
        window_strides, padding, lhs_dilation, rhs_dilation, canonical, feature_group_count, batch_group_count,
        precision, preferred_element_type)
    # ``out`` holds (batch, spatial..., feature); the requested layout puts them at ``os_``.
    order = (os_[0], *os_[2:], os_[1])
    perm = [0] * len(order)
    for axis, logical in enumerate(order):
        perm[logical] = axis
    return jnp.transpose(out, perm)


def _eval_canonical(jaxpr, consts, *args):
    """Evaluate ``jaxpr`` with each ``conv_general_dilated`` replaced by :func:`_canonical_conv`."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = c
    for v, a in zip(jaxpr.invars, args, strict=True):
        env[v] = a
    for eqn in jaxpr.eqns:
        ins, prm = [read(v) for v in eqn.invars], eqn.params
        if eqn.primitive.name == "conv_general_dilated":
            outs = [_canonical_conv(*ins, prm["window_strides"], prm["padding"], prm["lhs_dilation"],
                                    prm["rhs_dilation"], prm["dimension_numbers"], prm["feature_group_count"],
                                    prm["batch_group_count"], prm["precision"], prm["preferred_element_type"])]
        elif eqn.primitive.name in ("jit", "pjit", "closed_call"):  # inlined: their convolutions too
            inner = prm["jaxpr"] if "jaxpr" in prm else prm["call_jaxpr"]
            outs = _eval_canonical(inner.jaxpr, inner.consts, *ins)
        else:
            with eqn.ctx.manager:  # as jax.core.eval_jaxpr binds an equation
                outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(prm))
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, o in zip(eqn.outvars, outs, strict=True):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _canonical_convs(fn):
    """``fn`` (arrays in, a pytree of arrays out) with its convolutions in canonical form."""

    def wrapped(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = _eval_canonical(closed.jaxpr, closed.consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return wrapped


def _conv_with_canonical_vjp(lhs, rhs, window_strides, padding, **kwargs):
    """``lax.conv_general_dilated`` whose forward and backward convolutions are all canonical."""

    def conv(a, k):
        return jax.lax.conv_general_dilated(a, k, window_strides, padding, **kwargs)

    @jax.custom_vjp
    def f(a, k):
        return _canonical_conv(a, k, window_strides, padding, **kwargs)

    def fwd(a, k):
        return f(a, k), (a, k)

    def bwd(res, g):
        a, k = res
        return tuple(_canonical_convs(lambda a, k, g: jax.vjp(conv, a, k)[1](g))(a, k, g))

    f.defvjp(fwd, bwd)
    return f(lhs, rhs)
