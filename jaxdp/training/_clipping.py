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

This module is the public API and chooses the path; the paths live in
``_per_example`` (``vmap(grad)``, the general path), ``_ghost`` (the fast path's layer
interception) with ``_ghost_norms`` (its per-layer norms and sums), and
``_canonical_conv`` (convolutions in XLA-CPU's canonical form, used by both).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from .. import _validate
from ._ghost import _diagnose, _discover, _fast, _warn_fallback
from ._per_example import LossFn, PyTree, _check_batch, _vmap_clipped
from ._per_example import clip_per_example_grads as clip_per_example_grads
from ._per_example import per_example_grads as per_example_grads

__all__ = [
    "ClippedGrads",
    "clip_per_example_grads",
    "per_example_grads",
    "per_example_grad_norms",
    "clipped_grad_sum",
    "fast_path_supported",
]


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


def fast_path_supported(loss_fn: LossFn, model_or_params, batch, *, wrt=nnx.Param) -> bool:
    """True when :func:`clipped_grad_sum` would use the fast path.

    That is: ``model_or_params`` is an NNX module all of whose ``nnx.Param`` variables are
    the parameters of ``nnx.Linear``, ``nnx.Conv`` (no kernel mask,
    ``feature_group_count=1``), ``nnx.Embed`` or :class:`jaxdp.models.LipschitzDense`
    layers (exactly these classes, no tied parameters), each layer is applied exactly once
    (``Embed.attend`` not used), to an input whose leading axis is the batch, and
    ``loss_fn`` returns a ``(b,)`` vector. Unlike :func:`clipped_grad_sum`, it never warns.
    """
    if not isinstance(model_or_params, nnx.Module):
        return False
    x, y = _check_batch(batch)
    return _discover(loss_fn, model_or_params, x, y, wrt) is not None

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
                     use_fast_path: bool | None = None, mask=None, wrt=nnx.Param) -> ClippedGrads:
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
    It applies to the trainable parameters of ``nnx.Linear``, ``nnx.LinearGeneral`` (so
    ``nnx.MultiHeadAttention``), ``nnx.LoRALinear``, ``nnx.Conv`` (no mask,
    ``feature_group_count=1``), ``nnx.Embed`` and :class:`jaxdp.models.LipschitzDense`
    (a contraction of the input's last axes with the kernel's first ones: :math:`a_t` the
    flattened contracted axes), and ``nnx.Einsum`` whose contraction is a sum of outer
    products (per group of kernel axes shared by input and output, such as heads).
    ``nnx.LayerNorm`` / ``nnx.RMSNorm`` have closed forms: example ``i``'s scale and bias
    gradients are :math:`\sum_p \hat x_{i,p}\odot\delta_{i,p}` and
    :math:`\sum_p\delta_{i,p}` over its positions (``(b, d)``, with :math:`\hat x` from one
    forward-mode pass of the layer); ``nnx.LoRA`` adapters (:math:`xAB`) are two
    outer-product layers, :math:`B` with inputs :math:`xA` and :math:`A` with inputs
    :math:`x` and output gradients :math:`\delta B^\top`, each by the Gram or the
    materialised form, whichever costs less. Parameters held by any other module (another
    ``nnx.Einsum``, a norm layer with cross-device statistics, a user's layer) get their
    per-example gradients *per layer*: ``vmap`` over the examples of that module's own
    backward pass, from its recorded inputs and :math:`\delta`, which materialises ``b``
    copies of that module's parameters only. A module outside those named here is named
    in one ``UserWarning``. Every layer must
    be applied exactly once to an input whose leading axis is the batch (checked at trace
    time, from shapes only); otherwise (shared or tied layers, a module holding random
    state and parameters, ...) the general ``vmap(grad)`` path runs for the whole model,
    and with ``use_fast_path=None`` a ``UserWarning`` names the layer type it could not
    handle (once per model type and reason).

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
      use_fast_path: ``None`` (default) picks automatically, warning when it falls back;
        ``False`` forces ``vmap(grad)``; ``True`` raises ``ValueError`` (naming the layer)
        if the fast path does not apply to every layer.
      mask: optional ``(b,)`` booleans (or 0/1 weights): rows with ``False`` are padding
        and contribute nothing to ``grad_sum`` (their norms are still returned). This is
        how a Poisson-sampled batch of random size runs in a padded batch of static shape.
      wrt: an nnx filter of the trainable parameters (default every ``nnx.Param``; e.g.
        ``nnx.LoRAParam`` for LoRA fine-tuning): only these are differentiated, clipped
        and summed; the others are public constants (``grad_sum`` holds the trainable ones).

    Returns:
      :class:`ClippedGrads` ``(grad_sum, norms)``: ``grad_sum`` is shaped like the
      parameters (``nnx.State`` of ``nnx.Param`` for a module), ``norms`` are the unclipped
      per-example norms, shape ``(b,)``.

    References:
      Goodfellow, "Efficient per-example gradient computations" (2015), arXiv:1510.01799;
      Li, Tramèr, Liang, Hashimoto, "Large language models can be strong differentially
      private learners" (ghost clipping, ICLR 2022); Bu, Wang, Zha, Karypis, "Differentially
      private optimization on large model at small cost" (book-keeping, ICML 2023).

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
    return _dispatch(loss_fn, model_or_params, x, y, clip_norm, use_fast_path, mask, wrt)


def _dispatch(loss_fn, model_or_params, x, y, clip_norm, use_fast_path, mask=None, wrt=nnx.Param) -> ClippedGrads:
    # One compiled program per (loss_fn, model structure, shapes): called eagerly this
    # avoids op-by-op dispatch; inside the caller's jit it is simply inlined.
    if isinstance(model_or_params, nnx.Module):
        graphdef, params, rest = nnx.split(model_or_params, wrt, ...)
        return _clipped_module(loss_fn, graphdef, params, rest, x, y, clip_norm, use_fast_path, mask, wrt)
    if use_fast_path:
        raise ValueError(_NO_FAST_PATH)
    return _clipped_pytree(loss_fn, model_or_params, x, y, clip_norm, mask)


_NO_FAST_PATH = (
    "use_fast_path=True but the fast path does not apply: the model must be an NNX module "
    "whose every trainable parameter belongs to an nnx.Linear, nnx.LinearGeneral, nnx.LoRALinear, nnx.Conv (no mask, "
    "feature_group_count=1), nnx.Embed, jaxdp.models.LipschitzDense, nnx.LayerNorm, nnx.RMSNorm, nnx.LoRA or "
    "nnx.Einsum applied exactly once to an input with the batch on its leading axis, and "
    "loss_fn must return a (batch,) vector of per-example losses."
)


@functools.partial(jax.jit, static_argnames=("loss_fn", "graphdef", "use_fast_path", "wrt"))
def _clipped_module(loss_fn, graphdef, params, rest, x, y, clip_norm, use_fast_path, mask=None, wrt=nnx.Param):
    model = nnx.merge(graphdef, params, rest)
    calls, why = (None, None) if use_fast_path is False else _diagnose(loss_fn, model, x, y, wrt)
    if use_fast_path and (calls is None or why is not None):
        raise ValueError(_NO_FAST_PATH + (f" Here: {why}." if why else ""))
    if why is not None:  # at trace time: once per compilation, deduplicated
        _warn_fallback(model, why, per_layer=calls is not None)
    if calls is not None:
        return ClippedGrads(*_fast(loss_fn, model, x, y, clip_norm, calls, mask, wrt))
    return ClippedGrads(*_vmap_clipped(loss_fn, model, x, y, clip_norm, mask, wrt))


@functools.partial(jax.jit, static_argnames=("loss_fn",))
def _clipped_pytree(loss_fn, params, x, y, clip_norm, mask=None):
    return ClippedGrads(*_vmap_clipped(loss_fn, params, x, y, clip_norm, mask))
