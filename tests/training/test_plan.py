"""Planning by declaration (not by class), array-like hyper-parameters and learning-rate schedules.

References: the update with a schedule is recomputed by hand in float64 NumPy from the
documented key schedule; a schedule's reported ε is compared with direct calls of the
accountant (``pnsgd_privacy``) at the bounding constants and at every constant rate of the
schedule, never with the loop's own numbers.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxdp.accounting import pnsgd_privacy
from jaxdp.data import from_arrays
from jaxdp.models import LossConstants, SoftmaxRegression, logistic_loss_constants, squared_loss, squared_loss_constants
from jaxdp.training import add_gaussian_noise, dpsgd, plan_privacy, pnsgd, pnsgd_noise_std, train

# Same accountant, same float64 inputs: agreement to rounding.
EPS_RTOL = 1e-9
# float32 updates against a float64 reference over a few steps.
BY_HAND_RTOL = 1e-5


def _data(n=32, d=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    y = (x[:, 0] + 0.3 * rng.normal(size=n) > 0).astype(np.int32)
    return from_arrays(x, y, test_fraction=0.0)  # rows scaled to ||x|| <= 1


class LeastSquares(nnx.Module):
    """A user's model: declares its loss and constants, no jaxdp base class."""

    def __init__(self, d, rngs, radius=1.0, lipschitz=None):
        zeros = nnx.initializers.zeros_init()
        self.linear = nnx.Linear(d, 1, kernel_init=zeros, bias_init=zeros, rngs=rngs)
        self.radius, self.lipschitz = radius, lipschitz

    def __call__(self, x):
        return self.linear(x)[:, 0]

    def loss(self, x, y):
        return squared_loss(self, x, 2.0 * y - 1.0)

    def loss_constants(self, feature_norm_bound):
        c = squared_loss_constants(feature_norm_bound, label_bound=1.0, radius=self.radius)
        return c if self.lipschitz is None else c._replace(lipschitz=self.lipschitz)


class LossOnly(nnx.Module):
    """A model that declares a loss and nothing else."""

    def __init__(self, d, rngs):
        self.linear = nnx.Linear(d, 2, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)

    def loss(self, x, y):
        z = self(x)
        return jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, y[:, None], axis=-1)[:, 0]


class Bare(nnx.Module):
    def __init__(self, d, rngs):
        self.linear = nnx.Linear(d, 2, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


# ---------------------------------------------------------------------------------------
# Planning from the declaration
# ---------------------------------------------------------------------------------------


def test_user_model_gets_the_hidden_state_analysis_from_its_declaration():
    ds = _data()
    plan = plan_privacy(LeastSquares(3, nnx.Rngs(0)), ds, learning_rate=0.5, radius=1.0, batch_size=8)
    c = squared_loss_constants(1.0, 1.0, 1.0)
    assert plan.analysis == "hidden-state" and plan.convex
    assert plan.lipschitz == plan.clip_norm == c.lipschitz and plan.smoothness == c.smoothness
    assert plan.loss_fn.__qualname__ == "LeastSquares.loss" and plan.num_steps == 4
    res = train(LeastSquares(3, nnx.Rngs(0)), ds, learning_rate=0.5, noise_multiplier=1.0, radius=1.0,
                batch_size=8, passes=2, progress=False, noise_seed=0)
    led = res.state.ledger
    assert res.privacy.analysis == "hidden-state" and led.clipped == 0 and led.lipschitz == c.lipschitz
    # The report is the accountant's, called directly on the same constants.
    ref = pnsgd_privacy(lipschitz=c.lipschitz, smoothness=c.smoothness, learning_rate=0.5,
                        noise_std=pnsgd_noise_std(1.0, c.lipschitz, 8), diameter=2.0, num_records=32,
                        delta=1e-5, batch_size=8, passes=2)
    np.testing.assert_allclose(res.privacy.epsilon, np.asarray(ref.best), rtol=EPS_RTOL)


def test_constants_for_a_smaller_ball_give_composition_with_the_reason():
    plan = plan_privacy(LeastSquares(3, nnx.Rngs(0), radius=0.5), _data(), learning_rate=0.5, radius=1.0,
                        batch_size=8)
    assert plan.analysis == "composition" and "radius 1" in plan.reason and "<= 0.5" in plan.reason


def test_violated_constants_at_run_time_report_composition():
    """A declared L that is too small: C = L clips some gradient, the run is demoted, never amplified."""
    ds = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = train(LeastSquares(3, nnx.Rngs(0), lipschitz=0.05), ds, learning_rate=0.5, noise_multiplier=1.0,
                    radius=1.0, batch_size=8, passes=1, progress=False, noise_seed=0)
    assert res.state.ledger.clipped > 0
    assert res.privacy.analysis == "composition" and "exceeded the clip norm" in res.privacy.reason
    assert np.all(res.privacy.epsilon == res.privacy.composition)


def test_model_with_a_loss_only_trains_by_composition_and_dpsgd():
    ds = _data()
    plan = plan_privacy(LossOnly(3, nnx.Rngs(0)), ds, learning_rate=0.5, radius=1.0, batch_size=8, clip_norm=1.0)
    assert plan.analysis == "composition" and not plan.convex and "LossOnly" in plan.reason
    with pytest.raises(ValueError, match="clip_norm is required"):
        plan_privacy(LossOnly(3, nnx.Rngs(0)), ds, learning_rate=0.5, radius=1.0, batch_size=8)
    res = train(LossOnly(3, nnx.Rngs(0)), ds, algorithm="dpsgd", learning_rate=0.5, noise_multiplier=1.0,
                clip_norm=1.0, batch_size=8, passes=1, progress=False, noise_seed=0)
    assert res.privacy.analysis == "dpsgd" and int(res.state.step) == 4


def test_model_without_a_loss_needs_loss_fn():
    with pytest.raises(ValueError, match="loss_fn is required"):
        plan_privacy(Bare(3, nnx.Rngs(0)), _data(), learning_rate=0.5, radius=1.0, batch_size=8, clip_norm=1.0)
    plan = plan_privacy(Bare(3, nnx.Rngs(0)), _data(), learning_rate=0.5, radius=1.0, batch_size=8, clip_norm=1.0,
                        loss_fn=lambda m, x, y: LossOnly.loss(m, x, y))
    assert plan.analysis == "composition"


def test_builtin_models_plan_as_before(digits_like=None):
    ds = _data(n=64)
    plan = plan_privacy(SoftmaxRegression(3, 2, rngs=nnx.Rngs(0)), ds, learning_rate=1.0, radius=5.0, batch_size=8)
    assert plan.analysis == "hidden-state" and plan.loss_fn.__qualname__ == "SoftmaxRegression.loss"
    assert plan_privacy(SoftmaxRegression(3, 2, rngs=nnx.Rngs(0)), ds, learning_rate=1.0, radius=5.0, batch_size=8,
                        return_intermediates=True).analysis == "composition"


# ---------------------------------------------------------------------------------------
# Learning-rate schedules
# ---------------------------------------------------------------------------------------


def _ls_ref(eta, lip, *, sc=0.0, nu=1.0, c=None):
    c = squared_loss_constants(1.0, 1.0, 1.0) if c is None else c
    return np.asarray(pnsgd_privacy(lipschitz=lip, smoothness=c.smoothness, learning_rate=eta,
                                    noise_std=pnsgd_noise_std(nu, c.lipschitz, 8), diameter=2.0, num_records=32,
                                    delta=1e-5, strong_convexity=sc, batch_size=8, passes=2).best)


def test_schedule_is_accounted_at_the_bounding_constants_and_never_below_a_constant_rate():
    ds = _data()
    c = squared_loss_constants(1.0, 1.0, 1.0)
    rates = np.array([0.5, 0.4, 0.3, 0.2, 0.5, 0.4, 0.3, 0.25])  # 2 passes of 4 steps
    res = train(LeastSquares(3, nnx.Rngs(0)), ds, learning_rate=rates, noise_multiplier=1.0, radius=1.0,
                batch_size=8, passes=2, progress=False, noise_seed=0)
    led, eps = res.state.ledger, res.privacy.epsilon
    assert res.privacy.analysis == "hidden-state" and "schedule" in res.privacy.reason
    assert led.learning_rate == 0.2 and led.lipschitz == pytest.approx(c.lipschitz * 0.5 / 0.2, rel=1e-15)
    # Independent reference: the accountant at the bounding constants (eta_min, L max/min).
    np.testing.assert_allclose(eps, _ls_ref(0.2, c.lipschitz * 2.5), rtol=EPS_RTOL)
    # Never below the constant-rate epsilon of any rate of the schedule (the most favourable included).
    for eta in np.unique(rates):
        assert np.all(eps >= _ls_ref(float(eta), c.lipschitz) * (1 - EPS_RTOL))


def test_constant_schedule_equals_the_constant_rate():
    ds = _data()
    kw = dict(noise_multiplier=1.0, radius=1.0, batch_size=8, passes=2, progress=False, noise_seed=0)
    a = train(LeastSquares(3, nnx.Rngs(0)), ds, learning_rate=0.3, **kw)
    b = train(LeastSquares(3, nnx.Rngs(0)), ds, learning_rate=optax.constant_schedule(0.3), **kw)
    np.testing.assert_array_equal(a.privacy.epsilon, b.privacy.epsilon)
    for u, v in zip(jax.tree.leaves(a.state.params), jax.tree.leaves(b.state.params), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=BY_HAND_RTOL)


def test_schedule_step_above_the_rule_is_refused():
    c = squared_loss_constants(1.0, 1.0, 1.0)  # beta = 2: eta <= 1
    bad = optax.linear_schedule(0.5, 1.5, 4)  # reaches 1.5 > 2/beta
    with pytest.raises(ValueError, match="learning_rate"):
        plan_privacy(LeastSquares(3, nnx.Rngs(0)), _data(), learning_rate=bad, radius=1.0, batch_size=8, passes=2)
    with pytest.raises(ValueError, match="learning_rate"):
        plan_privacy(LeastSquares(3, nnx.Rngs(0)), _data(), learning_rate=[0.5, -0.1], radius=1.0, batch_size=8)
    assert 1.0 <= 2.0 / c.smoothness


def test_schedule_update_by_hand():
    """Y_{t+1} = Π(Y_t − η_t(g_t + Z_t)) with the per-step rates, from the documented key schedule."""
    radius, nu, b = 1.0, 0.5, 2
    rates = np.array([0.5, 0.25, 0.125])
    key = jax.random.key(3)
    tx = pnsgd(rates, nu, 1.0, radius, key, batch_size=b)
    params = jnp.zeros(2)
    state = tx.init(params)
    grads = [np.array([0.3, -0.2]), np.array([-0.1, 0.4]), np.array([0.2, 0.2])]
    y = np.zeros(2)
    k = key
    std = nu * 2 * 1.0 / b
    for t, g in enumerate(grads):
        u, state = tx.update(jnp.asarray(g, jnp.float32), state, params)
        params = optax.apply_updates(params, u)
        k, noise_key = jax.random.split(k)
        z = std * np.asarray(jax.random.normal(jax.random.split(noise_key, 1)[0], (2,), jnp.float32), np.float64)
        y = y - rates[t] * (g + z)
        y = y * min(1.0, radius / np.linalg.norm(y))
        np.testing.assert_allclose(np.asarray(params, np.float64), y, rtol=BY_HAND_RTOL, atol=1e-7)


def test_dpsgd_accepts_a_schedule():
    ds = _data()
    res = train(LossOnly(3, nnx.Rngs(0)), ds, algorithm="dpsgd", learning_rate=optax.cosine_decay_schedule(0.5, 8),
                noise_multiplier=1.0, clip_norm=1.0, batch_size=8, passes=2, progress=False, noise_seed=0)
    assert res.state.ledger.learning_rate is None and int(res.state.step) == 8
    tx = dpsgd(optax.linear_schedule(0.1, 0.0, 10), 1.0, 1.0, 8.0, jax.random.key(0))
    u, _ = tx.update(jnp.ones(3), tx.init(jnp.zeros(3)))
    assert u.shape == (3,)


# ---------------------------------------------------------------------------------------
# Array-like hyper-parameters: traced under jit, vmap and grad
# ---------------------------------------------------------------------------------------


def test_transforms_trace_their_hyper_parameters():
    params = jnp.zeros(3)
    g = jnp.array([1.0, -2.0, 0.5])

    @jax.jit
    def step(eta, nu, clip, radius):
        tx = pnsgd(eta, nu, clip, radius, jax.random.key(0), batch_size=4)
        u, _ = tx.update(g, tx.init(params), params)
        return optax.apply_updates(params, u)

    eager = pnsgd(0.1, 0.5, 1.0, 2.0, jax.random.key(0), batch_size=4)
    u, _ = eager.update(g, eager.init(params), params)
    np.testing.assert_allclose(step(0.1, 0.5, 1.0, 2.0), optax.apply_updates(params, u), rtol=1e-6)
    # One compilation serves every value (they are traced, not static).
    step(0.2, 0.7, 1.5, 3.0)
    assert step._cache_size() == 1
    # vmap over the noise std, grad through the learning rate.
    stds = jax.vmap(lambda nu: pnsgd_noise_std(nu, 1.0, 4))(jnp.array([1.0, 2.0]))
    np.testing.assert_allclose(stds, [0.5, 1.0])
    d = jax.grad(lambda eta: jnp.sum(step(eta, 0.0, 1.0, 100.0)))(0.1)
    assert d == pytest.approx(-float(jnp.sum(g)), rel=1e-6)

    @jax.jit
    def noisy(s):
        tx = add_gaussian_noise(s, jax.random.key(1))
        return tx.update(jnp.zeros(3), tx.init(jnp.zeros(3)))[0]

    assert float(jnp.abs(noisy(0.0)).max()) == 0.0 and float(jnp.abs(noisy(1.0)).max()) > 0.0

    @jax.jit
    def dp(nu, clip, b):
        tx = dpsgd(0.1, nu, clip, b, jax.random.key(0))
        return tx.update(jnp.ones(3), tx.init(jnp.zeros(3)))[0]

    assert dp(0.0, 1.0, 8.0) == pytest.approx(-0.1 / 8.0 * np.ones(3), rel=1e-6)


def test_concrete_validation_still_names_the_parameter():
    with pytest.raises(ValueError, match="noise_multiplier"):
        pnsgd_noise_std(-1.0, 1.0, 4)
    with pytest.raises(ValueError, match="learning_rate"):
        pnsgd([0.1, 0.0], 1.0, 1.0, 1.0, jax.random.key(0))
    with pytest.raises(ValueError, match="learning_rate"):
        pnsgd([0.5, 3.0], 1.0, 1.0, 1.0, jax.random.key(0), smoothness=1.0)
    assert pnsgd_noise_std(1.0, 1.0, 4) == 0.5 and isinstance(pnsgd_noise_std(1.0, 1.0, 4), float)
    assert math.isclose(LossConstants(*logistic_loss_constants(1.0)).lipschitz, math.sqrt(2.0))
