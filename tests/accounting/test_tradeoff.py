"""Trade-off curves of events against independent references.

References: the Gaussian curve Φ(Φ⁻¹(α) + μ) evaluated with scipy.stats (Dong, Roth & Su
2022, Eq. (6)); dp_accounting's PLD profile (``get_delta_for_epsilon``) turned into a TPR
bound here, by its own envelope over a dense ε grid; the RDP → Bernoulli constraint solved
with scipy's brentq at each order.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import mpmath as mp
import numpy as np
import pytest
from scipy import optimize
from scipy.stats import norm

import jaxdp.accounting as A

FPR = np.array([0.0, 1e-9, 1e-6, 1e-4, 1e-3, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 0.99, 1.0])
# ndtr/ndtri in float64 against scipy's: both within a few ulp of Φ, so 1e-10 (the issue's
# acceptance) holds with a wide margin; abs because TPR spans 0 to 1.
ATOL_GDP = 1e-10
# Small grids keep each PLD evaluation under a second; the bracket is certified at any size.
GRID = 2**12


def _gaussian_curve(mu, fpr):
    return norm.cdf(norm.ppf(fpr) + mu)


@pytest.mark.parametrize("event,mu", [
    (A.Gaussian(1.0), 1.0),
    (A.Gaussian(0.37), 1.0 / 0.37),
    (A.SelfComposed(A.Gaussian(2.0), 4), 1.0),
    (A.Composed((A.Gaussian(1.0), A.SelfComposed(A.Gaussian(3.0), 9))), math.sqrt(2.0)),
])
def test_gdp_curve_of_gaussian_mechanisms_is_exact(event, mu):
    got = np.asarray(A.tradeoff(event, FPR, accountant="gdp"))
    np.testing.assert_allclose(got, _gaussian_curve(mu, FPR), rtol=0, atol=ATOL_GDP)
    assert got.dtype == np.float64
    assert float(A.gdp_mu(event)) == pytest.approx(mu, rel=1e-15)


def test_gdp_of_pnsgd_is_shifted_interpolation():
    ev = A.PNSGD(1.0, 0.5, 0.5, 2.0, 1.0, num_records=40)
    mu = float(A.pnsgd_shifted_gdp(40, 40, 1.0, 2.0, 0.5, 1.0, smoothness=0.5))
    np.testing.assert_allclose(A.tradeoff(ev, FPR, accountant="gdp"), _gaussian_curve(mu, FPR), atol=ATOL_GDP)


def _dp_accounting_tpr(sigma, q, count, fpr):
    """TPR bound from dp_accounting's (pessimistic) PLD profile on a dense ε grid, both lines."""
    from dp_accounting.pld import privacy_loss_distribution as pldlib

    pld = pldlib.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=1e-4)
    pld = pld.self_compose(count) if count > 1 else pld
    eps = np.linspace(0.0, 20.0, 4001)
    d = np.asarray(pld.get_delta_for_epsilon(eps))
    a = np.asarray(fpr)[:, None]
    lines = np.minimum(np.exp(eps) * a + d, 1.0 - np.exp(-eps) * (1.0 - d - a))
    return np.clip(lines.min(axis=1), 0.0, 1.0)


def test_pld_curve_brackets_the_exact_gaussian_curve():
    ev = A.Gaussian(1.0)
    up = np.asarray(A.tradeoff(ev, FPR, accountant="pld", grid_size=GRID))
    lo = np.asarray(A.tradeoff(ev, FPR, accountant="pld", estimate="lower", grid_size=GRID))
    exact = _gaussian_curve(1.0, FPR)
    assert np.all(lo <= exact + 1e-15) and np.all(exact <= up + 1e-15)
    # Tight where it matters: the upper bound's excess is second order in the ε step (0.05).
    assert np.max(up - exact) < 2e-4


@pytest.mark.parametrize("q,sigma,count", [(0.5, 1.0, 4), (0.1, 0.8, 10)])
def test_pld_curve_against_dp_accounting(q, sigma, count):
    ev = A.SelfComposed(A.PoissonSampled(q, A.Gaussian(sigma)), count)
    fpr = FPR[(FPR > 0) & (FPR < 1)]
    up = np.asarray(A.tradeoff(ev, fpr, accountant="pld", grid_size=GRID))
    lo = np.asarray(A.tradeoff(ev, fpr, accountant="pld", estimate="lower", grid_size=GRID))
    ref = _dp_accounting_tpr(sigma, q, count, fpr)
    assert np.all(lo <= up)
    # Never below dp_accounting's TPR (measured: at least 1 + 5e-9 times it here). Relative
    # 1e-6 allows for its pessimistic discretisation of the loss (1e-4), which can put its
    # own δ a little above the true profile.
    assert np.all(up >= ref * (1 - 1e-6) - 1e-12), (up, ref)
    # The lower bound stays below it too (dp_accounting's value is an upper bound).
    assert np.all(lo <= ref + 1e-12)


def test_rdp_curve_is_an_upper_bound_and_solves_the_bernoulli_constraint():
    ev = A.Gaussian(1.3)
    orders = (1.5, 2.0, 4.0, 16.0, 64.0)
    fpr = FPR[(FPR > 0) & (FPR < 1)]
    got = np.asarray(A.tradeoff(ev, fpr, orders=orders))
    assert np.all(got >= _gaussian_curve(1 / 1.3, fpr) - 1e-15)

    def renyi(p, r, a):  # D_a(Bern(p) ‖ Bern(r)) · (a − 1), 40 digits
        p, r = mp.mpf(p), mp.mpf(r)
        return mp.log(p**a * r ** (1 - a) + (1 - p) ** a * (1 - r) ** (1 - a))

    with mp.workdps(40):
        for x, g in zip(fpr, got):
            best = 1.0
            for a in orders:
                b = (a - 1) * a / (2 * mp.mpf(1.3) ** 2)
                h = lambda t: max(renyi(t, x, a), renyi(x, t, a)) - b  # noqa: E731
                if h(1 - mp.mpf(10) ** -30) > 0:
                    best = min(best, optimize.brentq(lambda t: float(h(t)), x, 1 - 1e-16, xtol=1e-300, rtol=1e-15))
            assert g == pytest.approx(best, rel=1e-9, abs=1e-15)


def test_transformations_and_gradients():
    f = lambda s, acc: A.tradeoff(A.Gaussian(s), 0.05, accountant=acc)  # noqa: E731
    # GDP: d/dσ Φ(z + 1/σ) = -φ(z + 1/σ)/σ².
    z = norm.ppf(0.05)
    assert float(jax.grad(f)(1.3, "gdp")) == pytest.approx(-norm.pdf(z + 1 / 1.3) / 1.3**2, rel=1e-10)
    for acc in ("gdp", "rdp"):
        val = float(f(1.3, acc))
        assert float(jax.jit(f, static_argnums=1)(1.3, acc)) == pytest.approx(val, rel=1e-12)
        v = jax.vmap(lambda s: f(s, acc))(jnp.array([1.3, 2.0]))
        assert float(v[0]) == pytest.approx(val, rel=1e-12) and v.dtype == jnp.float64
        h = 1e-6
        fd = (float(f(1.3 + h, acc)) - float(f(1.3 - h, acc))) / (2 * h)
        assert float(jax.grad(f)(1.3, acc)) == pytest.approx(fd, rel=1e-6)
    # Batches broadcast against fpr.
    out = A.tradeoff(A.Gaussian(jnp.array([1.0, 2.0])), jnp.array([[0.01], [0.1]]), accountant="gdp")
    assert out.shape == (2, 2)


def test_pld_under_jit_and_batches():
    eps = np.linspace(0.0, 10.0, 41)
    f = lambda s: A.tradeoff(A.Gaussian(s), 0.05, accountant="pld", epsilons=eps, grid_size=GRID)  # noqa: E731
    val = float(f(1.0))
    assert float(jax.jit(f)(1.0)) == pytest.approx(val, rel=1e-9)
    batch = A.tradeoff(A.Gaussian(jnp.array([1.0, 2.0])), 0.05, accountant="pld", epsilons=eps, grid_size=GRID)
    assert batch.shape == (2,) and float(batch[0]) == pytest.approx(val, rel=1e-9)


def test_bad_input():
    ev = A.Gaussian(1.0)
    with pytest.raises(ValueError, match="fpr"):
        A.tradeoff(ev, 1.5)
    with pytest.raises(ValueError, match="estimate='lower'"):
        A.tradeoff(ev, 0.1, estimate="lower")
    with pytest.raises(ValueError, match="Gaussian-DP"):
        A.tradeoff(A.PoissonSampled(0.1, ev), 0.1, accountant="gdp")
    with pytest.raises(ValueError, match="accountant"):
        A.tradeoff(ev, 0.1, accountant="prv")
    with pytest.raises(ValueError, match="epsilons"):
        A.tradeoff(ev, 0.1, accountant="pld", epsilons=[1.0, 2.0])
    assert np.isnan(float(jax.jit(lambda s: A.tradeoff(A.Gaussian(s), 0.1, accountant="gdp"))(-1.0)))
