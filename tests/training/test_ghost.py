"""The fast path's coverage: taken on every model the library ships, and loud where it falls back.

The fast path (``_ghost``) intercepts layers by class and flax attribute; a flax upgrade
or a new layer could turn it off. These tests pin it on the library's models (the convex
models, the MLP, the Lipschitz network, the benchmark CNN, the custom model of
``examples/16_custom_model.py``) and check that a model it cannot handle gets one warning
naming the layer type, and the right clipped sum from the general path. References are
independent of both paths: one ``jax.grad`` per example in a Python loop, norms and sums
in NumPy float64 (``_loop_grads`` and ``_reference_clipped_sum`` from test_clipping).
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdp.models import (
    MLP,
    LipschitzDense,
    LipschitzMLP,
    LogisticRegression,
    SoftmaxRegression,
    binary_logistic_loss,
    softmax_cross_entropy_loss,
    squared_loss,
)
from jaxdp.training import _clipping, _ghost, clipped_grad_sum, fast_path_supported

from .test_clipping import _loop_grads, _reference_clipped_sum

# float64: the fast path and the loop reference differ only in summation order (~1e-16).
X64_TOL = 1e-12


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


class _UserWarnings(list):
    """The ``UserWarning`` instances among the recorded warnings (not jax's or flax's deprecations)."""

    def __init__(self, caught):
        super().__init__()
        self.caught = caught

    def refresh(self):
        self[:] = [w for w in self.caught if issubclass(w.category, UserWarning)]
        return self


@pytest.fixture
def fresh_warnings():
    """Forget which fallbacks were warned about, and record every warning."""
    saved = set(_ghost._WARNED)
    _ghost._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield _UserWarnings(caught)
    _ghost._WARNED.clear()
    _ghost._WARNED.update(saved)


class _CNN(nnx.Module):
    """The CNN of ``benchmarks/dpsgd_step.py`` (two 3x3 convs, average pooling, a dense head), smaller."""

    def __init__(self, rngs, dtype=jnp.float64):
        kw = {"param_dtype": dtype, "rngs": rngs}
        self.c1 = nnx.Conv(1, 4, (3, 3), padding="SAME", **kw)
        self.c2 = nnx.Conv(4, 6, (3, 3), padding="SAME", **kw)
        self.out = nnx.Linear(2 * 2 * 6, 3, **kw)

    def __call__(self, x):
        h = nnx.avg_pool(jax.nn.relu(self.c1(x.reshape(-1, 8, 8, 1))), (2, 2), strides=(2, 2))
        h = nnx.avg_pool(jax.nn.relu(self.c2(h)), (2, 2), strides=(2, 2))
        return self.out(h.reshape(h.shape[0], -1))


class _LeastSquares(nnx.Module):
    """The custom model of ``examples/16_custom_model.py``."""

    def __init__(self, in_features, rngs):
        self.linear = nnx.Linear(in_features, 1, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)[:, 0]


class _Head(nnx.Module):
    """One LipschitzDense layer on its own."""

    def __init__(self, rngs):
        self.dense = LipschitzDense(64, 3, rngs, max_spectral_norm=1.5, param_dtype=jnp.float64)

    def __call__(self, x):
        return self.dense(x)


def _shipped(name):
    """``(model, loss_fn, labels)`` for each model the library ships or shows (float64 parameters)."""
    rngs = nnx.Rngs(0)
    f64 = {"param_dtype": jnp.float64}
    classes = lambda b: jnp.arange(b) % 3  # noqa: E731
    models = {
        "LogisticRegression": lambda: (LogisticRegression(64, rngs, **f64), binary_logistic_loss,
                                       lambda b: jnp.arange(b) % 2),
        "SoftmaxRegression": lambda: (SoftmaxRegression(64, 3, rngs, **f64), softmax_cross_entropy_loss, classes),
        "MLP": lambda: (MLP((64, 16, 3), rngs, **f64), softmax_cross_entropy_loss, classes),
        "LipschitzMLP": lambda: (LipschitzMLP((64, 16, 16, 3), rngs, max_spectral_norm=2.0, **f64),
                                 softmax_cross_entropy_loss, classes),
        "LipschitzDense": lambda: (_Head(rngs), softmax_cross_entropy_loss, classes),
        "CNN": lambda: (_CNN(rngs), softmax_cross_entropy_loss, classes),
        "LeastSquares": lambda: (_LeastSquares(64, rngs), squared_loss, lambda b: jnp.linspace(-1.0, 1.0, b)),
    }
    return models[name]()


def _batch(b, labels, seed=0):
    return jax.random.normal(jax.random.key(seed), (b, 64), jnp.float64), labels(b)


def _perturbed(model, seed=1):
    """``model`` with every parameter moved off its start (the convex models start at zero)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [v + 0.3 * jax.random.normal(k, v.shape, v.dtype) for v, k in zip(leaves, keys, strict=True)]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves), rest)


def _check_against_reference(loss, model, x, y, got):
    ref = _loop_grads(loss, model, x, y)
    norms = np.array([math.sqrt(sum(float(np.sum(g**2)) for g in ex)) for ex in ref])
    clip = float(np.median(norms))
    want, _ = _reference_clipped_sum(ref, clip)
    out = got(clip)
    np.testing.assert_allclose(out.norms, norms, rtol=X64_TOL)
    for g, w in zip(jax.tree.leaves(out.grad_sum), want, strict=True):
        np.testing.assert_allclose(g, w, rtol=X64_TOL, atol=X64_TOL * np.max(np.abs(w)))


def _spy_paths(monkeypatch):
    """Record which path ``_clipped_module`` takes (it is called fresh, not from the jit cache)."""
    taken = []
    fast, general = _clipping._fast, _clipping._vmap_clipped
    monkeypatch.setattr(_clipping, "_fast", lambda *a, **k: taken.append("fast") or fast(*a, **k))
    monkeypatch.setattr(_clipping, "_vmap_clipped", lambda *a, **k: taken.append("general") or general(*a, **k))
    return taken


def _traced_fresh(loss, model, x, y, clip):
    """``clipped_grad_sum``'s compiled program, traced anew (a new function object misses every cache)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    raw = _clipping._clipped_module.__wrapped__
    return jax.jit(lambda p, r, x, y: raw(loss, graphdef, p, r, x, y, clip, None))(params, rest, x, y)


@pytest.mark.parametrize("name", ["LogisticRegression", "SoftmaxRegression", "MLP", "LipschitzMLP",
                                  "LipschitzDense", "CNN", "LeastSquares"])
def test_fast_path_taken_on_every_shipped_model(name, fresh_warnings, monkeypatch):
    model, loss, labels = _shipped(name)
    model = _perturbed(model)
    x, y = _batch(6, labels)
    calls, why = _ghost._diagnose(loss, model, x, y)
    assert why is None and calls is not None, why
    assert fast_path_supported(loss, model, (x, y))
    taken = _spy_paths(monkeypatch)
    _traced_fresh(loss, model, x, y, 1.0)
    assert taken == ["fast"]
    # The public call, default choice: the fast path's numbers, and not a word.
    _check_against_reference(loss, model, x, y, lambda clip: clipped_grad_sum(loss, model, (x, y), clip))
    assert not fresh_warnings.refresh(), [str(w.message) for w in fresh_warnings]


def _fresh(loss_fn):
    """A new function object computing ``loss_fn``: clipped_grad_sum's jit cache (keyed on it) misses,
    so the fallback is decided, and warned about, in this test whatever ran before."""
    return lambda model, x, y: loss_fn(model, x, y)


class ScaleShift(nnx.Module):
    """An elementwise affine layer: parameters outside any layer the fast path knows."""

    def __init__(self, features):
        self.scale = nnx.Param(jnp.linspace(0.5, 1.5, features, dtype=jnp.float64))
        self.shift = nnx.Param(jnp.linspace(-0.2, 0.2, features, dtype=jnp.float64))

    def __call__(self, x):
        return x * self.scale[...] + self.shift[...]


class _WithScaleShift(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(64, 3, param_dtype=jnp.float64, rngs=rngs)
        self.affine = ScaleShift(3)

    def __call__(self, x):
        return self.affine(jnp.tanh(self.dense(x)))


def test_unsupported_layer_warns_once_with_its_type_and_clips_right(fresh_warnings):
    loss = _fresh(softmax_cross_entropy_loss)
    x, y = _batch(6, lambda b: jnp.arange(b) % 3)
    model = _WithScaleShift(nnx.Rngs(0))
    assert not fast_path_supported(loss, model, (x, y))
    assert not fresh_warnings.refresh()  # the query is silent
    _check_against_reference(loss, model, x, y, lambda clip: clipped_grad_sum(loss, model, (x, y), clip))
    # Again: eagerly with another clip norm, inside jit, on another instance, per-example norms.
    clipped_grad_sum(loss, model, (x, y), 0.1)
    jax.jit(lambda x, y: clipped_grad_sum(loss, model, (x, y), 0.5).norms)(x, y)
    clipped_grad_sum(loss, _WithScaleShift(nnx.Rngs(1)), (x[:4], y[:4]), 0.5)
    messages = [str(w.message) for w in fresh_warnings.refresh()]
    assert len(messages) == 1, messages
    assert "ScaleShift" in messages[0] and "_WithScaleShift" in messages[0], messages[0]
    assert issubclass(fresh_warnings[0].category, UserWarning)
    assert fresh_warnings[0].filename == __file__  # the caller's line, not jax's internals
    # Choosing the general path explicitly is silent; demanding the fast one names the layer.
    _ghost._WARNED.clear()
    clipped_grad_sum(loss, model, (x, y), 0.5, use_fast_path=False)
    assert len(fresh_warnings.refresh()) == 1
    with pytest.raises(ValueError, match="ScaleShift"):
        clipped_grad_sum(loss, model, (x, y), 0.5, use_fast_path=True)


class _ConvNet(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(1, 2, (3, 3), padding="SAME", param_dtype=jnp.float64, rngs=rngs)
        self.head = nnx.Linear(2 * 64, 3, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.conv(x.reshape(-1, 8, 8, 1)))
        return self.head(h.reshape(h.shape[0], -1))


def test_instrumentation_failure_warns_naming_the_layer(fresh_warnings):
    """Forward-mode autodiff inside loss_fn meets the recorded convolution's custom_vjp:
    the fast path cannot trace it, says so (naming nnx.Conv), and the general path clips right."""

    def loss(model, x, y):
        # The loss and its directional derivative along the inputs (a smoothness penalty).
        value, slope = jax.jvp(lambda x: softmax_cross_entropy_loss(model, x, y), (x,), (jnp.ones_like(x),))
        return value + 0.1 * slope**2

    x, y = _batch(5, lambda b: jnp.arange(b) % 3)
    model = _ConvNet(nnx.Rngs(0))
    _check_against_reference(loss, model, x, y, lambda clip: clipped_grad_sum(loss, model, (x, y), clip))
    messages = [str(w.message) for w in fresh_warnings.refresh()]
    assert len(messages) == 1, messages
    assert "nnx.Conv at 'conv'" in messages[0] and "NotImplementedError" in messages[0], messages[0]


def test_flax_layer_no_longer_calling_its_primitive_is_loud(fresh_warnings, monkeypatch):
    """A flax version whose nnx.Linear stops calling ``self.dot_general`` (what the fast path
    intercepts) turns the fast path off with a warning, not silently."""
    monkeypatch.setattr(nnx.Linear, "__call__", lambda self, x: x @ self.kernel[...] + self.bias[...])
    x, y = _batch(4, lambda b: jnp.arange(b) % 3)
    model = MLP((64, 8, 3), nnx.Rngs(0), param_dtype=jnp.float64)
    loss = _fresh(softmax_cross_entropy_loss)
    _check_against_reference(loss, model, x, y, lambda clip: clipped_grad_sum(loss, model, (x, y), clip))
    messages = [str(w.message) for w in fresh_warnings.refresh()]
    assert len(messages) == 1 and "nnx.Linear at 'layers/0', not applied" in messages[0], messages


def test_caller_errors_raise_not_fall_back(fresh_warnings):
    """A bug in loss_fn is raised as it is (not taken for an unsupported layer, no warning)."""

    def broken(model, x, y):
        return softmax_cross_entropy_loss(model, x, y) + jnp.ones((x.shape[0] + 1,))  # shapes differ

    x, y = _batch(4, lambda b: jnp.arange(b) % 3)
    model = MLP((64, 8, 3), nnx.Rngs(0), param_dtype=jnp.float64)
    with pytest.raises((TypeError, ValueError), match="shapes|broadcast"):
        clipped_grad_sum(broken, model, (x, y), 1.0)
    assert not fresh_warnings.refresh(), [str(w.message) for w in fresh_warnings]


@pytest.mark.parametrize("case", ["shared", "tied", "unused", "attend"])
def test_other_fallbacks_name_the_layer(case, fresh_warnings):
    rngs = nnx.Rngs(0)

    class Net(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(64, 64, param_dtype=jnp.float64, rngs=rngs)
            self.b = nnx.Linear(64, 3, param_dtype=jnp.float64, rngs=rngs)
            self.emb = nnx.Embed(4, 64, param_dtype=jnp.float64, rngs=rngs) if case == "attend" else None
            if case == "tied":
                self.c = nnx.Linear(64, 64, param_dtype=jnp.float64, rngs=rngs)
                self.c.kernel = self.a.kernel

        def __call__(self, x):
            h = jnp.tanh(self.a(x))
            if case == "shared":
                h = jnp.tanh(self.a(h))
            if case == "tied":
                h = jnp.tanh(self.c(h))
            if case == "attend":
                h = h + self.emb.attend(h)[:, :1]
            return self.b(h) if case != "unused" else h[:, :3]

    want = {"shared": "nnx.Linear at 'a', applied 2 times", "tied": "nnx.Linear at 'a' and nnx.Linear at 'c'",
            "unused": "nnx.Linear at 'b', not applied", "attend": "nnx.Embed at 'emb' is used through Embed.attend"}
    x, y = _batch(4, lambda b: jnp.arange(b) % 3)
    model = Net()
    loss = _fresh(softmax_cross_entropy_loss)
    why = _ghost._diagnose(loss, model, x, y)[1]
    assert why is not None and want[case] in why, why
    if case == "unused":
        return  # a parameter without gradient: the general path's result is the plain one
    _check_against_reference(loss, model, x, y, lambda clip: clipped_grad_sum(loss, model, (x, y), clip))
    messages = [str(w.message) for w in fresh_warnings.refresh()]
    assert len(messages) == 1 and want[case] in messages[0], messages
