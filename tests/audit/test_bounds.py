"""Clopper-Pearson intervals and the many-run ε lower bound against scipy (independent references)."""

import jax
import mpmath
import numpy as np
import pytest
from scipy import stats

from jaxdp import audit

# Bisection leaves 2^-100; betainc is accurate to ~1e-13 relative at these sizes, so the
# quantiles agree with scipy's to 1e-9 relative (scipy's own root finding is ~1e-12).
QUANTILE_RTOL = 1e-9


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def test_clopper_pearson_matches_scipy_beta_ppf():
    k = np.array([0, 1, 5, 50, 99, 100, 3, 20_000, 7, 99_990])
    n = np.array([100, 100, 100, 100, 100, 100, 100_000, 100_000, 1_000_000, 100_000])
    c = 0.95
    lo, hi = audit.clopper_pearson(k, n, c)
    a = (1 - c) / 2
    ref_lo = np.where(k > 0, stats.beta.ppf(a, np.maximum(k, 1), n - k + 1), 0.0)
    ref_hi = np.where(k < n, stats.beta.ppf(1 - a, k + 1, np.maximum(n - k, 1)), 1.0)
    np.testing.assert_allclose(np.asarray(lo), ref_lo, rtol=QUANTILE_RTOL, atol=1e-300)
    np.testing.assert_allclose(np.asarray(hi), ref_hi, rtol=QUANTILE_RTOL)
    # the bracket's safe ends: never above scipy's lower bound / below its upper one beyond its precision
    assert np.all(np.asarray(lo) <= ref_lo * (1 + 1e-9))
    assert np.all(np.asarray(hi) >= ref_hi * (1 - 1e-9))


def test_clopper_pearson_one_point_against_mpmath_beta_inverse():
    # Upper bound for k = 3 of n = 1000 at 99 %: I_x(4, 997) = 0.995, solved at 40 digits.
    mpmath.mp.dps = 40
    lo, hi = mpmath.mpf(0), mpmath.mpf(1)
    for _ in range(120):  # bisection: I_x(4, 997) increases in x
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mpmath.betainc(4, 997, 0, mid, regularized=True) < mpmath.mpf("0.995") else (lo, mid)
    ref = hi
    _, hi = audit.clopper_pearson(3, 1000, 0.99)
    assert float(hi) == pytest.approx(float(ref), rel=QUANTILE_RTOL)


def _reference_bound(s_in, s_out, thresholds, delta, confidence):
    """numpy + scipy.stats.beta: the same formula, Bonferroni over the thresholds."""
    tail = (1 - confidence) / (2 * len(thresholds))
    best = 0.0
    for t in thresholds:
        tp, fp = int(np.sum(s_in >= t)), int(np.sum(s_out >= t))
        n1, n0 = len(s_in), len(s_out)
        tpr = stats.beta.ppf(tail, tp, n1 - tp + 1) if tp > 0 else 0.0
        fpr = stats.beta.ppf(1 - tail, fp + 1, n0 - fp) if fp < n0 else 1.0
        cands = []
        if tpr - delta > 0 and fpr > 0:
            cands.append(np.log((tpr - delta) / fpr))
        if 1 - fpr - delta > 0 and 1 - tpr > 0:
            cands.append(np.log((1 - fpr - delta) / (1 - tpr)))
        best = max([best, *cands])
    return best


def test_epsilon_lower_bound_fixed_thresholds_matches_reference():
    rng = np.random.default_rng(0)
    s_in, s_out = 1.0 + rng.standard_normal(3000), rng.standard_normal(3000)
    thresholds = np.array([-2.0, 0.5, 1.5, 2.5, 3.0])
    got = audit.epsilon_lower_bound(s_in, s_out, 1e-4, 0.9, thresholds=thresholds)
    ref = _reference_bound(s_in, s_out, thresholds, 1e-4, 0.9)
    assert float(got.epsilon) == pytest.approx(ref, rel=1e-8)
    assert float(got.epsilon) > 0.5


def test_epsilon_lower_bound_no_evidence_gives_zero():
    # Same shapes and threshold count as above: one compiled program for the module.
    rng = np.random.default_rng(1)
    s = rng.standard_normal(6000)
    thresholds = np.array([-2.0, 0.5, 1.5, 2.5, 3.0])
    lb = audit.epsilon_lower_bound(s[:3000], s[3000:], 1e-4, 0.9, thresholds=thresholds)  # same distribution
    assert float(lb.epsilon) == 0.0


def test_epsilon_lower_bound_validates():
    with pytest.raises(ValueError, match="confidence"):
        audit.epsilon_lower_bound(np.zeros(4), np.zeros(4), 1e-5, 1.5)
    with pytest.raises(ValueError, match="delta"):
        audit.epsilon_lower_bound(np.zeros(4), np.zeros(4), -1.0)
    with pytest.raises(ValueError, match="1-D"):
        audit.epsilon_lower_bound(np.zeros((2, 2)), np.zeros(4), 1e-5)
    with pytest.raises(ValueError, match="successes"):
        audit.clopper_pearson(5, 4)


def test_empirical_tradeoff_boxes_cover_the_true_rates_and_lie_under_the_curve():
    # Gaussian mechanism μ = 1: at threshold t the exact rates are FPR = Φ(-t), TPR = Φ(1 - t).
    import jaxdp

    from scipy.stats import norm

    k1, k2 = jax.random.split(jax.random.key(3))
    s_in = 1.0 + jax.random.normal(k1, (20000,))
    s_out = jax.random.normal(k2, (20000,))
    t = np.linspace(-1.0, 3.5, 10)
    pts = jaxdp.audit.empirical_tradeoff(s_in, s_out, 0.95, thresholds=t)
    assert np.all((pts.fpr_lower <= norm.sf(t)) & (norm.sf(t) <= pts.fpr_upper))
    assert np.all((pts.tpr_lower <= norm.sf(t - 1)) & (norm.sf(t - 1) <= pts.tpr_upper))
    np.testing.assert_allclose(pts.fpr, np.mean(np.asarray(s_out)[:, None] >= t, axis=0))
    # The box's lower-right corner never lies above the claimed (exact) curve.
    curve = np.asarray(jaxdp.accounting.tradeoff(jaxdp.accounting.Gaussian(1.0), pts.fpr_upper, accountant="gdp"))
    assert np.all(pts.tpr_lower <= curve)
    default = jaxdp.audit.empirical_tradeoff(s_in, s_out)
    assert default.fpr.shape == default.tpr_upper.shape and float(default.fpr.min()) == pytest.approx(1 / 20000)
