"""DP-SBCD updates against closed forms and numerical minimisation; the driver's noise and accounting."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.optimize import minimize

import jaxdp.accounting as A
from jaxdp.models import LipschitzMLP, spectral_norms
from jaxdp.training import train_dpsbcd
from jaxdp.training._dpsbcd import activation_update, preactivation_update, weight_decay_prox


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def test_weight_decay_prox_is_the_argmin():
    # Prox_{η,r}(θ) = argmin_t r(t) + ‖t − θ‖²/(2η), r = (λ/2)‖t‖²: θ/(1 + ηλ) (the paper prints
    # ηθ/(1+η) for λ = 1, which is not the argmin).
    rng = np.random.default_rng(0)
    theta = rng.normal(size=6)
    for eta, lam in ((0.01, 1.0), (0.5, 2.0), (1.0, 0.0)):
        res = minimize(lambda t, eta=eta, lam=lam: 0.5 * lam * t @ t + (t - theta) @ (t - theta) / (2 * eta),
                       np.zeros(6), tol=1e-14)
        np.testing.assert_allclose(np.asarray(weight_decay_prox(jnp.asarray(theta), eta, lam)), res.x, atol=1e-7)
    assert not np.allclose(np.asarray(weight_decay_prox(jnp.asarray(theta), 0.01, 1.0)), 0.01 * theta / 1.01)


def _eq6(a, w):
    """Eq. 6 of the paper, cases in order (a = x_{d+1} ≥ 0 as in a ReLU network)."""
    if -a <= w <= -(math.sqrt(2) - 1) * a <= 0:
        return w
    if w + a <= 0:
        return min(0.0, w)
    return 0.5 * (w + a)


def test_preactivation_update_is_the_exact_minimiser_and_eq6():
    rng = np.random.default_rng(1)
    a = np.concatenate([rng.normal(size=300) * 2, np.abs(rng.normal(size=300))])
    w = rng.normal(size=600) * 2
    got = np.asarray(preactivation_update(jnp.asarray(a), jnp.asarray(w)))
    grid = np.linspace(-8, 8, 160001)  # brute force, spacing 1e-4

    def cost(u, a, w):
        return (a - np.maximum(u, 0)) ** 2 + (u - w) ** 2

    for ai, wi, gi in zip(a, w, got):
        best = cost(grid, ai, wi).min()
        assert cost(gi, ai, wi) <= best + 1e-12
        if ai >= 0:
            assert cost(gi, ai, wi) == pytest.approx(cost(_eq6(ai, wi), ai, wi), abs=1e-12)


def test_activation_update_solves_the_least_squares_problems():
    rng = np.random.default_rng(2)
    relu_prev, u_next, w, y = rng.normal(size=(5, 4)), rng.normal(size=(5, 3)), rng.normal(size=(4, 3)), \
        rng.normal(size=(5, 3))
    got = np.asarray(activation_update(jnp.asarray(relu_prev), jnp.asarray(u_next), jnp.asarray(w)))
    gamma = 0.7
    got_last = np.asarray(activation_update(jnp.asarray(relu_prev), None, jnp.asarray(w), y=jnp.asarray(y),
                                            penalty=gamma))
    for i in range(5):  # each row: min ‖x − p‖² + ‖u − xW‖², a stacked least-squares problem
        lhs = np.vstack([np.eye(4), w.T])
        sol = np.linalg.lstsq(lhs, np.concatenate([relu_prev[i], u_next[i]]), rcond=None)[0]
        np.testing.assert_allclose(got[i], sol, rtol=1e-10, atol=1e-12)
        lhs = np.vstack([math.sqrt(gamma) * np.eye(4), w.T])  # ½‖xW − y‖² + (γ/2)‖x − p‖²
        sol = np.linalg.lstsq(lhs, np.concatenate([math.sqrt(gamma) * relu_prev[i], y[i]]), rcond=None)[0]
        np.testing.assert_allclose(got_last[i], sol, rtol=1e-10, atol=1e-12)


def _data(n=60, d=4, k=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    return x, rng.integers(0, k, size=n)


def test_noise_has_variance_2_eta_o():
    # One layer, one step, gradient clipped to ~0, ρ large: W_out − W_in = sqrt(2ηo)·Z.
    x, y = _data(n=50, d=40, k=50)
    model = LipschitzMLP((40, 50), rngs=nnx.Rngs(0), max_spectral_norm=1e6)
    w0 = np.asarray(model.layers[0].kernel[...], np.float64)
    eta, o = 0.1, 0.02
    res = train_dpsbcd(model, (x, y), learning_rate=eta, noise_temperature=[o], clip_norm=1e-30,
                       contraction=1.0, batch_size=50, delta=1e-5, noise_seed=3)
    diff = np.asarray(res.model.layers[0].kernel[...], np.float64) - w0
    std = math.sqrt(2 * eta * o)
    # 2000 entries: the sample std has relative standard error 1/sqrt(2·2000) ≈ 1.6 %; 5 SE.
    assert np.std(diff) == pytest.approx(std, rel=0.08)
    assert abs(np.mean(diff)) < 5 * std / math.sqrt(diff.size)


def test_driver_accounts_with_the_stated_constants_and_is_reproducible():
    x, y = _data()
    kw = dict(learning_rate=0.2, noise_temperature=[0.01, 0.005], clip_norm=0.5, contraction=0.99, batch_size=25,
              delta=1e-5, weight_decay=1.0, noise_seed=7)

    def run(**extra):
        model = LipschitzMLP((4, 8, 3), rngs=nnx.Rngs(0), max_spectral_norm=2.0)
        return train_dpsbcd(model, (x, y), **{**kw, **extra})

    r1, r2, r3 = run(), run(), run(noise_seed=8)
    k1 = [np.asarray(layer.kernel[...]) for layer in r1.model.layers]
    k2 = [np.asarray(layer.kernel[...]) for layer in r2.model.layers]
    k3 = [np.asarray(layer.kernel[...]) for layer in r3.model.layers]
    assert all(np.array_equal(a, b) for a, b in zip(k1, k2))
    assert not all(np.array_equal(a, b) for a, b in zip(k1, k3))
    # 60 records, batches of 25: m = 2 batches, 50 records used; S_g = 2C, L_T = 1/(1 + ηλ).
    want = A.dpsbcd_epsilon(1e-5, [0.01, 0.005], learning_rate=0.2, sensitivity=1.0, contraction=0.99,
                            prox_lipschitz=1 / 1.2, num_records=50, batch_size=25)
    # Two layers, summed: more than one layer's ε.
    assert r1.epsilon > float(want)
    s = np.full(2, 1.0)
    want2 = A.dpsbcd_epsilon(1e-5, [0.01, 0.005], learning_rate=0.2, sensitivity=s, contraction=0.99,
                             prox_lipschitz=1 / 1.2, num_records=50, batch_size=25)
    assert r1.epsilon == pytest.approx(float(want2), rel=1e-12)
    assert np.all(spectral_norms(r1.model) <= 2.0 * (1 + 0.05))
    assert set(r1._fields) == {"model", "epsilon", "delta", "event", "test_accuracy", "seconds"}


def test_driver_rejects_bad_input():
    x, y = _data()
    model = LipschitzMLP((4, 8, 3), rngs=nnx.Rngs(0), max_spectral_norm=2.0)
    kw = dict(learning_rate=0.2, noise_temperature=[0.01], clip_norm=0.5, contraction=1.0, batch_size=20,
              delta=1e-5)
    with pytest.raises(ValueError, match="noise_temperature"):
        train_dpsbcd(model, (x, y), **{**kw, "noise_temperature": [0.01 - 0.003 * k for k in range(5)]})
    with pytest.raises(ValueError, match="model"):
        train_dpsbcd(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), (x, y), **kw)
    with pytest.raises(TypeError, match="contraction"):
        train_dpsbcd(model, (x, y), **{k: v for k, v in kw.items() if k != "contraction"})
    with pytest.raises(ValueError, match="clip_norm"):
        train_dpsbcd(model, (x, y), **{**kw, "clip_norm": 0.0})
