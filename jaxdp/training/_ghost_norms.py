r"""Per-layer per-example gradient norms and clipped sums from a layer's inputs and output gradients.

For a layer recorded by :mod:`jaxdp.training._ghost` (its inputs ``a`` and the gradients
``δ`` of the per-example losses with respect to its outputs), the squared norm of each
example's parameter gradient and the weighted sum :math:`\sum_i w_i \partial\ell_i/\partial\theta`
of the layer's parameters, without the whole model's per-example gradients.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp

from ._canonical_conv import _canonical_convs


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
    else:  # the input's last k axes contracted with the kernel's first k (k = 1 but for LinearGeneral)
        inputs, k = rec["inputs"], len(rec["dims"][0][0])
        a = inputs.reshape(b, -1, math.prod(inputs.shape[inputs.ndim - k:]))
        g = delta.reshape(b, a.shape[1], -1)
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

    # Canonical form: the grouped convolution runs fast inside loops too (see _canonical_conv).
    return _canonical_convs(jax.vmap(one))(rec["inputs"], delta)


def _layer_sq_norm(rec, delta: jax.Array) -> tuple[jax.Array, dict | None]:
    """Per-example squared norm of one recorded layer's parameter gradient (bias included).

    Also returns the layer's per-example gradients ``{"kernel": (b, ...), "bias": (b, e)}``
    when the norm materialised them (convolutions with few channels), else ``None``.
    """
    if "ids" in rec:
        return _embed_sq_norm(rec["ids"], delta, rec["vocab"]), None
    if "einsum" in rec:
        return _einsum_sq_norm(rec, delta), None
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
    if "einsum" in rec:
        return _einsum_grad_sum(rec, delta, weights)
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


def _einsum_plan(spec: str, kernel_ndim: int, bias_ndim: int | None):
    """How an ``nnx.Einsum`` contraction factors into positions, groups, contracted and output axes.

    For ``spec = "lhs,rhs->out"`` (letters only), with the batch the first letter of ``lhs``
    and of ``out``: positions P (in lhs and out, not the kernel), contracted C (lhs and
    kernel), outputs E (kernel and out), groups G (all three: a block per value, such as the
    heads of a per-head projection). Returns ``(P, G, C, E, lhs, rhs, out)`` or None when the
    contraction has another shape (a letter of one operand only, a repeated letter, the
    batch elsewhere, a bias that is not the output's axes after the positions).
    """
    spec = spec.replace(" ", "")
    if "..." in spec or "->" not in spec or spec.count(",") != 1:
        return None
    ins, out = spec.split("->")
    lhs, rhs = ins.split(",")
    if (len(rhs) != kernel_ndim or not lhs or not out or lhs[0] != out[0] or lhs[0] in rhs
            or any(len(set(s)) != len(s) for s in (lhs, rhs, out))):
        return None
    letters = set(lhs) | set(rhs) | set(out)
    if any(sum(c in s for s in (lhs, rhs, out)) < 2 for c in letters):
        return None  # summed over inside one operand: not a sum of outer products
    p = [c for c in lhs[1:] if c in out and c not in rhs]
    g = [c for c in rhs if c in lhs and c in out]
    cc = [c for c in rhs if c in lhs and c not in out]
    e = [c for c in rhs if c in out and c not in lhs]
    if bias_ndim is not None and (out[1:1 + len(p)] != "".join(p) or bias_ndim != len(out) - 1 - len(p)):
        return None
    return p, g, cc, e, lhs, rhs, out


def _einsum_factors(rec, delta: jax.Array) -> tuple[jax.Array, jax.Array, tuple]:
    """``(a (b·G, T, C), g (b·G, T, E), group shape)`` of one recorded ``nnx.Einsum``."""
    p, g, cc, e, lhs, rhs, out = rec["einsum"]
    x = rec["inputs"]
    b = x.shape[0]
    size = dict(zip(lhs, x.shape, strict=True)) | dict(zip(out, delta.shape, strict=True))
    t = math.prod(size[c] for c in p)
    gs = tuple(size[c] for c in g)
    a = jnp.transpose(x, [lhs.index(c) for c in (lhs[0], *p, *g, *cc)])
    d = jnp.transpose(delta, [out.index(c) for c in (out[0], *p, *g, *e)])
    a = jnp.moveaxis(a.reshape(b, t, math.prod(gs), -1), 2, 1).reshape(b * math.prod(gs), t, -1)
    d = jnp.moveaxis(d.reshape(b, t, math.prod(gs), -1), 2, 1).reshape(b * math.prod(gs), t, -1)
    return a.astype(jnp.result_type(a.dtype, d.dtype)), d, gs


def _einsum_sq_norm(rec, delta: jax.Array) -> jax.Array:
    """Per-example squared norm of an ``nnx.Einsum``'s kernel (and bias) gradient: the ghost
    norm of each group's block, summed over the groups."""
    b = delta.shape[0]
    a, g, _ = _einsum_factors(rec, delta)
    sq = _sq_norm_and_grads(a, g)[0].reshape(b, -1).sum(axis=1)
    if "bias" in rec["recorder"].params:
        n_p = len(rec["einsum"][0])
        gb = jnp.sum(delta.reshape(b, math.prod(delta.shape[1:1 + n_p]), -1), axis=1)
        sq = sq + jnp.sum(jnp.square(gb), axis=1)
    return sq


def _einsum_grad_sum(rec, delta: jax.Array, weights: jax.Array) -> dict:
    r""":math:`\sum_i w_i \partial\ell_i/\partial\theta` of an ``nnx.Einsum``: one contraction of
    the inputs with the weighted output gradients, back in the kernel's axis order."""
    p, g, cc, e, lhs, rhs, out = rec["einsum"]
    params = rec["recorder"].params
    b = delta.shape[0]
    wd = weights.astype(delta.dtype).reshape((-1,) + (1,) * (delta.ndim - 1)) * delta
    a, d, gs = _einsum_factors(rec, wd)
    ng = math.prod(gs)
    flat = jnp.einsum("ngtc,ngte->gce", a.reshape(b, ng, *a.shape[1:]), d.reshape(b, ng, *d.shape[1:]),
                      precision=jax.lax.Precision.HIGHEST)
    order = (*g, *cc, *e)
    size = dict(zip(rhs, params["kernel"].shape, strict=True))
    kernel = jnp.transpose(flat.reshape([size[c] for c in order]), [order.index(c) for c in rhs])
    result = {"kernel": kernel}
    if "bias" in params:
        n_p = len(p)
        result["bias"] = jnp.sum(wd.reshape(b * math.prod(wd.shape[1:1 + n_p]), -1), axis=0).reshape(
            params["bias"].shape)
    return result


def _affine_norm_grads(rec, delta: jax.Array, xhat: jax.Array | None) -> dict:
    r"""Per-example gradients of an ``nnx.LayerNorm`` / ``nnx.RMSNorm``'s scale and bias, in closed form.

    The layer's output is :math:`y_p = \hat x_p \odot s + \beta` at every position ``p``
    (token, pixel) of an example, with :math:`\hat x` the normalised input, so example
    ``i``'s gradients are sums over its positions,

    .. math:: \partial\ell_i/\partial s = \sum_p \hat x_{i,p}\odot\delta_{i,p},\qquad
              \partial\ell_i/\partial\beta = \sum_p \delta_{i,p},

    ``(b, d)`` each: the size of the result, no copy of anything larger (Ba et al., 2016,
    "Layer Normalization", eq. 4; Zhang & Sennrich, 2019, "Root Mean Square Layer
    Normalization", eq. 4).

    Args:
      rec: the layer's record (``feature_axes``: its feature axes, canonical, without the batch axis 0).
      delta: output gradients, the output's shape ``(b, ...)``.
      xhat: :math:`\partial y/\partial s` in the direction of ones (the normalised input,
        the output's shape), or None when the scale is not trainable.

    Returns:
      ``{"scale": (b, *scale.shape), "bias": (b, *bias.shape)}`` for the trainable ones.
    """
    b = delta.shape[0]
    feature = rec["feature_axes"]
    summed = tuple(ax for ax in range(1, delta.ndim) if ax not in feature)
    out = {}
    for attr, value in rec["recorder"].params.items():
        term = delta if attr == "bias" else xhat.astype(delta.dtype) * delta
        out[attr] = jnp.sum(term, axis=summed).reshape(b, *value.shape)
    return out


def _lora_factors(rec, delta: jax.Array) -> dict:
    r"""The (inputs, output gradients) of an ``nnx.LoRA``'s two adapters: both are outer-product layers.

    For ``out = x A B`` (``A``: ``d×r``, ``B``: ``r×e``) at positions ``t`` with output
    gradients :math:`\delta_t`, example ``i``'s gradients are

    .. math:: \partial\ell_i/\partial B = \sum_t (x_t A)\,\delta_t^\top,\qquad
              \partial\ell_i/\partial A = \sum_t x_t\,(B\delta_t)^\top,

    so the adapter ``B`` is a dense layer with inputs ``xA`` (b, T, r) and ``A`` one with
    inputs ``x`` (b, T, d) and output gradients :math:`\delta B^\top` (b, T, r): their
    norms by the Gram identity or the materialised gradient, whichever is cheaper
    (:func:`_sq_norm_and_grads`; Hu et al., 2022, "LoRA", eq. 3; Li et al., 2022, "Large
    Language Models Can Be Strong Differentially Private Learners", §4).

    Returns:
      ``{attr: (a, g)}`` for the trainable adapters (``lora_a``, ``lora_b``).
    """
    lora_a, lora_b = rec["lora_ab"]
    x = rec["inputs"]
    b = x.shape[0]
    dtype = jnp.result_type(x.dtype, delta.dtype, lora_a.dtype, lora_b.dtype)
    hi = jax.lax.Precision.HIGHEST
    x = x.reshape(b, -1, x.shape[-1]).astype(dtype)
    g = delta.reshape(b, x.shape[1], -1).astype(dtype)
    out = {}
    params = rec["recorder"].params
    if "lora_b" in params:
        out["lora_b"] = (jnp.einsum("btd,dr->btr", x, lora_a.astype(dtype), precision=hi), g)
    if "lora_a" in params:
        out["lora_a"] = (x, jnp.einsum("bte,re->btr", g, lora_b.astype(dtype), precision=hi))
    return out


def _closed_sq_norm(rec, delta: jax.Array, xhat: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """``(squared norms (b,), per-example parts)`` of a layer with a closed form (norms, LoRA).

    The parts are, per trainable parameter, ``("grad", (b, *shape))`` when the per-example
    gradient is formed (cheap: a norm layer's, a low-rank adapter's when ``T·d·r`` is below
    the Gram cost) or ``("outer", (a, g))`` for the Gram identity (the clipped sum
    contracts ``a`` with the weighted ``g``).
    """
    b = delta.shape[0]
    if rec["closed"] == "norm":
        parts = {k: ("grad", v) for k, v in _affine_norm_grads(rec, delta, xhat).items()}
    else:
        parts = {}
        for attr, (a, g) in _lora_factors(rec, delta).items():
            sq_k, w = _sq_norm_and_grads(a, g)
            parts[attr] = ("grad", w) if w is not None else ("outer", (a, g), sq_k)
    sq = None
    for part in parts.values():
        term = part[2] if part[0] == "outer" else jnp.sum(jnp.square(part[1]).reshape(b, -1), axis=1)
        sq = term if sq is None else sq + term
    return sq, parts


def _closed_grad_sum(rec, parts: dict, weights: jax.Array) -> dict:
    r""":math:`\sum_i w_i \partial\ell_i/\partial\theta` of a layer with a closed form, from its parts."""
    hi = jax.lax.Precision.HIGHEST
    out = {}
    for attr, part in parts.items():
        shape = rec["recorder"].params[attr].shape
        if part[0] == "grad":
            v = part[1]
            out[attr] = jnp.tensordot(weights.astype(v.dtype), v.reshape(v.shape[0], -1), axes=1,
                                      precision=hi).reshape(shape)
        else:
            a, g = part[1]
            wg = weights.astype(g.dtype)[:, None, None] * g
            out[attr] = jnp.einsum("btd,bte->de", a, wg, precision=hi).reshape(shape)
    return out
