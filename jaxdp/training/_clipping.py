r"""Per-example gradients, per-example clipping, and a fast path for dense layers.

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
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
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
    positive = sq_norms > 0
    safe_sq = jnp.where(positive, sq_norms, jnp.ones_like(sq_norms))
    norms = jnp.where(positive, jnp.sqrt(safe_sq), jnp.zeros_like(sq_norms))
    clip_norm = jnp.asarray(clip_norm, dtype=norms.dtype)
    over = norms > clip_norm
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


# ----------------------------------------------------------------------------------------
# Fast path for dense layers
# ----------------------------------------------------------------------------------------
#
# For a dense layer z = x W + b applied to a 2-D input (one row per example), the
# per-example gradients are ∂ℓ_i/∂W = x_i δ_iᵀ and ∂ℓ_i/∂b = δ_i with δ_i = ∂ℓ_i/∂z_i,
# so ‖∂ℓ_i/∂W‖_F² = ‖x_i‖² ‖δ_i‖² (a rank-one outer product). The δ's of every layer
# come out of one backward pass of Σ_i ℓ_i with respect to zero "probes" added to the
# layers' outputs (ℓ_i depends on row i only, so row i of the probe gradient is δ_i).
# The clipped sum Σ_i c_i g_i is then the gradient of Σ_i c_i ℓ_i (c_i held constant),
# which reuses the same forward pass through the VJP.
#
# Layers are intercepted by swapping each nnx.Linear's ``dot_general`` (an attribute
# Linear calls with (inputs, kernel, ...)) on a freshly merged copy of the model, so the
# user's module is never modified.


class _Recorder:
    """Stands in for one Linear's ``dot_general``: records its input, adds a probe."""

    def __init__(self, original, registry: list, probes, has_bias: bool):
        self.original = original
        self.registry = registry
        self.probes = probes
        self.has_bias = has_bias

    def __call__(self, lhs, rhs, dimension_numbers, *args, **kwargs):
        out = self.original(lhs, rhs, dimension_numbers, *args, **kwargs)
        position = len(self.registry)
        self.registry.append(
            {"recorder": self, "inputs": lhs, "shape": out.shape, "dtype": out.dtype,
             "dims": dimension_numbers}
        )
        if self.probes is not None:
            out = out + self.probes[position].astype(out.dtype)
        return out


def _linear_param_owners(model: nnx.Module) -> dict | None:
    """Map path of every nnx.Linear to it, or None if some Param lives outside a Linear."""
    modules = dict(nnx.iter_modules(model))
    # Exactly nnx.Linear: a subclass may use its kernel differently (weight norm, LoRA...).
    linears = {p: m for p, m in modules.items() if type(m) is nnx.Linear}
    count = 0
    for path, value in nnx.iter_graph(model):
        if isinstance(value, nnx.Param):
            count += 1
            owner, attr = tuple(path[:-1]), path[-1]
            if owner not in linears or attr not in ("kernel", "bias"):
                return None
    # iter_graph lists a shared Variable once: if two layers tie a kernel, the count is
    # short, and the tied kernel's per-example gradient (a sum of two outer products)
    # has no factored norm.
    if count != sum(1 + (m.bias is not None) for m in linears.values()):
        return None
    return linears or None


def _instrumented(graphdef, rest, registry):
    """Return ``build(params, probes)``: a fresh model copy with every Linear instrumented."""

    def build(p, probes):
        model = nnx.merge(graphdef, p, rest)
        for _, m in nnx.iter_modules(model):
            if type(m) is nnx.Linear:
                m.dot_general = _Recorder(m.dot_general, registry, probes, m.bias is not None)
        return model

    return build


def _discover(loss_fn, model, x, y) -> list | None:
    """Trace once (shapes only); return the call records if the fast path applies."""
    linears = _linear_param_owners(model)
    if linears is None:
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
    seen = set()
    for rec in registry:
        lhs_contract = rec["dims"][0][0]
        if (
            len(rec["inputs"].shape) != 2
            or rec["inputs"].shape[0] != b
            or tuple(lhs_contract) != (1,)
            or tuple(rec["dims"][1][0]) != ()
            or len(rec["shape"]) != 2
        ):
            return None
        seen.add(id(rec["recorder"]))
    # Each Linear must be applied exactly once: a shared layer's per-example gradient is
    # a sum of outer products, whose norm does not factor.
    if len(registry) != len(linears) or len(seen) != len(registry):
        return None
    return [(tuple(r["shape"]), r["dtype"]) for r in registry]


def fast_path_supported(loss_fn: LossFn, model_or_params, batch) -> bool:
    """True when :func:`clipped_grad_sum` would use the dense-layer fast path.

    That is: ``model_or_params`` is an NNX module all of whose ``nnx.Param`` variables are
    the kernels and biases of ``nnx.Linear`` layers, each layer is applied exactly once,
    to a 2-D input ``(b, features)``, and ``loss_fn`` returns a ``(b,)`` vector.
    """
    if not isinstance(model_or_params, nnx.Module):
        return False
    x, y = _check_batch(batch)
    return _discover(loss_fn, model_or_params, x, y) is not None


def _fast(loss_fn, model, x, y, clip_norm, calls, mask=None) -> ClippedGrads:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    probes = [jnp.zeros(shape, dtype) for shape, dtype in calls]
    registry: list = []
    build = _instrumented(graphdef, rest, registry)

    def f(p, probes_):
        registry.clear()
        losses = loss_fn(build(p, probes_), x, y)
        return losses, [rec["inputs"] for rec in registry]

    losses, vjp_fn, inputs = jax.vjp(f, params, probes, has_aux=True)
    has_bias = [rec["recorder"].has_bias for rec in registry]
    _, deltas = vjp_fn(jnp.ones_like(losses))  # row i of deltas[k] is δ_i of layer k
    sq = None
    for inp, delta, bias in zip(inputs, deltas, has_bias, strict=True):
        in_sq = jnp.sum(jnp.square(inp), axis=1)
        if bias:
            in_sq = in_sq + 1
        term = in_sq * jnp.sum(jnp.square(delta), axis=1)
        sq = term if sq is None else sq + term.astype(sq.dtype)
    norms, factor = _safe_clip_factor(sq, clip_norm)
    # The weights are constants of the second backward pass (S = Σ c_i g_i).
    factor = jax.lax.stop_gradient(_masked(factor, mask)).astype(losses.dtype)
    grad_sum, _ = vjp_fn(factor)
    return ClippedGrads(grad_sum, norms)


def per_example_grad_norms(loss_fn: LossFn, model_or_params, batch) -> jax.Array:
    r"""Per-example gradient norms :math:`\lVert\nabla_\theta \ell_i\rVert`, shape ``(b,)``.

    Uses the dense-layer fast path when :func:`fast_path_supported`, else ``vmap(grad)``.
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
    r"""Sum of per-example clipped gradients, with a fast path for dense layers.

    .. math::

        S = \sum_{i=1}^{b} c_i\, g_i,\qquad c_i = \min\Bigl(1, \frac{C}{\lVert g_i\rVert}\Bigr),
        \qquad g_i = \nabla_\theta \ell_i(\theta).

    **Fast path** (no per-example gradient is materialised). For a dense layer
    :math:`z = xW + b` on a 2-D input, :math:`\partial\ell_i/\partial W = x_i\delta_i^\top`
    with :math:`\delta_i = \partial\ell_i/\partial z_i`, so

    .. math::

        \lVert g_i\rVert^2 = \sum_{\text{layers } k}
            \bigl(\lVert x_i^{(k)}\rVert^2 + [\text{layer } k \text{ has a bias}]\bigr)
            \lVert\delta_i^{(k)}\rVert^2 .

    All :math:`\delta^{(k)}` come from one backward pass of :math:`\sum_i \ell_i` with
    respect to zero probes added to the layer outputs; :math:`S` is then the gradient of
    :math:`\sum_i c_i \ell_i` with :math:`c` held constant, from the same forward pass.
    It applies when every ``nnx.Param`` of the model is a kernel or bias of an
    ``nnx.Linear`` that is applied exactly once to a 2-D input (checked at trace time,
    from shapes only); otherwise the general ``vmap(grad)`` path runs.

    Assumptions (both paths): example ``i``'s loss depends on row ``i`` of the batch only
    (no batch statistics). Fast path only: ``loss_fn`` uses the parameters only through
    the layers' forward calls (no weight penalty computed inside ``loss_fn``; add a
    data-independent regulariser's gradient separately).

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
    "whose every nnx.Param is the kernel or bias of an nnx.Linear applied exactly once to a "
    "2-D input, and loss_fn must return a (batch,) vector of per-example losses."
)


def _masked(factor: jax.Array, mask) -> jax.Array:
    return factor if mask is None else factor * jnp.asarray(mask).astype(factor.dtype)


def _vmap_clipped(loss_fn, model_or_params, x, y, clip_norm, mask=None) -> ClippedGrads:
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
