"""Shifted-interpolation GDP of PNSGD (Bok, Su & Altschuler, ICML 2024).

References (never jaxdp itself):
* an exhaustive minimiser: every start time τ = 0..t-1 and the lower convex hull of every
  step's point, by Andrew's monotone chain in numpy (a different algorithm from the
  library's four-point minorant and its search over start times);
* a direct solution of the allocation problem as a quadratic programme (scipy SLSQP) on
  tiny runs, which checks the convex-minorant reduction itself;
* closed forms evaluated in mpmath at 40 digits: Feldman et al.'s coefficient, the
  NoisyGD strongly convex formula, the NoisyCGD strongly convex worst-record formula, the
  linear-Gaussian instance's exact μ;
* the test vectors computed with mpmath in the implementation note of the paper
  (Bok et al.'s repository formulas), quoted to 10-13 digits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import mpmath as mp
import numpy as np
import pytest

import jaxdp.accounting as A

mp.mp.dps = 40

# The energy carries a 1e-10 relative slack (μ: 5e-11) on top of float64 rounding of the
# geometric sums (μ² moves by 1e-10): closed forms and test vectors agree to twice that.
RTOL = 2e-10
# The QP solver (SLSQP) converges to ~1e-9 in the objective.
RTOL_QP = 1e-6


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


# ---------------------------------------------------------------------------------------
# Independent references.
# ---------------------------------------------------------------------------------------


def _hull_energy(tt, uu):
    """Energy Σ(ΔU)²/ΔT of the lower convex hull of the points (monotone chain)."""
    hull = []
    for p in zip(tt, uu):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            # pop the middle point when it is on or above the chord (cross product ≤ 0)
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) <= 0:
                hull.pop()
            else:
                break
        hull.append(p)
    return sum((b[1] - a[1]) ** 2 / (b[0] - a[0]) for a, b in zip(hull, hull[1:]) if b[0] > a[0])


def exhaustive_mu_over_r(j, m, k, c, z0_units):
    """min over every τ of the allocation energy, in units of ηΔ (μ/r), c < 1 or = 1."""
    t = k * m
    sens = np.zeros(t + 1)
    sens[[(p - 1) * m + j for p in range(1, k + 1)]] = 1.0
    best = math.inf
    for tau in range(t):
        n_loc = t - tau
        z = 0.0 if tau == 0 else z0_units
        i = np.arange(1, n_loc + 1)
        w = c ** (n_loc - i)
        tt = np.concatenate([[0.0], np.cumsum(w * w)])
        uu = np.concatenate([[0.0], z * c**n_loc + np.cumsum(sens[tau + 1:] * w)])
        best = min(best, _hull_energy(tt, uu))
    return math.sqrt(best)


def qp_mu_over_r(j, m, k, c, z0_units, tau):
    """The allocation problem itself: min Σa² s.t. z_k = c z_{k-1} + s_k − a_k ≥ 0, z_t = 0."""
    from scipy.optimize import minimize

    t = k * m
    s = np.zeros(t + 1)
    s[[(p - 1) * m + j for p in range(1, k + 1)]] = 1.0
    z_init = 0.0 if tau == 0 else z0_units
    n_loc = t - tau

    def zs(a):
        z, out = z_init, []
        for q in range(n_loc):
            z = c * z + s[tau + 1 + q] - a[q]
            out.append(z)
        return np.array(out)

    cons = [{"type": "ineq", "fun": lambda a: zs(a)[:-1]}, {"type": "eq", "fun": lambda a: zs(a)[-1:]}]
    a0 = np.full(n_loc, (z_init + s.sum()) / n_loc)
    res = minimize(lambda a: a @ a, a0, jac=lambda a: 2 * a, bounds=[(0, None)] * n_loc, constraints=cons,
                   method="SLSQP", options={"ftol": 1e-14, "maxiter": 500})
    assert res.success
    return math.sqrt(res.fun)


def feldman_mu_over_r(j, m, k):
    return mp.sqrt(mp.mpf(k - 1) / m + mp.mpf(1) / (m - j + 1))


def noisygd_sc(c, t):
    c = mp.mpf(c)
    return mp.sqrt((1 + c) / (1 - c) * (1 - c**t) / (1 + c**t))


def noisycgd_sc_worst(c, l_, e_):
    c = mp.mpf(c)
    x = c ** (l_ * (e_ - 1))
    return mp.sqrt(1 + c ** (2 * l_ - 2) * (1 - c**2) / (1 - c**l_) ** 2 * (1 - x) / (1 + x))


def linear_gaussian_mu_over_r(j, m, k, c):
    """Exact μ/r of the quadratic (linear when c = 1) instance: Gaussian last iterate."""
    c = mp.mpf(c)
    t = k * m
    mean = sum(c ** (t - ((p - 1) * m + j)) for p in range(1, k + 1))
    var = sum(c ** (2 * (t - i)) for i in range(1, t + 1))
    return mean / mp.sqrt(var)


def mu_over_r(positions, n, b, k, c, z0_units, *, lip=1.0, sig=1.0):
    """Library μ/r with η = 1, β = 1, ρ = 1 - c (so c = max(|1-ρ|, 0) = c) and D set from z0."""
    delta_s = 2.0 * lip / b  # the full batches' Δ
    r = delta_s / sig
    pos = np.atleast_1d(np.asarray(positions, dtype=np.float64))
    mu = A.pnsgd_shifted_gdp(_pad(pos), n, lip, sig, 1.0, z0_units * delta_s, smoothness=1.0,
                             strong_convexity=1.0 - c, batch_size=b, passes=k)
    return np.asarray(mu)[: pos.size] / r


# Every call evaluates PAD positions (padded with position 1), so that the tests share one
# compiled program (values are traced; only the shape would recompile).
PAD = 64


def _pad(pos):
    pos = np.asarray(pos, dtype=np.float64).reshape(-1)
    assert pos.size <= PAD
    return np.concatenate([pos, np.ones(PAD - pos.size)])


# ---------------------------------------------------------------------------------------
# Reduction and search against the exhaustive minimum and the QP.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "m,k,c,z0",
    [(5, 4, 1.0, 2.5), (3, 6, 1.0, 0.7), (4, 5, 0.9, 3.0), (1, 12, 0.8, 1.5), (6, 3, 0.5, 10.0),
     (2, 8, 0.99, 1.0), (7, 2, 0.3, 0.2), (4, 6, 1.0, 12.0)],
)
def test_every_record_matches_exhaustive_minimum(m, k, c, z0):
    pos = np.arange(1, m + 1)
    got = mu_over_r(pos, m, 1, k, c, z0)
    want = np.array([exhaustive_mu_over_r(j, m, k, c, z0) for j in pos])
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-300)


@pytest.mark.parametrize("m,k,c,z0,j,tau", [(3, 2, 1.0, 1.5, 2, 0), (3, 2, 1.0, 0.5, 3, 2), (2, 3, 0.8, 2.0, 1, 3),
                                           (4, 1, 0.6, 1.0, 2, 0)])
def test_convex_minorant_solves_the_allocation_qp(m, k, c, z0, j, tau):
    # The start-τ energy by the monotone-chain minorant vs the QP solved directly.
    t = k * m
    sens = np.zeros(t + 1)
    sens[[(p - 1) * m + j for p in range(1, k + 1)]] = 1.0
    n_loc = t - tau
    z = 0.0 if tau == 0 else z0
    w = c ** (n_loc - np.arange(1, n_loc + 1))
    tt = np.concatenate([[0.0], np.cumsum(w * w)])
    uu = np.concatenate([[0.0], z * c**n_loc + np.cumsum(sens[tau + 1:] * w)])
    np.testing.assert_allclose(math.sqrt(_hull_energy(tt, uu)), qp_mu_over_r(j, m, k, c, z0, tau), rtol=RTOL_QP)


# ---------------------------------------------------------------------------------------
# Closed forms and test vectors.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,k,b", [(22, 10, 1), (5, 3, 4), (1, 7, 2), (20, 1, 3)])
def test_convex_run_start_is_twice_feldman(m, k, b):
    # c = 1 and a diameter too large for a later start: μ² = 2 × Feldman's RDP coefficient.
    n = m * b
    pos = np.arange(1, n + 1)
    mu = np.asarray(A.pnsgd_shifted_gdp(_pad(pos), n, 1.3, 0.7, 0.5, 1e6, smoothness=2.0, batch_size=b, passes=k))[:n]
    coef = [2 * 1.3**2 / (b * 0.7) ** 2 * feldman_mu_over_r(math.ceil(i / b), m, k) ** 2 for i in pos]
    np.testing.assert_allclose(np.asarray(mu) ** 2, 2 * np.array([float(x) for x in coef]), rtol=RTOL)


@pytest.mark.parametrize("c,t,want", [(0.95, 160, 6.243294860028), (0.99, 1000, 14.10612698742), (0.9, 10, 3.029146795329)])
def test_noisygd_strongly_convex_closed_form(c, t, want):
    got = mu_over_r([3], 3, 3, t, c, 1e9)[0]  # one batch of all records: NoisyGD
    assert got == pytest.approx(float(noisygd_sc(c, t)), rel=RTOL)
    assert got == pytest.approx(want, rel=RTOL)


@pytest.mark.parametrize("c,l_,e_,want", [(0.99, 20, 5, 1.07533619951), (0.9999, 40, 100, 1.853008197762),
                                          (0.9, 7, 4, None), (0.5, 3, 9, None)])
def test_noisycgd_strongly_convex_worst_record(c, l_, e_, want):
    mu = mu_over_r(np.arange(1, l_ + 1), l_, 1, e_, c, 1e9)
    assert mu.max() == pytest.approx(mu[-1], rel=1e-14)
    assert mu[-1] == pytest.approx(float(noisycgd_sc_worst(c, l_, e_)), rel=RTOL)
    if want is not None:
        assert mu[-1] == pytest.approx(want, rel=RTOL)


def test_noisycgd_logistic_regression_setting():
    # Bok et al.'s logistic regression: c = 0.9999, l = 40, E = 50, r = 2/3.
    mu = mu_over_r([40], 40, 1, 50, 0.9999, 1e9)[0] * 2.0 / 3.0
    assert mu == pytest.approx(0.9924913968982, rel=RTOL)


def test_per_record_vectors():
    got = mu_over_r([1, 22], 22, 1, 10, 1.0, 960.0)
    np.testing.assert_allclose(got, [0.6741998624632, 1.187051350655], rtol=RTOL)
    assert mu_over_r([990], 1000, 1, 1, 0.95, 1e9)[0] == pytest.approx(0.2273082654812, rel=RTOL)


@pytest.mark.parametrize("z,want", [(10.0, 6.324555320337), (20.0, 8.944271909999), (2.5, 3.240370349204)])
def test_never_above_noisygd_convex_diameter_form(z, want):
    # Paper form B (a valid but not optimal allocation) at t = 4⌈z⌉ steps of NoisyGD.
    t = 4 * math.ceil(z)
    assert mu_over_r([2], 2, 2, t, 1.0, z)[0] <= want * (1 + RTOL)
    assert mu_over_r([2], 2, 2, t, 1.0, z)[0] <= math.sqrt(t) * (1 + RTOL)


@pytest.mark.parametrize("z,l_,want", [(32.0, 22, 2.611164839335), (50.0, 20, 3.316624790355)])
def test_never_above_noisycgd_convex_diameter_form(z, l_, want):
    e_ = 4 * math.ceil(z)
    assert mu_over_r([l_], l_, 1, e_, 1.0, z)[0] <= want * (1 + RTOL)


def test_case_b_prime_diameter_start():
    # L = 2, b = 64, σ = 1/16 (r = 1), η = 1, D = 2 (z = 32), 22 batches, 400 passes.
    mu = np.asarray(A.pnsgd_shifted_gdp(_pad([1, 1408]), 1408, 2.0, 0.0625, 1.0, 2.0, smoothness=1.0, batch_size=64,
                                        passes=400))[:2]
    np.testing.assert_allclose(mu, [2.375845162242, 2.577719968295], rtol=RTOL)
    assert float(A.gaussian_mechanism_epsilon(1e-5, 1.0 / mu[1])) == pytest.approx(13.729, abs=6e-4)


@pytest.mark.parametrize("m,k,c", [(1, 30, 0.9), (5, 4, 0.95), (6, 3, 1.0), (3, 5, 0.7)])
def test_never_below_linear_gaussian_instance(m, k, c):
    got = mu_over_r(np.arange(1, m + 1), m, 1, k, c, 1e9)
    want = np.array([float(linear_gaussian_mu_over_r(j, m, k, c)) for j in range(1, m + 1)])
    assert np.all(got >= want * (1 - 1e-13))
    if m == 1:  # NoisyGD: the bound is tight
        np.testing.assert_allclose(got, want, rtol=RTOL)


def test_gdp_conversions_reuse_the_gaussian_mechanism():
    # μ-GDP ⇔ Gaussian mechanism with noise multiplier 1/μ (mpmath vectors of the note).
    for mu, want in ((0.5, 1.993091404415), (1.0, 4.377178095681), (2.0, 9.997256146434)):
        assert float(A.gaussian_mechanism_epsilon(1e-5, 1.0 / mu)) == pytest.approx(want, rel=RTOL)
    assert float(A.gaussian_mechanism_delta(1.0, 1.0)) == pytest.approx(0.1269367375066, rel=1e-12)
    assert float(A.gaussian_mechanism_delta(3.0, 0.5)) == pytest.approx(0.1838130765445, rel=1e-12)


def test_rdp_export():
    mu = A.pnsgd_shifted_gdp(_pad([3, 7]), 7, 1.0, 1.5, 0.4, 2.0, smoothness=1.0, strong_convexity=0.2, passes=3)[:2]
    rdp = A.pnsgd_shifted_rdp([1.5, 4.0], _pad([3, 7]), 7, 1.0, 1.5, 0.4, 2.0, smoothness=1.0, strong_convexity=0.2, passes=3)
    np.testing.assert_allclose(rdp[:2], 0.5 * np.asarray(mu)[:, None] ** 2 * np.array([1.5, 4.0]), rtol=1e-15)


def test_contraction_factor_and_validation():
    assert float(A.shifted_contraction(0.5, 1.0, 0.1)) == pytest.approx(0.95, rel=1e-15)
    assert float(A.shifted_contraction(1.5, 1.0, 0.1)) == pytest.approx(0.85, rel=1e-15)
    # c ≤ step_contraction's M on η ≤ 2/(β+ρ)
    for eta in (0.1, 0.7, 1.2, 2 / 1.3):
        assert float(A.shifted_contraction(eta, 1.0, 0.3)) <= float(A.step_contraction(eta, 1.0, 0.3)) + 1e-15
    kw = dict(smoothness=1.0)
    with pytest.raises(ValueError, match="learning_rate"):
        A.pnsgd_shifted_gdp(1, 4, 1.0, 1.0, 2.5, 1.0, **kw)
    with pytest.raises(ValueError, match="positions"):
        A.pnsgd_shifted_gdp(5, 4, 1.0, 1.0, 0.5, 1.0, **kw)
    with pytest.raises(ValueError, match="diameter"):
        A.pnsgd_shifted_gdp(1, 4, 1.0, 1.0, 0.5, 0.0, **kw)
    with pytest.raises(ValueError, match="strong_convexity"):
        A.pnsgd_shifted_gdp(1, 4, 1.0, 1.0, 0.5, 1.0, smoothness=1.0, strong_convexity=2.0)
    out = jax.jit(lambda s: A.pnsgd_shifted_gdp(_pad([1]), 4, 1.0, s, 0.5, 1.0, **kw))(-1.0)
    assert np.all(np.isnan(out))


def test_monotone_in_position_and_noise():
    pos = np.arange(1, 61)
    mu = np.asarray(A.pnsgd_shifted_gdp(_pad(pos), 60, 1.0, 1.0, 0.5, 0.3, smoothness=1.0, strong_convexity=0.05,
                                        batch_size=4, passes=6))[:60]
    assert np.all(np.diff(mu) >= -1e-12 * mu[1:])
    mu2 = np.asarray(A.pnsgd_shifted_gdp(_pad(pos), 60, 1.0, 2.0, 0.5, 0.3, smoothness=1.0, strong_convexity=0.05,
                                         batch_size=4, passes=6))[:60]
    np.testing.assert_allclose(mu2, mu / 2, rtol=1e-14)


def test_last_batch_smaller():
    # n = 10, b = 4: the last batch has 2 records, Δ = 2L/2.
    mu = A.pnsgd_shifted_gdp(_pad([10]), 10, 1.0, 1.0, 1.0, 1e6, smoothness=1.0, batch_size=4, passes=1)
    assert float(mu[0]) == pytest.approx(1.0, rel=RTOL)  # r = 2·1/(2·1), one final step


def test_gradients_finite_and_match_differences():
    pos = _pad([5])

    def f(x):
        lip, eta, dia, rho = x[0], x[1], x[2], x[3]
        return A.pnsgd_shifted_gdp(pos, 8, lip, 1.0, eta, dia, smoothness=1.0, strong_convexity=rho, batch_size=2,
                                   passes=3)[0]

    # at ρ = 0.1 (strongly convex) and ρ = 0 with a large diameter (convex, run's start)
    for x in (np.array([1.0, 0.5, 0.4, 0.1]), np.array([1.0, 0.5, 100.0, 0.0])):
        g = np.asarray(jax.grad(f)(jnp.asarray(x)))
        assert np.all(np.isfinite(g))
        h = 1e-6
        for i in range(4 if x[3] > 0 else 3):  # ρ = 0 is a boundary: one-sided only
            e = np.zeros(4)
            e[i] = h
            fd = (float(f(jnp.asarray(x + e))) - float(f(jnp.asarray(x - e)))) / (2 * h)
            assert g[i] == pytest.approx(fd, rel=1e-5, abs=1e-8)


@pytest.mark.slow  # compiles a 10^4-position program; benchmarks/pnsgd_positions.py times it
@pytest.mark.parametrize("n", [10_000])
def test_cost_every_position(n):
    # 10^4 steps and every record position (vectorised; the start search is logarithmic).
    pos = np.arange(1, n + 1)
    mu = A.pnsgd_shifted_gdp(pos, n, 1.0, 1.0, 0.5, 1.0, smoothness=1.0, batch_size=100, passes=100)
    assert np.all(np.isfinite(np.asarray(mu)))


# ---------------------------------------------------------------------------------------
# Integration: the best-of, the event, the calibration.
# ---------------------------------------------------------------------------------------


def _mp_gdp_epsilon(mu, delta):
    """ε of μ-GDP at δ (Dong, Roth, Su): root of Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) = δ (bisection, 40 digits)."""
    mu, delta = mp.mpf(mu), mp.mpf(delta)

    def d(e):
        return mp.ncdf(-e / mu + mu / 2) - mp.exp(e) * mp.ncdf(-e / mu - mu / 2)

    lo, hi = mp.mpf(0), mu * mp.sqrt(2 * mp.log(1 / delta)) + mu**2
    for _ in range(160):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if d(mid) > delta else (lo, mid)
    return hi


TRAIN_DEFAULTS = dict(lipschitz=2.0, smoothness=1.0, learning_rate=1.0, noise_std=0.0625, diameter=60.0,
                      num_records=1408, batch_size=64, passes=10)


def test_pnsgd_privacy_best_includes_shifted_gdp():
    # `jaxdp train` defaults (case a of the note): worst 5.7648 -> 5.3450, best 3.0226 -> 2.7886.
    out = A.pnsgd_privacy(**TRAIN_DEFAULTS, delta=1e-5, positions=np.array([1.0, 1408.0]))
    want = [float(_mp_gdp_epsilon(m, mp.mpf("1e-5"))) for m in (0.6741998624632, 1.187051350655)]
    np.testing.assert_allclose(out.shifted_gdp, want, rtol=1e-9)
    np.testing.assert_allclose(out.shifted_gdp, [2.7886, 5.3450], atol=6e-5)
    others = np.minimum(np.minimum(out.contraction, out.iteration), np.minimum(out.strongly_convex, out.composition))
    np.testing.assert_allclose(others, [3.02263696912, 5.76479602725], rtol=1e-9)  # today's best-of
    np.testing.assert_array_equal(out.best, np.minimum(others, out.shifted_gdp))


def test_event_epsilon_delta_and_rdp_use_shifted_gdp():
    ev = A.PNSGD(**TRAIN_DEFAULTS)
    eps = float(A.epsilon(ev, 1e-5))
    assert eps == pytest.approx(float(_mp_gdp_epsilon(1.187051350655, mp.mpf("1e-5"))), rel=1e-9)
    # δ at that ε is the exact GDP δ (μ as in the library, up to its 1e-10 slack).
    mu = 1.187051350655
    d_mp = mp.ncdf(-eps / mu + mu / 2) - mp.exp(eps) * mp.ncdf(-eps / mu - mu / 2)
    assert float(A.delta(ev, eps)) == pytest.approx(float(d_mp), rel=1e-8)
    curve = np.asarray(A.rdp(ev, [2.0, 8.0]))
    np.testing.assert_allclose(curve, 0.5 * mu**2 * np.array([2.0, 8.0]), rtol=RTOL)  # below Feldman's 1.409α


def test_calibrate_shifted_gdp():
    # σ* with μ(σ*) = μ_max(ε, δ): μ scales as 1/σ, so σ* = μ(σ = 1)·/μ_max; μ_max by mpmath.
    kw = dict(lipschitz=1.0, smoothness=1.0, learning_rate=0.5, diameter=1e6, num_records=20, strong_convexity=0.1,
              passes=3)
    sig = float(A.calibrate_pnsgd_noise_std(2.0, 1e-5, **kw, analysis="shifted_gdp"))
    # μ at σ = 1 for the worst record: NoisyCGD strongly convex closed form (c = 0.95, r = 2; D too large for a later start)
    mu1 = 2.0 * float(noisycgd_sc_worst(0.95, 20, 3))
    lo, hi = mp.mpf("0.01"), mp.mpf(2)  # μ_max: ε(μ) = 2, ε increasing in μ
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _mp_gdp_epsilon(mid, "1e-5") < 2 else (lo, mid)
    mu_max = (lo + hi) / 2
    assert sig == pytest.approx(mu1 / float(mu_max), rel=1e-8)
    assert sig >= mu1 / float(mu_max) * (1 - 1e-12)  # on the safe side
