"""Balls-in-bins / random allocation (jaxdp/accounting/_allocation.py).

References, none of them jaxdp: the remove direction's moment by brute force over ordered
compositions in mpmath (t ≤ 4); both directions at t = 2 by an mpmath quadrature of the
densities (rotated so that it is one-dimensional); the Gaussian mechanism's closed form at
t = 1; a Monte Carlo estimate of E[S^{-1}] with its confidence bound for larger t; and the
hockey-stick divergence of the privacy-loss random variable by Monte Carlo, whose 99 %
lower confidence bound must not exceed the δ the accountant certifies at its ε.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdp.accounting as A
from tests.references import allocation_k_remove_moment, allocation_remove_moment, allocation_renyi_t2

# Rounding of the float64 series powering: the remove direction is exact up to this.
EXACT_RTOL = 1e-11
EXACT_ATOL = 2e-11  # the 1e-11 margin on log M, over α − 1 ≥ 1
# Slack of the add-direction quadrature seen on these grids (its cells are bounded from
# above, so it is never below the exact value; it may exceed it by up to ~4 %).
ADD_SLACK = 0.05


def _rdp(orders, t, sigma, direction):
    return np.asarray(A.random_allocation_rdp(orders, t, sigma, direction=direction))


# =======================================================================================
# Exact references.
# =======================================================================================


@pytest.mark.parametrize("sigma", [0.6, 1.0, 2.5])
def test_t1_is_the_gaussian_mechanism(sigma):
    orders = np.array([1.25, 2.0, 3.5, 10.0, 64.0, 256.0])
    for direction in ("remove", "add", "both"):
        np.testing.assert_allclose(_rdp(orders, 1, sigma, direction), orders / (2 * sigma**2), rtol=1e-14)
    ev = A.balls_in_bins_event(sigma, 1, 7)
    assert float(A.epsilon(ev, 1e-5)) == float(A.epsilon(A.SelfComposed(A.Gaussian(sigma), 7), 1e-5))


@pytest.mark.parametrize("t", [2, 3, 4])
@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0])
def test_remove_direction_is_exact_at_integer_orders(t, sigma):
    alphas = [2, 3, 5, 8, 12]
    mine = _rdp(np.array(alphas, dtype=float), t, sigma, "remove")
    ref = np.array([allocation_remove_moment(t, sigma, a) / (a - 1) for a in alphas])
    np.testing.assert_allclose(mine, ref, rtol=EXACT_RTOL, atol=EXACT_ATOL)
    assert np.all(mine >= ref)  # the margin puts rounding on the safe side


@pytest.mark.parametrize("sigma", [0.7, 1.0, 2.0])
def test_t2_both_directions_against_quadrature(sigma):
    ints = np.array([2.0, 3.0, 6.0])
    rem = _rdp(ints, 2, sigma, "remove")
    np.testing.assert_allclose(rem, [allocation_renyi_t2(a, sigma, "remove") for a in ints], rtol=1e-10)
    orders = np.array([1.5, 2.0, 3.0, 4.5, 8.0])
    add = _rdp(orders, 2, sigma, "add")
    ref = np.array([allocation_renyi_t2(a, sigma, "add") for a in orders])
    assert np.all(add >= ref), (add, ref)
    assert np.all(add <= ref * (1 + ADD_SLACK)), (add / ref)


@pytest.mark.parametrize("t, alphas", [(2, [64, 200, 256]), (3, [30, 48])])
def test_remove_direction_is_exact_at_high_orders(t, alphas):
    mine = _rdp(np.array(alphas, dtype=float), t, 1.5, "remove")
    ref = np.array([allocation_remove_moment(t, 1.5, a) / (a - 1) for a in alphas])
    np.testing.assert_allclose(mine, ref, rtol=EXACT_RTOL, atol=EXACT_ATOL)
    assert np.all(mine >= ref)


def test_fractional_orders_use_the_next_integer():
    r = _rdp(np.array([2.5, 3.0]), 3, 1.0, "remove")
    assert r[0] == r[1]


def test_add_direction_above_a_monte_carlo_confidence_bound():
    """E[S^{-1}] (order 2) at t = 10 and 50: the certified bound is above the MC mean's lower confidence bound."""
    rng = np.random.default_rng(7)
    n = 200_000
    for t, sigma in ((10, 1.0), (50, 0.8)):
        z = rng.standard_normal((n, t))
        inv = 1.0 / np.exp(z / sigma - 0.5 / sigma**2).mean(axis=1)
        lo = inv.mean() - 3.3 * inv.std() / math.sqrt(n)  # 99.95 % one-sided (CLT; S^{-1} has all moments)
        bound = float(_rdp(np.array([2.0]), t, sigma, "add")[0])
        assert bound >= math.log(lo)
        assert bound <= math.log(inv.mean()) * (1 + ADD_SLACK) + 1e-4


def test_allocation_is_no_worse_than_poisson_as_t_grows():
    """At t = 1000 steps per pass the balls-in-bins ε is within 5 % of (here below) Poisson at q = 1/t.

    Same σ, same number of steps t·passes, δ = 1e-5; at t = 10 it may exceed Poisson.
    """
    for sigma, passes in ((0.8, 5), (1.0, 20), (2.0, 50)):
        alloc = float(A.epsilon(A.balls_in_bins_event(sigma, 1000, passes), 1e-5))
        poisson = float(A.dpsgd_epsilon(1e-3, sigma, 1000 * passes, 1e-5))
        assert alloc <= 1.05 * poisson, (sigma, alloc, poisson)
        assert alloc >= 0.5 * poisson, (sigma, alloc, poisson)


# =======================================================================================
# Monte Carlo lower bounds on the hockey-stick divergence.
# =======================================================================================


def _mc_delta_lower(sigma, t, passes, eps, n, rng, direction, confidence=0.99):
    """A lower confidence bound on δ(ε) = E[(1 − e^{ε − L})_+] of the privacy-loss variable L.

    L sums over passes the log density ratio of one epoch, drawn under P (remove: the
    record in step 1, WLOG by symmetry) or Q (add). Each term is in [0, 1]; the bound is
    the empirical-Bernstein lower bound of Maurer & Pontil (2009), Theorem 4.
    """
    loss = np.zeros(n)
    for _ in range(passes):
        x = sigma * rng.standard_normal((n, t))
        if direction == "remove":
            x[:, 0] += 1.0
        ll = np.logaddexp.reduce((2 * x - 1) / (2 * sigma**2), axis=1) - math.log(t)
        loss += ll if direction == "remove" else -ll
    h = -np.expm1(np.minimum(eps - loss, 0.0))  # (1 − e^{ε−L})_+
    log_term = math.log(2.0 / (1.0 - confidence))
    var = h.var(ddof=1)
    return h.mean() - math.sqrt(2 * var * log_term / n) - 7 * log_term / (3 * (n - 1))


def _log_esym(y_log, k):
    """log e_k(y) (the k-th elementary symmetric polynomial) of each row, from log y, in log space."""
    n, t = y_log.shape
    e = np.full((n, k + 1), -np.inf)
    e[:, 0] = 0.0
    for i in range(t):
        e[:, 1:] = np.logaddexp(e[:, 1:], e[:, :-1] + y_log[:, i:i + 1])
    return e[:, k]


def _mc_delta_lower(sigma, t, passes, eps, n, rng, direction, confidence=0.99, k=1):
    """A lower confidence bound on δ(ε) = E[(1 − e^{ε − L})_+] of the privacy-loss variable L.

    L sums over passes the log density ratio of one epoch, drawn under P (remove: the
    record in steps 1..k, WLOG by symmetry) or Q (add); for k of t steps the ratio is
    e_k(y)/C(t, k) with y_i = exp((2x_i − 1)/(2σ²)), the pair itself (no reduction). Each
    term is in [0, 1]; the bound is the empirical-Bernstein lower bound of Maurer & Pontil
    (2009), Theorem 4.
    """
    loss = np.zeros(n)
    log_binom = math.lgamma(t + 1) - math.lgamma(k + 1) - math.lgamma(t - k + 1)
    for _ in range(passes):
        x = sigma * rng.standard_normal((n, t))
        if direction == "remove":
            x[:, :k] += 1.0
        y_log = (2 * x - 1) / (2 * sigma**2)
        ll = (np.logaddexp.reduce(y_log, axis=1) if k == 1 else _log_esym(y_log, k)) - log_binom
        loss += ll if direction == "remove" else -ll
    h = -np.expm1(np.minimum(eps - loss, 0.0))  # (1 − e^{ε−L})_+
    log_term = math.log(2.0 / (1.0 - confidence))
    var = h.var(ddof=1)
    return h.mean() - math.sqrt(2 * var * log_term / n) - 7 * log_term / (3 * (n - 1))


def _check_mc(configs, n, seed, k=1):
    rng = np.random.default_rng(seed)
    for sigma, t, passes, delta in configs:
        eps = float(A.epsilon(A.random_allocation_event(sigma, t, k, passes), delta))
        for direction in ("remove", "add"):
            lo = _mc_delta_lower(sigma, t, passes, eps, n, rng, direction, k=k)
            assert lo <= delta, (sigma, t, k, passes, delta, eps, direction, lo)


def test_epsilon_above_monte_carlo_lower_bound_fast():
    _check_mc([(0.6, 4, 1, 0.1), (1.0, 10, 2, 0.05), (2.0, 32, 3, 0.01)], n=50_000, seed=3)


@pytest.mark.slow
def test_epsilon_above_monte_carlo_lower_bound_50_configs():
    rng = np.random.default_rng(11)
    configs = []
    for _ in range(50):
        configs.append((float(np.exp(rng.uniform(math.log(0.5), math.log(3.0)))), int(rng.integers(2, 65)),
                        int(rng.integers(1, 5)), float(rng.choice([0.2, 0.1, 0.05, 0.01]))))
    _check_mc(configs, n=100_000, seed=12)


# =======================================================================================
# k of t steps: the reduction to 1 of ⌊t/k⌋ and ⌈t/k⌉ (docs/batch_schemes.md, "k of t").
# =======================================================================================


ORDERS_K = np.array([1.5, 2.0, 3.0, 5.0, 12.0, 64.0])


def test_k1_is_todays_balls_in_bins():
    """k = 1 runs the k = 1 code: ε is that of balls-in-bins, bit for bit (shapes of test_jit_vmap_grad_agree)."""
    sig = jnp.array([0.8, 1.0, 2.0])
    t = jnp.array([10.0, 100.0, 1000.0])
    np.testing.assert_array_equal(np.asarray(A.epsilon(A.random_allocation_event(sig, t, 1, 3), 1e-5)),
                                  np.asarray(A.epsilon(A.balls_in_bins_event(sig, t, 3), 1e-5)))
    assert A.RandomAllocation(10, A.Gaussian(1.0)).selected == 1


# =======================================================================================
# ε with the quadrature at fewer orders (_allocation.pruned_curve).
# =======================================================================================


def _full_list_epsilon(sig, t, passes, delta):
    """ε from the public curve at all of dp_accounting's orders, composed and converted (no pruning)."""
    curve = np.asarray(passes)[..., None] * np.asarray(A.random_allocation_rdp(A.DEFAULT_ORDERS, t, sig))
    return np.asarray(A.rdp_to_epsilon(curve, A.DEFAULT_ORDERS, delta).epsilon)


@pytest.mark.slow  # the full curve's compile costs ~10 s; the Monte Carlo tests check the pruned ε in CI
def test_pruned_epsilon_is_the_full_list_value():
    """ε evaluates the add direction at 39 of 156 orders; the minimiser is among them (shapes of test_jit_vmap_grad_agree)."""
    sig = jnp.array([0.8, 1.0, 2.0])
    t = jnp.array([10.0, 100.0, 1000.0])
    got = np.asarray(A.epsilon(A.balls_in_bins_event(sig, t, 3), 1e-5))
    _assert_pruned_close(got, _full_list_epsilon(sig, t, 3.0, 1e-5))


def _assert_pruned_close(got, full):
    """ε's pruned path against the full list: never below but for rounding (1e-12), above by ≤ 1e-8 relative
    (its chords come from the φ bound at 177 of the 385 u-nodes: certified, a little looser)."""
    rel = got / full - 1.0
    assert np.all(np.isfinite(got)) and rel.min() >= -1e-12 and rel.max() <= 1e-8, (rel.min(), rel.max())


@pytest.mark.slow
def test_pruned_epsilon_is_the_full_list_value_218_configs():
    """200 random configurations (σ 0.4–5, t 1–5000, passes 1–2000, δ 1e-12–1e-3) and the benchmark's grid."""
    from benchmarks.batch_schemes import _PEER_GRID

    rng = np.random.default_rng(1)
    n = 200
    sig = np.exp(rng.uniform(math.log(0.4), math.log(5.0), n))
    t = np.exp(rng.uniform(0.0, math.log(5000.0), n)).round()
    e = np.exp(rng.uniform(0.0, math.log(2000.0), n)).round()
    d = 10.0 ** rng.uniform(-12.0, -3.0, n)
    grid = [g for g in _PEER_GRID if g[2] == 1]
    sig = np.concatenate([sig, [g[0] for g in grid]])
    t = np.concatenate([t, [g[1] for g in grid]])
    e = np.concatenate([e, [g[3] for g in grid]])
    d = np.concatenate([d, np.full(len(grid), 1e-5)])
    got = np.asarray(jax.jit(lambda *a: A.epsilon(A.balls_in_bins_event(*a[:3]), a[3]))(sig, t, e, d))
    _assert_pruned_close(got, _full_list_epsilon(sig, t, e, d))


@pytest.mark.slow
def test_k_of_t_is_the_composition_of_its_blocks():
    """t = km + r: per direction, k − r epochs of 1 of m plus r of 1 of m + 1; the larger direction."""
    for t, k in ((101, 2), (10, 3), (12, 4)):
        m, r = t // k, t % k
        got = np.asarray(A.random_allocation_rdp(ORDERS_K, t, 0.9, selected=k))
        dirs = []
        for direction in ("remove", "add"):
            c = np.asarray(A.random_allocation_rdp(ORDERS_K, np.array([m, m + 1.0]), 0.9, direction=direction))
            dirs.append((k - r) * c[0] + r * c[1])
        np.testing.assert_allclose(got, np.maximum(*dirs), rtol=1e-14, atol=0)


@pytest.mark.parametrize("t, k, sigma", [(4, 2, 1.0), pytest.param(5, 2, 0.7, marks=pytest.mark.slow),
                                         pytest.param(6, 3, 1.5, marks=pytest.mark.slow),
                                         pytest.param(6, 2, 0.8, marks=pytest.mark.slow)])
def test_k_of_t_remove_direction_above_the_exact_value(t, k, sigma):
    """The remove direction of the k-of-t pair itself, by brute force in mpmath, never above the bound."""
    alphas = [2, 3, 4, 5]
    mine = np.asarray(A.random_allocation_rdp(np.array(alphas, dtype=float), t, sigma, selected=k, direction="remove"))
    exact = np.array([allocation_k_remove_moment(t, k, sigma, a) / (a - 1) for a in alphas])
    assert np.all(mine >= exact), (mine, exact)


def test_k_of_t_epsilon_above_monte_carlo_lower_bound_fast():
    _check_mc([(0.8, 6, 1, 0.1), (1.5, 12, 2, 0.02)], n=40_000, seed=5, k=2)
    _check_mc([(1.0, 9, 1, 0.05)], n=40_000, seed=6, k=3)


@pytest.mark.slow
def test_k_of_t_epsilon_above_monte_carlo_lower_bound_30_configs():
    rng = np.random.default_rng(21)
    for i in range(30):
        k = int(rng.integers(2, 5))
        cfg = (float(np.exp(rng.uniform(math.log(0.5), math.log(3.0)))), int(rng.integers(k, 41)),
               int(rng.integers(1, 4)), float(rng.choice([0.2, 0.1, 0.05, 0.01])))
        _check_mc([cfg], n=100_000, seed=100 + i, k=k)


def test_k_of_t_approaches_poisson_at_rate_k_over_t():
    """k = 2 of t = 2000 steps against Poisson at q = k/t = 1e-3 (same σ, same steps): within 5 %."""
    for sigma, passes in ((1.0, 10), (2.0, 25)):
        alloc = float(A.epsilon(A.random_allocation_event(sigma, 2000, 2, passes), 1e-5))
        poisson = float(A.dpsgd_epsilon(1e-3, sigma, 2000 * passes, 1e-5))
        assert 0.5 * poisson <= alloc <= 1.05 * poisson, (sigma, alloc, poisson)


@pytest.mark.slow
def test_k_of_t_jit_vmap_grad_in_both_x64_modes():
    """(x64 off: also the transformation matrix's random_allocation_event row.)"""
    sig = jnp.array([0.9, 2.0])
    eager = np.asarray([float(A.epsilon(A.random_allocation_event(float(s), 30, 3, 2), 1e-5)) for s in sig])
    for x64 in (False, True):
        with jax.enable_x64(x64):
            f = jax.jit(lambda s: A.epsilon(A.random_allocation_event(s, 30, 3, 2), 1e-5))
            v = jax.vmap(f)(sig)
            assert v.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(v), eager, rtol=1e-12)
            g = float(jax.grad(f)(1.0))
            if x64:
                h = 1e-5
                fd = (float(f(1.0 + h)) - float(f(1.0 - h))) / (2 * h)
            assert g < 0
    assert abs(g - fd) < 1e-4 * abs(fd)


# =======================================================================================
# Transformations, dtypes, errors.
# =======================================================================================


def test_jit_vmap_grad_agree():
    sig = jnp.array([0.8, 1.0, 2.0])
    t = jnp.array([10.0, 100.0, 1000.0])
    eager = np.asarray(A.epsilon(A.balls_in_bins_event(sig, t, 3), 1e-5))
    f = jax.jit(lambda s, n: A.epsilon(A.balls_in_bins_event(s, n, 3), 1e-5))
    np.testing.assert_allclose(np.asarray(jax.vmap(f)(sig, t)), eager, rtol=1e-12)
    g = jax.grad(lambda s: A.epsilon(A.balls_in_bins_event(s, 100.0, 3), 1e-5))(1.0)
    h = 1e-5
    fd = (float(f(1.0 + h, 100.0)) - float(f(1.0 - h, 100.0))) / (2 * h)
    assert g < 0 and abs(float(g) - fd) < 1e-3 * abs(fd)


def test_float64_with_x64_off():
    with jax.enable_x64(False):
        e = jax.jit(lambda s: A.epsilon(A.balls_in_bins_event(s, 50, 2), 1e-5))(1.0)
        assert e.dtype == jnp.float64
        r = jax.vmap(lambda s: A.random_allocation_rdp([2.0, 8.0], 50, s))(jnp.array([1.0, 2.0]))
        assert r.dtype == jnp.float64
    with jax.enable_x64(True):
        e64 = A.epsilon(A.balls_in_bins_event(1.0, 50, 2), 1e-5)
    assert abs(float(e) - float(e64)) < 1e-12 * float(e64)


def test_invalid_inputs():
    with pytest.raises(ValueError, match="steps_per_pass"):
        A.balls_in_bins_event(1.0, 2.5, 1)
    with pytest.raises(ValueError, match="steps_per_pass"):
        A.random_allocation_rdp([2.0], 0, 1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        A.balls_in_bins_event(0.0, 10, 1)
    with pytest.raises(ValueError, match="direction"):
        A.random_allocation_rdp([2.0], 10, 1.0, direction="up")
    with pytest.raises(ValueError, match="add_remove"):
        A.epsilon(A.RandomAllocation(10, A.Gaussian(1.0, relation="replace_one")), 1e-5)
    bad = jax.jit(lambda n: A.random_allocation_rdp([2.0], n, 1.0))(2.5)
    assert np.isnan(np.asarray(bad)).all()
    with pytest.raises(ValueError, match="selected"):
        A.random_allocation_event(1.0, 10, 11, 1)
    with pytest.raises(ValueError, match="selected"):
        A.random_allocation_event(1.0, 10, 0, 1)
    with pytest.raises(ValueError, match="selected"):
        A.random_allocation_rdp([2.0], 10, 1.0, selected=2.5)
    with pytest.raises(ValueError, match="selected"):
        A.epsilon(A.RandomAllocation(3, A.Gaussian(1.0), selected=4), 1e-5)
    bad = jax.jit(lambda n: A.random_allocation_rdp([2.0], n, 1.0, selected=3))(2.0)  # t < k under jit
    assert np.isnan(np.asarray(bad)).all()


@pytest.mark.slow  # ~15 s of compiles (the pruned path's derivative in both x64 modes)
def test_pruned_epsilon_gradient_with_x64_off():
    """ε's pruned path (dp_accounting's orders) differentiates with x64 off as with it on.

    Its picked orders and chords are selected by traced indices; gathers there would
    transpose into float32 scatters outside the float64 scope (a TypeError before s15).
    """
    f = lambda s: A.epsilon(A.balls_in_bins_event(s, 100.0, 3.0), 1e-5)  # noqa: E731
    with jax.enable_x64(False):
        off = float(jax.grad(jax.jit(f))(1.2))
    with jax.enable_x64(True):
        on = float(jax.grad(f)(1.2))
    assert np.isfinite(off) and off == pytest.approx(on, rel=1e-5), (off, on)
