"""The PLD lower bound (``estimate="lower"``, merged buckets) against independent references.

References: the exact Gaussian-DP curve and the exact hockey-stick curve of one Poisson-sampled
Gaussian step (closed forms, evaluated with mpmath at 40 digits), and dp_accounting 0.6.0's
pessimistic PLD (an upper bound on the true ε) on issue 27's five DP-SGD configurations.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import mpmath
import numpy as np
import pytest

import jaxdp.accounting as A

mpmath.mp.dps = 40

# Issue 27's acceptance table (benchmarks/pld.py): (q, σ, steps) at δ = 1e-5.
TABLE = [(256 / 60000, 1.1, 14063), (0.001, 0.8, 1000), (0.1, 2.0, 100), (0.01, 1.0, 10000), (0.001, 1.0, 10000)]


def _gauss_delta(eps, mu):
    eps, mu = mpmath.mpf(eps), mpmath.mpf(mu)
    return mpmath.ncdf(-eps / mu + mu / 2) - mpmath.exp(eps) * mpmath.ncdf(-eps / mu - mu / 2)


def _gauss_epsilon(delta, mu):
    lo, hi = 0.0, 200.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _gauss_delta(mid, mu) > delta else (lo, mid)
    return hi


def _sampled_gauss_delta(eps, q, sigma):
    """max over add/remove of P(L > ε) - e^ε Q(L > ε) for one Poisson-sampled Gaussian step."""
    eps, q, sigma = mpmath.mpf(eps), mpmath.mpf(q), mpmath.mpf(sigma)
    mu = 1 / sigma
    out = []
    # remove: P = (1-q)N(0,1) + qN(μ,1), Q = N(0,1); L > ε ⟺ x > z0.
    y = mpmath.log((mpmath.exp(eps) - 1 + q) / q)
    z0 = y / mu + mu / 2
    out.append((1 - q) * mpmath.ncdf(-z0) + q * mpmath.ncdf(-(z0 - mu)) - mpmath.exp(eps) * mpmath.ncdf(-z0))
    # add: P = N(0,1), Q = (1-q)N(0,1) + qN(μ,1); L > ε ⟺ x < w (for ε < -log(1-q)).
    if eps < -mpmath.log(1 - q):
        w = mpmath.log((mpmath.exp(-eps) - 1 + q) / q) / mu + mu / 2
        out.append(mpmath.ncdf(w) - mpmath.exp(eps) * ((1 - q) * mpmath.ncdf(w) + q * mpmath.ncdf(w - mu)))
    return float(max(out))


def test_lower_gaussian_compositions_below_and_near_closed_form():
    cases = [(2.0, 4), (1.0, 1), (0.8, 100), (5.0, 1000), (3.0, 25)]
    sig = jnp.array([s for s, _ in cases])
    k = jnp.array([float(c) for _, c in cases])
    ev = A.SelfComposed(A.Gaussian(sig), k)
    for n in (2**10, 2**14):
        lo = np.asarray(A.epsilon(ev, 1e-5, accountant="pld", grid_size=n, estimate="lower"))
        d_lo = np.asarray(A.delta(ev, 1.0, accountant="pld", grid_size=n, estimate="lower"))
        for i, (s, c) in enumerate(cases):
            mu = math.sqrt(c) / s
            exact = _gauss_epsilon(1e-5, mu)
            assert lo[i] <= exact, (n, s, c, lo[i], exact)
            assert d_lo[i] <= float(_gauss_delta(1.0, mu)), (n, s, c)
            if n == 2**14:  # merged buckets: the bias is a small fraction of h per step
                assert lo[i] >= 0.99 * exact, (n, s, c, lo[i], exact)


def test_lower_sampled_gaussian_step_below_closed_form():
    q = jnp.array([1e-3, 0.01, 0.1, 0.5, 1.0])
    sigma = jnp.array([0.8, 1.0, 2.0, 0.6, 1.5])
    ev = A.PoissonSampled(q, A.Gaussian(sigma))
    for eps in (0.0, 0.05, 0.5, 2.0):
        lo = np.asarray(A.delta(ev, eps, accountant="pld", grid_size=2**12, estimate="lower"))
        for i in range(5):
            qi, si = float(q[i]), float(sigma[i])
            exact = _sampled_gauss_delta(eps, min(qi, 1 - 1e-30), si) if qi < 1 else float(_gauss_delta(eps, 1 / si))
            assert lo[i] <= exact * (1 + 1e-9) + 1e-15, (qi, si, eps, lo[i], exact)
            assert lo[i] >= 0.9 * exact - 1e-6, (qi, si, eps, lo[i], exact)


def _dp_accounting_epsilon(q, sigma, steps, delta=1e-5):
    """dp_accounting's pessimistic PLD at value step 1e-4: above the true ε."""
    import dp_accounting
    from dp_accounting import pld

    acc = pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), int(steps))
    return acc.get_epsilon(delta)


def _check_table(table, grid_size, min_ratios):
    q, s, t = (np.array(x, dtype=float) for x in zip(*table))
    b = A.pld_bracket(A.dpsgd_event(q, s, t), 1e-5, grid_size=grid_size)
    for i, cfg in enumerate(table):
        ref = _dp_accounting_epsilon(*cfg)
        lo, up = float(b.lower[i]), float(b.upper[i])
        assert lo <= ref, (cfg, lo, ref)
        assert lo >= min_ratios[i] * up, (cfg, lo, up)


def test_lower_dpsgd_below_dp_accounting_small_grid():
    # Long compositions at a coarse grid; rounding buckets down gave lower = 0 on both. For
    # q = 0.001 the spacing at 2^12 (h ≈ 1e-3) is as wide as a step's loss spread, so most
    # merged buckets go one bin down and the lower bound is 0 there too (only its validity is
    # checked; 0.94 × the upper at the default 2^14, the slow test below).
    _check_table([(0.01, 1.0, 2000), (0.001, 0.8, 1000)], 2**12, [0.5, 0.0])


@pytest.mark.slow
def test_lower_dpsgd_table_below_dp_accounting_and_half_the_upper():
    # Issue 27's acceptance: lower ≥ 0.5 × upper at the default grid on its five configurations
    # (measured 0.955-1.000 with the s13 plan, 0.66-1.00 before; benchmarks/pld.py prints the table).
    _check_table(TABLE, A.PLD_GRID_SIZE, [0.5] * len(TABLE))


@pytest.mark.parametrize("sigma", [0.8786, 1.0244])
def test_lower_bound_below_dp_accountings_pessimistic_pld_where_main_overstated_it(sigma):
    """Session 11 found the rounded-down lower bound at 1.78 (σ = 0.8786) and 0.958 (σ = 1.0244)
    for q = 1e-3, 1000 steps, δ = 1e-6, where the truth is about 0.29 and 0.18: a "lower bound"
    above the upper. The merged-bucket lower bound stays below dp_accounting's pessimistic PLD
    (an upper bound on the true ε) and below jaxdp's own upper bound."""
    dpa = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant

    event = A.dpsgd_event(1e-3, sigma, 1000)
    bracket = A.pld_bracket(event, 1e-6)
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dpa.PoissonSampledDpEvent(1e-3, dpa.GaussianDpEvent(sigma)), 1000)
    assert float(bracket.lower) <= acc.get_epsilon(1e-6)
    assert float(bracket.lower) <= float(bracket.upper)


# (q, ε₀, k, δ): Poisson-sampled (ε₀, 1e-7)-DP steps. Before session 16 the lower bound of the
# first three exceeded the exact ε (0.00517 against 0.00368 for the first, above its own upper
# bound): the masses above the grid's cut sat at the grid's top bin, not at the cut, and the
# ε read-out raised a solution below the window's bottom to that bottom.
SAMPLED_APPROX_DP = [(0.0004028, 0.4808, 75, 1e-5), (0.0003555, 0.371, 157, 1e-5), (0.00236, 0.8317, 48, 1e-3),
                     (0.01, 0.48, 10, 1e-5)]


def test_lower_bound_of_sampled_approx_dp_below_the_exact_epsilon():
    # (One program, the lower bound; the upper bound in the slow test below.)
    from tests.references import sampled_approx_dp_epsilon

    q, e0, k, d = (np.array(c, float) for c in zip(*SAMPLED_APPROX_DP))
    event = A.SelfComposed(A.PoissonSampled(q, A.ApproxDP(e0, 1e-7)), k)
    lower = np.asarray(A.epsilon(event, d, accountant="pld", estimate="lower", grid_size=2**12))
    for i, c in enumerate(SAMPLED_APPROX_DP):
        exact = sampled_approx_dp_epsilon(c[0], c[1], 1e-7, c[2], c[3])
        assert lower[i] <= exact, (c, lower[i], exact)
        if i < 3:  # (tight where the window holds the answer)
            assert lower[i] >= 0.9 * exact, (c, lower[i], exact)


@pytest.mark.slow
def test_upper_bound_of_sampled_approx_dp_above_the_exact_epsilon():
    from tests.references import sampled_approx_dp_epsilon

    q, e0, k, d = (np.array(c, float) for c in zip(*SAMPLED_APPROX_DP))
    event = A.SelfComposed(A.PoissonSampled(q, A.ApproxDP(e0, 1e-7)), k)
    for grid_size in (2**10, 2**14):
        upper = np.asarray(A.epsilon(event, d, accountant="pld", grid_size=grid_size))
        for i, c in enumerate(SAMPLED_APPROX_DP):
            assert upper[i] >= sampled_approx_dp_epsilon(c[0], c[1], 1e-7, c[2], c[3]), (c, grid_size, upper[i])
