"""Per-example clipping, per-example gradients, and the dense-layer fast path.

References are independent of the code under test: per-example gradients from a Python
loop of ``jax.grad`` on one example at a time, and clipping recomputed in NumPy float64.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxdp.models import (
    MLP,
    LogisticRegression,
    SoftmaxRegression,
    binary_logistic_loss,
    softmax_cross_entropy_loss,
)
from jaxdp.training import (
    clip_per_example_grads,
    clipped_grad_sum,
    fast_path_supported,
    per_example_grad_norms,
    per_example_grads,
)

# The brief's agreement target for fast path vs vmap(grad), checked in float64 where the
# two paths differ only by summation order (observed ~1e-16).
PATH_TOL = 1e-6
# float32: both paths round differently in sums over ~100 terms; 1e-5 relative is ~100 ulps.
F32_TOL = 1e-5


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _loop_grads(loss_fn, model, x, y):
    """Reference per-example gradients: one jax.grad per example, in a Python loop."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    # jit once (eager op-by-op dispatch would compile every primitive separately).
    grad_one = jax.jit(jax.grad(lambda p, xi, yi: loss_fn(nnx.merge(graphdef, p, rest), xi, yi)[0]))
    out = []
    for i in range(x.shape[0]):
        g = grad_one(params, x[i:i + 1], y[i:i + 1])
        out.append([np.asarray(leaf, np.float64) for leaf in jax.tree.leaves(g)])
    return out


def _reference_clipped_sum(per_ex, clip):
    norms = np.array([math.sqrt(sum(float(np.sum(leaf**2)) for leaf in g)) for g in per_ex])
    factors = np.minimum(1.0, clip / np.where(norms > 0, norms, 1.0))
    total = [sum(f * g[j] for f, g in zip(factors, per_ex, strict=True)) for j in range(len(per_ex[0]))]
    return total, norms


# ---------------------------------------------------------------------------------------
# clip_per_example_grads
# ---------------------------------------------------------------------------------------

# XLA on CPU flushes subnormals to zero, so they are left out of the strategies.
_batch = hnp.arrays(np.float32, (6, 4), elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=False))
_batch2 = hnp.arrays(np.float32, (6, 2, 3), elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=False))


@settings(max_examples=40, deadline=None)
@given(_batch, _batch2, st.floats(1e-3, 1e3))
def test_clipping_bounds_every_norm(a, b, clip):
    clipped, norms = clip_per_example_grads({"a": jnp.asarray(a), "b": jnp.asarray(b)}, clip)
    a64, b64 = np.asarray(clipped["a"], np.float64), np.asarray(clipped["b"], np.float64)
    out_norms = np.sqrt(np.sum(a64**2, axis=1) + np.sum(b64.reshape(6, -1) ** 2, axis=1))
    # float32 rescaling rounds each entry by <= 2^-24 relative.
    assert np.all(out_norms <= clip * (1 + 4 * np.finfo(np.float32).eps))
    a_ref, b_ref = a.astype(np.float64), b.astype(np.float64).reshape(6, -1)
    ref = np.sqrt(np.sum(a_ref**2, axis=1) + np.sum(b_ref**2, axis=1))
    # Squares below float32's smallest normal (entries below ~1.1e-19) flush to 0 as well: a row of
    # ten such entries can report a norm up to ~3.5e-19 low (hypothesis found 0 for 3.0e-30).
    np.testing.assert_allclose(norms, ref, rtol=F32_TOL, atol=1e-18)
    # Examples already within the bound are untouched.
    inside = ref < clip * (1 - 1e-4)
    np.testing.assert_array_equal(np.asarray(clipped["a"])[inside], a[inside])


def test_clipping_zero_gradient_is_safe():
    g = {"w": jnp.zeros((3, 2)), "b": jnp.zeros((3,))}
    clipped, norms = clip_per_example_grads(g, 1.0)
    np.testing.assert_array_equal(norms, np.zeros(3))
    np.testing.assert_array_equal(clipped["w"], np.zeros((3, 2)))

    def f(w):
        c, n = clip_per_example_grads({"w": w}, 0.5)
        return jnp.sum(c["w"]) + jnp.sum(n)

    for w in (jnp.zeros((3, 2)), jnp.array([[0.0, 0.0], [3.0, 4.0], [0.1, 0.1]])):
        assert np.all(np.isfinite(jax.grad(f)(w)))


def test_clipping_hand_example():
    clipped, norms = clip_per_example_grads(jnp.array([[3.0, 4.0], [0.3, 0.4]]), 1.0)
    np.testing.assert_allclose(norms, [5.0, 0.5], rtol=1e-7)
    np.testing.assert_allclose(clipped, [[0.6, 0.8], [0.3, 0.4]], rtol=1e-6)


def test_clipping_validates():
    with pytest.raises(ValueError, match="clip_norm"):
        clip_per_example_grads(jnp.ones((2, 2)), 0.0)
    with pytest.raises(ValueError, match="clip_norm"):
        clipped_grad_sum(binary_logistic_loss, LogisticRegression(2, rngs=nnx.Rngs(0)),
                         (jnp.ones((2, 2)), jnp.ones(2)), -1.0)
    with pytest.raises(ValueError, match="leading batch axis"):
        clip_per_example_grads({"a": jnp.ones((2, 2)), "b": jnp.ones((3,))}, 1.0)


# ---------------------------------------------------------------------------------------
# per-example gradients and the fast path
# ---------------------------------------------------------------------------------------


def _data(key, b, d, k, dtype):
    x = jax.random.normal(jax.random.key(key), (b, d), dtype)
    y = jnp.arange(b) % k
    return x, y


def _randomise(model, scale, seed):
    """Give a (zero-initialised) model random parameters so the gradients are generic."""
    params = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [scale * jax.random.normal(k, leaf.shape, leaf.dtype) for k, leaf in zip(keys, leaves, strict=True)]
    nnx.update(model, jax.tree.unflatten(treedef, new))
    return model


CASES = {
    "mlp": (lambda dt: MLP((5, 7, 6, 3), rngs=nnx.Rngs(0), param_dtype=dt), softmax_cross_entropy_loss, 3),
    "logistic": (lambda dt: _randomise(LogisticRegression(5, rngs=nnx.Rngs(0), param_dtype=dt), 1.0, 1),
                 binary_logistic_loss, 2),
    "softmax": (lambda dt: _randomise(SoftmaxRegression(5, 4, rngs=nnx.Rngs(0), param_dtype=dt), 1.0, 2),
                softmax_cross_entropy_loss, 4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_path_equals_vmap_and_loop_float64(case, x64):
    make, loss, k = CASES[case]
    model = make(jnp.float64)
    x, y = _data(3, 9, 5, k, jnp.float64)
    assert fast_path_supported(loss, model, (x, y))
    ref_grads = _loop_grads(loss, model, x, y)
    ref_norms = np.array([math.sqrt(sum(float(np.sum(g**2)) for g in ex)) for ex in ref_grads])
    clip = float(np.median(ref_norms))  # half of the examples are clipped
    ref_sum, _ = _reference_clipped_sum(ref_grads, clip)
    fast = clipped_grad_sum(loss, model, (x, y), clip)
    slow = clipped_grad_sum(loss, model, (x, y), clip, use_fast_path=False)
    for out in (fast, slow):
        np.testing.assert_allclose(out.norms, ref_norms, rtol=PATH_TOL)
        for got, want in zip(jax.tree.leaves(out.grad_sum), ref_sum, strict=True):
            np.testing.assert_allclose(got, want, rtol=PATH_TOL, atol=PATH_TOL * 1e-3)
    for a, b in zip(jax.tree.leaves(fast.grad_sum), jax.tree.leaves(slow.grad_sum), strict=True):
        np.testing.assert_allclose(a, b, rtol=PATH_TOL, atol=1e-12)
    np.testing.assert_allclose(per_example_grad_norms(loss, model, (x, y)), ref_norms, rtol=PATH_TOL)
    # The materialised per-example gradients themselves.
    per_ex = per_example_grads(loss, model, (x, y))
    for j, leaf in enumerate(jax.tree.leaves(per_ex)):
        assert leaf.shape[0] == x.shape[0]
        for i in range(x.shape[0]):
            np.testing.assert_allclose(leaf[i], ref_grads[i][j], rtol=1e-12, atol=1e-14)


def test_fast_path_equals_vmap_float32_jitted():
    model = MLP((20, 16, 10), rngs=nnx.Rngs(1))
    x, y = _data(4, 32, 20, 10, jnp.float32)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def run(fast):
        @jax.jit
        def f(p):
            return clipped_grad_sum(softmax_cross_entropy_loss, nnx.merge(graphdef, p, rest), (x, y), 0.3,
                                    use_fast_path=fast)
        return f(params)

    fast, slow = run(True), run(False)
    assert fast.norms.dtype == jnp.float32
    np.testing.assert_allclose(fast.norms, slow.norms, rtol=F32_TOL)
    for a, b in zip(jax.tree.leaves(fast.grad_sum), jax.tree.leaves(slow.grad_sum), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=F32_TOL, atol=F32_TOL * float(jnp.max(jnp.abs(b))))


def test_pure_pytree_params():
    def loss(w, x, y):
        return 0.5 * (x @ w - y) ** 2

    x, y = jnp.eye(3), jnp.array([1.0, 2.0, 3.0])
    out = clipped_grad_sum(loss, jnp.zeros(3), (x, y), 1.5)
    np.testing.assert_allclose(out.norms, [1.0, 2.0, 3.0])
    np.testing.assert_allclose(out.grad_sum, [-1.0, -1.5, -1.5], rtol=1e-6)


class _Shared(nnx.Module):
    """One Linear applied twice: per-example norms do not factor, so no fast path."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x):
        return self.lin(jnp.tanh(self.lin(x)))


class _WithNorm(nnx.Module):
    """A LayerNorm holds parameters that are not a Linear's."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs)
        self.norm = nnx.LayerNorm(3, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.lin(x))


class _Sequence(nnx.Module):
    """A Linear applied to a 3-D input (a sequence): the fast path sums over its positions."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x):
        return self.lin(x.reshape(x.shape[0], 2, 3)).sum(axis=1)


class _Tied(nnx.Module):
    """Two Linears sharing one kernel Variable."""

    def __init__(self, rngs):
        self.a = nnx.Linear(3, 3, rngs=rngs)
        self.b = nnx.Linear(3, 3, use_bias=False, rngs=rngs)
        self.b.kernel = self.a.kernel

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


def test_layer_norm_takes_the_fast_path_per_layer(x64):
    """A LayerNorm's parameters (issue 25): per-example gradients per layer, exact, no fallback."""
    model = _WithNorm(nnx.Rngs(0))
    nnx.update(model, jax.tree.map(lambda p: p.astype(jnp.float64), nnx.state(model, nnx.Param)))
    x, y = _data(6, 5, 3, 3, jnp.float64)
    assert fast_path_supported(softmax_cross_entropy_loss, model, (x, y))
    out = clipped_grad_sum(softmax_cross_entropy_loss, model, (x, y), 0.1, use_fast_path=True)
    ref_sum, ref_norms = _reference_clipped_sum(_loop_grads(softmax_cross_entropy_loss, model, x, y), 0.1)
    np.testing.assert_allclose(out.norms, ref_norms, rtol=PATH_TOL)
    for got, want in zip(jax.tree.leaves(out.grad_sum), ref_sum, strict=True):
        np.testing.assert_allclose(got, want, rtol=PATH_TOL, atol=1e-12)


@pytest.mark.parametrize("cls,d", [(_Shared, 3), (_Tied, 3)])
def test_fallback_for_unsupported_models(cls, d, x64):
    model = cls(nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: p.astype(jnp.float64), params))
    x, y = _data(6, 5, d, 3, jnp.float64)
    assert not fast_path_supported(softmax_cross_entropy_loss, model, (x, y))
    with pytest.raises(ValueError, match="fast path"):
        clipped_grad_sum(softmax_cross_entropy_loss, model, (x, y), 0.1, use_fast_path=True)
    out = clipped_grad_sum(softmax_cross_entropy_loss, model, (x, y), 0.1)
    ref_sum, ref_norms = _reference_clipped_sum(_loop_grads(softmax_cross_entropy_loss, model, x, y), 0.1)
    np.testing.assert_allclose(out.norms, ref_norms, rtol=PATH_TOL)
    for got, want in zip(jax.tree.leaves(out.grad_sum), ref_sum, strict=True):
        np.testing.assert_allclose(got, want, rtol=PATH_TOL, atol=1e-12)


def test_linear_on_sequence_uses_fast_path(x64):
    model = _Sequence(nnx.Rngs(0))
    nnx.update(model, jax.tree.map(lambda p: p.astype(jnp.float64), nnx.state(model, nnx.Param)))
    x, y = _data(6, 5, 6, 3, jnp.float64)
    assert fast_path_supported(softmax_cross_entropy_loss, model, (x, y))
    out = clipped_grad_sum(softmax_cross_entropy_loss, model, (x, y), 0.1, use_fast_path=True)
    ref_sum, ref_norms = _reference_clipped_sum(_loop_grads(softmax_cross_entropy_loss, model, x, y), 0.1)
    np.testing.assert_allclose(out.norms, ref_norms, rtol=PATH_TOL)
    for got, want in zip(jax.tree.leaves(out.grad_sum), ref_sum, strict=True):
        np.testing.assert_allclose(got, want, rtol=PATH_TOL, atol=1e-12)


def test_model_is_not_modified():
    model = MLP((4, 3), rngs=nnx.Rngs(0))
    before = model.layers[0].dot_general
    clipped_grad_sum(softmax_cross_entropy_loss, model, _data(0, 2, 4, 3, jnp.float32), 1.0)
    assert model.layers[0].dot_general is before


def test_bad_batch():
    model = MLP((4, 3), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="leading batch axis"):
        clipped_grad_sum(softmax_cross_entropy_loss, model, (jnp.ones((3, 4)), jnp.ones(2)), 1.0)
    with pytest.raises(ValueError, match="pair"):
        clipped_grad_sum(softmax_cross_entropy_loss, model, jnp.ones((3, 4)), 1.0)
