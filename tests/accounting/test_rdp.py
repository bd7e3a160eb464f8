"""Sampled-Gaussian RDP against independent references (mpmath, closed forms, notes, dp_accounting)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as dpa

from jaxdp.accounting import DEFAULT_ORDERS, gaussian_rdp, heterogeneous_rdp, sampled_gaussian_rdp
from tests.references import sgm_rdp_int, sgm_rdp_quad

# The accuracy requirement for exact orders; observed errors are ~1e-11 or better.
EXACT_RTOL = 1e-9
# Values in the notes are printed with 11 significant digits.
NOTES_RTOL = 5e-10

# (q, sigma, alpha, exact RDP) from shared/notes/seeds/004_tail_two_densities.md §3.1
# ("exact" column: closed-form for integer α, 40-digit mpmath quadrature for fractional α).
NOTES_31 = [
    (0.01, 1.1, 1.5, 9.5545285719e-05), (0.01, 1.1, 2, 1.2851008161e-04), (0.01, 1.1, 2.5, 1.6207740937e-04),
    (0.01, 1.1, 3.7, 2.4528772272e-04), (0.01, 1.1, 4.7, 3.17788071822e-04), (0.01, 1.1, 10.5, 9.6727130523e-04),
    (0.01, 1.1, 12.5, 1.80051253494e-01), (0.01, 1.1, 16, 1.6998267278e00), (0.01, 1.1, 256, 1.0116189429e02),
    (256 / 60000, 1.1, 1.5, 1.7479784463e-05), (256 / 60000, 1.1, 8.1, 9.9659727619e-05),
    (256 / 60000, 1.1, 10.5, 1.3216541131e-04), (0.001, 0.8, 1.5, 2.8164645683e-06),
    (0.001, 0.8, 8.6, 5.0786082645e-05), (0.001, 0.8, 10.5, 5.6910849461e-01), (0.01, 2.0, 1.1, 1.5578226652e-05),
    (0.01, 2.0, 3.7, 5.2819978535e-05), (0.05, 1.5, 1.1, 7.4876477082e-04), (0.05, 1.5, 3.5, 2.5657280859e-03),
    (0.1, 1.0, 1.5, 1.1734592197e-02), (0.1, 1.0, 2.5, 2.3503727261e-02), (0.1, 1.0, 3.7, 4.8331624426e-02),
    (0.5, 2.0, 1.5, 4.9819377632e-02), (0.5, 2.0, 2.5, 8.8629845524e-02), (0.5, 2.0, 10.5, 6.5850995038e-01),
    (0.5, 0.5, 1.1, 7.926317795715e-01), (0.5, 2.0, 256, 3.1304134595e01),
]


def _diagonal(points):
    """ε(α_k) at (q_k, σ_k) for each point, in one compiled call (all orders × all points)."""
    q = np.array([p[0] for p in points])
    sigma = np.array([p[1] for p in points])
    orders = sorted({float(p[2]) for p in points})
    full = np.asarray(sampled_gaussian_rdp(orders, q, sigma))
    return np.array([full[k, orders.index(float(p[2]))] for k, p in enumerate(points)])


def test_notes_table():
    got = _diagonal(NOTES_31)
    ref = np.array([p[3] for p in NOTES_31])
    np.testing.assert_allclose(got, ref, rtol=NOTES_RTOL)


def _random_points(n, seed, frac=True):
    rng = np.random.default_rng(seed)
    pts = []
    for _ in range(n):
        q = float(10 ** rng.uniform(-5, 0))
        sigma = float(10 ** rng.uniform(math.log10(0.3), math.log10(50)))
        alpha = float(np.round(rng.uniform(1.01, 12), 3)) if frac else float(rng.integers(2, 40))
        pts.append((q, sigma, alpha))
    return pts


# 10 random points and the corners (30-digit quadrature is ~0.7 s a point; the fuzz tests and the
# dp_accounting comparisons cover the fractional range too).
QUAD_POINTS = _random_points(10, 1) + [(1e-5, 50.0, 1.1), (1e-5, 0.3, 1.5), (1.0 - 1e-6, 0.3, 2.5),
                                       (0.999, 50.0, 7.3), (1e-5, 50.0, 11.9), (0.3, 0.3, 1.01)]


def test_fractional_against_quadrature():
    """Random (q in [1e-5, 1], σ in [0.3, 50], fractional α) and corner cases vs 30-digit quadrature."""
    got = _diagonal(QUAD_POINTS)
    ref = np.array([sgm_rdp_quad(q, s, a, dps=30) for q, s, a in QUAD_POINTS])
    np.testing.assert_allclose(got, ref, rtol=EXACT_RTOL)


@pytest.mark.parametrize("q,sigma,alpha", [(0.02, 1.3, 4.0), (3e-4, 7.0, 9.0), (0.6, 0.4, 3.0)])
def test_integer_orders_quadrature_and_sum_agree(q, sigma, alpha):
    # Two independent references (quadrature, exact sum) and jaxdp must all agree.
    quad = sgm_rdp_quad(q, sigma, alpha, dps=30)
    exact = sgm_rdp_int(q, sigma, int(alpha))
    got = float(sampled_gaussian_rdp([alpha], q, sigma)[0])
    assert exact == pytest.approx(quad, rel=1e-12)
    assert got == pytest.approx(exact, rel=EXACT_RTOL)


@pytest.mark.parametrize("q,sigma", [(1e-5, 0.3), (1e-3, 1.0), (0.05, 4.0), (0.5, 20.0), (1e-5, 50.0), (0.9, 0.6)])
def test_integer_orders_against_mpmath_sum(q, sigma):
    orders = [2, 3, 7, 16, 63, 128, 1024]
    got = np.asarray(sampled_gaussian_rdp(orders, q, sigma))
    ref = np.array([sgm_rdp_int(q, sigma, a) for a in orders])
    np.testing.assert_allclose(got, ref, rtol=EXACT_RTOL)


@pytest.mark.parametrize("q", [1e-9, 1e-6, 1e-3, 0.1, 0.7, 1.0])
@pytest.mark.parametrize("sigma", [0.3, 1.0, 50.0])
def test_order_two_closed_form(q, sigma):
    # ε(2) = log1p(q² (e^{1/σ²} - 1)), exact for every q.
    got = float(sampled_gaussian_rdp([2.0], q, sigma)[0])
    assert got == pytest.approx(math.log1p(q * q * math.expm1(1 / sigma**2)), rel=1e-12)


def test_special_cases():
    orders = [1.5, 2.0, 7.25, 64.0]
    np.testing.assert_allclose(sampled_gaussian_rdp(orders, 1.0, 2.0), np.array(orders) / 8.0, rtol=1e-15)
    np.testing.assert_array_equal(sampled_gaussian_rdp(orders, 0.0, 2.0), np.zeros(4))
    np.testing.assert_allclose(gaussian_rdp(orders, 2.0), np.array(orders) / 8.0, rtol=1e-15)


def test_default_grid_finite_where_dp_accounting_is_inf():
    # dp_accounting 0.6.0 returns inf at some fractional orders for these (notes §3.1);
    # the true values are finite.
    for q, sigma in [(0.1, 1.0), (0.5, 2.0), (0.5, 0.5)]:
        r = np.asarray(sampled_gaussian_rdp(DEFAULT_ORDERS, q, sigma))
        assert np.all(np.isfinite(r)) and np.all(r > 0)


def test_against_dp_accounting_random_grid():
    """Integer orders match dp_accounting; fractional ones never exceed its upper bound."""
    rng = np.random.default_rng(7)
    q = 10 ** rng.uniform(-4, -0.5, 6)
    sigma = rng.uniform(0.5, 8.0, 6)
    ours = np.asarray(sampled_gaussian_rdp(DEFAULT_ORDERS, q, sigma))
    is_int = DEFAULT_ORDERS == np.floor(DEFAULT_ORDERS)
    for k in range(6):
        ref = np.asarray(dpa._compute_rdp_poisson_subsampled_gaussian(q[k], sigma[k], DEFAULT_ORDERS))
        # dp_accounting sums the raw binomial terms (k = 0, 1 included), so its own rounding
        # error reaches ~1e-9 relative at small q; jaxdp matches mpmath to ~1e-14 there.
        np.testing.assert_allclose(ours[k, is_int], ref[is_int], rtol=1e-8)
        fin = np.isfinite(ref) & ~is_int
        # dp_accounting sums |terms| (an upper bound): ours is at most it (plus rounding).
        assert np.all(ours[k, fin] <= ref[fin] * (1 + 1e-8))


def test_broadcasting_and_shapes():
    q = np.array([[0.01], [0.02]])
    sigma = np.array([1.0, 2.0, 3.0])
    r = sampled_gaussian_rdp([1.5, 2.0, 30.0], q, sigma)
    assert r.shape == (2, 3, 3) and r.dtype == jnp.float64
    for i in range(2):
        for j in range(3):
            np.testing.assert_allclose(r[i, j], sampled_gaussian_rdp([1.5, 2.0, 30.0], q[i, 0], sigma[j]), rtol=1e-14)


def test_large_batch_chunking_matches_small():
    rng = np.random.default_rng(3)
    q = 10 ** rng.uniform(-4, -1, 70)  # > one chunk, not a multiple of it
    sigma = rng.uniform(0.5, 5, 70)
    big = np.asarray(sampled_gaussian_rdp([1.7, 5.0], q, sigma))
    small = np.stack([np.asarray(sampled_gaussian_rdp([1.7, 5.0], q[i], sigma[i])) for i in (0, 33, 69)])
    np.testing.assert_allclose(big[[0, 33, 69]], small, rtol=1e-14)


def test_heterogeneous_is_sum_of_segments():
    orders = [1.5, 4.0, 20.0]
    r = heterogeneous_rdp(orders, [0.01, 0.03], [1.0, 2.0], [100, 7])
    ref = 100 * np.asarray(sampled_gaussian_rdp(orders, 0.01, 1.0)) + 7 * np.asarray(sampled_gaussian_rdp(orders, 0.03, 2.0))
    np.testing.assert_allclose(r, ref, rtol=1e-14)
    # A fractional step count is charged as the next integer (conservative).
    np.testing.assert_allclose(heterogeneous_rdp(orders, [0.01], [1.0], [2.2]), 3 * np.asarray(sampled_gaussian_rdp(orders, 0.01, 1.0)), rtol=1e-14)


def test_float64_with_global_flag_off():
    with jax.enable_x64(False):
        r = sampled_gaussian_rdp([1.5, 3.0], 0.01, 1.0)
        # Inside a user's float32 jit the argument is already float32; the accountant
        # still computes and returns float64 from that value.
        jr = jax.jit(lambda q: sampled_gaussian_rdp([1.5, 3.0], q, 1.0))(0.01)
    assert r.dtype == np.float64 and jr.dtype == np.float64
    ref = [sgm_rdp_quad(0.01, 1.0, 1.5, dps=30), sgm_rdp_int(0.01, 1.0, 3)]
    np.testing.assert_allclose(r, ref, rtol=EXACT_RTOL)
    q32 = float(np.float32(0.01))
    np.testing.assert_allclose(jr, [sgm_rdp_quad(q32, 1.0, 1.5, dps=30), sgm_rdp_int(q32, 1.0, 3)], rtol=EXACT_RTOL)


def test_jit_vmap_agree():
    orders = DEFAULT_ORDERS
    q = np.array([1e-4, 0.01, 0.3])
    s = np.array([0.7, 1.5, 9.0])
    eager = np.asarray(sampled_gaussian_rdp(orders, q, s))
    jitted = np.asarray(jax.jit(lambda a, b: sampled_gaussian_rdp(orders, a, b))(q, s))
    vm = np.asarray(jax.vmap(lambda a, b: sampled_gaussian_rdp(orders, a, b))(q, s))
    np.testing.assert_allclose(jitted, eager, rtol=1e-13)
    np.testing.assert_allclose(vm, eager, rtol=1e-13)


def test_invalid_inputs_eager_errors():
    with pytest.raises(ValueError, match="noise_multiplier"):
        sampled_gaussian_rdp([2.0], 0.1, 0.0)
    with pytest.raises(ValueError, match="q"):
        sampled_gaussian_rdp([2.0], 1.5, 1.0)
    with pytest.raises(ValueError, match="orders"):
        sampled_gaussian_rdp([1.0, 2.0], 0.1, 1.0)
    with pytest.raises(TypeError, match="orders"):
        jax.jit(lambda o: sampled_gaussian_rdp(o, 0.1, 1.0))(jnp.array([2.0]))


def test_invalid_inputs_under_jit_are_nan():
    f = jax.jit(lambda q, s: sampled_gaussian_rdp([1.5, 2.0], q, s))
    for q, s in [(1.5, 1.0), (-0.1, 1.0), (0.1, 0.0), (0.1, -2.0), (0.1, jnp.nan), (jnp.nan, 1.0)]:
        assert np.all(np.isnan(np.asarray(f(q, s))))


def test_extreme_sigma_never_below_truth():
    """Far outside σ ∈ [0.3, 50] (or for α → 1) float64 cancellation grows like σ² (or
    α/(α-1)); the rounding margin keeps every value at or above the 60-digit truth
    (conservative, never optimistic)."""
    pts = [(1e-8, 1e6, 5.2), (1e-5, 1e3, 3.3), (0.3, 1e3, 2.5), (1e-12, 1e5, 1.5), (1e-3, 2e2, 9.9),
           (0.3, 2.0, 1.0001), (0.01, 5.0, 1.0001)]  # orders next to 1: cancellation ∝ α/(α-1)
    got = _diagonal(pts)
    ref = np.array([sgm_rdp_quad(q, s, a, dps=60) for q, s, a in pts])
    assert np.all(got >= ref * (1 - 1e-15))
    assert np.all(got <= ref * 1.2)


def test_cached_plans_are_read_only():
    # The plans and weights are cached (functools) and shared by every later call with the
    # same key: an in-place change would alter later results silently, so it raises.
    from jaxdp._numerics import crvz_weights
    from jaxdp.accounting import _per_instance, _rdp

    plan = _rdp._plan((1.5, 2.0, 3.0, 17.0))
    pi_plan = _per_instance._plan((1.5, 64.0), 5, (0, 1, 2, 3, 4), 150.0, "levels", 2)
    arrays = [crvz_weights(20)[0], plan.frac.w_left, plan.frac.alpha, plan.int_groups[0].log_comb, pi_plan.grid,
              pi_plan.blocks[0][1], pi_plan.flat]
    for arr in arrays:
        with pytest.raises(ValueError, match="read-only"):
            arr[0] = 0


def test_shipped_gammaln_table_is_scipys_and_builds_the_default_plan(monkeypatch, tmp_path):
    # The default orders' plan reads log Γ from a shipped table instead of importing
    # scipy.special (a fresh process's first ε). The table must hold SciPy's own numbers, and
    # every plan built from it must equal, array for array, the plan built with SciPy.
    import dataclasses

    from scipy import special as sp

    from jaxdp.accounting import _rdp

    args, values = _rdp._gammaln_table()
    assert np.all(np.diff(args) > 0) and np.array_equal(values, sp.gammaln(args))
    rebuilt = _rdp._write_gammaln_table(str(tmp_path / "table.npy"))  # the generator writes the same table
    assert np.array_equal(rebuilt, _rdp._gammaln_table())

    def arrays(plan):
        groups = [*plan.int_groups, plan.frac]
        return [np.asarray(getattr(g, f.name)) for g in groups for f in dataclasses.fields(g)]

    rng = np.random.default_rng(21)
    keys = [tuple(DEFAULT_ORDERS.tolist()), (1.5, 2.0, 3.0, 17.0)]
    keys += [tuple(np.sort(rng.choice(DEFAULT_ORDERS, size=12, replace=False)).tolist()) for _ in range(4)]
    keys += [(1.25, 2.75, 33.3, 70.0)]  # arguments outside the table: SciPy
    with_scipy = []
    monkeypatch.setattr(_rdp, "_gammaln", _rdp._scipy_gammaln)
    for key in keys:
        with_scipy.append(arrays(_rdp._plan.__wrapped__(key)))
    monkeypatch.undo()

    def no_scipy(x):
        raise AssertionError("the default orders' plan should not need SciPy")

    for key, ref in zip(keys, with_scipy):
        if set(key) <= set(DEFAULT_ORDERS.tolist()):
            monkeypatch.setattr(_rdp, "_scipy_gammaln", no_scipy)
        got = arrays(_rdp._plan.__wrapped__(key))
        monkeypatch.undo()
        assert len(got) == len(ref) and all(np.array_equal(a, b) for a, b in zip(got, ref)), key
    # The b2 coefficients' signs are computed in integers: SciPy's binom agrees on random orders.
    alpha = rng.uniform(1.0, 2000.0, 500)
    alpha = alpha[alpha != np.floor(alpha)]
    k = np.arange(2, 34.0)
    sign = (-1.0) ** np.maximum(k[None, :] - np.ceil(alpha)[:, None], 0.0)
    assert np.array_equal(sign, np.sign(sp.binom(alpha[:, None], k[None, :])))
