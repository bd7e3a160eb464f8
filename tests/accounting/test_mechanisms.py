"""Classic mechanisms, calibrations, composition, subsampling and discrete divergences.

References are independent of jaxdp: mpmath at 50 digits, dp_accounting 0.6.0, scipy,
closed forms written out here in plain Python floats, and brute-force enumeration.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import mpmath as mp
import numpy as np
import pytest
import scipy.special
import scipy.stats
from dp_accounting import gaussian_mechanism as dpa_gauss
from dp_accounting.pld import accountant as dpa_accountant
from dp_accounting.pld import common as dpa_common
from dp_accounting.pld import privacy_loss_mechanism as dpa_plm
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxdp.accounting as A

# dp_accounting's brentq runs to xtol=1e-12; jaxdp bisects to float64 resolution and then
# rounds up by a relative 1e-12 safety margin on log δ. 1e-9 relative covers both.
CALIB_RTOL = 1e-9
# Closed forms evaluated in a different order of operations: a few ulps.
CLOSED_RTOL = 1e-12
# mpmath (50 digits) against float64 special functions: the hockey-stick closed form loses
# a few digits to cancellation for small δ; 1e-9 relative is far below any use.
MP_RTOL = 1e-9

mp.mp.dps = 50


# ---------------------------------------------------------------------------------------
# Independent references.
# ---------------------------------------------------------------------------------------


def mp_gauss_delta(eps: float, s: float) -> mp.mpf:
    """Balle-Wang (Theorem 8) δ(ε) for noise multiplier s, at 50 digits."""
    e, s = mp.mpf(eps), mp.mpf(s)
    return mp.ncdf(1 / (2 * s) - e * s) - mp.exp(e) * mp.ncdf(-1 / (2 * s) - e * s)


def mp_kov(eps: float, delta: float, k: int, total: float, dps: int = 30) -> float:
    """Kairouz-Oh-Viswanath Theorem 3.3 at 30 digits: δ_i as a sum of positive terms.

    δ_i increases with i, so the largest feasible i is found by bisection over i (O(k log k)
    terms instead of O(k^2)).
    """
    with mp.workdps(dps):
        e, d = mp.mpf(eps), mp.mpf(delta)
        norm = (1 + mp.exp(e)) ** k

        def feasible(i):
            di = mp.fsum(mp.binomial(k, l) * (mp.exp(e * (k - l)) - mp.exp(e * (k - 2 * i + l))) for l in range(i))
            return 1 - (1 - d) ** k * (1 - di / norm) <= total

        if not feasible(0):
            return math.inf
        lo, hi = 0, k // 2  # feasible(lo) holds
        if feasible(hi):
            lo = hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if feasible(mid) else (lo, mid)
        return float(e * (k - 2 * lo))


# ---------------------------------------------------------------------------------------
# Samplers.
# ---------------------------------------------------------------------------------------

N_SAMPLES = 200_000
# Mean of N i.i.d. draws: 6 standard errors leaves a false-alarm rate below 2e-9.
MEAN_SE = 6.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16])
def test_samplers_keep_dtype_and_shape(dtype):
    v = jnp.ones((3, 4), dtype)
    for fn, arg in ((A.laplace_mechanism, 0.5), (A.gaussian_mechanism, 0.5)):
        y = fn(jax.random.key(1), v, arg)
        assert y.shape == v.shape and y.dtype == dtype


def test_samplers_integer_value_promoted():
    y = A.gaussian_mechanism(jax.random.key(0), jnp.arange(3), 1.0)
    assert jnp.issubdtype(y.dtype, jnp.floating)


def test_laplace_sampler_distribution():
    b, centre = 2.5, 3.0
    y = np.asarray(A.laplace_mechanism(jax.random.key(7), jnp.full((N_SAMPLES,), centre), b), np.float64)
    se = b * math.sqrt(2.0 / N_SAMPLES)  # Var Lap(b) = 2b^2
    assert abs(y.mean() - centre) < MEAN_SE * se
    # Kolmogorov-Smirnov against scipy's Laplace; fixed key, so a p-value floor of 1e-3 is a
    # fixed (not flaky) check that would fail for a wrong scale by more than ~1%.
    assert scipy.stats.kstest(y, scipy.stats.laplace(loc=centre, scale=b).cdf).pvalue > 1e-3


def test_gaussian_sampler_distribution():
    s, centre = 0.7, -1.0
    y = np.asarray(A.gaussian_mechanism(jax.random.key(11), jnp.full((N_SAMPLES,), centre), s), np.float64)
    assert abs(y.mean() - centre) < MEAN_SE * s / math.sqrt(N_SAMPLES)
    # Sample variance: its standard error is s^2 sqrt(2/(N-1)).
    assert abs(y.var(ddof=1) - s * s) < MEAN_SE * s * s * math.sqrt(2.0 / (N_SAMPLES - 1))
    assert scipy.stats.kstest(y, scipy.stats.norm(loc=centre, scale=s).cdf).pvalue > 1e-3


def test_samplers_jit_vmap_grad():
    key = jax.random.key(3)
    v = jnp.zeros(5)
    np.testing.assert_array_equal(jax.jit(A.gaussian_mechanism)(key, v, 1.0), A.gaussian_mechanism(key, v, 1.0))
    keys = jax.random.split(key, 4)
    ys = jax.vmap(A.laplace_mechanism, in_axes=(0, None, 0))(keys, v, jnp.arange(1.0, 5.0))
    assert ys.shape == (4, 5)
    # Reparameterised noise: d(value + s·Z)/ds = Z.
    z = A.gaussian_mechanism(key, v, 1.0)
    g = jax.grad(lambda s: jnp.sum(A.gaussian_mechanism(key, v, s)))(2.0)
    np.testing.assert_allclose(g, jnp.sum(z), rtol=1e-12)


def test_samplers_validate():
    with pytest.raises(ValueError, match="scale"):
        A.laplace_mechanism(jax.random.key(0), 1.0, -1.0)
    with pytest.raises(ValueError, match="noise_std"):
        A.gaussian_mechanism(jax.random.key(0), 1.0, math.nan)
    assert jnp.all(jnp.isnan(jax.jit(A.gaussian_mechanism)(jax.random.key(0), jnp.zeros(2), -1.0)))


# ---------------------------------------------------------------------------------------
# Laplace calibration.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("eps,sens", [(0.5, 2.0), (1.0, 1.0), (0.01, 3.0), (4.0, 0.5)])
def test_laplace_scale_matches_dp_accounting(eps, sens):
    ref = dpa_plm.LaplacePrivacyLoss.from_privacy_guarantee(
        dpa_common.DifferentialPrivacyParameters(eps, 0.0), sensitivity=sens
    ).parameter
    np.testing.assert_allclose(A.calibrate_laplace_scale(eps, sens), ref, rtol=CLOSED_RTOL)
    # At b = Δ/ε the exact δ(ε) of the Laplace mechanism (an independent closed form,
    # [1 - exp(ε/2 - Δ/(2b))]_+) is 0.
    b = float(A.calibrate_laplace_scale(eps, sens))
    assert max(0.0, -math.expm1(eps / 2 - sens / (2 * b))) <= 1e-12


def test_laplace_scale_inf_and_invalid():
    assert float(A.calibrate_laplace_scale(math.inf, 1.0)) == 0.0
    with pytest.raises(ValueError, match="epsilon"):
        A.calibrate_laplace_scale(0.0, 1.0)
    assert math.isnan(float(jax.jit(A.calibrate_laplace_scale)(-1.0, 1.0)))
    np.testing.assert_allclose(jax.grad(A.calibrate_laplace_scale)(2.0, 3.0), -3.0 / 4.0, rtol=CLOSED_RTOL)


# ---------------------------------------------------------------------------------------
# The analytic Gaussian mechanism.
# ---------------------------------------------------------------------------------------

GAUSS_POINTS = [(0.0, 1.0), (1.0, 1.0), (0.5, 3.0), (3.0, 0.5), (0.1, 20.0), (5.0, 1.2)]


@pytest.mark.parametrize("eps,s", GAUSS_POINTS)
def test_gaussian_delta_matches_mpmath(eps, s):
    np.testing.assert_allclose(A.gaussian_mechanism_delta(eps, s), float(mp_gauss_delta(eps, s)), rtol=MP_RTOL)


@pytest.mark.parametrize("delta,s", [(1e-5, 1.0), (1e-6, 0.8), (1e-3, 5.0), (1e-10, 2.0), (0.3, 0.5)])
def test_gaussian_epsilon_matches_dp_accounting_and_is_certified(delta, s):
    ours = float(A.gaussian_mechanism_epsilon(delta, s))
    np.testing.assert_allclose(ours, dpa_gauss.get_epsilon_gaussian(s, delta), rtol=CALIB_RTOL)
    assert mp_gauss_delta(ours, s) <= delta  # never under-reported


def test_gaussian_epsilon_zero_when_noise_is_large():
    # δ(0) = erf(1/(2√2 s)) ≈ 0.0399 < 0.05 at s = 10.
    assert float(A.gaussian_mechanism_epsilon(0.05, 10.0)) == 0.0
    assert float(A.gaussian_mechanism_epsilon(0.05, math.inf)) == 0.0


# Tail-bound calibrations of the tutorial, written out independently (plain floats).
def _closed_reference(method, e, d):
    L = math.log(1 / d)
    if method == "6.91":
        return (math.sqrt(2 * L) + math.sqrt(2 * L + 2 * e)) / (2 * e)
    if method == "6.81":
        return math.sqrt(2 * L) / e + (2 * e) ** -0.5
    if method == "6.82":
        return max(1.0, math.sqrt(max(math.log(d**-2 / (2 * math.pi)), 0.0))) / e + (2 * e) ** -0.5
    if method == "6.83":
        return math.sqrt(math.log(math.exp(e) / d**2)) / e
    if method == "6.84":
        return max(math.sqrt(1 + e), math.sqrt(max(math.log(math.exp(e) / (2 * math.pi * d**2)), 0.0))) / e
    if method == "dwork_roth":
        return max(1.5, math.sqrt(2 * math.log(1.25 / d))) / e
    raise AssertionError(method)


CALIB_POINTS = [(1.0, 1e-5), (0.5, 1e-5), (0.1, 1e-6), (2.0, 1e-5), (0.9, 0.3), (8.0, 1e-9)]
# Published values for (ε, δ) = (0.5, 1e-5): the tutorial's table (computed from its
# formulas; matches _closed_reference) and Balle-Wang's analytic calibration.
TABLE_05 = {"analytic": 7.031826676, "6.91": 9.700143087, "6.81": 10.597051824, "6.82": 10.206079266,
            "6.83": 9.700690889, "6.84": 9.314069758, "dwork_roth": 9.689610525}


@pytest.mark.parametrize("method", A.GAUSSIAN_CALIBRATIONS)
@pytest.mark.parametrize("eps,delta", CALIB_POINTS)
def test_gaussian_calibrations(method, eps, delta):
    if method == "dwork_roth" and eps >= 1:
        with pytest.raises(ValueError, match="epsilon"):
            A.calibrate_gaussian_noise_multiplier(eps, delta, method=method)
        assert math.isnan(float(jax.jit(A.calibrate_gaussian_noise_multiplier, static_argnames="method")(
            eps, delta, method=method)))
        return
    s = float(A.calibrate_gaussian_noise_multiplier(eps, delta, method=method))
    if method == "analytic":
        np.testing.assert_allclose(s, dpa_gauss.get_sigma_gaussian(eps, delta), rtol=CALIB_RTOL)
    else:
        np.testing.assert_allclose(s, _closed_reference(method, eps, delta), rtol=CLOSED_RTOL)
    # Every calibration is sufficient: the exact δ at the returned multiplier is ≤ δ.
    assert mp_gauss_delta(eps, s) <= delta
    if (eps, delta) == (0.5, 1e-5):
        np.testing.assert_allclose(s, TABLE_05[method], rtol=1e-9)


def test_analytic_calibration_is_smallest():
    for eps, delta in CALIB_POINTS:
        s = [float(A.calibrate_gaussian_noise_multiplier(eps, delta, method=m)) for m in A.GAUSSIAN_CALIBRATIONS
             if not (m == "dwork_roth" and eps >= 1)]
        assert s[0] == min(s)
        # ... and tight: 1e-9 below it the exact δ exceeds the target.
        assert mp_gauss_delta(eps, s[0] * (1 - 1e-9)) > delta


def test_gaussian_jit_vmap_and_x64_off():
    eps = jnp.array([0.5, 1.0, 2.0])
    delta = jnp.array([1e-5, 1e-6, 1e-3])
    plain = A.calibrate_gaussian_noise_multiplier(eps, delta)
    jitted = jax.jit(A.calibrate_gaussian_noise_multiplier)(eps, delta)
    vm = jax.vmap(A.calibrate_gaussian_noise_multiplier)(eps, delta)
    np.testing.assert_array_equal(plain, jitted)
    np.testing.assert_allclose(plain, vm, rtol=1e-15)
    with jax.enable_x64(False):
        out = A.gaussian_mechanism_epsilon(1e-5, 1.0)
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(out, dpa_gauss.get_epsilon_gaussian(1.0, 1e-5), rtol=CALIB_RTOL)


# Central differences with step 1e-6 in float64: truncation O(h^2) and rounding O(1e-16/h)
# are both below 1e-6 relative.
FD_STEP = 1e-6
FD_RTOL = 1e-6


def _fd(f, x):
    return (f(x + FD_STEP) - f(x - FD_STEP)) / (2 * FD_STEP)


def test_gaussian_gradients_match_finite_differences():
    def calib(e, d):
        return dpa_gauss.get_sigma_gaussian(e, d, tol=1e-15)

    g_eps, g_delta = jax.grad(A.calibrate_gaussian_noise_multiplier, argnums=(0, 1))(1.0, 1e-5)
    np.testing.assert_allclose(g_eps, _fd(lambda e: calib(e, 1e-5), 1.0), rtol=FD_RTOL)
    # δ derivative: differentiate in log δ to keep the step relative.
    fd_log = _fd(lambda t: calib(1.0, math.exp(t)), math.log(1e-5))
    np.testing.assert_allclose(g_delta * 1e-5, fd_log, rtol=FD_RTOL)
    g_s = jax.grad(A.gaussian_mechanism_epsilon, argnums=1)(1e-5, 1.0)
    fd_s = _fd(lambda s: dpa_gauss.get_epsilon_gaussian(s, 1e-5, tol=1e-15), 1.0)
    np.testing.assert_allclose(g_s, fd_s, rtol=FD_RTOL)
    g_d = jax.grad(A.gaussian_mechanism_delta, argnums=(0, 1))(1.0, 2.0)
    np.testing.assert_allclose(g_d[0], float(mp.diff(lambda e: mp_gauss_delta(e, 2.0), 1.0)), rtol=1e-9)
    np.testing.assert_allclose(g_d[1], float(mp.diff(lambda s: mp_gauss_delta(1.0, s), 2.0)), rtol=1e-9)


def test_gaussian_validation():
    with pytest.raises(ValueError, match="method"):
        A.calibrate_gaussian_noise_multiplier(1.0, 1e-5, method="6.85")
    with pytest.raises(ValueError, match="delta"):
        A.calibrate_gaussian_noise_multiplier(1.0, 1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        A.gaussian_mechanism_epsilon(1e-5, 0.0)
    assert math.isnan(float(jax.jit(A.gaussian_mechanism_epsilon)(2.0, 1.0)))
    assert math.isnan(float(jax.jit(A.calibrate_gaussian_noise_multiplier)(-1.0, 1e-5)))


# ---------------------------------------------------------------------------------------
# Composition.
# ---------------------------------------------------------------------------------------


def test_basic_composition():
    eps = np.array([[0.1, 0.2, 0.3], [1.0, 0.0, 2.0]])
    delta = np.array([1e-6, 0.0, 1e-7])
    e, d = A.basic_composition(eps, delta)
    np.testing.assert_allclose(e, [0.6, 3.0], rtol=CLOSED_RTOL)
    np.testing.assert_allclose(d, [1.1e-6, 1.1e-6], rtol=CLOSED_RTOL)
    e0, _ = A.basic_composition(eps, delta[None, :], axis=0)
    np.testing.assert_allclose(e0, [1.1, 0.2, 2.3], rtol=CLOSED_RTOL)
    with pytest.raises(ValueError, match="delta"):
        A.basic_composition([1.0], [1.5])


def _drv(e, k, dp):
    return math.sqrt(2 * k * math.log(1 / dp)) * e + k * e * math.expm1(e)


def _a(e):
    return min(e * math.expm1(e), e)


@pytest.mark.parametrize("e,d,k,total", [(0.1, 0.0, 100, 1e-5), (0.01, 1e-9, 1000, 1e-5), (0.5, 1e-8, 50, 1e-6),
                                         (1.0, 0.0, 30, 1e-3)])
def test_advanced_composition_closed_forms(e, d, k, total):
    dp = total - k * d
    refs = {
        "dwork_roth": _drv(e, k, dp),
        "tutorial_independent": k * _a(e) + math.sqrt(2 * k * math.log(1 / dp)) * e,
        "tutorial_adaptive": k * _a(e) + math.sqrt(2 * k * math.log(1 / dp)) * (e + _a(e)),
    }
    for form, ref in refs.items():
        got = A.advanced_composition(e, d, k, total, form=form)
        np.testing.assert_allclose(got, min(ref, k * e), rtol=CLOSED_RTOL)


def test_advanced_composition_tutorial_values():
    # The tutorial's vectors: k = 100, ε = 0.1, β = 1e-5 (Claims 17 and 18), and k = 1000,
    # ε = 0.01, β = 1e-6.
    f = A.advanced_composition
    np.testing.assert_allclose(f(0.1, 0.0, 100, 1e-5, form="tutorial_independent"), 5.8502350929, rtol=1e-10)
    np.testing.assert_allclose(f(0.1, 0.0, 100, 1e-5, form="tutorial_adaptive"), 6.3549004685, rtol=1e-10)
    np.testing.assert_allclose(f(0.1, 1e-7, 100, 2e-5, form="tutorial_adaptive"), 6.3549004685, rtol=1e-10)
    np.testing.assert_allclose(f(0.01, 0.0, 1000, 1e-6, form="tutorial_independent"), 1.7627598071, rtol=1e-10)
    np.testing.assert_allclose(f(0.01, 0.0, 1000, 1e-6, form="tutorial_adaptive"), 1.7794657791, rtol=1e-10)


def test_advanced_composition_edges_and_grad():
    # Total δ below k·δ: nothing certifiable. Exactly k·δ: basic composition.
    assert float(A.advanced_composition(0.1, 1e-6, 100, 5e-5)) == math.inf
    np.testing.assert_allclose(A.advanced_composition(0.1, 1e-7, 100, 1e-5), 10.0, rtol=CLOSED_RTOL)
    g = jax.grad(A.advanced_composition)(0.1, 0.0, 100.0, 1e-5)
    np.testing.assert_allclose(g, _fd(lambda e: _drv(e, 100, 1e-5), 0.1), rtol=FD_RTOL)
    with pytest.raises(ValueError, match="num_steps"):
        A.advanced_composition(0.1, 0.0, 2.5, 1e-5)
    assert math.isnan(float(jax.jit(A.advanced_composition)(0.1, 0.0, 2.5, 1e-5)))
    ks = jnp.arange(1.0, 6.0)
    np.testing.assert_allclose(jax.vmap(A.advanced_composition, in_axes=(None, None, 0, None))(0.3, 0.0, ks, 1e-5),
                               A.advanced_composition(0.3, 0.0, ks, 1e-5), rtol=1e-15)


@pytest.mark.parametrize("e,d,k,total", [(0.1, 0.0, 100, 1e-5), (1.0, 1e-6, 10, 1e-4), (0.5, 0.0, 3, 0.3),
                                         (0.2, 1e-8, 250, 1e-5), (0.3, 0.0, 64, 0.5)])
def test_optimal_composition_matches_dp_accounting(e, d, k, total):
    ref = dpa_accountant.advanced_composition(dpa_common.DifferentialPrivacyParameters(e, d), k, total)
    ref = math.inf if ref is None else ref
    got = float(A.optimal_homogeneous_composition(e, d, k, total))
    assert got == pytest.approx(ref, rel=CLOSED_RTOL)
    assert got == pytest.approx(mp_kov(e, d, k, total), rel=CLOSED_RTOL)


def test_optimal_composition_large_k_vs_mpmath():
    # dp_accounting overflows here ((1 + e^ε)^k); the log-space sums do not.
    for e, d, k, total in [(0.05, 1e-10, 2000, 1e-6), (0.01, 0.0, 3000, 1e-5)]:
        got = float(A.optimal_homogeneous_composition(e, d, k, total))
        assert got == pytest.approx(mp_kov(e, d, k, total), rel=CLOSED_RTOL)
        # Never worse than the Dwork-Rothblum-Vadhan bound it refines.
        assert got <= float(A.advanced_composition(e, d, k, total))


def test_optimal_composition_infeasible_and_batch():
    # 1 - (1 - δ)^k > total δ: no ε works.
    assert float(A.optimal_homogeneous_composition(0.1, 1e-6, 100, 1e-5)) == math.inf
    es = jnp.array([0.05, 0.1, 0.2])
    batch = A.optimal_homogeneous_composition(es, 0.0, 100, 1e-5, max_num_steps=128)
    one = [float(A.optimal_homogeneous_composition(float(x), 0.0, 100, 1e-5, max_num_steps=128)) for x in es]
    np.testing.assert_allclose(batch, one, rtol=1e-15)
    with pytest.raises(ValueError, match="num_steps"):
        A.optimal_homogeneous_composition(0.1, 0.0, 200, 1e-5, max_num_steps=128)
    # ε' = ε(k - 2i*) is piecewise linear in ε with slope k - 2i*.
    grad = jax.grad(lambda e: A.optimal_homogeneous_composition(e, 0.0, 100.0, 1e-5, max_num_steps=128))(0.1)
    np.testing.assert_allclose(grad, 44.0)


# ---------------------------------------------------------------------------------------
# Amplification by subsampling.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("e,r,ref", [(1.0, 0.01, 0.0170368632), (0.5, 0.004, 0.0025915242), (2.0, 0.1, 0.4940287080)])
def test_amplification_tutorial_values(e, r, ref):
    # The published values have 10 decimals: agree to that rounding, and to the closed form.
    np.testing.assert_allclose(A.amplify_by_poisson_sampling(e, 1e-6, r)[0], ref, atol=6e-11)
    np.testing.assert_allclose(A.amplify_by_poisson_sampling(e, 1e-6, r)[0], math.log1p(r * math.expm1(e)),
                               rtol=CLOSED_RTOL)
    np.testing.assert_allclose(A.amplify_by_poisson_sampling(e, 1e-6, r)[1], r * 1e-6, rtol=CLOSED_RTOL)
    n, m = round(r * 1000), 1000
    np.testing.assert_allclose(A.amplify_by_sampling_without_replacement(e, 0.0, n, m)[0], ref, atol=6e-11)


def test_amplification_small_rate_precision_and_grad():
    # log(1 + q(e^ε - 1)) for tiny q and ε, against mpmath (a naive log(1 + q*(exp(ε)-1))
    # in float64 loses every digit here).
    q, e = 1e-12, 1e-6
    ref = float(mp.log1p(mp.mpf(q) * mp.expm1(mp.mpf(e))))
    np.testing.assert_allclose(A.amplify_by_poisson_sampling(e, 0.0, q)[0], ref, rtol=1e-14)
    g = jax.grad(lambda q: A.amplify_by_poisson_sampling(1.0, 0.0, q)[0])(0.3)
    np.testing.assert_allclose(g, math.expm1(1.0) / (1 + 0.3 * math.expm1(1.0)), rtol=CLOSED_RTOL)
    with pytest.raises(ValueError, match="batch_size"):
        A.amplify_by_sampling_without_replacement(1.0, 0.0, 11, 10)
    with pytest.raises(ValueError, match="q"):
        A.amplify_by_poisson_sampling(1.0, 0.0, 1.5)


# ---------------------------------------------------------------------------------------
# Discrete divergences.
# ---------------------------------------------------------------------------------------


def _sup_over_events(p, q, eps):
    """max_S p(S) - e^ε q(S) by enumerating every event S (the definition)."""
    n = len(p)
    best = 0.0
    for mask in itertools.product([0, 1], repeat=n):
        m = np.array(mask, bool)
        best = max(best, float(mp.fsum(p[m]) - mp.exp(eps) * mp.fsum(q[m])))
    return best


def test_hockey_stick_by_enumeration():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(6), size=4)
    q = rng.dirichlet(np.ones(6), size=4)
    q[0, 2] = 0.0
    q[0] /= q[0].sum()
    eps = np.array([0.0, 0.1, 0.7, 2.0])
    got = A.hockey_stick_divergence(p, q, eps)
    ref = [_sup_over_events(p[i], q[i], eps[i]) for i in range(4)]
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-15)
    # The tutorial's Claim 2 pair: the tight δ at ε = log 4/3 is 1/15.
    np.testing.assert_allclose(A.hockey_stick_divergence([0.4, 0.6], [0.6, 0.4], math.log(4 / 3)), 1 / 15, rtol=1e-12)
    assert float(A.hockey_stick_divergence([0.5, 0.5], [1.0, 0.0], math.inf)) == 0.5


def test_kl_matches_scipy_and_handles_zeros():
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(5), size=(2, 3))
    q = rng.dirichlet(np.ones(5), size=(2, 3))
    np.testing.assert_allclose(A.kl_divergence(p, q), scipy.special.rel_entr(p, q).sum(-1), rtol=1e-12)
    assert float(A.kl_divergence([0.0, 1.0], [0.5, 0.5])) == pytest.approx(math.log(2), rel=1e-14)
    assert float(A.kl_divergence([0.5, 0.5], [1.0, 0.0])) == math.inf
    g = jax.grad(lambda p: A.kl_divergence(p, jnp.array([0.5, 0.25, 0.25])))(jnp.array([0.5, 0.5, 0.0]))
    assert jnp.all(jnp.isfinite(g))
    np.testing.assert_allclose(g[:2], [1.0, 1.0 + math.log(2)], rtol=1e-12)


def test_divergences_validation_jit_vmap():
    with pytest.raises(ValueError, match="p must sum to 1"):
        A.kl_divergence([0.5, 0.6], [0.5, 0.5])
    with pytest.raises(ValueError, match="p_prime"):
        A.hockey_stick_divergence([0.5, 0.5], [1.5, -0.5], 0.0)
    assert math.isnan(float(jax.jit(A.kl_divergence)(jnp.array([0.5, 0.6]), jnp.array([0.5, 0.5]))))
    p = jnp.array([[0.2, 0.8], [0.5, 0.5]])
    q = jnp.array([0.6, 0.4])
    vm = jax.vmap(A.hockey_stick_divergence, in_axes=(0, None, None))(p, q, 0.2)
    np.testing.assert_allclose(vm, A.hockey_stick_divergence(p, q, 0.2), rtol=1e-15)
    g = jax.grad(A.hockey_stick_divergence, argnums=2)(jnp.array([0.2, 0.8]), q, 0.2)
    np.testing.assert_allclose(g, -math.exp(0.2) * 0.4, rtol=1e-12)


# ---------------------------------------------------------------------------------------
# The jit / grad / x64 matrix for every accountant.
# ---------------------------------------------------------------------------------------

_P2, _Q2 = (0.2, 0.8), (0.6, 0.4)
MATRIX = {
    "calibrate_laplace_scale": (A.calibrate_laplace_scale, (0.5, 2.0)),
    "gaussian_mechanism_delta": (A.gaussian_mechanism_delta, (1.0, 2.0)),
    "gaussian_mechanism_epsilon": (lambda s: A.gaussian_mechanism_epsilon(1e-5, s), (1.0,)),
    "calibrate_gaussian_noise_multiplier": (A.calibrate_gaussian_noise_multiplier, (1.0, 1e-5)),
    "advanced_composition": (A.advanced_composition, (0.1, 0.0, 100.0, 1e-5)),
    "optimal_homogeneous_composition": (
        lambda e: A.optimal_homogeneous_composition(e, 0.0, 100.0, 1e-5, max_num_steps=128), (0.1,)),
    "amplify_by_poisson_sampling": (lambda e, q: A.amplify_by_poisson_sampling(e, 0.0, q)[0], (1.0, 0.01)),
    "amplify_by_sampling_without_replacement": (
        lambda e: A.amplify_by_sampling_without_replacement(e, 0.0, 10, 1000)[0], (1.0,)),
    "basic_composition": (lambda e: A.basic_composition(jnp.stack([e, 2.0 * e]), 0.0)[0], (0.25,)),
    "hockey_stick_divergence": (lambda e: A.hockey_stick_divergence(_P2, _Q2, e), (0.2,)),
    "kl_divergence": (lambda a: A.kl_divergence(jnp.stack([a, 1.0 - a]), _Q2), (0.25,)),
}
# x64 off vs on: the inputs are Python floats (or stacks of float32-exact values), so the
# value is the same float64 number; the gradient is float32 when x64 is off (JAX returns the
# cotangent in the input's dtype), and is compared with central differences of the float64
# value (FD_STEP: truncation and rounding below 1e-7 relative), so 1e-6 covers both.
F32_RTOL = 1e-6


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_accountant_matrix(name):
    f, args = MATRIX[name]
    v64 = float(f(*args))
    fd = (float(f(args[0] + FD_STEP, *args[1:])) - float(f(args[0] - FD_STEP, *args[1:]))) / (2 * FD_STEP)
    assert math.isfinite(v64) and math.isfinite(fd)
    with jax.enable_x64(False):
        v = f(*args)
        assert v.dtype == jnp.float64
        assert float(v) == pytest.approx(v64, rel=1e-15)
        assert float(jax.grad(f)(*args)) == pytest.approx(fd, rel=F32_RTOL)
        assert float(jax.jit(jax.grad(f))(*args)) == pytest.approx(fd, rel=F32_RTOL)


# ---------------------------------------------------------------------------------------
# Properties (hypothesis): certified and monotone.
# ---------------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(eps=st.floats(0.05, 8.0), log10_delta=st.floats(-12.0, -1.0))
def test_analytic_calibration_certified_and_monotone(eps, log10_delta):
    delta = 10.0**log10_delta
    s = float(A.calibrate_gaussian_noise_multiplier(eps, delta))
    assert mp_gauss_delta(eps, s) <= delta
    assert float(A.calibrate_gaussian_noise_multiplier(eps * 1.1, delta)) <= s
    assert float(A.gaussian_mechanism_epsilon(delta, s)) <= eps * (1 + 1e-9)


@settings(max_examples=30, deadline=None)
@given(eps=st.floats(0.0, 2.0), k=st.integers(1, 120), log10_total=st.floats(-9.0, -1.0))
def test_composition_ordering(eps, k, log10_total):
    total = 10.0**log10_total
    opt = float(A.optimal_homogeneous_composition(eps, 0.0, k, total, max_num_steps=128))
    drv = float(A.advanced_composition(eps, 0.0, k, total))
    assert opt <= drv * (1 + 1e-12) + 1e-12 and drv <= k * eps * (1 + 1e-12) + 1e-12
