"""Lipschitz layers: the rescaling of eq. 2 and the certified Lipschitz bound, against exact spectral norms.

Reference for every spectral norm: the square root of the largest eigenvalue of WᵀW from
NumPy's symmetric eigensolver in float64 (a different LAPACK routine from the SVD that
``spectral_norms`` uses).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxdp.models import LipschitzDense, LipschitzMLP, lipschitz_upper_bound, spectral_norms

# The certified norms carry a 1e-9 relative safety margin over the float64 SVD; eigvalsh of
# WᵀW in float64 has relative error ~n·2^-52 on λ (~1e-13 on sqrt(λ) for n ≤ 200). So the
# certificate may exceed the reference by the margin plus that, never by more.
EXACT_RTOL = 1e-9 + 1e-12
# Power iteration converged (200 steps from the carried vector) on these small random layers:
# the estimate is within 1e-3 relative of the top singular value.
POWER_RTOL = 1e-3


def _true_norm(w) -> float:
    w = np.asarray(w, dtype=np.float64)
    return float(np.sqrt(max(np.linalg.eigvalsh(w.T @ w)[-1], 0.0)))


def _kernels(model):
    return [np.asarray(layer.kernel[...]) for layer in model.layers]


def _train(model, steps=30, seed=0):
    """A few steps of plain SGD on a squared loss, rescaling after each step (1 power iteration)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(64, 10)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(64, 3)) * 5.0, jnp.float32)
    opt = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)
        model.rescale()
        return loss

    for _ in range(steps):
        step(model, opt)
    return model


def test_trained_network_bound_is_never_below_the_true_norms():
    model = _train(LipschitzMLP((10, 32, 32, 3), rngs=nnx.Rngs(0), max_spectral_norm=1.5))
    true = np.array([_true_norm(w) for w in _kernels(model)])
    cert = spectral_norms(model)
    assert np.all(cert >= true)
    np.testing.assert_allclose(cert, true, rtol=EXACT_RTOL)
    bound = lipschitz_upper_bound(model)
    assert bound >= np.prod(true)
    assert bound <= np.prod(true) * (1 + EXACT_RTOL) ** (len(true) + 1)
    # The training drove the weights up against the constraint: the norms are near ρ, and
    # one power iteration per step kept them within the power-iteration tolerance of ρ.
    assert np.all(true <= 1.5 * (1 + 0.05))
    model.rescale(200)
    true = np.array([_true_norm(w) for w in _kernels(model)])
    assert np.all(true <= 1.5 * (1 + POWER_RTOL))


def test_power_iteration_estimate_is_a_lower_bound():
    layer = LipschitzDense(20, 30, rngs=nnx.Rngs(3), max_spectral_norm=100.0)
    w = np.asarray(layer.kernel[...])
    true = _true_norm(w)
    for it in (1, 2, 5, 50):
        est = float(layer.estimate(it))
        assert est <= true * (1 + 1e-6)  # float32 rounding of the Rayleigh quotient
    assert est == pytest.approx(true, rel=POWER_RTOL)


def test_rescale_is_eq_2():
    layer = LipschitzDense(6, 4, rngs=nnx.Rngs(1), max_spectral_norm=10.0)
    w = np.asarray(layer.kernel[...])
    layer.kernel[...] = jnp.asarray(5.0 * w)  # norm ~5·‖w‖ < 10: untouched
    before = np.asarray(layer.kernel[...])
    lam = float(layer.rescale(100))
    if lam <= 10.0:
        np.testing.assert_array_equal(np.asarray(layer.kernel[...]), before)
    layer.kernel[...] = jnp.asarray(100.0 * w)
    lam = float(layer.rescale(100))
    np.testing.assert_allclose(np.asarray(layer.kernel[...]), 100.0 * w * (10.0 / lam), rtol=1e-6)
    assert _true_norm(np.asarray(layer.kernel[...])) == pytest.approx(10.0, rel=POWER_RTOL)


def test_empirical_lipschitz_ratio_below_bound():
    model = LipschitzMLP((8, 16, 16, 4), rngs=nnx.Rngs(2), max_spectral_norm=(2.0, 1.0, 0.5))
    bound = lipschitz_upper_bound(model)
    key1, key2 = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key1, (2000, 8))
    d = 1e-2 * jax.random.normal(key2, (2000, 8))
    ratio = jnp.linalg.norm(model(x + d) - model(x), axis=1) / jnp.linalg.norm(d, axis=1)
    assert float(ratio.max()) <= bound * (1 + 1e-5)  # float32 forward pass
    # A single linear layer attains its bound (direction of the top right singular vector).
    lin = LipschitzMLP((8, 4), rngs=nnx.Rngs(0), max_spectral_norm=3.0)
    w = np.asarray(lin.layers[0].kernel[...], dtype=np.float64)
    u = np.linalg.svd(w)[0][:, 0]
    gain = np.linalg.norm(u @ w)
    assert lipschitz_upper_bound(lin) == pytest.approx(gain, rel=1e-6)


@pytest.mark.parametrize("rho", [0.0, -1.0, math.nan, math.inf, "a"])
def test_bad_rho_is_named(rho):
    with pytest.raises(ValueError, match="max_spectral_norm"):
        LipschitzDense(3, 3, rngs=nnx.Rngs(0), max_spectral_norm=rho)
    with pytest.raises(ValueError, match="max_spectral_norm"):
        LipschitzMLP((3, 3, 3), rngs=nnx.Rngs(0), max_spectral_norm=(1.0, rho))


def test_bad_shapes_and_iterations():
    with pytest.raises(ValueError, match="max_spectral_norm"):
        LipschitzMLP((3, 3, 3), rngs=nnx.Rngs(0), max_spectral_norm=(1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="power_iterations"):
        LipschitzDense(3, 3, rngs=nnx.Rngs(0), max_spectral_norm=1.0, power_iterations=0)
    with pytest.raises(ValueError, match="LipschitzDense"):
        lipschitz_upper_bound(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


def test_nonfinite_kernel_gives_inf():
    layer = LipschitzDense(3, 3, rngs=nnx.Rngs(0), max_spectral_norm=1.0)
    layer.kernel[...] = jnp.full((3, 3), jnp.nan)
    assert lipschitz_upper_bound(layer) == math.inf
