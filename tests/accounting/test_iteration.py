"""Amplification-by-iteration RDP bounds (Feldman et al. 2018; Balle et al. 2019).

References (never jaxdp itself): the closed forms and test vectors of
shared/notes/seeds/001_pabi.md, direct sums in Python floats, a brute-force numerical
minimisation of Theorem 22 over shift schedules (scipy SLSQP), and the improved RDP→DP
conversion minimised over a fine grid of orders (tests/references.py).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize

from jaxdp.accounting import _iteration as I

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from references import rdp_to_epsilon_improved

# Vectors printed to 10 significant digits in the notes.
RTOL_10 = 1e-9
# Closed forms evaluated in float64 both ways.
RTOL_EXACT = 1e-13


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


@pytest.mark.parametrize(
    "alpha,n,lip,noise_std,i,want",
    [(2, 100, 1, 1, 1, 0.04), (2, 100, 1, 1, 50, 0.07843137255), (2, 100, 1, 1, 100, 4), (10, 100, 1, 1, 1, 0.2), (10, 100, 1, 1, 50, 0.3921568627), (10, 100, 1, 1, 100, 20), (8, 10000, 1, 4, 1, 1e-4), (8, 10000, 1, 4, 5000, 1.99960008e-4), (8, 10000, 1, 4, 10000, 1)],
)
def test_theorem23_vectors(alpha, n, lip, noise_std, i, want):
    got = float(I.pnsgd_iteration_rdp([alpha], i, n, lip, noise_std)[0])
    assert got == pytest.approx(want, rel=RTOL_10)
    assert got == pytest.approx(2 * alpha * lip**2 / (noise_std**2 * (n - i + 1)), rel=RTOL_EXACT)
    assert float(I.skip_pnsgd_iteration_rdp([alpha], i, n, lip, noise_std)[0]) == got


def test_theorem23_profile_and_shape():
    got = np.asarray(I.pnsgd_iteration_rdp(jnp.array([2.0]), jnp.arange(1, 11), 10, 1.0, 1.0))[:, 0]
    want = [0.4, 0.4444444444, 0.5, 0.5714285714, 0.6666666667, 0.8, 1.0, 1.3333333333, 2.0, 4.0]
    np.testing.assert_allclose(got, want, rtol=RTOL_10)
    assert I.pnsgd_iteration_rdp(np.array([1.5, 2.0, 8.0]), jnp.arange(1, 5)[:, None], 4, 1.0, 1.0).shape == (4, 1, 3)


@pytest.mark.parametrize(
    "alpha,i,n,k,noise_std,want",
    [(2, 100, 100, 5, 1, 4.16), (2, 1, 100, 5, 1, 0.2), (2, 50, 100, 5, 1, 0.2384313725), (2, 3, 6, 3, 1, 2.333333333), (2, 6, 6, 3, 1, 5.333333333), (2, 1, 5, 4, 1, 3.2), (2, 2, 5, 4, 1, 3.4), (3, 4, 5, 4, 1, 6.6), (2, 5, 5, 4, 1, 6.4), (2, 1, 8, 2, 1, 1), (2, 7, 8, 2, 0.5, 10)],
)
def test_multi_epoch_vectors(alpha, i, n, k, noise_std, want):
    assert float(I.pnsgd_iteration_rdp([alpha], i, n, 1.0, noise_std, passes=k)[0]) == pytest.approx(want, rel=RTOL_10)


def _theorem22_min(shifts, noise_std=1.0):
    """min Σ a_t²/(2σ²) (per unit α) s.t. a ≥ 0, prefix sums of a ≤ prefix sums of s, equal at the end."""
    s = np.asarray(shifts, dtype=float)
    t = s.size
    cs = np.cumsum(s)
    cons = [{"type": "eq", "fun": lambda a: np.sum(a) - cs[-1]}]
    cons += [{"type": "ineq", "fun": (lambda a, j=j: cs[j] - np.sum(a[: j + 1]))} for j in range(t - 1)]
    a0 = np.full(t, cs[-1] / t)
    res = optimize.minimize(lambda a: np.sum(a**2) / (2 * noise_std**2), a0, bounds=[(0, None)] * t, constraints=cons, method="SLSQP", options={"ftol": 1e-14, "maxiter": 500})
    assert res.success
    return res.fun


@pytest.mark.parametrize("n,b,k,i", [(6, 1, 3, 2), (8, 2, 2, 3), (7, 3, 2, 7), (5, 1, 1, 2)])
def test_batches_and_passes_match_brute_force_theorem22(n, b, k, i):
    # Shift 2ηL/b_j (η = L = 1) at each use of the record's batch; noise sd η σ = 1.
    m = math.ceil(n / b)
    j = math.ceil(i / b)
    b_j = b if j < m else n - (m - 1) * b
    shifts = np.zeros(k * m)
    for p in range(k):
        shifts[p * m + j - 1] = 2.0 / b_j
    want = _theorem22_min(shifts)  # RDP / α
    got = float(I.pnsgd_iteration_rdp([2.0], i, n, 1.0, 1.0, batch_size=b, passes=k)[0]) / 2
    assert got == pytest.approx(want, rel=1e-6)


def test_batch1_pass1_reduce_exactly():
    a = I.pnsgd_iteration_rdp([3.0], 7, 30, 1.3, 0.7)
    b = I.pnsgd_iteration_rdp([3.0], 7, 30, 1.3, 0.7, batch_size=1, passes=1)
    assert float(a[0]) == float(b[0]) == pytest.approx(2 * 3 * 1.3**2 / (0.7**2 * 24), rel=RTOL_EXACT)


@pytest.mark.parametrize(
    "alpha,n,noise_std,harm,lme",
    [(2, 1000, 2, 0.01497094172, 0.008526703875), (2, 100, 2, 0.1037475504, 0.06072422062), (10, 10000, 14, 1.99747062e-4, 1.096804444e-4)],
)
def test_stop_pnsgd_vectors(alpha, n, noise_std, harm, lme):
    assert float(I.stop_pnsgd_iteration_rdp([alpha], n, 1.0, noise_std)[0]) == pytest.approx(harm, rel=RTOL_10)
    got = float(I.stop_pnsgd_iteration_rdp([alpha], n, 1.0, noise_std, form="logmeanexp")[0])
    # Exact log-mean-exp by a direct sum; ours bounds the tail, so it is ≥ and very close.
    y = (alpha - 1) * 2 * alpha / noise_std**2
    exact = math.log1p(sum(math.expm1(y / t) for t in range(1, n + 1)) / n) / (alpha - 1)
    assert exact == pytest.approx(lme, rel=RTOL_10)
    assert exact * (1 - 1e-14) <= got <= exact * (1 + 1e-4)
    assert got <= float(I.stop_pnsgd_iteration_rdp([alpha], n, 1.0, noise_std)[0])


def test_stop_pnsgd_profile_condition_and_pitfall():
    prof = np.asarray(I.stop_pnsgd_iteration_rdp([2.0], 10, 1.0, 2.0, positions=jnp.arange(1, 11)))[:, 0]
    want = [0.5857936508, 0.5657936508, 0.5435714286, 0.5185714286, 0.49, 0.4566666667, 0.4166666667, 0.3666666667, 0.3, 0.2]
    np.testing.assert_allclose(prof, want, rtol=RTOL_10)
    # σ ≥ L√(2α(α−1)): at σ = 2 the harmonic form holds up to α = 2 only.
    v = np.asarray(I.stop_pnsgd_iteration_rdp([2.0, 2.5, 4.69], 1000, 1.0, 2.0))
    assert np.isfinite(v[0]) and np.isinf(v[1]) and np.isinf(v[2])
    # Pitfall demo of the notes: ε(δ=1e-5) from the harmonic form at α = 2 is 11.5279;
    # the log-mean-exp form at α ≈ 4.69 gives ≈ 3.643.
    assert v[0] + math.log(1e5) == pytest.approx(11.5279, abs=1e-4)
    lme = float(I.stop_pnsgd_iteration_rdp([4.69], 1000, 1.0, 2.0, form="logmeanexp")[0])
    assert lme + math.log(1e5) / 3.69 == pytest.approx(3.643, abs=2e-3)
    # Large n, positions near the end: the tail bound path (more than 32 terms) stays close.
    y = 1 * 2 * 2 / 1.0**2
    exact = math.log1p(sum(math.expm1(y / t) for t in range(1, 5001)) / 20000) / 1
    got = float(I.stop_pnsgd_iteration_rdp([2.0], 20000, 1.0, 1.0, positions=15000, form="logmeanexp")[0])
    assert exact <= got <= exact * (1 + 1e-3)


def test_strongly_convex_forms():
    m = math.sqrt(0.76)
    for i, want in [(20, 0.005604575435), (30, 0.04420839553), (39, 1.52)]:
        assert float(I.strongly_convex_iteration_rdp([2.0], i, 40, 1.0, 1.0, m)[0]) / 2 == pytest.approx(want, rel=RTOL_10)
    assert float(I.strongly_convex_iteration_rdp([2.0], 40, 40, 1.0, 1.0, m)[0]) / 2 == pytest.approx(2.0, rel=RTOL_EXACT)
    # "shifted": M^{2K}(1−M²)/(1−M^{2(K+1)}) · 2L²/σ², and Theorem 23 at M = 1.
    for i in (1, 20, 39, 40):
        K = 40 - i
        want = 2 * m ** (2 * K) / sum(m ** (2 * l) for l in range(K + 1))
        got = float(I.strongly_convex_iteration_rdp([2.0], i, 40, 1.0, 1.0, m, form="shifted")[0]) / 2
        assert got == pytest.approx(want, rel=1e-12)
        at_one = float(I.strongly_convex_iteration_rdp([2.0], i, 40, 1.0, 1.0, 1.0, form="shifted")[0])
        assert at_one == pytest.approx(float(I.pnsgd_iteration_rdp([2.0], i, 40, 1.0, 1.0)[0]), rel=RTOL_EXACT)
    # M = 0: later steps forget the record entirely.
    assert float(I.strongly_convex_iteration_rdp([2.0], 3, 40, 1.0, 1.0, 0.0, form="shifted")[0]) == 0.0
    # Batches: n, i → m, j and L → L/b_j.
    got = float(I.strongly_convex_iteration_rdp([2.0], 7, 30, 1.0, 1.0, m, batch_size=4)[0]) / 2
    assert got == pytest.approx(2 / 16 * m**7 / 6, rel=1e-12)


def _shifted_brute(m, K):
    """min Σ a_l² s.t. Σ_l M^{K−l} a_l = M^K s (s = 2, noise sd 1), by SLSQP."""
    w = np.array([m ** (K - l) for l in range(K + 1)])
    cons = [{"type": "eq", "fun": lambda a: w @ a - 2 * m**K}]
    res = optimize.minimize(lambda a: np.sum(a**2) / 2, np.full(K + 1, 0.1), constraints=cons, method="SLSQP", options={"ftol": 1e-15})
    return res.fun


@pytest.mark.parametrize("m,K", [(0.8, 3), (0.5, 5), (0.95, 8)])
def test_shifted_form_matches_brute_force(m, K):
    got = float(I.strongly_convex_iteration_rdp([2.0], 10 - K, 10, 1.0, 1.0, m, form="shifted")[0]) / 2
    assert got == pytest.approx(_shifted_brute(m, K), rel=1e-6)


@settings(max_examples=30, deadline=None)
@given(m=st.floats(0.0, 1.0), i=st.integers(1, 50))
def test_proposition1_never_below_shifted_optimum(m, i):
    p1 = float(I.strongly_convex_iteration_rdp([2.0], i, 50, 1.0, 1.0, m)[0])
    sh = float(I.strongly_convex_iteration_rdp([2.0], i, 50, 1.0, 1.0, m, form="shifted")[0])
    assert sh <= p1 * (1 + 1e-12) + 1e-300


@pytest.mark.parametrize("c,delta,want", [(0.02, 1e-5, 0.9797051824), (2, 1e-5, 11.59705182), (2e-4, 1e-6, 0.1053304354), (0.008, 1e-5, 0.6149708518)])
def test_linear_conversion_classic(c, delta, want):
    assert float(I.linear_rdp_epsilon(c, delta, method="classic")) == pytest.approx(want, rel=RTOL_10)


def test_linear_conversion_improved_against_fine_grid():
    orders = np.geomspace(1.0101, 1e6, 40000)
    for c, delta in [(0.02, 1e-5), (2.0, 1e-5), (2e-4, 1e-6), (0.008, 1e-5), (50.0, 1e-8), (1e-7, 1e-3)]:
        got = float(I.linear_rdp_epsilon(c, delta))
        ref = rdp_to_epsilon_improved(orders, c * orders, delta)
        assert got <= ref + 1e-12  # continuous optimum is at most the grid's
        assert got == pytest.approx(ref, rel=1e-7, abs=1e-12)
    # Total-variation shortcut: δ ≥ √(1 − e^{−c}) gives ε = 0.
    assert float(I.linear_rdp_epsilon(1e-6, 0.01)) == 0.0
    assert float(I.linear_rdp_epsilon(0.0, 1e-5)) == 0.0
    assert float(I.linear_rdp_epsilon(jnp.inf, 1e-5)) == math.inf


@pytest.mark.parametrize("c", [1e16, 1e20, 1e30, 1e34, 1e36, 1e300])
def test_linear_conversion_huge_coefficient_is_not_zero(c):
    """A noise std of 1e-18 gives coefficients near 1e36, where the optimal order 1 + u rounds
    to 1: the conversion once returned ε = 0 there (log(1 − 1/α) = −inf), a privacy breach.
    Reference: the Canonne–Kamath–Steinke bound minimised in mpmath at 60 digits."""
    import mpmath as mp

    mp.mp.dps = 60
    cm, ld = mp.mpf(c), mp.log(mp.mpf("1e-5"))

    def eps(u):
        return cm * (1 + u) + mp.log(u) - mp.log1p(u) - (ld + mp.log1p(u)) / u

    u0 = mp.sqrt(-ld / cm)
    ref = min(eps(u0 * f) for f in (mp.mpf(1) / 4, mp.mpf(1) / 2, 1, 2, 4))
    got = float(I.linear_rdp_epsilon(c, 1e-5))
    assert got >= float(ref) * (1 - 1e-12)
    assert got == pytest.approx(float(ref), rel=1e-9)


def test_pnsgd_privacy_tiny_noise_is_not_private():
    from jaxdp.accounting import pnsgd_privacy

    r = pnsgd_privacy(lipschitz=1.0, smoothness=1.0, learning_rate=0.5, noise_std=1e-18, diameter=1.0,
                      num_records=100, delta=1e-5, positions=np.array([1, 50, 100]))
    for name, v in r._asdict().items():
        if name != "positions":
            assert np.all(np.asarray(v) > 1e30), name  # 2L²/(b²σ²) ≈ 2e36 per step


def test_linear_delta_prop1():
    for eps, k, want in [(0.5, 1 / 78, 0.00977228), (1.0, 1 / 78, 5.58487e-9), (1.0, 0.025, 7.43855e-5), (2.0, 0.5, 0.324652), (5.0, 2.0, 0.324652)]:
        assert float(I.linear_rdp_delta(eps, k)) == pytest.approx(want, rel=1e-5)
    assert float(I.linear_rdp_delta(0.3, 0.5)) == 1.0
    # Inverse of the classic epsilon.
    e = float(I.linear_rdp_epsilon(0.3, 1e-6, method="classic"))
    assert float(I.linear_rdp_delta(e, 0.3)) == pytest.approx(1e-6, rel=1e-10)


def test_errors_nan_and_jit():
    with pytest.raises(ValueError, match="position"):
        I.pnsgd_iteration_rdp([2.0], 0, 10, 1.0, 1.0)
    with pytest.raises(ValueError, match="orders"):
        I.pnsgd_iteration_rdp([1.0], 1, 10, 1.0, 1.0)
    with pytest.raises(ValueError, match="noise_std"):
        I.pnsgd_iteration_rdp([2.0], 1, 10, 1.0, 0.0)
    with pytest.raises(ValueError, match="passes"):
        I.pnsgd_iteration_rdp([2.0], 1, 10, 1.0, 1.0, passes=0)
    with pytest.raises(ValueError, match="contraction"):
        I.strongly_convex_iteration_rdp([2.0], 1, 10, 1.0, 1.0, 1.2)
    with pytest.raises(ValueError, match="form"):
        I.stop_pnsgd_iteration_rdp([2.0], 10, 1.0, 1.0, form="log")
    with pytest.raises(ValueError, match="delta"):
        I.linear_rdp_epsilon(0.1, 1.0)
    f = jax.jit(lambda p, s: I.pnsgd_iteration_rdp(jnp.array([2.0]), p, 10, 1.0, s))
    assert np.isnan(float(f(11, 1.0)[0])) and np.isnan(float(f(1, -1.0)[0]))
    np.testing.assert_array_equal(np.asarray(f(3, 1.5)), np.asarray(I.pnsgd_iteration_rdp([2.0], 3, 10, 1.0, 1.5)))
    g = jax.jit(I.linear_rdp_epsilon)
    assert np.isnan(float(g(0.1, 1.5))) and np.isnan(float(g(-0.1, 1e-5)))
    assert float(g(0.02, 1e-5)) == float(I.linear_rdp_epsilon(0.02, 1e-5))
    v = jax.vmap(lambda c: I.linear_rdp_epsilon(c, 1e-5))(jnp.array([0.02, 2.0]))
    np.testing.assert_allclose(np.asarray(v), [float(I.linear_rdp_epsilon(0.02, 1e-5)), float(I.linear_rdp_epsilon(2.0, 1e-5))], rtol=1e-14)


def test_linear_epsilon_gradient():
    f = lambda c: I.linear_rdp_epsilon(c, 1e-5)  # noqa: E731
    h = 1e-7
    fd = (float(f(0.02 + h)) - float(f(0.02 - h))) / (2 * h)
    assert float(jax.grad(f)(0.02)) == pytest.approx(fd, rel=1e-5)


@settings(max_examples=30, deadline=None)
@given(i1=st.integers(1, 200), i2=st.integers(1, 200), k=st.integers(1, 4), b=st.integers(1, 7))
def test_rdp_non_decreasing_in_position(i1, i2, k, b):
    lo, hi = min(i1, i2), max(i1, i2)
    f = lambda i: float(I.pnsgd_iteration_rdp([2.0], i, 200, 1.0, 1.0, batch_size=b, passes=k)[0])  # noqa: E731
    assert f(lo) <= f(hi) * (1 + 1e-14)
