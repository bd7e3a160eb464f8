"""The formulas of docs/lipschitz_constants.md, checked numerically (never against themselves).

Each loss is written here again as a plain function of the flat parameter vector
θ = (w, b) and one example, differentiated by JAX: over random points of the admissible
domain (features with ‖x‖ ≤ X, labels in range, ‖θ‖ ≤ R where the constants need it) the
largest gradient norm and Hessian eigenvalue never exceed the formula, the smallest
eigenvalue is ≥ 0 (convexity), and adversarial points reach the formula (so it is tight).
The user models of the protocol are checked to train under the analysis they declare.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp.models import (
    HiddenStateModel,
    LogisticRegression,
    LossConstants,
    logistic_loss_constants,
    softmax_loss_constants,
    squared_loss,
    squared_loss_constants,
)

# float64 derivatives: the bound must hold up to rounding (~1e-15 relative); 1e-9 is loose.
BOUND_RTOL = 1e-9
# The adversarial points attain the bound in a limit; 1e-6 relative is reached at the chosen scales.
TIGHT_RTOL = 1e-6
SAMPLES = 200


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _logistic(theta, x, y):
    z = theta[:-1] @ x + theta[-1]
    return jnp.logaddexp(0.0, z) - y * z


def _softmax(theta, x, y, k):
    w = theta[:-k].reshape(x.shape[0], k)
    z = x @ w + theta[-k:]
    return jax.scipy.special.logsumexp(z) - z[y]


def _squared(theta, x, y):
    return 0.5 * (theta[:-1] @ x + theta[-1] - y) ** 2


def _sup(loss, thetas, xs, ys):
    g = jax.vmap(jax.grad(loss))(thetas, xs, ys)
    h = jax.vmap(jax.hessian(loss))(thetas, xs, ys)
    eig = np.linalg.eigvalsh(np.asarray(h))
    return float(np.max(np.linalg.norm(np.asarray(g), axis=1))), float(eig.max()), float(eig.min())


def _ball(key, n, d, radius):
    """Points of the ball of radius `radius` in R^d, half of them on its sphere."""
    k1, k2 = jax.random.split(key)
    v = jax.random.normal(k1, (n, d), jnp.float64)
    v = v / jnp.linalg.norm(v, axis=1, keepdims=True)
    r = jnp.where(jnp.arange(n) % 2 == 0, 1.0, jax.random.uniform(k2, (n,), jnp.float64) ** (1.0 / d))
    return v * (r * radius)[:, None]


@pytest.mark.parametrize("bound", [0.5, 1.0, 3.0])
def test_logistic_formula_bounds_random_points(bound):
    d = 3
    k = jax.random.split(jax.random.key(1), 3)
    xs = _ball(k[0], SAMPLES, d, bound)
    thetas = 5.0 * jax.random.normal(k[1], (SAMPLES, d + 1), jnp.float64)  # any θ: no ball needed
    ys = jax.random.bernoulli(k[2], 0.5, (SAMPLES,)).astype(jnp.float64)
    g, hi, lo = _sup(_logistic, thetas, xs, ys)
    c = logistic_loss_constants(bound)
    assert g <= c.lipschitz * (1 + BOUND_RTOL) and hi <= c.smoothness * (1 + BOUND_RTOL) and lo >= -1e-12
    # Closed forms of the docs, by hand.
    assert c.lipschitz == pytest.approx(math.sqrt(bound**2 + 1), rel=1e-15)
    assert c.smoothness == pytest.approx((bound**2 + 1) / 4, rel=1e-15)
    # Tight: a confidently wrong prediction (|p − y| → 1) and z = 0 (p(1 − p) = 1/4), x on the sphere.
    x = jnp.array([bound, 0.0, 0.0])
    g_adv = float(jnp.linalg.norm(jax.grad(_logistic)(jnp.array([40.0 / max(bound, 1e-3), 0, 0, 40.0]), x, 0.0)))
    h_adv = float(np.linalg.eigvalsh(np.asarray(jax.hessian(_logistic)(jnp.zeros(d + 1), x, 1.0))).max())
    assert g_adv == pytest.approx(c.lipschitz, rel=TIGHT_RTOL)
    assert h_adv == pytest.approx(c.smoothness, rel=TIGHT_RTOL)


@pytest.mark.parametrize("bound", [0.0, 1.0, 2.0])
def test_softmax_formula_bounds_random_points(bound):
    d, k = 3, 4
    keys = jax.random.split(jax.random.key(2), 3)
    xs = _ball(keys[0], SAMPLES, d, bound)
    thetas = 4.0 * jax.random.normal(keys[1], (SAMPLES, d * k + k), jnp.float64)
    ys = jax.random.randint(keys[2], (SAMPLES,), 0, k)
    g, hi, lo = _sup(lambda t, x, y: _softmax(t, x, y, k), thetas, xs, ys)
    c = softmax_loss_constants(bound)
    assert g <= c.lipschitz * (1 + BOUND_RTOL) and hi <= c.smoothness * (1 + BOUND_RTOL) and lo >= -1e-12
    assert c.lipschitz == pytest.approx(math.sqrt(2 * (bound**2 + 1)), rel=1e-15)
    assert c.smoothness == pytest.approx((bound**2 + 1) / 2, rel=1e-15)
    # Tight: all the mass on a wrong class; p = (1/2, 1/2, 0, 0).
    x = jnp.array([bound, 0.0, 0.0])
    t_wrong = jnp.zeros(d * k + k).at[d * k + 1].set(60.0)
    t_half = jnp.zeros(d * k + k).at[d * k + 2:].set(-80.0)
    f = lambda t, y: _softmax(t, x, y, k)  # noqa: E731
    assert float(jnp.linalg.norm(jax.grad(f)(t_wrong, 0))) == pytest.approx(c.lipschitz, rel=TIGHT_RTOL)
    assert float(np.linalg.eigvalsh(np.asarray(jax.hessian(f)(t_half, 0))).max()) == pytest.approx(
        c.smoothness, rel=TIGHT_RTOL)


@pytest.mark.parametrize("bound,label_bound,radius", [(1.0, 1.0, 1.0), (0.5, 2.0, 3.0), (2.0, 0.0, 0.5)])
def test_squared_formula_bounds_random_points(bound, label_bound, radius):
    d = 3
    keys = jax.random.split(jax.random.key(3), 3)
    xs = _ball(keys[0], SAMPLES, d, bound)
    thetas = _ball(keys[1], SAMPLES, d + 1, radius)  # the constants hold on ‖θ‖ ≤ R only
    ys = label_bound * jax.random.uniform(keys[2], (SAMPLES,), jnp.float64, -1.0, 1.0)
    g, hi, lo = _sup(_squared, thetas, xs, ys)
    c = squared_loss_constants(bound, label_bound=label_bound, radius=radius)
    assert g <= c.lipschitz * (1 + BOUND_RTOL) and hi <= c.smoothness * (1 + BOUND_RTOL) and lo >= -1e-12
    s = bound**2 + 1
    assert c.lipschitz == pytest.approx((radius * math.sqrt(s) + label_bound) * math.sqrt(s), rel=1e-15)
    assert c.smoothness == pytest.approx(s, rel=1e-15) and c.radius == radius and c.strong_convexity == 0.0
    # Tight: x on the sphere, θ = −R x̃/‖x̃‖, y = Y.
    x = jnp.array([bound, 0.0, 0.0])
    xt = jnp.array([bound, 0.0, 0.0, 1.0])
    theta = -radius * xt / jnp.linalg.norm(xt)
    assert float(jnp.linalg.norm(jax.grad(_squared)(theta, x, label_bound))) == pytest.approx(
        c.lipschitz, rel=TIGHT_RTOL)
    assert float(np.linalg.eigvalsh(np.asarray(jax.hessian(_squared)(theta, x, 0.0))).max()) == pytest.approx(
        c.smoothness, rel=TIGHT_RTOL)


def test_squared_loss_outside_the_ball_exceeds_the_constants():
    """Why the constants state a radius: beyond it the gradient norm grows past L."""
    c = squared_loss_constants(1.0, label_bound=1.0, radius=1.0)
    x = jnp.array([1.0, 0.0])
    theta = -3.0 * jnp.array([1.0, 0.0, 1.0]) / math.sqrt(2.0)  # norm 3 > R = 1
    assert float(jnp.linalg.norm(jax.grad(_squared)(theta, x, 1.0))) > c.lipschitz


def test_squared_loss_function_matches_closed_form():
    out = squared_loss(lambda x: x @ jnp.array([2.0, -1.0]), jnp.array([[1.0, 1.0], [0.0, 3.0]]), jnp.array([0.5, 1.0]))
    np.testing.assert_allclose(np.asarray(out), [0.5 * 0.5**2, 0.5 * 4.0**2], rtol=1e-15)


def test_squared_constants_validate():
    with pytest.raises(ValueError, match="label_bound"):
        squared_loss_constants(1.0, label_bound=-1.0, radius=1.0)
    with pytest.raises(ValueError, match="radius"):
        squared_loss_constants(1.0, label_bound=1.0, radius=0.0)


def test_protocol_is_structural():
    class Declares:
        def loss(self, x, y):
            return x

        def loss_constants(self, feature_norm_bound):
            return LossConstants(1.0, 1.0)

    class LossOnly:
        def loss(self, x, y):
            return x

    assert isinstance(Declares(), HiddenStateModel) and not isinstance(LossOnly(), HiddenStateModel)
    from flax import nnx

    assert isinstance(LogisticRegression(2, rngs=nnx.Rngs(0)), HiddenStateModel)
    assert LossConstants(1.0, 2.0) == (1.0, 2.0, 0.0, True, math.inf)
