"""PNSGD transformations against the analysed update Y ← Π(Y − η(g + Z)), computed by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxdp.models import MLP, softmax_cross_entropy_loss
from jaxdp.training import (
    AddGaussianNoiseState,
    add_gaussian_noise,
    clipped_grad_sum,
    pnsgd,
    pnsgd_noise_std,
    project_l2_ball,
    project_onto_l2_ball,
)

# float32 arithmetic: the chain (noise, scale, projection, apply_updates) rounds a few
# times, each by <= 2^-24 relative; 1e-6 leaves room for ~10 roundings.
F32_RTOL = 1e-6
# Projection: apply_updates adds params + (Π(θ+u) − θ), one more rounding than Π itself,
# so the final norm may exceed R by a few float32 ulps.
BALL_SLACK = 8 * float(np.finfo(np.float32).eps)


def _reference_noise(key, tree, std):
    """The documented key schedule, reproduced with jax.random directly."""
    next_key, noise_key = jax.random.split(key)
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(noise_key, len(leaves))
    noise = [std * np.asarray(jax.random.normal(k, leaf.shape, leaf.dtype), np.float64)
             for leaf, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(treedef, noise), next_key


def _np_project(tree, radius):
    leaves = jax.tree.leaves(tree)
    norm = math.sqrt(sum(float(np.sum(np.square(x))) for x in leaves))
    scale = min(1.0, radius / norm) if norm > 0 else 1.0
    return jax.tree.map(lambda x: x * scale, tree)


PARAMS = {"b": np.array([0.1, -0.3], np.float32), "w": np.array([[0.3, -0.2], [0.5, 0.4]], np.float32)}
GRAD = {"b": np.array([0.4, 0.2], np.float32), "w": np.array([[-0.5, 0.25], [0.1, -0.7]], np.float32)}


@pytest.mark.parametrize("radius", [0.3, 1.0, 50.0])  # projection active, mildly and not at all
@pytest.mark.parametrize("batch_size", [1, 4])
def test_pnsgd_equals_analysed_update(radius, batch_size):
    lr, nu, clip = 0.5, 1.3, 0.7
    key = jax.random.key(42)
    tx = pnsgd(lr, nu, clip, radius, key, batch_size=batch_size)
    params = jax.tree.map(jnp.asarray, PARAMS)
    state = tx.init(params)
    std = nu * 2 * clip / batch_size  # σ_Z = ν·Δ with Δ = 2C/b
    ref_key = key
    for _ in range(3):  # several steps: the key schedule must keep matching
        z, ref_key = _reference_noise(ref_key, params, std)
        y64 = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
        expected = _np_project(
            jax.tree.map(lambda y, g, n: y - lr * (np.asarray(g, np.float64) + n), y64, GRAD, z),
            radius)
        updates, state = tx.update(jax.tree.map(jnp.asarray, GRAD), state, params)
        params = optax.apply_updates(params, updates)
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
            assert got.dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=F32_RTOL, atol=1e-7)


def test_pnsgd_hand_example_without_noise():
    tx = pnsgd(0.5, noise_multiplier=0.0, clip_norm=1.0, radius=1.0, key=jax.random.key(0))
    params = {"a": jnp.array([0.0, 0.0]), "c": jnp.array([0.0])}
    grads = {"a": jnp.array([-4.0, 0.0]), "c": jnp.array([3.0])}
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    # Y − ηg = (2, 0, −1.5), norm 2.5, projected onto the unit ball: (0.8, 0, −0.6).
    np.testing.assert_allclose(new["a"], [0.8, 0.0], rtol=F32_RTOL)
    np.testing.assert_allclose(new["c"], [-0.6], rtol=F32_RTOL)


def test_noise_std_convention():
    assert pnsgd_noise_std(1.5, 2.0, 1) == pytest.approx(6.0)  # ν·2C at b = 1
    assert pnsgd_noise_std(1.5, 2.0, 8) == pytest.approx(0.75)  # ν·2C/b


@pytest.mark.parametrize("batch_size", [1, 8])
def test_pnsgd_noise_has_the_stated_std(batch_size):
    # With g = 0 and a ball too large to matter, the update is −η Z: its sample std over
    # n i.i.d. coordinates estimates σ_Z with standard error σ_Z/√(2n) (and the mean has
    # standard error σ_Z/√n). Tolerance: 5 standard errors (fixed key, so deterministic).
    n = 200_000
    lr, nu, clip = 0.1, 0.8, 1.7
    tx = pnsgd(lr, nu, clip, radius=1e6, key=jax.random.key(7), batch_size=batch_size)
    params = jnp.zeros(n, jnp.float32)
    updates, _ = tx.update(jnp.zeros(n, jnp.float32), tx.init(params), params)
    z = np.asarray(updates, np.float64) / -lr
    sigma_z = nu * 2 * clip / batch_size
    assert abs(z.std() - sigma_z) <= 5 * sigma_z / math.sqrt(2 * n)
    assert abs(z.mean()) <= 5 * sigma_z / math.sqrt(n)


def test_add_gaussian_noise_std_and_mean():
    # Same tolerance argument as above, on the raw transformation.
    n, std = 100_000, 0.37
    tx = add_gaussian_noise(std, jax.random.key(3))
    u, _ = tx.update(jnp.zeros(n), tx.init(jnp.zeros(n)))
    u = np.asarray(u, np.float64)
    assert abs(u.std() - std) <= 5 * std / math.sqrt(2 * n)
    assert abs(u.mean()) <= 5 * std / math.sqrt(n)


def test_keys_differ_every_step():
    tx = add_gaussian_noise(1.0, jax.random.key(0))
    state = tx.init(jnp.zeros(4))
    keys, noises = [jax.random.key_data(state.key)], []
    step = jax.jit(tx.update)
    for t in range(5):
        u, state = step(jnp.zeros(4), state)
        assert isinstance(state, AddGaussianNoiseState)
        assert int(state.count) == t + 1
        keys.append(jax.random.key_data(state.key))
        noises.append(np.asarray(u))
    as_tuples = {tuple(np.ravel(k).tolist()) for k in keys}
    assert len(as_tuples) == len(keys)
    for i in range(len(noises)):
        for j in range(i):
            assert not np.allclose(noises[i], noises[j])
    # The leaves of one step get different keys too.
    u, _ = tx.update({"a": jnp.zeros(4), "b": jnp.zeros(4)}, tx.init(None))
    assert not np.allclose(u["a"], u["b"])


def test_int_seed_equals_key():
    a = add_gaussian_noise(1.0, 5)
    b = add_gaussian_noise(1.0, jax.random.key(5))
    ua, _ = a.update(jnp.zeros(3), a.init(None))
    ub, _ = b.update(jnp.zeros(3), b.init(None))
    np.testing.assert_array_equal(ua, ub)


def test_dtype_is_kept():
    with jax.enable_x64(True):
        tx = pnsgd(0.1, 1.0, 1.0, 1.0, jax.random.key(0))
        for dtype in (jnp.float32, jnp.float64):
            params = {"w": jnp.ones((3,), dtype)}
            u, _ = tx.update({"w": jnp.ones((3,), dtype)}, tx.init(params), params)
            assert u["w"].dtype == dtype


_vectors = hnp.arrays(np.float32, (5,), elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=False))
_matrices = hnp.arrays(np.float32, (2, 3), elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=False))


@settings(max_examples=40, deadline=None)
@given(_vectors, _matrices, _vectors, _matrices, st.floats(1e-3, 1e3))
def test_projection_keeps_params_in_ball(p1, p2, u1, u2, radius):
    tx = project_l2_ball(radius)
    params = {"a": jnp.asarray(p1), "b": jnp.asarray(p2)}
    params = project_onto_l2_ball(params, radius)  # start inside K, as PNSGD does
    updates = {"a": jnp.asarray(u1), "b": jnp.asarray(u2)}
    new_u, _ = tx.update(updates, tx.init(params), params)
    new = optax.apply_updates(params, new_u)
    norm = math.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in jax.tree.leaves(new)))
    assert norm <= radius * (1 + BALL_SLACK)
    # Inside the ball the projection is the identity: the new params are θ + u (up to the
    # rounding of (θ + u) − θ, so compared at float32 precision relative to R).
    inner = optax.apply_updates(params, updates)
    inner_norm = math.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in jax.tree.leaves(inner)))
    if inner_norm < radius * (1 - 1e-3):
        for got, want in zip(jax.tree.leaves(new), jax.tree.leaves(inner), strict=True):
            np.testing.assert_allclose(got, want, rtol=F32_RTOL, atol=BALL_SLACK * radius)


def test_projection_at_zero_is_finite():
    out = project_onto_l2_ball({"a": jnp.zeros(3)}, 1.0)
    np.testing.assert_array_equal(out["a"], np.zeros(3))
    g = jax.grad(lambda x: jnp.sum(project_onto_l2_ball(x, 1.0)))(jnp.zeros(3))
    assert np.all(np.isfinite(g))


def test_projection_needs_params():
    tx = project_l2_ball(1.0)
    with pytest.raises(ValueError, match="params"):
        tx.update(jnp.zeros(2), tx.init(jnp.zeros(2)))
    chained = pnsgd(0.1, 1.0, 1.0, 1.0, jax.random.key(0))
    with pytest.raises(ValueError, match="params"):
        chained.update(jnp.zeros(2), chained.init(jnp.zeros(2)))


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"learning_rate": -0.1}, "learning_rate"),
        ({"learning_rate": math.nan}, "learning_rate"),
        ({"clip_norm": 0.0}, "clip_norm"),
        ({"clip_norm": -1.0}, "clip_norm"),
        ({"radius": 0.0}, "radius"),
        ({"radius": -2.0}, "radius"),
        ({"radius": math.inf}, "radius"),
        ({"noise_multiplier": -0.5}, "noise_multiplier"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"learning_rate": 0.5, "smoothness": 5.0}, "learning_rate"),  # η > 2/β = 0.4
        ({"smoothness": 0.0}, "smoothness"),
    ],
)
def test_pnsgd_rejects_bad_input(kwargs, name):
    args = {"learning_rate": 0.1, "noise_multiplier": 1.0, "clip_norm": 1.0, "radius": 1.0,
            "key": jax.random.key(0)}
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        pnsgd(**args)


def test_pnsgd_accepts_contractive_step():
    pnsgd(0.4, 1.0, 1.0, 1.0, jax.random.key(0), smoothness=5.0)  # η = 2/β exactly


def test_other_factories_validate():
    with pytest.raises(ValueError, match="noise_std"):
        add_gaussian_noise(-1.0, jax.random.key(0))
    with pytest.raises(ValueError, match="radius"):
        project_l2_ball(0.0)
    with pytest.raises(TypeError, match="key"):
        add_gaussian_noise(1.0, "seed")


def test_jit_and_eager_agree():
    tx = pnsgd(0.3, 1.0, 0.5, 0.8, jax.random.key(1), batch_size=2)
    params = jax.tree.map(jnp.asarray, PARAMS)
    grads = jax.tree.map(jnp.asarray, GRAD)
    state = tx.init(params)
    eager, _ = tx.update(grads, state, params)
    jitted, _ = jax.jit(tx.update)(grads, state, params)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(a, b, rtol=F32_RTOL, atol=1e-7)


def test_pnsgd_step_on_nnx_model():
    """Jitted PNSGD steps on an NNX model's Param state: the params end in the ball."""
    model = MLP((6, 8, 3), rngs=nnx.Rngs(0))
    b, clip, radius = 4, 1.0, 0.05
    x = jax.random.normal(jax.random.key(1), (b, 6))
    y = jnp.array([0, 1, 2, 0])
    tx = pnsgd(1.0, 1.0, clip, radius, jax.random.key(2), batch_size=b)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        m = nnx.merge(graphdef, params, rest)
        g = clipped_grad_sum(softmax_cross_entropy_loss, m, (x, y), clip).grad_sum
        g = jax.tree.map(lambda s: s / b, g)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(2):
        params, state = step(params, state)
    assert float(optax.tree.norm(params)) <= radius * (1 + BALL_SLACK)
    nnx.update(model, params)
    assert model(x).shape == (b, 3)
