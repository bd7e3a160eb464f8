"""Models: shapes, flags, losses against closed forms, and the Lipschitz/smoothness bounds.

The bounds are checked empirically: per-example gradient norms and Hessian eigenvalues on
random parameters and random features with ‖x‖ ≤ X never exceed the stated constants, and
adversarial constructions come close to them (so the constants are not loose).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.flatten_util import ravel_pytree
from scipy.special import logsumexp

from jaxdp.models import (
    MLP,
    LogisticRegression,
    SoftmaxRegression,
    binary_logistic_loss,
    logistic_loss_constants,
    softmax_cross_entropy_loss,
    softmax_loss_constants,
)

# float64 gradients: the bound must hold up to rounding (~1e-15 relative); 1e-9 is loose.
BOUND_RTOL = 1e-9


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _flat_loss(model, loss_fn, x, y):
    """Loss of one example as a function of the flattened parameter vector."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    flat, unravel = ravel_pytree(params)

    def f(theta):
        return loss_fn(nnx.merge(graphdef, unravel(theta), rest), x[None], y[None])[0]

    return f, flat


def _random_features(key, n, d, bound):
    """Rows with norms spread over [0, X], half of them exactly on the sphere ‖x‖ = X."""
    k1, k2 = jax.random.split(key)
    x = jax.random.normal(k1, (n, d), jnp.float64)
    x = x / jnp.linalg.norm(x, axis=1, keepdims=True)
    radii = jnp.where(jnp.arange(n) % 2 == 0, 1.0, jax.random.uniform(k2, (n,), jnp.float64))
    return np.asarray(x * radii[:, None] * bound)


def test_shapes_flags_and_zero_init():
    x = jnp.ones((5, 4))
    logit = LogisticRegression(4, rngs=nnx.Rngs(0))
    soft = SoftmaxRegression(4, 3, rngs=nnx.Rngs(0))
    mlp = MLP((4, 8, 3), rngs=nnx.Rngs(0))
    assert logit(x).shape == (5,)
    assert soft(x).shape == (5, 3)
    assert mlp(x).shape == (5, 3)
    assert LogisticRegression.is_convex and SoftmaxRegression.is_convex and not MLP.is_convex
    assert logit.is_convex and not mlp.is_convex
    for m in (logit, soft):  # data-independent start at the centre of every ball
        assert all(float(jnp.max(jnp.abs(p))) == 0.0 for p in jax.tree.leaves(nnx.state(m, nnx.Param)))
    assert logit.loss_constants(2.0) == logistic_loss_constants(2.0)
    assert soft.loss_constants(2.0) == softmax_loss_constants(2.0)


def test_param_dtype_is_kept():
    m = SoftmaxRegression(4, 3, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
    assert m.linear.kernel[...].dtype == jnp.float64
    m32 = MLP((4, 3), rngs=nnx.Rngs(0))
    assert m32.layers[0].kernel[...].dtype == jnp.float32


def test_bad_construction():
    with pytest.raises(ValueError, match="num_classes"):
        SoftmaxRegression(4, 1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="features"):
        MLP((4,), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="feature_norm_bound"):
        logistic_loss_constants(-1.0)
    with pytest.raises(ValueError, match="feature_norm_bound"):
        softmax_loss_constants(math.nan)


def test_constants_closed_form():
    assert logistic_loss_constants(3.0)[:2] == pytest.approx((math.sqrt(10.0), 2.5))
    assert softmax_loss_constants(3.0)[:2] == pytest.approx((math.sqrt(20.0), 5.0))
    assert softmax_loss_constants(0.0)[:2] == pytest.approx((math.sqrt(2.0), 0.5))
    # Convex, rho = 0, valid for every theta.
    assert logistic_loss_constants(3.0)[2:] == (0.0, True, math.inf)
    assert softmax_loss_constants(3.0)[2:] == (0.0, True, math.inf)


def test_losses_match_closed_forms():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 4))
    y2 = rng.integers(0, 2, 7)
    y3 = rng.integers(0, 3, 7)
    logit = LogisticRegression(4, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
    w, b = rng.normal(size=(4, 1)) * 3, rng.normal(size=(1,))
    nnx.update(logit, {"linear": {"kernel": jnp.asarray(w), "bias": jnp.asarray(b)}})
    z = x @ w[:, 0] + b[0]
    ref = np.logaddexp(0.0, z) - y2 * z  # log(1 + e^z) − y z
    np.testing.assert_allclose(binary_logistic_loss(logit, jnp.asarray(x), jnp.asarray(y2)), ref, rtol=1e-12)
    soft = SoftmaxRegression(4, 3, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
    W, c = rng.normal(size=(4, 3)) * 3, rng.normal(size=(3,))
    nnx.update(soft, {"linear": {"kernel": jnp.asarray(W), "bias": jnp.asarray(c)}})
    z = x @ W + c
    ref = logsumexp(z, axis=1) - z[np.arange(7), y3]
    got = softmax_cross_entropy_loss(soft, jnp.asarray(x), jnp.asarray(y3))
    np.testing.assert_allclose(got, ref, rtol=1e-12)
    # Stable for huge logits.
    big = binary_logistic_loss(lambda _: jnp.array([800.0, -800.0]), None, jnp.array([0, 1]))
    np.testing.assert_allclose(big, [800.0, 800.0])


def _grad_norms(model, loss_fn, x, y):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def one(p, xi, yi):
        return loss_fn(nnx.merge(graphdef, p, rest), xi[None], yi[None])[0]

    g = jax.jit(jax.vmap(jax.grad(one), in_axes=(None, 0, 0)))(params, jnp.asarray(x), jnp.asarray(y))
    sq = sum(jnp.sum(leaf.reshape(leaf.shape[0], -1) ** 2, axis=1) for leaf in jax.tree.leaves(g))
    return np.sqrt(np.asarray(sq))


@pytest.mark.parametrize("bound", [0.5, 4.0])
def test_lipschitz_bound_holds_on_random_data(bound):
    n, d, k = 400, 6, 4
    key = jax.random.key(int(bound * 10))
    x = _random_features(key, n, d, bound)
    y2 = np.arange(n) % 2
    yk = np.arange(n) % k
    for scale in (0.0, 1.0, 30.0):  # at the start, generic, and saturated parameters
        logit = LogisticRegression(d, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
        soft = SoftmaxRegression(d, k, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
        for m, seed in ((logit, 1), (soft, 2)):
            params = nnx.state(m, nnx.Param)
            leaves, treedef = jax.tree.flatten(params)
            keys = jax.random.split(jax.random.key(seed), len(leaves))
            new = [scale * jax.random.normal(kk, leaf.shape, leaf.dtype)
                   for kk, leaf in zip(keys, leaves, strict=True)]
            nnx.update(m, jax.tree.unflatten(treedef, new))
        lg = _grad_norms(logit, binary_logistic_loss, x, y2)
        sg = _grad_norms(soft, softmax_cross_entropy_loss, x, yk)
        assert lg.max() <= logistic_loss_constants(bound).lipschitz * (1 + BOUND_RTOL)
        assert sg.max() <= softmax_loss_constants(bound).lipschitz * (1 + BOUND_RTOL)


def test_lipschitz_bounds_are_nearly_attained():
    bound, d, k = 2.0, 3, 3
    x = np.array([[bound, 0.0, 0.0]])
    # Logistic: a confidently wrong prediction, |p − y| → 1.
    logit = LogisticRegression(d, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
    nnx.update(logit, {"linear": {"kernel": jnp.array([[20.0], [0.0], [0.0]]), "bias": jnp.array([20.0])}})
    g = _grad_norms(logit, binary_logistic_loss, x, np.array([0]))[0]
    assert g == pytest.approx(logistic_loss_constants(bound).lipschitz, rel=1e-6)
    # Softmax: all the mass on one wrong class, ‖p − e_y‖² → 2.
    soft = SoftmaxRegression(d, k, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
    nnx.update(soft, {"linear": {"kernel": jnp.zeros((d, k)), "bias": jnp.array([0.0, 40.0, 0.0])}})
    g = _grad_norms(soft, softmax_cross_entropy_loss, x, np.array([0]))[0]
    assert g == pytest.approx(softmax_loss_constants(bound).lipschitz, rel=1e-6)


def _max_min_hessian_eig(model, loss_fn, x, y):
    f, flat = _flat_loss(model, loss_fn, jnp.asarray(x), jnp.asarray(y))
    eig = np.linalg.eigvalsh(np.asarray(jax.jit(jax.hessian(f))(flat)))
    return eig.max(), eig.min()


def test_smoothness_and_convexity_on_random_points():
    bound, d, k = 1.5, 3, 3
    rng = np.random.default_rng(1)
    beta_l = logistic_loss_constants(bound).smoothness
    beta_s = softmax_loss_constants(bound).smoothness
    for trial in range(4):
        x = _random_features(jax.random.key(trial), 1, d, bound)
        logit = LogisticRegression(d, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
        soft = SoftmaxRegression(d, k, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
        nnx.update(logit, {"linear": {"kernel": jnp.asarray(rng.normal(size=(d, 1))),
                                      "bias": jnp.asarray(rng.normal(size=(1,)))}})
        nnx.update(soft, {"linear": {"kernel": jnp.asarray(rng.normal(size=(d, k))),
                                     "bias": jnp.asarray(rng.normal(size=(k,)))}})
        hi, lo = _max_min_hessian_eig(logit, binary_logistic_loss, x, np.array([trial % 2]))
        assert lo >= -1e-12 and hi <= beta_l * (1 + BOUND_RTOL)
        hi, lo = _max_min_hessian_eig(soft, softmax_cross_entropy_loss, x, np.array([trial % k]))
        assert lo >= -1e-12 and hi <= beta_s * (1 + BOUND_RTOL)


def test_smoothness_bounds_are_attained():
    bound, d, k = 1.5, 3, 3
    x = np.array([[bound, 0.0, 0.0]])
    # p = 1/2 maximises p(1 − p) = 1/4; logits zero at the (zero) start.
    logit = LogisticRegression(d, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
    hi, _ = _max_min_hessian_eig(logit, binary_logistic_loss, x, np.array([1]))
    assert hi == pytest.approx(logistic_loss_constants(bound).smoothness, rel=1e-9)
    # p = (1/2, 1/2, 0): the logit Hessian has eigenvalue 1/2.
    soft = SoftmaxRegression(d, k, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
    nnx.update(soft, {"linear": {"kernel": jnp.zeros((d, k)), "bias": jnp.array([0.0, 0.0, -60.0])}})
    hi, _ = _max_min_hessian_eig(soft, softmax_cross_entropy_loss, x, np.array([0]))
    assert hi == pytest.approx(softmax_loss_constants(bound).smoothness, rel=1e-9)
