"""Per-example norms of transformer layers without the model's per-example gradients.

Covers nnx.Linear on sequences (Gram and materialised branches), nnx.LinearGeneral and
nnx.MultiHeadAttention, nnx.Einsum, nnx.LayerNorm / nnx.RMSNorm, nnx.Embed on sequences,
nnx.LoRA / nnx.LoRALinear with only the adapters trainable, a model mixing these with a
layer the fast path has no formula for, and a small transformer encoder. The reference is
independent of the library: one ``jax.grad`` per example in a Python loop, in float64,
norms and clipped sums in NumPy.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdp.training import _clipping, _ghost, clipped_grad_sum, fast_path_supported

# float64: the fast path and the loop reference differ only in summation order (~1e-15);
# the acceptance bound of the issue is 1e-10 relative.
X64_TOL = 1e-10
F64 = {"param_dtype": jnp.float64}


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture
def fresh_warnings():
    saved = set(_ghost._WARNED)
    _ghost._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    _ghost._WARNED.clear()
    _ghost._WARNED.update(saved)


def _loss(model, x, y):
    """Per-example squared error of a scalar read-out (a fresh function: misses the jit caches)."""
    out = model(x)
    return 0.5 * jnp.sum((out.reshape(out.shape[0], -1) - y[:, None]) ** 2, axis=1)


def _reference(model, x, y, clip, wrt=nnx.Param):
    """Per-example gradient norms and clipped sum: one jax.grad per example, NumPy float64."""
    graphdef, params, rest = nnx.split(model, wrt, ...)

    def one(p, xi, yi):
        return _loss(nnx.merge(graphdef, p, rest), xi[None], yi[None])[0]

    grads = [jax.tree.leaves(jax.grad(one)(params, x[i], y[i])) for i in range(x.shape[0])]
    norms = np.array([np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in gs)) for gs in grads])
    factors = np.minimum(1.0, clip / norms)
    sums = [sum(f * np.asarray(gs[k], np.float64) for f, gs in zip(factors, grads, strict=True))
            for k in range(len(grads[0]))]
    return norms, sums


def _check(model, x, y, wrt=nnx.Param, fast=True):
    """The fast path applies (if ``fast``) and matches the reference at a clip norm between the norms."""
    loss = lambda m, x, y: _loss(m, x, y)  # noqa: E731  (a fresh function object)
    if fast:
        assert fast_path_supported(loss, model, (x, y), wrt=wrt), _ghost._diagnose(loss, model, x, y, wrt)[1]
    norms, sums = _reference(model, x, y, 1.0, wrt)
    clip = float(np.median(norms))
    norms, sums = _reference(model, x, y, clip, wrt)
    out = clipped_grad_sum(loss, model, (x, y), clip, wrt=wrt)
    np.testing.assert_allclose(out.norms, norms, rtol=X64_TOL)
    got = jax.tree.leaves(out.grad_sum)
    assert len(got) == len(sums)
    # Relative to the whole gradient: some leaves are zero up to rounding (the attention
    # keys' bias, to which softmax is invariant).
    scale = max(np.max(np.abs(w)) for w in sums)
    for g, w in zip(got, sums, strict=True):
        np.testing.assert_allclose(g, w, rtol=X64_TOL, atol=X64_TOL * scale)
    return out


def _data(b, shape, seed=0, ids=None):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, ids, (b, *shape)) if ids else rng.normal(size=(b, *shape))
    return jnp.asarray(x), jnp.asarray(rng.normal(size=(b,)))


class _SeqLinear(nnx.Module):
    def __init__(self, d, e, rngs):
        self.a = nnx.Linear(d, e, rngs=rngs, **F64)
        self.b = nnx.Linear(e, 1, use_bias=False, rngs=rngs, **F64)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x))).sum(axis=(1, 2))


@pytest.mark.parametrize("t,d,e", [(1, 5, 3), (3, 7, 11), (17, 4, 6), (9, 16, 2), (2, 2, 9)])
def test_linear_on_sequences(t, d, e):
    """Both branches (Gram T²(d+e) < T·d·e, else materialised) and T = 1."""
    x, y = _data(4, (t, d), seed=t * d)
    _check(_SeqLinear(d, e, nnx.Rngs(t)), x, y)


class _General(nnx.Module):
    def __init__(self, rngs):
        self.q = nnx.LinearGeneral(6, (2, 3), rngs=rngs, **F64)
        self.o = nnx.LinearGeneral((2, 3), 4, axis=(-2, -1), rngs=rngs, **F64)

    def __call__(self, x):
        return self.o(jnp.tanh(self.q(x))).sum(axis=(1, 2))


def test_linear_general():
    x, y = _data(5, (4, 6), seed=1)
    _check(_General(nnx.Rngs(0)), x, y)


def _attention_f64(query, key, value, mask=None, **_):
    """Dot-product attention with its softmax in the inputs' dtype (float64 here).

    ``nnx.MultiHeadAttention``'s default goes through ``jax.nn.dot_product_attention``,
    whose softmax is always float32: float64 models then have float32-accurate attention
    gradients (two correct ways to differentiate it differ by ~1e-9 relative in the norms).
    The fast path's float64 exactness is checked with this one.
    """
    logits = jnp.einsum("...qhd,...khd->...hqk", query / np.sqrt(query.shape[-1]), key)
    if mask is not None:
        logits = jnp.where(mask, logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("...hqk,...khd->...qhd", weights, value)


class _Attention(nnx.Module):
    def __init__(self, t, d, heads, rngs, attention_fn=_attention_f64):
        self.mha = nnx.MultiHeadAttention(heads, d, qkv_features=2 * d, decode=False, rngs=rngs,
                                          attention_fn=attention_fn, **F64)
        self.head = nnx.Linear(d, 1, rngs=rngs, **F64)

    def __call__(self, x):
        return self.head(self.mha(x)).sum(axis=(1, 2))


@pytest.mark.parametrize("t,d,heads", [(3, 4, 2), (6, 8, 4), (1, 6, 3)])
def test_multi_head_attention(t, d, heads):
    x, y = _data(4, (t, d), seed=t + d)
    _check(_Attention(t, d, heads, nnx.Rngs(0)), x, y)


def test_multi_head_attention_default_softmax_is_float32_accurate():
    """flax's default attention (a float32 softmax inside float64 layers) at float32's accuracy.

    The fast path's norm is that of the gradient it sums (so the clip holds exactly); the
    reference differentiates the same float32 softmax in another order.
    """
    x, y = _data(4, (6, 8), seed=14)
    model = _Attention(6, 8, 4, nnx.Rngs(0), attention_fn=nnx.dot_product_attention)
    loss = lambda m, x, y: _loss(m, x, y)  # noqa: E731
    assert fast_path_supported(loss, model, (x, y))
    norms, sums = _reference(model, x, y, 1.0)
    out = clipped_grad_sum(loss, model, (x, y), float(np.median(norms)))
    np.testing.assert_allclose(out.norms, norms, rtol=1e-6)
    own = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(
        clipped_grad_sum(loss, model, (x[:1], y[:1]), 1e9).grad_sum)))
    np.testing.assert_allclose(own, out.norms[0], rtol=1e-12)  # the norm is its own gradient's


class _Einsums(nnx.Module):
    def __init__(self, rngs):
        self.qkv = nnx.Einsum("btd,dnh->btnh", (6, 2, 3), (2, 3), rngs=rngs, **F64)
        self.out = nnx.Einsum("btnh,nhd->btd", (2, 3, 5), (5,), rngs=rngs, **F64)
        self.per_head = nnx.Einsum("btnh,nhk->btnk", (2, 3, 4), (2, 4), rngs=rngs, **F64)  # heads: groups
        self.head = nnx.Einsum("btd,do->bo", (5, 1), rngs=rngs, **F64)  # sums over t: per layer

    def __call__(self, x):
        h = jnp.tanh(self.qkv(x))
        h = jnp.tanh(self.out(h)) + jnp.tanh(self.per_head(h)).sum(axis=(2, 3))[..., None]
        return self.head(h)


@pytest.mark.parametrize("t", [1, 2, 5, 40])  # T = 2: the Gram form for qkv (T(d+e) < de)
def test_einsum(t):
    """Ghost norms per group of the contraction (Gram or materialised by cost), and the
    per-layer path for the read-out that sums over positions inside the contraction."""
    model = _Einsums(nnx.Rngs(t))
    x, y = _data(4, (t, 6), seed=2 + t)
    _check(model, x, y)
    layers, per_layer, _ = _ghost._owners(model)[0]
    assert set(layers) == {("qkv",), ("out",), ("per_head",)} and set(per_layer) == {("head",)}


class _Norms(nnx.Module):
    def __init__(self, d, rngs):
        self.ln = nnx.LayerNorm(d, rngs=rngs, **F64)
        self.rms = nnx.RMSNorm(d, rngs=rngs, **F64)
        self.lin = nnx.Linear(d, 1, rngs=rngs, **F64)

    def __call__(self, x):
        return self.lin(self.rms(jnp.tanh(self.ln(x)) + 0.3 * x)).sum(axis=(1, 2))


@pytest.mark.parametrize("t,d", [(1, 3), (4, 5), (7, 2)])
def test_layer_norm_and_rms_norm(t, d):
    x, y = _data(4, (t, d), seed=3 * t + d)
    _check(_Norms(d, nnx.Rngs(0)), x, y)


class _Tokens(nnx.Module):
    def __init__(self, vocab, d, rngs):
        self.emb = nnx.Embed(vocab, d, rngs=rngs, **F64)
        self.lin = nnx.Linear(d, 1, rngs=rngs, **F64)

    def __call__(self, ids):
        return self.lin(jnp.tanh(self.emb(ids))).sum(axis=(1, 2))


@pytest.mark.parametrize("t,vocab", [(5, 3), (12, 50)])
def test_embed_on_sequences_with_repeated_ids(t, vocab):
    x, y = _data(4, (t,), seed=t, ids=vocab)
    _check(_Tokens(vocab, 4, nnx.Rngs(0)), x, y)


class _Lora(nnx.Module):
    def __init__(self, d, e, rank, rngs):
        self.base = nnx.Linear(d, e, rngs=rngs, **F64)
        self.lora = nnx.LoRA(d, rank, e, base_module=self.base, rngs=rngs, **F64)
        self.lora_linear = nnx.LoRALinear(e, 3, lora_rank=rank, lora_param_dtype=jnp.float64, rngs=rngs, **F64)
        self.head = nnx.Linear(3, 1, rngs=rngs, **F64)

    def __call__(self, x):
        return self.head(jnp.tanh(self.lora_linear(jnp.tanh(self.lora(x))))).sum(axis=(1, 2))


def _perturb_lora(model, seed):
    """LoRA's B starts at zero (then A gets no gradient): give every adapter a random B."""
    rng = np.random.default_rng(seed)
    for _, m in nnx.iter_modules(model):
        if isinstance(m, nnx.LoRA):
            m.lora_b.set_value(jnp.asarray(rng.normal(size=m.lora_b.shape)))
    return model


@pytest.mark.parametrize("rank,t", [(1, 4), (2, 1), (4, 6)])
@pytest.mark.parametrize("trainable", ["adapters", "all"])
def test_lora_only_trainable_parameters_counted(rank, t, trainable):
    wrt = nnx.LoRAParam if trainable == "adapters" else nnx.Param
    model = _perturb_lora(_Lora(5, 4, rank, nnx.Rngs(rank)), rank)
    x, y = _data(4, (t, 5), seed=rank * t)
    out = _check(model, x, y, wrt=wrt)
    n_leaves = 4 if trainable == "adapters" else 4 + 6
    assert len(jax.tree.leaves(out.grad_sum)) == n_leaves


class ScaleShift(nnx.Module):
    """An elementwise affine layer the fast path has no formula for."""

    def __init__(self, d):
        self.scale = nnx.Param(jnp.linspace(0.5, 1.5, d, dtype=jnp.float64))
        self.shift = nnx.Param(jnp.linspace(-0.2, 0.2, d, dtype=jnp.float64))

    def __call__(self, x):
        return x * self.scale[...] + self.shift[...]


class _MixedSupport(nnx.Module):
    def __init__(self, rngs):
        self.ln = nnx.LayerNorm(6, rngs=rngs, **F64)
        self.a = nnx.Linear(6, 6, rngs=rngs, **F64)
        self.odd = ScaleShift(6)
        self.b = nnx.Linear(6, 1, rngs=rngs, **F64)

    def __call__(self, x):
        return self.b(jnp.tanh(self.odd(jnp.tanh(self.a(self.ln(x)))))).sum(axis=(1, 2))


def test_mixed_supported_and_unsupported_layers_exact_with_one_warning(fresh_warnings, monkeypatch):
    model = _MixedSupport(nnx.Rngs(0))
    x, y = _data(5, (3, 6), seed=4)
    taken = []
    fast = _clipping._fast
    monkeypatch.setattr(_clipping, "_fast", lambda *a, **k: taken.append("fast") or fast(*a, **k))
    _check(model, x, y, fast=False)
    clipped_grad_sum(lambda m, x, y: _loss(m, x, y), model, (x[:3], y[:3]), 0.5)
    messages = [str(w.message) for w in fresh_warnings if issubclass(w.category, UserWarning)]
    assert len(messages) == 1, messages
    assert "ScaleShift" in messages[0] and "LayerNorm" not in messages[0], messages[0]
    assert taken and set(taken) == {"fast"}  # per layer: the others stay on the fast path
    with pytest.raises(ValueError, match="ScaleShift"):
        clipped_grad_sum(lambda m, x, y: _loss(m, x, y), model, (x, y), 0.5, use_fast_path=True)


class EncoderBlock(nnx.Module):
    """Pre-norm transformer block: multi-head self-attention and an MLP, with residuals."""

    def __init__(self, d, heads, hidden, rngs, **kw):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs, **kw)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs, **kw)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs, **kw)
        self.up = nnx.Linear(d, hidden, rngs=rngs, **kw)
        self.down = nnx.Linear(hidden, d, rngs=rngs, **kw)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class _Encoder(nnx.Module):
    def __init__(self, vocab, t, d, rngs):
        self.tok = nnx.Embed(vocab, d, rngs=rngs, **F64)
        self.pos = nnx.Embed(t, d, rngs=rngs, **F64)
        self.blocks = nnx.List([EncoderBlock(d, 2, 2 * d, rngs, **F64) for _ in range(2)])
        self.norm = nnx.RMSNorm(d, rngs=rngs, **F64)
        self.head = nnx.Linear(d, 1, rngs=rngs, **F64)

    def __call__(self, ids):
        pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        h = self.tok(ids) + self.pos(pos)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(axis=1))


def test_transformer_encoder_takes_the_fast_path_for_every_layer(fresh_warnings):
    model = _Encoder(11, 6, 8, nnx.Rngs(0))
    x, y = _data(4, (6,), seed=5, ids=11)
    calls, why = _ghost._diagnose(_loss, model, x, y)
    assert why is None and calls is not None, why
    owners, _ = _ghost._owners(model)
    layers, per_layer, _ = owners
    # Pinned: every parameter-holding layer is one the fast path has a formula for.
    assert {type(m) for m in layers.values()} == {nnx.Embed, nnx.LinearGeneral, nnx.Linear}
    assert {type(m) for m in per_layer.values()} == {nnx.LayerNorm, nnx.RMSNorm}
    assert len(calls) == len(layers) + len(per_layer) == 2 + 2 * (2 + 4 + 2) + 2
    _check(model, x, y)
    assert not [w for w in fresh_warnings if issubclass(w.category, UserWarning)]


@pytest.fixture
def per_layer_calls(monkeypatch):
    """The layer types whose per-example gradients went through the per-layer vmap."""
    seen = []
    inner = _ghost._per_layer_grads

    def spy(rec, delta):
        seen.append(rec["recorder"].layer.split(" ")[0])
        return inner(rec, delta)

    monkeypatch.setattr(_ghost, "_per_layer_grads", spy)
    return seen


class _NormShapes(nnx.Module):
    """Norm layers over several feature / reduction layouts on (b, T, H, W) inputs."""

    def __init__(self, h, w, rngs):
        self.ln_last = nnx.LayerNorm(w, rngs=rngs, **F64)
        self.ln_two = nnx.LayerNorm(h * w, feature_axes=(-2, -1), reduction_axes=(-2, -1), rngs=rngs, **F64)
        self.ln_wide = nnx.LayerNorm(w, reduction_axes=(-2, -1), rngs=rngs, **F64)  # stats over (H, W), scale per W
        self.ln_noscale = nnx.LayerNorm(w, use_scale=False, use_fast_variance=False, rngs=rngs, **F64)
        self.rms = nnx.RMSNorm(w, epsilon=1e-3, rngs=rngs, **F64)
        self.lin = nnx.Linear(w, 1, rngs=rngs, **F64)

    def __call__(self, x):
        h = jnp.tanh(self.ln_last(x)) + 0.5 * self.ln_two(x * 1.3)
        h = jnp.sin(self.ln_wide(h)) + self.ln_noscale(h) * x
        return self.lin(self.rms(h + 0.2 * x)).sum(axis=(1, 2, 3))


def _perturb_norms(model, seed):
    """Norm layers start at scale 1, bias 0: give every one random values (a generic point)."""
    rng = np.random.default_rng(seed)
    for _, m in nnx.iter_modules(model):
        for attr in ("scale", "bias"):
            var = getattr(m, attr, None) if isinstance(m, nnx.LayerNorm | nnx.RMSNorm) else None
            if var is not None:
                var.set_value(jnp.asarray(rng.normal(size=var.shape)))
    return model


@pytest.mark.parametrize("seed", range(4))
def test_norm_layers_closed_form_random_shapes(seed, per_layer_calls):
    """LayerNorm / RMSNorm scale and bias gradients from x̂ ⊙ δ and δ summed over positions, on
    random batch, sequence and feature sizes: the float64 loop reference to 1e-10, no per-layer vmap."""
    rng = np.random.default_rng(100 + seed)
    b, t, h, w = (int(v) for v in rng.integers(2, 6, 4))
    model = _perturb_norms(_NormShapes(h, w, nnx.Rngs(seed)), seed)
    x, y = _data(b, (t, h, w), seed=seed)
    _check(model, x, y)
    assert per_layer_calls == []


def test_norm_layers_frozen_scale_or_bias(per_layer_calls):
    """Only the trainable half of a norm layer is counted (the other is a public constant)."""
    model = _perturb_norms(_Norms(5, nnx.Rngs(0)), 0)
    x, y = _data(4, (3, 5), seed=9)
    for keep in ("scale", "bias"):
        wrt = nnx.All(nnx.Param, nnx.Any(nnx.PathContains(keep), nnx.PathContains("lin")))
        out = _check(model, x, y, wrt=wrt)
        assert {k[-1] for k, _ in nnx.to_flat_state(out.grad_sum) if k[0] != "lin"} == {keep}
    assert per_layer_calls == []


class _LoraSeq(nnx.Module):
    def __init__(self, d, e, rank, rngs):
        self.lora = nnx.LoRA(d, rank, e, rngs=rngs, **F64)
        self.lora_linear = nnx.LoRALinear(e, e, lora_rank=rank, lora_param_dtype=jnp.float64, rngs=rngs, **F64)
        self.head = nnx.Linear(e, 1, rngs=rngs, **F64)

    def __call__(self, x):
        return self.head(jnp.tanh(self.lora_linear(jnp.tanh(self.lora(x))))).sum(axis=(1, 2))


@pytest.mark.parametrize("seed", range(4))
def test_lora_closed_form_random_shapes_and_ranks(seed, per_layer_calls):
    """Adapters A, B as outer-product layers (grad_B = (xA)ᵀδ, grad_A = xᵀ(δBᵀ)) on random
    widths, ranks and sequence lengths, both norm branches; the float64 reference to 1e-10."""
    rng = np.random.default_rng(200 + seed)
    d, e = (int(v) for v in rng.integers(8, 40, 2))
    rank = int(rng.integers(1, 6))
    t = int(rng.integers(1, 9))
    model = _perturb_lora(_LoraSeq(d, e, rank, nnx.Rngs(seed)), seed)
    x, y = _data(3, (t, d), seed=seed)
    for wrt in (nnx.LoRAParam, nnx.Param):
        out = _check(model, x, y, wrt=wrt)
        assert len(jax.tree.leaves(out.grad_sum)) == (4 if wrt is nnx.LoRAParam else 4 + 4)
    assert per_layer_calls == []


@pytest.mark.parametrize("t,d,e,rank", [(2, 32, 32, 4), (6, 32, 32, 4), (1, 9, 7, 3)])
def test_lora_gram_and_materialised_branches(t, d, e, rank, per_layer_calls):
    """T(d+r) < d·r takes the Gram identity for A (and T(r+e) < r·e for B), else the
    per-example adapter gradients are formed; T = 1 is a product of norms."""
    from jaxdp.training._ghost_norms import _materialises

    assert _materialises(t, d, rank) == (t > 2)
    model = _perturb_lora(_LoraSeq(d, e, rank, nnx.Rngs(t)), t)
    x, y = _data(4, (t, d), seed=t + d)
    _check(model, x, y, wrt=nnx.LoRAParam)
    assert per_layer_calls == []


def test_unknown_layer_still_per_layer(per_layer_calls, fresh_warnings):
    """The closed forms leave a layer without one on the per-layer vmap (and its warning)."""
    model = _MixedSupport(nnx.Rngs(1))
    x, y = _data(4, (3, 6), seed=5)
    _check(model, x, y, fast=False)
    assert set(per_layer_calls) == {"ScaleShift"}


class _LoraFlat(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.LoRALinear(7, 5, lora_rank=3, lora_param_dtype=jnp.float64, rngs=rngs, **F64)
        self.ln = nnx.LayerNorm(5, rngs=rngs, **F64)
        self.head = nnx.Linear(5, 1, rngs=rngs, **F64)

    def __call__(self, x):
        return self.head(self.ln(jnp.tanh(self.body(x))))


def test_lora_and_layer_norm_on_flat_inputs(per_layer_calls):
    """(b, d) inputs (one position per example: the norms are products of norms)."""
    model = _perturb_norms(_perturb_lora(_LoraFlat(nnx.Rngs(3)), 3), 3)
    x, y = _data(5, (7,), seed=11)
    for wrt in (nnx.LoRAParam, nnx.Param):
        _check(model, x, y, wrt=wrt)
    assert per_layer_calls == []
