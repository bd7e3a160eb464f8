"""Audit statistics under a caller's ``jit`` with 64-bit types off: computed on the host.

The statistics use ``jax.scipy.special.betainc`` inside loops; XLA lowers that primitive
when the caller's program is compiled, outside jaxdp's float64 scope, which fails with the
x64 flag off. There, the statistic is computed by a ``jax.pure_callback`` on the host in
float64 (eagerly, with the inputs' values) and each output is rounded to float32 in its
safe direction: lower bounds down, upper bounds and p-values up.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from .._numerics import _x64_enabled

DOWN, NEAREST, UP = -1, 0, 1


def _round32(value, direction):
    v64 = np.asarray(value, np.float64)
    v32 = v64.astype(np.float32)
    if direction == DOWN:
        v32 = np.where(v32.astype(np.float64) > v64, np.nextafter(v32, np.float32(-np.inf)), v32)
    elif direction == UP:
        v32 = np.where(v32.astype(np.float64) < v64, np.nextafter(v32, np.float32(np.inf)), v32)
    return v32.astype(np.float32)


def on_host_when_x64_off(*directions):
    """Decorator: with x64 off and traced arguments, run ``fn`` in a host callback (see above)."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            flat, tree = jax.tree.flatten((args, kwargs))
            traced = [i for i, x in enumerate(flat) if isinstance(x, jax.core.Tracer)]
            if not traced or _x64_enabled():
                return fn(*args, **kwargs)

            def call(dyn):
                vals = list(flat)
                for i, d in zip(traced, dyn):
                    vals[i] = d
                a, k = jax.tree.unflatten(tree, vals)
                return fn(*a, **k)

            with jax.enable_x64(True):
                structs = [jax.ShapeDtypeStruct(np.shape(flat[i]), flat[i].dtype) for i in traced]
                out_shape = jax.eval_shape(call, structs)
            outs, out_tree = jax.tree.flatten(out_shape)
            dirs = list(directions) + [NEAREST] * (len(outs) - len(directions))

            def host(*dyn):
                with jax.enable_x64(True):
                    res = jax.tree.leaves(call([np.asarray(d) for d in dyn]))
                return tuple(_round32(r, d) for r, d in zip(res, dirs))

            result = jax.pure_callback(host, tuple(jax.ShapeDtypeStruct(o.shape, np.float32) for o in outs),
                                       *[flat[i] for i in traced], vmap_method="sequential")
            return jax.tree.unflatten(out_tree, list(result))

        return wrapper

    return deco
