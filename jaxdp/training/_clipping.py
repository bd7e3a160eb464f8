r"""Per-example gradients, per-example clipping, and a fast path for dense, conv and embedding layers.

Conventions used throughout this module:

* A *batch* is a tuple ``(x, y)`` of arrays whose leading axis has the same size ``b``.
* A *loss function* ``loss_fn(model, x, y)`` returns the vector of **per-example** losses,
  shape ``(b,)``, and example ``i``'s loss depends on row ``i`` of the batch only (no
  batch statistics). ``model`` is a Flax NNX module, or, in pure-pytree use, a parameter
  pytree.
* A gradient's norm is the global L2 norm over all its leaves; per-example norms are the
  global norms of each example's slice.

The clipped-gradient sum computed here is

.. math::

    \sum_{i=1}^{b} \min\Bigl(1, \frac{C}{\lVert g_i \rVert}\Bigr) g_i,
    \qquad g_i = \nabla_\theta \ell_i(\theta),

whose replace-one sensitivity is :math:`2C`; the *mean* (divide by ``b``) has
sensitivity :math:`2C/b`. See :func:`jaxdp.training.pnsgd` for how the noise is set
from it.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
from flax import nnx

from .. import _validate

__all__ = [
    "ClippedGrads",
    "clip_per_example_grads",
    "per_example_grads",
    "per_example_grad_norms",
    "clipped_grad_sum",
    "fast_path_supported",
]

PyTree = Any
LossFn = Callable[..., jax.Array]


class ClippedGrads(NamedTuple):
    """Result of :func:`clipped_grad_sum`.

    Attributes:
      grad_sum: pytree like the parameters, :math:`\\sum_i \\min(1, C/\\lVert g_i\\rVert) g_i`
        (a *sum*; divide by the batch size for the mean).
      norms: shape ``(b,)``, the **unclipped** per-example gradient norms
        :math:`\\lVert g_i\\rVert`. Use them to check at run time that clipping stayed
        inactive (``norms <= clip_norm``) where an analysis needs it.
    """

    grad_sum: PyTree
    norms: jax.Array


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


def _pure(loss_fn: LossFn, model_or_params) -> tuple[PyTree, Callable]:
    """Return ``(params, f)`` with ``f(params, x, y)`` the per-example loss vector.

    For an NNX module the parameters are its ``nnx.Param`` state; every other variable
    (batch statistics, RNG state, ...) is held fixed.
    """
    if isinstance(model_or_params, nnx.Module):
        graphdef, params, rest = nnx.split(model_or_params, nnx.Param, ...)

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


def _per_example_grads(loss_fn, model_or_params, x, y):
    params, f = _pure(loss_fn, model_or_params)

    def one(p, xi, yi):
        return f(p, xi[None], yi[None])[0]

    return jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(params, x, y)


@functools.partial(jax.jit, static_argnames=("loss_fn", "graphdef"))
def _per_example_grads_module(loss_fn, graphdef, params, rest, x, y):
    return _per_example_grads(loss_fn, nnx.merge(graphdef, params, rest), x, y)


@functools.partial(jax.jit, static_argnames=("loss_fn",))
def _per_example_grads_pytree(loss_fn, params, x, y):
    return _per_example_grads(loss_fn, params, x, y)


# Convolutions in XLA's canonical form
# ----------------------------------------------------------------------------------------
#
# XLA on CPU runs a convolution fast (Eigen/YNNPACK) only in its canonical form: input
# (batch, spatial..., feature), kernel (spatial..., in, out), output (batch, spatial...,
# feature). Its pass that rewrites other forms into that one (transposes around a canonical
# convolution) visits the entry computation only, so a non-canonical convolution inside a
# ``while`` or ``cond`` body (a ``lax.scan`` over steps, the overflow chunk of a DP-SGD
# step) falls back to a naive loop nest, 10-25x slower. JAX's transpose rules emit exactly
# such convolutions (the filter gradient, the input gradient). The functions below write
# every convolution of the clipping paths in the canonical form themselves: the same
# arithmetic (the transposes only move data), fast in any context.


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


# ----------------------------------------------------------------------------------------
# ----------------------------------------------------------------------------------------
# Fast path for dense, convolutional and embedding layers
# ----------------------------------------------------------------------------------------
#
# Every supported layer computes its output from the example's own input rows and its
# parameters through one primitive call, and its per-example parameter gradient is a sum
# over the example's *positions* t (1 for a dense layer on a 2-D input; the tokens of a
# sequence; the output pixels of a convolution) of outer products a_t δ_tᵀ, where a_t is
# the input seen at position t (the row, the token, the receptive-field patch) and δ_t the
# gradient of ℓ_i with respect to the output at t:
#
#   ∂ℓ_i/∂W = Σ_t a_t δ_tᵀ,   ∂ℓ_i/∂b = Σ_t δ_t,   ∂ℓ_i/∂E[k] = Σ_{t: id_t = k} δ_t.
#
# The δ's of every layer come out of one backward pass of Σ_i ℓ_i with respect to zero
# "probes" added to the layers' outputs (ℓ_i depends on row i only, so row i of a probe's
# gradient holds example i's δ's). The squared norm of each layer's per-example gradient is
# then formed from (a, δ) without the other examples' gradients (see _sq_norm_positions and
# _embed_sq_norm), and the clipped sum Σ_i c_i g_i is formed per layer from the same (a, δ)
# with δ scaled by c_i (one contraction per layer; no second backward pass). Where a norm
# needs the per-example weight gradients anyway (convolutions with few channels: vmap of the
# layer's filter gradient, one grouped convolution, or, for very few input channels, one
# batched contraction of the input's offset slices), the clipped sum is their weighted sum
# over examples (b·d·e operations instead of another b·T·d·e).
#
# Layers are intercepted on a freshly merged copy of the model (the user's module is never
# modified): nnx.Linear through its ``dot_general`` attribute, nnx.Conv through its
# ``conv_general_dilated`` attribute, nnx.Embed by giving the copy a subclass whose
# ``__call__`` records the ids (``attend``, a tied use of the table, marks the model
# unsupported).
#
# Safety by construction: the clipped sum is formed only from the intercepted calls' (a, δ),
# exactly the per-example gradients whose norms are measured, so a use of a parameter
# elsewhere in ``loss_fn`` (a weight penalty) loses its gradient instead of escaping the
# clipping: each clipped term has norm ≤ C. (The copy also holds every owned parameter as
# stop_gradient(p), each intercepted call adding p − stop_gradient(p), an exact zero, at its
# own use of p, so that any gradient taken through the copy has the same property.)

# Exactly these classes: a subclass may use its parameters differently (weight norm, LoRA).
_OWNED = {nnx.Linear: ("kernel", "bias"), nnx.Conv: ("kernel", "bias"), nnx.Embed: ("embedding",)}


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


class _Recorder:
    """Stands in for one layer's primitive: records its inputs, adds a probe to its output."""

    kind = "linear"

    def __init__(self, original, registry: list, probes, params: dict, path: tuple = ()):
        self.original = original
        self.registry = registry
        self.probes = probes
        self.params = params  # the layer's real (differentiable) parameter values
        self.path = path  # the layer's path in the model (keys of its parameters' State)

    def _finish(self, out, record):
        if "bias" in self.params:
            out = _live(out, self.params["bias"])  # gives the gradient to the bias flax adds next
        position = len(self.registry)
        record.update(recorder=self, shape=out.shape, dtype=out.dtype)
        self.registry.append(record)
        if self.probes is not None:
            out = out + self.probes[position].astype(out.dtype)
        return out


class _LinearRecorder(_Recorder):
    kind = "linear"

    def __call__(self, lhs, rhs, dimension_numbers, *args, **kwargs):
        rhs = _live(rhs, self.params["kernel"])
        out = self.original(lhs, rhs, dimension_numbers, *args, **kwargs)
        return self._finish(out, {"inputs": lhs, "dims": dimension_numbers, "kernel_ndim": rhs.ndim})


class _ConvRecorder(_Recorder):
    kind = "conv"

    def __call__(self, lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                 dimension_numbers=None, feature_group_count=1, batch_group_count=1, **kwargs):
        rhs = _live(rhs, self.params["kernel"])
        # The layer's own convolution, in canonical form when it is lax's (see above).
        fn = self.original
        if fn is jax.lax.conv_general_dilated and kwargs.get("out_sharding") is None:
            fn = _conv_with_canonical_vjp
            kwargs.pop("out_sharding", None)
        out = fn(lhs, rhs, window_strides, padding, lhs_dilation=lhs_dilation,
                            rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
                            feature_group_count=feature_group_count, batch_group_count=batch_group_count,
                            **kwargs)
        dn = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
        conv = {"strides": tuple(window_strides), "padding": padding, "dn": dn,
                "lhs_dilation": tuple(lhs_dilation or (1,) * (lhs.ndim - 2)),
                "rhs_dilation": tuple(rhs_dilation or (1,) * (lhs.ndim - 2)),
                "filter_shape": tuple(rhs.shape[d] for d in dn.rhs_spec[2:]),
                "groups": (feature_group_count, batch_group_count)}
        return self._finish(out, {"inputs": lhs, "conv": conv})


class _RecordingEmbed(nnx.Embed):
    """nnx.Embed whose calls are recorded (set on the instrumented copy only)."""

    def __call__(self, inputs, out_sharding=None):
        rec = self._jaxdp_recorder
        out = nnx.Embed.__call__(self, inputs, out_sharding)
        ids = _normalised_ids(jnp.asarray(inputs), self.num_embeddings)
        real = rec.params["embedding"]
        out = out + jnp.take(real - jax.lax.stop_gradient(real), ids, axis=0, mode="fill",
                             fill_value=0).astype(out.dtype)
        return rec._finish(out, {"inputs": inputs, "ids": ids, "vocab": self.num_embeddings})

    def attend(self, query, out_sharding=None):
        self._jaxdp_recorder.registry.append({"recorder": None})  # a second use: unsupported
        return nnx.Embed.attend(self, query, out_sharding)


def _normalised_ids(ids, vocab: int):
    """Row of the table each id reads (jnp.take wraps negative ids; a one-row table broadcasts)."""
    if vocab == 1:
        return jnp.zeros(ids.shape, jnp.int32)
    ids = ids.astype(jnp.int32)
    return jnp.where(ids < 0, ids + vocab, ids)


def _owners(model: nnx.Module) -> dict | None:
    """Map path -> supported layer, or None if some Param lives outside one (or is tied)."""
    modules = dict(nnx.iter_modules(model))
    layers = {p: m for p, m in modules.items() if type(m) in _OWNED}
    for m in layers.values():
        if type(m) is nnx.Conv and (m.mask is not None or m.feature_group_count != 1):
            return None  # a masked kernel's gradient is masked; grouped convs are not factored here
    count = 0
    for path, value in nnx.iter_graph(model):
        if isinstance(value, nnx.Param):
            count += 1
            owner, attr = tuple(path[:-1]), path[-1]
            if owner not in layers or attr not in _OWNED[type(layers[owner])]:
                return None
    # iter_graph lists a shared Variable once: if two layers tie a parameter, the count is
    # short, and the tied parameter's per-example gradient (a sum over both layers) has no
    # factored norm here.
    expected = sum(1 + (getattr(m, "bias", None) is not None) if type(m) is not nnx.Embed else 1
                   for m in layers.values())
    if count != expected:
        return None
    return layers or None


def _instrumented(graphdef, rest, registry):
    """Return ``build(params, probes)``: a fresh model copy with every supported layer instrumented."""

    def build(p, probes):
        model = nnx.merge(graphdef, p, rest)
        for path, m in nnx.iter_modules(model):
            kind = type(m)
            if kind not in _OWNED:
                continue
            real = {}
            for attr in _OWNED[kind]:
                var = getattr(m, attr, None)
                if isinstance(var, nnx.Param):
                    real[attr] = var.value
                    var.value = jax.lax.stop_gradient(var.value)
            path = tuple(path)
            if kind is nnx.Linear:
                m.dot_general = _LinearRecorder(m.dot_general, registry, probes, real, path)
            elif kind is nnx.Conv:
                m.conv_general_dilated = _ConvRecorder(m.conv_general_dilated, registry, probes, real, path)
            else:
                m.__class__ = _RecordingEmbed
                m._jaxdp_recorder = _Recorder(None, registry, probes, real, path)
        return model

    return build


def _record_supported(rec, b: int) -> bool:
    """Shape checks of one recorded call (trace time)."""
    recorder = rec["recorder"]
    if recorder is None or len(rec["shape"]) < 1 or rec["shape"][0] != b:
        return False
    inputs = rec["inputs"]
    if inputs.ndim < 1 or inputs.shape[0] != b:
        return False
    if "ids" in rec:
        return True
    if "conv" in rec:
        c = rec["conv"]
        return (c["groups"] == (1, 1) and c["dn"].lhs_spec[0] == 0 and c["dn"].out_spec[0] == 0
                and all(v == 1 for v in c["lhs_dilation"]))
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = rec["dims"]
    return (tuple(lhs_contract) == (inputs.ndim - 1,) and tuple(rhs_contract) == (0,)
            and not tuple(lhs_batch) and not tuple(rhs_batch) and rec["kernel_ndim"] == 2
            and len(rec["shape"]) == inputs.ndim)


def _discover(loss_fn, model, x, y) -> list | None:
    """Trace once (shapes only); return the probe shapes if the fast path applies."""
    owners = _owners(model)
    if owners is None:
        return None
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    registry: list = []
    build = _instrumented(graphdef, rest, registry)

    def run(p, x, y):
        registry.clear()
        return loss_fn(build(p, None), x, y)

    try:
        out = jax.eval_shape(run, params, x, y)
    except Exception:  # any tracing problem means: use the general path
        return None
    b = x.shape[0]
    if out.shape != (b,):
        return None
    if not all(_record_supported(rec, b) for rec in registry):
        return None
    # Each layer must be applied exactly once: a shared layer's per-example gradient is a
    # sum over its calls, whose norm is not formed here.
    if len(registry) != len(owners) or len({id(r["recorder"]) for r in registry}) != len(registry):
        return None
    return [(tuple(r["shape"]), r["dtype"]) for r in registry]


def fast_path_supported(loss_fn: LossFn, model_or_params, batch) -> bool:
    """True when :func:`clipped_grad_sum` would use the fast path.

    That is: ``model_or_params`` is an NNX module all of whose ``nnx.Param`` variables are
    the parameters of ``nnx.Linear``, ``nnx.Conv`` (no kernel mask,
    ``feature_group_count=1``) or ``nnx.Embed`` layers (exactly these classes, no tied
    parameters), each layer is applied exactly once (``Embed.attend`` not used), to an input
    whose leading axis is the batch, and ``loss_fn`` returns a ``(b,)`` vector.
    """
    if not isinstance(model_or_params, nnx.Module):
        return False
    x, y = _check_batch(batch)
    return _discover(loss_fn, model_or_params, x, y) is not None


def _materialises(t: int, d: int, e: int) -> bool:
    """Whether the per-example weight gradient is formed (else the Gram identity or T = 1)."""
    return t > 1 and not t * t * (d + e) < t * d * e


def _sq_norm_positions(a: jax.Array, g: jax.Array) -> jax.Array:
    r"""Per-example :math:`\lVert\sum_t a_t g_t^\top\rVert_F^2` for ``a`` (b, T, d), ``g`` (b, T, e).

    Two exact ways, chosen by their cost per example (shapes are static):

    * materialise the per-example weight gradient :math:`\sum_t a_t g_t^\top` (``d·e``
      entries, ``T·d·e`` multiply-adds), the choice for convolutions with few channels;
    * the ghost-norm Gram identity
      :math:`\sum_{t,t'} (a_t\cdot a_{t'})(g_t\cdot g_{t'})` (``T²(d+e)``), the choice when
      the positions are few and the layer wide.

    ``T = 1`` (a dense layer on a 2-D input) is :math:`\lVert a\rVert^2\lVert g\rVert^2`.
    """
    return _sq_norm_and_grads(a, g)[0]


def _sq_norm_and_grads(a: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """``(squared norms (b,), per-example weight gradients (b, d, e) or None)``.

    The per-example gradients are returned where they are materialised for the norm, so
    that the clipped sum reuses them (a weighted sum over examples) instead of contracting
    the inputs with the output gradients a second time.
    """
    _, t, d = a.shape
    e = g.shape[2]
    if t == 1:
        return jnp.sum(jnp.square(a), axis=(1, 2)) * jnp.sum(jnp.square(g), axis=(1, 2)), None
    hi = jax.lax.Precision.HIGHEST
    if not _materialises(t, d, e):
        aa = jnp.einsum("btd,bsd->bts", a, a, precision=hi)
        gg = jnp.einsum("bte,bse->bts", g, g, precision=hi)
        return jnp.sum(aa * gg, axis=(1, 2)), None
    w = jnp.einsum("btd,bte->bde", a, g, precision=hi)
    return jnp.sum(jnp.square(w), axis=(1, 2)), w


def _conv_offset_slices(x: jax.Array, conv: dict) -> list[jax.Array]:
    """The input seen at each kernel offset: one ``(b, *out, C)`` slice of the padded input per offset.

    Offsets in row-major order over the kernel's spatial axes; pure data movement (strided
    slices of the padded input, kernel dilation included). Input dilation is not supported
    (such layers take the general path).
    """
    dn = conv["dn"]
    spec = dn.lhs_spec  # (batch axis, feature axis, spatial axes...)
    x = jnp.transpose(x, (spec[0], *spec[2:], spec[1]))  # (b, *spatial, C); free for NHWC
    nsp = x.ndim - 2
    dilated = [(k - 1) * r + 1 for k, r in zip(conv["filter_shape"], conv["rhs_dilation"], strict=True)]
    padding = conv["padding"]
    if isinstance(padding, str):
        padding = jax.lax.padtype_to_pads(x.shape[1:-1], dilated, conv["strides"], padding)
    x = jax.lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0)] + [(lo, hi, 0) for lo, hi in padding] + [(0, 0, 0)])
    out = [(x.shape[1 + i] - dilated[i]) // conv["strides"][i] + 1 for i in range(nsp)]
    slices = []
    for offset in itertools.product(*(range(k) for k in conv["filter_shape"])):
        start = [0] + [o * r for o, r in zip(offset, conv["rhs_dilation"], strict=True)] + [0]
        limit = ([x.shape[0]] + [s + (n - 1) * st + 1 for s, n, st in zip(start[1:-1], out, conv["strides"], strict=True)]
                 + [x.shape[-1]])
        slices.append(jax.lax.slice(x, start, limit, [1, *conv["strides"], 1]))
    return slices


def _conv_patches(x: jax.Array, conv: dict) -> jax.Array:
    """Receptive-field patches of ``x`` as (b, T, d): the ``a_t`` of a convolution.

    The offset slices (:func:`_conv_offset_slices`) with each channel's offsets in
    row-major order, so that ``d`` runs over (input channel, kernel offsets). The channels
    are moved last first and the offsets stacked after them, which builds the (b, T, d)
    array without transposing it afterwards (a transpose of the patches, ``K`` times the
    input's size, cost several forward passes of the layer on CPU).
    """
    p = jnp.stack(_conv_offset_slices(x, conv), axis=-1)  # (b, *out, C, K)
    return p.reshape(p.shape[0], math.prod(p.shape[1:-2]), -1)


def _embed_sq_norm(ids: jax.Array, g: jax.Array, vocab: int) -> jax.Array:
    r"""Per-example :math:`\sum_k \lVert\sum_{t: \mathrm{id}_t = k} g_t\rVert^2`, repeated ids exact.

    Sort each example's ids, number the runs of equal ids, sum the rows of each run
    (a scatter-add into ``T`` slots) and take the squared norms: ``O(T log T + T·D)`` per
    example, whatever the vocabulary size. Ids outside the table read nothing (``jnp.take``
    fills them) and get no gradient, so they are dropped.
    """
    b = ids.shape[0]
    ids = ids.reshape(b, -1)
    g = g.reshape(b, ids.shape[1], -1)
    inside = (ids >= 0) & (ids < vocab)
    g = jnp.where(inside[..., None], g, jnp.zeros((), g.dtype))
    order = jnp.argsort(ids, axis=1)
    sid = jnp.take_along_axis(ids, order, axis=1)
    sg = jnp.take_along_axis(g, order[..., None], axis=1)
    new = jnp.concatenate([jnp.ones((b, 1), bool), sid[:, 1:] != sid[:, :-1]], axis=1)
    run = jnp.cumsum(new, axis=1) - 1
    rows = jnp.zeros_like(sg).at[jnp.arange(b)[:, None], run].add(sg)
    return jnp.sum(jnp.square(rows), axis=(1, 2))


def _layer_factors(rec, delta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(a, g)`` of one dense or conv layer: inputs (b, T, d) and output gradients (b, T, e)."""
    b = delta.shape[0]
    if "conv" in rec:
        dn = rec["conv"]["dn"]
        g = jnp.transpose(delta, dn.out_spec)  # (b, e, *out)
        g = jnp.swapaxes(g.reshape(b, g.shape[1], -1), 1, 2)  # (b, T, e)
        a = _conv_patches(rec["inputs"], rec["conv"])  # (b, T, d)
    else:
        a = rec["inputs"].reshape(b, -1, rec["inputs"].shape[-1])
        g = delta.reshape(b, -1, delta.shape[-1])
    return a.astype(jnp.result_type(a.dtype, g.dtype)), g


def _conv_sizes(rec, delta: jax.Array) -> tuple[int, int, int]:
    """``(T, d, e)`` of a recorded convolution: output positions, patch size, output channels."""
    conv = rec["conv"]
    out_spec, lhs_spec = conv["dn"].out_spec, conv["dn"].lhs_spec
    t = math.prod(delta.shape[i] for i in out_spec[2:])
    d = rec["inputs"].shape[lhs_spec[1]] * math.prod(conv["filter_shape"])
    return t, d, delta.shape[out_spec[1]]


# Input channels up to which per-example kernel gradients are contracted from the offset
# slices rather than computed as one grouped convolution (a measured rule of thumb; both
# are exact). XLA on CPU, one thread, 293 examples, 3x3 SAME, in isolation: 1 channel
# 28x28 -> 16: 4-5 ms against 17-33 ms grouped (in the benchmark CNN's clipped sum: the
# grouped one 22 ms of 111); 3 channels 32x32 -> 32: 67-78 against 125-164 ms; 8 channels
# 14x14 -> 32: 11 against 23 ms; but 16 channels 14x14 -> 32: 59-71 against 33-34 ms.
_SLICES_MAX_IN_CHANNELS = 8


def _conv_per_example_kernel_grads(rec, delta: jax.Array) -> jax.Array:
    r"""Per-example kernel gradients of one convolution, shape ``(b,) + kernel.shape``.

    Two exact ways, the same ``T·d·e`` multiply-adds per example, chosen by the input
    channel count ``C`` (see ``_SLICES_MAX_IN_CHANNELS``):

    * few channels (a first layer on images): for each kernel offset ``k``,
      :math:`W_{i,k} = \sum_t x_{i,t+k} \delta_{i,t}^\top`, one batched contraction of the
      stacked offset slices ``(b, K, T, C)`` with the output gradients ``(b, T, e)``
      (no convolution: XLA on CPU runs a grouped convolution over one or two channels
      poorly);
    * otherwise ``vmap`` of the convolution's own filter gradient over the examples, which
      XLA runs as one grouped convolution, without materialising the ``K`` offset slices.
    """
    conv = rec["conv"]
    if rec["inputs"].shape[conv["dn"].lhs_spec[1]] <= _SLICES_MAX_IN_CHANNELS:
        return _conv_per_example_kernel_grads_slices(rec, delta)
    return _conv_per_example_kernel_grads_grouped(rec, delta)


def _conv_per_example_kernel_grads_slices(rec, delta: jax.Array) -> jax.Array:
    """Per-example kernel gradients from the offset slices: ``einsum('bktc,bte->bkce')``."""
    conv = rec["conv"]
    kernel_ndim = len(conv["filter_shape"]) + 2
    dtype = jnp.result_type(rec["inputs"].dtype, delta.dtype)
    b = delta.shape[0]
    a = jnp.stack(_conv_offset_slices(rec["inputs"].astype(dtype), conv), axis=1)  # (b, K, *out, C)
    a = a.reshape(b, a.shape[1], -1, a.shape[-1])  # (b, K, T, C)
    out_spec = conv["dn"].out_spec
    g = jnp.transpose(delta.astype(dtype), (out_spec[0], *out_spec[2:], out_spec[1]))  # (b, *out, e)
    g = g.reshape(b, -1, g.shape[-1])  # (b, T, e)
    w = jnp.einsum("bktc,bte->bkce", a, g, precision=jax.lax.Precision.HIGHEST)
    w = w.reshape(b, *conv["filter_shape"], *w.shape[2:])  # (b, *spatial, C, e)
    # Into the kernel's layout: rhs_spec = (out axis, in axis, spatial axes...).
    spec = conv["dn"].rhs_spec
    nsp = kernel_ndim - 2
    source = [0] * kernel_ndim
    source[spec[0]], source[spec[1]] = nsp + 1, nsp
    for i in range(nsp):
        source[spec[2 + i]] = i
    return jnp.transpose(w, (0, *(1 + s for s in source)))


def _conv_per_example_kernel_grads_grouped(rec, delta: jax.Array) -> jax.Array:
    """Per-example kernel gradients as ``vmap`` of the filter gradient (one grouped convolution)."""
    conv = rec["conv"]
    # Only the kernel's shape is used (the recorded value belongs to the forward trace).
    kernel_shape = rec["recorder"].params["kernel"].shape
    dtype = jnp.result_type(rec["inputs"].dtype, delta.dtype)

    def one(x_i, delta_i):
        def f(k):
            return jax.lax.conv_general_dilated(
                x_i[None].astype(dtype), k, conv["strides"], conv["padding"], lhs_dilation=conv["lhs_dilation"],
                rhs_dilation=conv["rhs_dilation"], dimension_numbers=conv["dn"],
                precision=jax.lax.Precision.HIGHEST)

        _, vjp = jax.vjp(f, jnp.zeros(kernel_shape, dtype))  # f is linear in k
        return vjp(delta_i[None].astype(dtype))[0]

    # Canonical form: the grouped convolution runs fast inside loops too (see above).
    return _canonical_convs(jax.vmap(one))(rec["inputs"], delta)


def _layer_sq_norm(rec, delta: jax.Array) -> tuple[jax.Array, dict | None]:
    """Per-example squared norm of one recorded layer's parameter gradient (bias included).

    Also returns the layer's per-example gradients ``{"kernel": (b, ...), "bias": (b, e)}``
    when the norm materialised them (convolutions with few channels), else ``None``.
    """
    if "ids" in rec:
        return _embed_sq_norm(rec["ids"], delta, rec["vocab"]), None
    has_bias = "bias" in rec["recorder"].params
    if "conv" in rec and _materialises(*_conv_sizes(rec, delta)):
        b = delta.shape[0]
        w = _conv_per_example_kernel_grads(rec, delta)
        sq = jnp.sum(jnp.square(w.reshape(b, -1)), axis=1)
        per_example = {"kernel": w}
        if has_bias:
            spatial = tuple(rec["conv"]["dn"].out_spec[2:])
            gb = jnp.sum(delta, axis=spatial)  # (b, e): batch axis 0 (checked at discovery)
            sq = sq + jnp.sum(jnp.square(gb), axis=1)
            per_example["bias"] = gb
        return sq, per_example
    a, g = _layer_factors(rec, delta)
    sq, w = _sq_norm_and_grads(a, g)
    per_example = None
    if w is not None:  # a dense layer applied at several positions
        per_example = {"kernel": w}
    if has_bias:
        gb = jnp.sum(g, axis=1)  # (b, e)
        sq = sq + jnp.sum(jnp.square(gb), axis=1)
        if per_example is not None:
            per_example["bias"] = gb
    return sq, per_example


def _layer_grad_sum(rec, delta: jax.Array, weights: jax.Array, per_example: dict | None = None) -> dict:
    r""":math:`\sum_i w_i \partial\ell_i/\partial\theta` for one layer's parameters, from its (a, δ).

    The gradient of :math:`\sum_i w_i\ell_i` is the layer's usual parameter gradient with
    each example's output gradients scaled by :math:`w_i`, contracted over examples and
    positions: one matmul per layer instead of a second backward pass through the model.
    Where the per-example gradients were already materialised for the norms
    (``per_example``), it is their weighted sum over examples instead, which costs
    ``b·d·e`` operations rather than another ``b·T·d·e``.
    """
    params = rec["recorder"].params
    hi = jax.lax.Precision.HIGHEST
    w = weights.astype(delta.dtype).reshape((-1,) + (1,) * (delta.ndim - 1))
    if "ids" in rec:
        table = params["embedding"]
        ids, g = rec["ids"].reshape(-1), (w * delta).reshape(-1, table.shape[-1])
        ids = jnp.where(ids < 0, table.shape[0], ids)  # outside the table: dropped
        return {"embedding": jnp.zeros(table.shape, g.dtype).at[ids].add(g, mode="drop")}
    kernel = params["kernel"]
    if per_example is not None:
        wk = weights.astype(per_example["kernel"].dtype)
        pe = per_example["kernel"]
        flat = jnp.einsum("b,bk->k", wk, pe.reshape(pe.shape[0], -1), precision=hi)
        bias_sum = None if "bias" not in per_example else jnp.einsum("b,be->e", wk, per_example["bias"], precision=hi)
        if "conv" in rec:  # already in the kernel's layout
            flat = flat.reshape(kernel.shape)
    else:
        a, g = _layer_factors(rec, w * delta)
        flat = jnp.einsum("btd,bte->de", a, g, precision=hi)  # (d, e)
        bias_sum = jnp.sum(g, axis=(0, 1)) if "bias" in params else None
    if "conv" in rec and per_example is None:
        # rows of ``flat`` are (input channel, kernel offsets): back to the kernel's layout.
        conv = rec["conv"]
        spec = conv["dn"].rhs_spec  # (out axis, in axis, spatial axes...)
        nsp = len(conv["filter_shape"])
        flat = flat.reshape((-1, *conv["filter_shape"], flat.shape[-1]))  # (I, *spatial, O)
        perm = [0] * kernel.ndim
        perm[spec[0]], perm[spec[1]] = nsp + 1, 0
        for i in range(nsp):
            perm[spec[2 + i]] = 1 + i
        flat = jnp.transpose(flat, perm)
    out = {"kernel": flat.reshape(kernel.shape)}
    if "bias" in params:
        out["bias"] = bias_sum.reshape(params["bias"].shape)
    return out


def _fast(loss_fn, model, x, y, clip_norm, calls, mask=None) -> ClippedGrads:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    probes = [jnp.zeros(shape, dtype) for shape, dtype in calls]
    registry: list = []
    build = _instrumented(graphdef, rest, registry)

    def f(p, probes_):
        registry.clear()
        losses = loss_fn(build(p, probes_), x, y)
        return losses, [{"inputs": rec["inputs"], "ids": rec.get("ids")} for rec in registry]

    # The parameters' cotangents are never used: under jit they are not computed.
    losses, vjp_fn, arrays = jax.vjp(f, params, probes, has_aux=True)
    # The aux output carries the recorded arrays; the static facts come from the registry.
    records = [{**reg, **{k: v for k, v in arr.items() if v is not None}}
               for arr, reg in zip(arrays, registry, strict=True)]
    _, deltas = vjp_fn(jnp.ones_like(losses))  # row i of deltas[k] holds example i's δ's at layer k
    sq, per_example = None, []
    for rec, delta in zip(records, deltas, strict=True):
        term, pe = _layer_sq_norm(rec, delta)
        per_example.append(pe)
        sq = term if sq is None else sq + term.astype(sq.dtype)
    norms, factor = _safe_clip_factor(sq, clip_norm)
    # The weights are constants (S = Σ c_i g_i is not differentiated through c).
    factor = jax.lax.stop_gradient(_masked(factor, mask))
    sums = {}
    for rec, delta, pe in zip(records, deltas, per_example, strict=True):
        for attr, value in _layer_grad_sum(rec, delta, factor, pe).items():
            sums[rec["recorder"].path + (attr,)] = value

    def fill(key_path, leaf):
        key = tuple(k.key for k in key_path if isinstance(k, jax.tree_util.DictKey))
        return sums[key].astype(leaf.dtype)

    return ClippedGrads(jax.tree_util.tree_map_with_path(fill, params), norms)


def per_example_grad_norms(loss_fn: LossFn, model_or_params, batch) -> jax.Array:
    r"""Per-example gradient norms :math:`\lVert\nabla_\theta \ell_i\rVert`, shape ``(b,)``.

    Uses the fast path when :func:`fast_path_supported`, else ``vmap(grad)``.
    Useful to check that clipping at a model's Lipschitz bound stays inactive.

    Examples:
      >>> import jax.numpy as jnp
      >>> loss = lambda w, x, y: 0.5 * (x @ w - y) ** 2
      >>> per_example_grad_norms(loss, jnp.zeros(2), (jnp.eye(2), jnp.array([1.0, -2.0]))).tolist()
      [1.0, 2.0]
    """
    x, y = _check_batch(batch)
    return _dispatch(loss_fn, model_or_params, x, y, math.inf, None).norms


def clipped_grad_sum(loss_fn: LossFn, model_or_params, batch, clip_norm, *,
                     use_fast_path: bool | None = None, mask=None) -> ClippedGrads:
    r"""Sum of per-example clipped gradients, with a fast path for dense, conv and embedding layers.

    .. math::

        S = \sum_{i=1}^{b} c_i\, g_i,\qquad c_i = \min\Bigl(1, \frac{C}{\lVert g_i\rVert}\Bigr),
        \qquad g_i = \nabla_\theta \ell_i(\theta).

    **Fast path** (no per-example gradient of the whole model is materialised). Each
    supported layer's per-example gradient is a sum over the example's positions :math:`t`
    (one for a dense layer on a 2-D input; the tokens of a sequence; the output pixels of
    a convolution) of outer products of the input :math:`a_t` seen there (row, token,
    receptive-field patch) and :math:`\delta_t = \partial\ell_i/\partial z_t`:

    .. math::

        \Bigl\lVert\frac{\partial\ell_i}{\partial W}\Bigr\rVert^2
          = \Bigl\lVert\sum_t a_t\delta_t^\top\Bigr\rVert_F^2
          = \sum_{t,t'} (a_t\cdot a_{t'})(\delta_t\cdot\delta_{t'}),\qquad
        \Bigl\lVert\frac{\partial\ell_i}{\partial b}\Bigr\rVert^2 = \Bigl\lVert\sum_t \delta_t\Bigr\rVert^2,

    computed per layer either from the materialised :math:`\sum_t a_t\delta_t^\top`
    (:math:`T d e` operations; convolutions with few channels, whose per-example kernel
    gradients then also give :math:`S` as a weighted sum) or from the Gram form
    (:math:`T^2(d+e)`; few positions, wide layers), whichever costs less; for a dense layer
    on a 2-D input it is :math:`\lVert a\rVert^2\lVert\delta\rVert^2`. For an embedding
    table the gradient of row :math:`k` is :math:`\sum_{t:\,\mathrm{id}_t = k}\delta_t`
    (repeated ids summed exactly, by sorting). :math:`\lVert g_i\rVert^2` is the sum over
    layers. All :math:`\delta` come from one backward pass of :math:`\sum_i \ell_i` with
    respect to zero probes added to the layer outputs; :math:`S` is then formed per layer
    from the same inputs and :math:`c_i\delta`, one contraction per layer.
    It applies when every ``nnx.Param`` of the model belongs to an ``nnx.Linear``,
    ``nnx.Conv`` (no mask, ``feature_group_count=1``) or ``nnx.Embed`` that is applied
    exactly once to an input whose leading axis is the batch (checked at trace time, from
    shapes only); otherwise (``nnx.LayerNorm``, shared or tied layers, ...) the general
    ``vmap(grad)`` path runs.

    Assumptions (both paths): example ``i``'s loss depends on row ``i`` of the batch only
    (no batch statistics). Fast path only: the layers' inputs keep examples on the leading
    axis, and ``loss_fn`` uses the parameters only through the layers' forward calls. A use
    elsewhere (a weight penalty inside ``loss_fn``) gets **no gradient** on the fast path
    (the parameters enter it through ``stop_gradient``), so it can never escape the
    clipping; add a data-independent regulariser's gradient separately.

    Args:
      loss_fn: ``loss_fn(model, x, y) -> (b,)`` per-example losses.
      model_or_params: Flax NNX module, or a parameter pytree (general path only, with
        ``loss_fn(params, x, y)``).
      batch: ``(x, y)`` with a leading batch axis ``b``.
      clip_norm: :math:`C > 0`.
      use_fast_path: ``None`` (default) picks automatically; ``False`` forces
        ``vmap(grad)``; ``True`` raises ``ValueError`` if the fast path does not apply.
      mask: optional ``(b,)`` booleans (or 0/1 weights): rows with ``False`` are padding
        and contribute nothing to ``grad_sum`` (their norms are still returned). This is
        how a Poisson-sampled batch of random size runs in a padded batch of static shape.

    Returns:
      :class:`ClippedGrads` ``(grad_sum, norms)``: ``grad_sum`` is shaped like the
      parameters (``nnx.State`` of ``nnx.Param`` for a module), ``norms`` are the unclipped
      per-example norms, shape ``(b,)``.

    References:
      Goodfellow, "Efficient per-example gradient computations" (2015), arXiv:1510.01799;
      Li, Tramèr, Liang, Hashimoto, "Large language models can be strong differentially
      private learners" (ghost clipping, ICLR 2022).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxdp.models import LogisticRegression, binary_logistic_loss
      >>> model = LogisticRegression(3, rngs=nnx.Rngs(0))
      >>> x, y = jnp.ones((4, 3)), jnp.array([0, 1, 0, 1])
      >>> out = clipped_grad_sum(binary_logistic_loss, model, (x, y), clip_norm=0.5)
      >>> out.norms.tolist()  # ‖(x, 1)‖·|σ(0) − y| = 2 · 0.5
      [1.0, 1.0, 1.0, 1.0]
    """
    _validate.check_in_range("clip_norm", clip_norm, 0.0, math.inf, lo_open=True)
    x, y = _check_batch(batch)
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.shape != (x.shape[0],):
            raise ValueError(f"mask must have shape ({x.shape[0]},), one entry per example; got {mask.shape}.")
    return _dispatch(loss_fn, model_or_params, x, y, clip_norm, use_fast_path, mask)


def _dispatch(loss_fn, model_or_params, x, y, clip_norm, use_fast_path, mask=None) -> ClippedGrads:
    # One compiled program per (loss_fn, model structure, shapes): called eagerly this
    # avoids op-by-op dispatch; inside the caller's jit it is simply inlined.
    if isinstance(model_or_params, nnx.Module):
        graphdef, params, rest = nnx.split(model_or_params, nnx.Param, ...)
        return _clipped_module(loss_fn, graphdef, params, rest, x, y, clip_norm, use_fast_path, mask)
    if use_fast_path:
        raise ValueError(_NO_FAST_PATH)
    return _clipped_pytree(loss_fn, model_or_params, x, y, clip_norm, mask)


_NO_FAST_PATH = (
    "use_fast_path=True but the fast path does not apply: the model must be an NNX module "
    "whose every nnx.Param belongs to an nnx.Linear, nnx.Conv (no mask, feature_group_count=1) "
    "or nnx.Embed applied exactly once to an input with the batch on its leading axis, and "
    "loss_fn must return a (batch,) vector of per-example losses."
)


def _masked(factor: jax.Array, mask) -> jax.Array:
    return factor if mask is None else factor * jnp.asarray(mask).astype(factor.dtype)


def _vmap_clipped(loss_fn, model_or_params, x, y, clip_norm, mask=None) -> ClippedGrads:
    if isinstance(model_or_params, nnx.Module) and any(isinstance(m, nnx.Conv)
                                                       for _, m in nnx.iter_modules(model_or_params)):
        graphdef, params, rest = nnx.split(model_or_params, nnx.Param, ...)
        # Canonical convolutions: fast inside loops too (see _canonical_conv).
        grads = _canonical_convs(lambda p, r, x, y: _per_example_grads_module(loss_fn, graphdef, p, r, x, y))(
            params, rest, x, y)
    else:
        grads = _per_example_grads(loss_fn, model_or_params, x, y)
    sq = _per_example_sq_norms(grads)
    norms, factor = _safe_clip_factor(sq, clip_norm)
    factor = _masked(factor, mask)

    def weighted_sum(leaf):
        return jnp.tensordot(factor.astype(leaf.dtype), leaf, axes=1)

    return ClippedGrads(jax.tree.map(weighted_sum, grads), norms)


@functools.partial(jax.jit, static_argnames=("loss_fn", "graphdef", "use_fast_path"))
def _clipped_module(loss_fn, graphdef, params, rest, x, y, clip_norm, use_fast_path, mask=None):
    model = nnx.merge(graphdef, params, rest)
    calls = None if use_fast_path is False else _discover(loss_fn, model, x, y)
    if use_fast_path and calls is None:
        raise ValueError(_NO_FAST_PATH)
    if calls is not None:
        return _fast(loss_fn, model, x, y, clip_norm, calls, mask)
    return _vmap_clipped(loss_fn, model, x, y, clip_norm, mask)


@functools.partial(jax.jit, static_argnames=("loss_fn",))
def _clipped_pytree(loss_fn, params, x, y, clip_norm, mask=None):
    return _vmap_clipped(loss_fn, params, x, y, clip_norm, mask)
