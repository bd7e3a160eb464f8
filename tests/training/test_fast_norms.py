"""Fast per-example gradient norms for convolutions, embeddings and dense layers on sequences.

The reference is independent of the fast path: one ``jax.grad`` per example in a Python
loop, with norms and clipped sums formed in NumPy float64 (``_loop_grads`` and
``_reference_clipped_sum`` from test_clipping), and the ``vmap(grad)`` general path.
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdp.models import softmax_cross_entropy_loss
from jaxdp.training import clipped_grad_sum, fast_path_supported, per_example_grad_norms
from jaxdp.training._ghost_norms import (
    _conv_per_example_kernel_grads_grouped,
    _conv_per_example_kernel_grads_slices,
    _embed_sq_norm,
    _sq_norm_positions,
)

from .test_clipping import _loop_grads, _reference_clipped_sum

# float64: the fast and general paths differ only in summation order (observed ~1e-16).
X64_TOL = 1e-12
# float32: sums over a few hundred terms in different orders; 1e-5 relative is ~100 ulps.
F32_TOL = 1e-5
_CANONICAL = "[b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f]"  # XLA's canonical convolution form


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


class _Mixed(nnx.Module):
    """Conv (stride 2, kernel dilation 2, SAME) -> Conv (VALID) -> mean pool, plus an Embed of
    repeated (and negative) ids, a Linear on the token sequence and a Linear head."""

    def __init__(self, dtype, rngs):
        kw = {"param_dtype": dtype, "rngs": rngs}
        self.c1 = nnx.Conv(2, 4, (3, 3), strides=2, padding="SAME", kernel_dilation=2, **kw)
        self.c2 = nnx.Conv(4, 5, (3, 3), padding="VALID", use_bias=False, **kw)
        self.emb = nnx.Embed(6, 5, **kw)
        self.seq = nnx.Linear(5, 5, **kw)
        self.head = nnx.Linear(5, 3, **kw)

    def __call__(self, x):
        img = x[:, :98].reshape(-1, 7, 7, 2)
        ids = x[:, 98:].astype(jnp.int32) - 2  # in [-2, 5]: negative ids read from the end
        h = jnp.tanh(self.c2(jax.nn.relu(self.c1(img)))).mean(axis=(1, 2))
        z = jnp.tanh(self.seq(self.emb(ids) + h[:, None, :])).mean(axis=1)
        return self.head(z)


class _WideConv(nnx.Module):
    """Few output positions, many channels: the Gram (ghost-norm) branch for the conv and
    for the Linear on a 2-token sequence."""

    def __init__(self, dtype, rngs):
        kw = {"param_dtype": dtype, "rngs": rngs}
        self.conv = nnx.Conv(16, 32, (3, 3), padding="SAME", **kw)
        self.seq = nnx.Linear(48, 24, **kw)
        self.head = nnx.Linear(24, 3, use_bias=False, **kw)

    def __call__(self, x):
        h = jax.nn.relu(self.conv(x.reshape(-1, 3, 3, 16)))  # T = 9, d = 144, e = 32
        h = h.reshape(h.shape[0], 2, -1)[:, :, :48]  # (b, 2, 48)
        return self.head(jnp.tanh(self.seq(h)).sum(axis=1))


@functools.cache
def _model(model_cls, dtype):
    """One instance per class and dtype (eager initialisation is slow on a loaded CPU).

    Build float64 ones under ``jax.enable_x64``; tests only read the module."""
    return model_cls(dtype, nnx.Rngs(0))


def _as64(model):
    """A float64 copy of ``model`` (the Embed's compute dtype included)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    copy = nnx.merge(graphdef, jax.tree.map(lambda v: v.astype(jnp.float64), params), rest)
    for _, m in nnx.iter_modules(copy):
        if isinstance(m, nnx.Embed):
            m.dtype = jnp.float64
    return copy


def _inputs(model_cls, b, dtype, seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    if model_cls is _Mixed:
        img = jax.random.normal(k1, (b, 98), dtype)
        ids = jax.random.randint(k2, (b, 8), 0, 8).astype(dtype)  # 8 tokens, 8 values: repeats
        x = jnp.concatenate([img, ids], axis=1)
    else:
        x = jax.random.normal(k1, (b, 144), dtype)
    return x, jnp.arange(b) % 3


@pytest.mark.parametrize("model_cls", [_Mixed, _WideConv])
def test_fast_norms_equal_loop_reference_float64(model_cls, x64):
    model = _model(model_cls, jnp.float64)
    x, y = _inputs(model_cls, 6, jnp.float64, 1)
    loss = softmax_cross_entropy_loss
    assert fast_path_supported(loss, model, (x, y))
    ref = _loop_grads(loss, model, x, y)
    ref_norms = np.array([math.sqrt(sum(float(np.sum(g**2)) for g in ex)) for ex in ref])
    clip = float(np.median(ref_norms))
    ref_sum, _ = _reference_clipped_sum(ref, clip)
    fast = clipped_grad_sum(loss, model, (x, y), clip, use_fast_path=True)
    np.testing.assert_allclose(fast.norms, ref_norms, rtol=X64_TOL)
    np.testing.assert_allclose(per_example_grad_norms(loss, model, (x, y)), ref_norms, rtol=X64_TOL)
    for got, want in zip(jax.tree.leaves(fast.grad_sum), ref_sum, strict=True):
        np.testing.assert_allclose(got, want, rtol=X64_TOL, atol=X64_TOL * np.max(np.abs(want)))
    if model_cls is _Mixed:  # and the general path (one model is enough: its compile is slow)
        slow = clipped_grad_sum(loss, model, (x, y), clip, use_fast_path=False)
        np.testing.assert_allclose(fast.norms, slow.norms, rtol=X64_TOL)
        for got, other in zip(jax.tree.leaves(fast.grad_sum), jax.tree.leaves(slow.grad_sum), strict=True):
            np.testing.assert_allclose(got, other, rtol=X64_TOL, atol=X64_TOL * np.max(np.abs(other)))


def test_fast_norms_float32_jitted_with_mask():
    """float32 under jit with padding rows, against the float64 loop reference."""
    model = _model(_Mixed, jnp.float32)
    x, y = _inputs(_Mixed, 8, jnp.float32, 3)
    mask = np.arange(8) < 5
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(p):
        m = nnx.merge(graphdef, p, rest)
        return clipped_grad_sum(softmax_cross_entropy_loss, m, (x, y), 0.2, use_fast_path=True, mask=mask)

    fast = run(params)
    with jax.enable_x64(True):
        ref = _loop_grads(softmax_cross_entropy_loss, _as64(model), x.astype(jnp.float64), y)
    ref_sum, ref_norms = _reference_clipped_sum([g for g, keep in zip(ref, mask, strict=True) if keep], 0.2)
    assert fast.norms.dtype == jnp.float32
    np.testing.assert_allclose(fast.norms[:5], ref_norms, rtol=F32_TOL)
    for a, b in zip(jax.tree.leaves(fast.grad_sum), ref_sum, strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=F32_TOL, atol=F32_TOL * float(np.max(np.abs(b))))
    # Every convolution (the forward ones, the input and filter gradients; strided and
    # dilated here) is in XLA's canonical form: on CPU a non-canonical one inside a scan over
    # steps runs 10-25x slower. The vmap path too (lowering only: a trace, no compilation).
    # (The per-example kernel gradients of these few-channel layers use no convolution; the
    # grouped form's are checked in test_conv_per_example_kernel_grads_both_forms.)
    vmap_run = jax.jit(lambda p: clipped_grad_sum(softmax_cross_entropy_loss, nnx.merge(graphdef, p, rest), (x, y),
                                                  0.2, use_fast_path=False))
    for text in (run.lower(params).as_text(), vmap_run.lower(params).as_text()):
        dims = re.findall(r"dim_numbers = (.*?), window", text)
        assert len(dims) >= 3 and set(dims) == {_CANONICAL}, dims


def test_conv_per_example_kernel_grads_both_forms(x64):
    """Both ways of forming per-example kernel gradients (offset slices for few input
    channels, one grouped convolution otherwise) against one ``jax.grad`` per example, for a
    strided, dilated, asymmetric convolution whose three layouts all differ; the grouped
    form's convolutions in XLA's canonical form."""
    layout = ("NCHW", "OIHW", "NHWC")
    rng = np.random.default_rng(7)
    b, spatial, c_in, c_out, size, strides, dilation = 2, (7, 6), 3, 4, (3, 2), (2, 1), (2, 1)
    lhs, rhs = (b, c_in, *spatial), (c_out, c_in, *size)
    x, kernel = jnp.asarray(rng.normal(size=lhs)), jnp.asarray(rng.normal(size=rhs))
    dn = jax.lax.conv_dimension_numbers(lhs, rhs, layout)

    def conv(xi, k):
        return jax.lax.conv_general_dilated(xi, k, strides, "SAME", rhs_dilation=dilation, dimension_numbers=dn)

    delta = jnp.asarray(rng.normal(size=conv(x, kernel).shape))
    one = jax.jit(jax.grad(lambda k, xi, di: jnp.sum(conv(xi[None], k) * di[None])))  # one example's gradient
    want = np.stack([one(kernel, x[i], delta[i]) for i in range(b)])
    rec = {"inputs": x, "recorder": type("R", (), {"params": {"kernel": kernel}})(),
           "conv": {"strides": strides, "padding": "SAME", "dn": dn, "lhs_dilation": (1, 1), "rhs_dilation": dilation,
                    "filter_shape": size, "groups": (1, 1)}}
    for form in (_conv_per_example_kernel_grads_slices, _conv_per_example_kernel_grads_grouped):
        fn = jax.jit(lambda d, form=form: form(rec, d))
        np.testing.assert_allclose(fn(delta), want, rtol=X64_TOL, atol=X64_TOL * np.max(np.abs(want)))
    text = fn.lower(delta).as_text()  # the grouped form's
    assert set(re.findall(r"dim_numbers = (.*?), window", text)) == {_CANONICAL}


@pytest.mark.parametrize("t,d,e", [(1, 5, 3), (3, 2, 2), (4, 40, 30)])  # rank one, unfold, Gram
def test_sq_norm_positions_against_numpy(t, d, e, x64):
    rng = np.random.default_rng(t)
    a, g = rng.normal(size=(3, t, d)), rng.normal(size=(3, t, e))
    want = [np.sum((a[i].T @ g[i]) ** 2) for i in range(3)]
    np.testing.assert_allclose(_sq_norm_positions(jnp.asarray(a), jnp.asarray(g)), want, rtol=X64_TOL)


def test_embed_sq_norm_repeated_ids_against_numpy(x64):
    rng = np.random.default_rng(0)
    ids = np.array([[1, 1, 1, 1], [0, 2, 0, 9], [3, 2, 1, 0]])  # 9 is outside a 4-row table
    g = rng.normal(size=(3, 4, 5))
    want = []
    for i in range(3):
        table = np.zeros((4, 5))
        for t in range(4):
            if ids[i, t] < 4:
                table[ids[i, t]] += g[i, t]
        want.append(np.sum(table**2))
    np.testing.assert_allclose(_embed_sq_norm(jnp.asarray(ids), jnp.asarray(g), 4), want, rtol=X64_TOL)


class _Penalised(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 3, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


def test_parameter_used_outside_layers_cannot_escape_clipping(x64):
    """A weight penalty inside loss_fn gets no gradient on the fast path (documented), so
    every clipped term keeps norm <= C: the sum equals the penalty-free loss's clipped sum."""
    model = _Penalised(nnx.Rngs(0))
    x, y = jax.random.normal(jax.random.key(0), (5, 4), jnp.float64), jnp.arange(5) % 3

    def penalised(m, x, y):
        return softmax_cross_entropy_loss(m, x, y) + 10.0 * jnp.sum(m.lin.kernel[...] ** 2)

    fast = clipped_grad_sum(penalised, model, (x, y), 0.1, use_fast_path=True)
    plain = clipped_grad_sum(softmax_cross_entropy_loss, model, (x, y), 0.1, use_fast_path=False)
    np.testing.assert_allclose(fast.norms, plain.norms, rtol=X64_TOL)
    for a, b in zip(jax.tree.leaves(fast.grad_sum), jax.tree.leaves(plain.grad_sum), strict=True):
        np.testing.assert_allclose(a, b, rtol=X64_TOL, atol=1e-15)


class _TiedEmbed(nnx.Module):
    """Embed used twice (input table and tied output layer via attend)."""

    def __init__(self, rngs):
        self.emb = nnx.Embed(5, 3, rngs=rngs)

    def __call__(self, x):
        return self.emb.attend(self.emb(x.astype(jnp.int32)).mean(axis=1))


class _GroupedConv(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(2, 4, (3, 3), feature_group_count=2, rngs=rngs)

    def __call__(self, x):
        return self.conv(x.reshape(-1, 4, 4, 2)).mean(axis=(1, 2))[:, :3]


@pytest.mark.parametrize("cls,x", [(_TiedEmbed, jnp.array([[0, 1, 1], [2, 4, 4]])),
                                   (_GroupedConv, jnp.ones((2, 32)))])
def test_unsupported_layers_fall_back(cls, x):
    model, y = cls(nnx.Rngs(0)), jnp.array([0, 1])
    assert not fast_path_supported(softmax_cross_entropy_loss, model, (x, y))
    with pytest.raises(ValueError, match="fast path"):
        clipped_grad_sum(softmax_cross_entropy_loss, model, (x, y), 1.0, use_fast_path=True)
