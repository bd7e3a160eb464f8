"""One-run auditing (Steinke, Nasr & Jagielski 2023, Theorem 5.2) against an mpmath implementation."""

import jax
import mpmath
import numpy as np
import pytest

from jaxdp import audit

# The p-value is a binomial tail plus a small δ term; jaxdp uses betainc (relative error
# ~1e-13) and a float64 table of pmfs, mpmath sums exactly at 40 digits.
P_RTOL = 1e-9
# ε from bisection (80 halvings) on either side; a 1e-9 relative change of β moves ε by far less.
EPS_ATOL = 1e-6


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _mp_p_value(eps, m, r, v, delta):
    mpmath.mp.dps = 40
    p = 1 / (1 + mpmath.exp(-mpmath.mpf(eps)))
    pmf = [mpmath.binomial(r, k) * p**k * (1 - p) ** (r - k) for k in range(r + 1)]
    tails = [mpmath.mpf(0)] * (r + 2)  # tails[u] = P[Bin >= u]
    for k in range(r, -1, -1):
        tails[k] = tails[k + 1] + pmf[k]
    alpha = max([(tails[v - i] - tails[v]) / i for i in range(1, v + 1)], default=0)
    return min(tails[v] + 2 * m * mpmath.mpf(delta) * alpha, 1)


def _mp_epsilon(m, r, v, delta, confidence):
    lo, hi = mpmath.mpf(0), mpmath.mpf(64)
    for _ in range(45):  # 64 / 2^45 < 2e-12
        mid = (lo + hi) / 2
        if _mp_p_value(mid, m, r, v, delta) < 1 - confidence:
            lo = mid
        else:
            hi = mid
    return float(lo)


# One m for every case: num_canaries is static, so each m is a compiled program.
M = 1000
P_CASES = [(1.0, 100, 80, 0.0), (0.5, 50, 40, 1e-4), (2.0, 300, 290, 1e-5), (0.1, 50, 30, 1e-3), (3.0, 1000, 990, 0.0)]
EPS_CASES = [(100, 100, 0.0), (200, 180, 1e-5), (40, 35, 1e-3), (120, 64, 0.0)]


def test_p_value_matches_mpmath():
    eps, r, v, delta = (np.array(c) for c in zip(*P_CASES))
    got = np.asarray(audit.one_run_p_value(eps, M, r, v, delta))
    ref = [float(_mp_p_value(*c[:1], M, *c[1:])) for c in P_CASES]
    np.testing.assert_allclose(got, ref, rtol=P_RTOL)


def test_epsilon_lower_bound_matches_mpmath_and_grows():
    r, v, delta = (np.array(c) for c in zip(*EPS_CASES))
    got = np.asarray(audit.one_run_epsilon_lower_bound(M, r, v, delta, 0.95))
    ref = [_mp_epsilon(M, *c, 0.95) for c in EPS_CASES]
    np.testing.assert_allclose(got, ref, atol=EPS_ATOL)
    # the defining property: the p-value at the returned ε is below the level
    assert np.all(np.asarray(audit.one_run_p_value(got, M, r, v, delta))[got > 0] < 0.05)
    # more canaries all guessed right: a larger bound; about half right (random guessing): ~0
    # (same shape (4,) as above: one compiled program)
    more = np.asarray(audit.one_run_epsilon_lower_bound(M, np.array([10, 100, 1000, 1000]),
                                                        np.array([10, 100, 1000, 510]), 0.0, 0.95))
    assert more[0] < more[1] < more[2]
    assert got[3] < 0.1 and more[3] < 0.1


def test_random_guesses_give_about_zero():
    rng = np.random.default_rng(0)
    inc = rng.random(M) < 0.5
    res = audit.one_run_audit(rng.standard_normal(M), inc, num_guesses=(10, 50, 200, 1000))
    assert float(res.epsilon) < 0.2


def test_validation():
    with pytest.raises(ValueError, match="num_correct"):
        audit.one_run_epsilon_lower_bound(100, 10, 11)
    with pytest.raises(ValueError, match="num_canaries"):
        audit.one_run_p_value(1.0, 0, 0, 0)
    with pytest.raises(ValueError, match="num_guesses"):
        audit.one_run_audit(np.zeros(5), np.zeros(5, bool), num_guesses=(6,))
