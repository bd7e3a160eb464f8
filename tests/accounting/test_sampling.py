"""Fixed-size and truncated sampling events (jaxdp/accounting/_sampling.py).

References: dp_accounting 0.6.0's RdpAccountant for sampling without replacement (the same
theorem, computed in its own code), Theorem 27 evaluated exactly in mpmath (where
dp_accounting's double-precision forward differences cancel), and exact Rényi divergences
of single-step output distributions (mpmath quadrature) as lower bounds for all three.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import mpmath as mp
import numpy as np
import pytest

import jaxdp.accounting as A
from tests.references import mixture_renyi, wor_theorem27_rdp

dpa = pytest.importorskip("dp_accounting")
from dp_accounting.rdp import rdp_privacy_accountant as R  # noqa: E402

REPLACE = dpa.NeighboringRelation.REPLACE_ONE
DELTA = 1e-5


def _wor_configs(count, seed):
    rng = np.random.default_rng(seed)
    n = rng.integers(100, 100_000, count)
    q = np.exp(rng.uniform(math.log(1e-3), math.log(0.9), count))
    m = np.maximum(1, np.round(q * n)).astype(int)
    sigma = np.exp(rng.uniform(math.log(0.5), math.log(8.0), count))
    steps = rng.integers(1, 5000, count)
    return n, m, sigma, steps


def _dpa_wor_epsilon(n, m, sigma, steps, orders=None):
    acc = R.RdpAccountant(orders=orders, neighboring_relation=REPLACE)
    ev = dpa.SampledWithoutReplacementDpEvent(int(n), int(m), dpa.GaussianDpEvent(float(sigma)))
    acc.compose(dpa.SelfComposedDpEvent(ev, int(steps)))
    return acc.get_epsilon(DELTA)


def _check_wor_parity(count, seed):
    n, m, sigma, steps = _wor_configs(count, seed)
    ev = A.SelfComposed(A.SampledWithoutReplacement(n.astype(float), m.astype(float),
                                                    A.Gaussian(sigma, relation="replace_one")), steps.astype(float))
    mine = np.asarray(A.epsilon(ev, DELTA))
    ref = np.array([_dpa_wor_epsilon(*c) for c in zip(n, m, sigma, steps)])
    np.testing.assert_allclose(mine, ref, rtol=1e-6)
    # Never below dp_accounting by more than its own rounding (jaxdp adds a rounding bound).
    assert np.all(mine >= ref * (1 - 1e-9))


def test_wor_epsilon_matches_dp_accounting():
    _check_wor_parity(16, seed=1)


@pytest.mark.slow  # dp_accounting takes ~0.6 s per configuration (pure Python forward differences)
def test_wor_epsilon_matches_dp_accounting_on_220_configurations():
    _check_wor_parity(220, seed=2)


def test_wor_curve_matches_dp_accounting_where_nothing_cancels():
    # σ ≤ 5: dp_accounting's forward differences keep their precision; the whole curve
    # (integer, fractional and the Stirling branch at 512 and 1024) agrees.
    orders = A.DEFAULT_ORDERS
    for q, s in [(0.01, 1.0), (0.1, 0.5), (0.001, 5.0), (0.3, 2.0), (0.9, 0.7), (0.05, 3.0)]:
        mine = np.asarray(A.sampled_without_replacement_rdp(orders, q, s))
        ref = R._compute_rdp_sample_wor_gaussian(q, s, orders)
        np.testing.assert_allclose(mine, ref, rtol=1e-6)


@pytest.mark.parametrize("q,sigma", [(0.5, 10.0), (0.9, 20.0), (0.2, 3.0), (0.01, 1.0),
                                     # log A of a tiny A - 1 through log1p (the log of the rounded
                                     # 1 + x was 3e-13 below the theorem at α = 2 here)
                                     pytest.param(0.212, 55.0, marks=pytest.mark.slow)])
def test_wor_never_below_exact_theorem27(q, sigma):
    # mpmath evaluates Theorem 27 with exact forward differences. At large σ dp_accounting's
    # double-precision differences are rounding noise (0.17 relative off at α = 64 for
    # σ = 10, and 6.5e-9 *below* the exact value at σ = 20, α = 20); jaxdp carries a
    # rounding bound and never falls below.
    orders = [2.0, 3.0, 8.0, 20.0, 30.0, 64.0]
    mine = np.asarray(A.sampled_without_replacement_rdp(orders, q, sigma))
    exact = np.array([wor_theorem27_rdp(q, sigma, int(a)) for a in orders])
    assert np.all(mine >= exact * (1 - 1e-13)), (mine, exact)
    # Where nothing cancels (the low orders) it is the theorem's value.
    np.testing.assert_allclose(mine[:3], exact[:3], rtol=1e-9)


@pytest.mark.parametrize("q,sigma,alpha", [(0.1, 1.0, 2.0), (0.3, 0.8, 3.0), (0.05, 2.0, 8.0), (0.5, 1.5, 4.5)])
def test_wor_never_below_single_step_divergence(q, sigma, alpha):
    # Pairs a data set and its replace-one neighbour can produce (records' values 0, 1/2,
    # -1/2, 1; replace-one sensitivity 1): the record is in the sample with probability q.
    got = float(A.sampled_without_replacement_rdp([alpha], q, sigma)[0])
    pairs = [
        (([1 - q, q], [0.0, 1.0]), ([1.0], [0.0])),
        (([1.0], [0.0]), ([1 - q, q], [0.0, 1.0])),
        (([1 - q, q], [0.0, 0.5]), ([1 - q, q], [0.0, -0.5])),
    ]
    for (pw, pm), (qw, qm) in pairs:
        assert got >= mixture_renyi(alpha, pw, pm, qw, qm, sigma)


def test_wr_single_draw_closed_form_and_lower_bound():
    orders = np.array([2.0, 3.5, 8.0])
    n, s = 100.0, 1.0
    got = np.asarray(A.sampled_with_replacement_rdp(orders, n, 1, s))
    want = np.log1p(np.expm1(orders * (orders - 1) / (2 * s * s)) / n) / (orders - 1)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # m = 3 draws from n = 10: the pair "record drawn K ~ Bin(3, 1/10) times" vs "never".
    m, n = 3, 10.0
    w = [math.comb(m, k) * (1 / n) ** k * (1 - 1 / n) ** (m - k) for k in range(m + 1)]
    for a in (2.0, 5.0):
        lb = mixture_renyi(a, w, [float(k) for k in range(m + 1)], [1.0], [0.0], 2.0)
        assert float(A.sampled_with_replacement_rdp([a], n, m, 2.0)[0]) >= lb


@pytest.mark.parametrize("m,n,sigma", [(3, 10.0, 1.0), pytest.param(4, 3.0, 2.0, marks=pytest.mark.slow),
                                         pytest.param(2, 2.0, 0.7, marks=pytest.mark.slow)])
def test_wr_never_below_brute_force_single_step(m, n, sigma):
    """Small cases by brute force (mpmath quadrature): the record is drawn K ~ Bin(m, 1/n)
    times, and each copy moves the batch sum by ±1/2 of the replace-one sensitivity (records
    +C and −C) or by 1 (+C against 0). The released sum's Rényi divergence of either pair,
    both orders, is at most the bound."""
    from scipy.special import logsumexp

    w = np.array([math.comb(m, k) * (1 / n) ** k * (1 - 1 / n) ** (m - k) for k in range(m + 1)])
    half = np.arange(m + 1) / 2
    ks = np.arange(m + 1, dtype=float)
    pairs = [((w, half), (w, -half)), ((w, ks), ([1.0], [0.0])), (([1.0], [0.0]), (w, ks))]
    # D_α(P‖Q) by the trapezoid rule in float64 on a grid of 0.001σ over ±(m + 40σ): the
    # integrand is smooth and negligible beyond, so the error is far below the 1e-6 allowed.
    z = np.linspace(-m - 40 * sigma, m + 40 * sigma, int((2 * m + 80 * sigma) / (1e-3 * sigma)) + 1)

    def log_dens(ws, ms):
        ms = np.asarray(ms)[:, None]
        return logsumexp(-0.5 * ((z[None, :] - ms) / sigma) ** 2, b=np.asarray(ws)[:, None], axis=0) \
            - math.log(sigma * math.sqrt(2 * math.pi))

    bounds = np.asarray(A.sampled_with_replacement_rdp([2.0, 4.5], n, m, sigma))
    for a, got in zip((2.0, 4.5), bounds):
        for (pw, pm), (qw, qm) in pairs:
            integrand = a * log_dens(pw, pm) + (1 - a) * log_dens(qw, qm)
            div = (logsumexp(integrand) + math.log(z[1] - z[0])) / (a - 1)
            assert got >= div * (1 - 1e-6), (a, got, div)


def test_dp_accounting_has_no_accountant_for_sampling_with_replacement():
    """Why the with-replacement bound has no dp_accounting parity test: 0.6.0 has the event
    but neither accountant supports it (if a later version does, compare with it here)."""
    from dp_accounting.pld import pld_privacy_accountant as P

    ev = dpa.SampledWithReplacementDpEvent(1000, 10, dpa.GaussianDpEvent(1.0))
    assert not R.RdpAccountant(neighboring_relation=REPLACE).supports(ev)
    assert not P.PLDAccountant(neighboring_relation=REPLACE).supports(ev)


def _tp_output_mixture(q, others, record, cap, include_record):
    """Exact output law (weights, means) of truncated Poisson on 1-D values, σ applied later."""
    import itertools

    vals = list(others) + ([record] if include_record else [])
    out = {}
    for draw in itertools.product([0, 1], repeat=len(vals)):
        p = 1.0
        for d in draw:
            p *= q if d else 1 - q
        chosen = [v for v, d in zip(vals, draw) if d]
        if len(chosen) <= cap:
            subsets = [(1.0, chosen)]
        else:
            combos = list(itertools.combinations(chosen, cap))
            subsets = [(1.0 / len(combos), list(c)) for c in combos]
        for w, sub in subsets:
            mean = round(sum(sub), 12)
            out[mean] = out.get(mean, 0.0) + p * w
    return list(out.values()), list(out.keys())


@pytest.mark.parametrize("q,cap,sigma,alpha", [(0.5, 1, 1.0, 2.0), (0.3, 2, 0.8, 3.0), (0.7, 1, 2.0, 5.0)])
def test_truncated_poisson_never_below_exact_single_step(q, cap, sigma, alpha):
    # n = 4 records (3 common + the differing one), values in [-1, 1] (clipping norm 1):
    # the exact output distributions of both neighbours, by enumeration, in both directions.
    got = float(A.truncated_poisson_rdp([alpha], q, 4, cap, sigma)[0])
    for others, rec in [([-1.0, -1.0, -1.0], 1.0), ([0.0, 0.0, 0.0], 1.0), ([1.0, -1.0, 0.0], 1.0)]:
        pw, pm = _tp_output_mixture(q, others, rec, cap, True)
        qw, qm = _tp_output_mixture(q, others, rec, cap, False)
        assert got >= mixture_renyi(alpha, pw, pm, qw, qm, sigma)
        assert got >= mixture_renyi(alpha, qw, qm, pw, pm, sigma)


def test_truncated_poisson_reduces_to_poisson_and_is_monotone():
    orders = A.DEFAULT_ORDERS
    np.testing.assert_allclose(A.truncated_poisson_rdp(orders, 0.01, 1000, 1001, 1.1),
                               A.sampled_gaussian_rdp(orders, 0.01, 1.1), rtol=1e-12)
    caps = np.array([0.0, 5.0, 20.0, 40.0, 80.0])
    e = np.asarray(A.epsilon(A.SelfComposed(A.TruncatedPoissonSampled(0.02, 1000, caps, A.Gaussian(1.0)), 100),
                             DELTA))
    e_poisson = float(A.epsilon(A.dpsgd_event(0.02, 1.0, 100), DELTA))
    assert e[0] == 0.0  # an empty batch releases nothing
    # Caps at and above the mean (20) cost at least Poisson; a small cap can cost less in
    # truth (dp_accounting's PLD agrees) and in this bound (the record is rarely kept).
    assert np.all(e[2:] >= e_poisson * (1 - 1e-12))
    # Pr[Bin(1000, 0.02) ≥ 80] ≈ 1e-20, but the high orders still see it (σ/2 there):
    # within 5 % of Poisson, not equal.
    assert e[-1] <= 1.05 * e_poisson


def test_rdp_accountant_refuses_wrong_relations_and_inner_events():
    with pytest.raises(ValueError, match="replace_one"):
        A.epsilon(A.SampledWithoutReplacement(100, 10, A.Gaussian(1.0)), DELTA)
    with pytest.raises(ValueError, match="add_remove"):
        A.epsilon(A.TruncatedPoissonSampled(0.1, 100, 10, A.Gaussian(1.0, relation="replace_one")), DELTA)
    with pytest.raises(ValueError, match="Gaussian"):
        A.epsilon(A.SampledWithReplacement(100, 10, A.Laplace(1.0, relation="replace_one")), DELTA)
    with pytest.raises(ValueError, match="batch_size"):
        A.epsilon(A.SampledWithoutReplacement(100, 101, A.Gaussian(1.0, relation="replace_one")), DELTA)
    with pytest.raises(ValueError, match="max_batch_size"):
        A.epsilon(A.TruncatedPoissonSampled(0.1, 100, -1, A.Gaussian(1.0)), DELTA)
    with pytest.raises(ValueError, match="batch_size"):
        A.SampledWithReplacement(100, 2.5, A.Gaussian(1.0, relation="replace_one"))


def _events(sigma):
    return {
        "wor": A.SelfComposed(A.SampledWithoutReplacement(1000.0, 50.0, A.Gaussian(sigma, relation="replace_one")), 200),
        "wr": A.SelfComposed(A.SampledWithReplacement(1000.0, 20, A.Gaussian(sigma, relation="replace_one")), 200),
        "trunc": A.SelfComposed(A.TruncatedPoissonSampled(0.05, 1000.0, 60.0, A.Gaussian(sigma)), 200),
    }


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("kind", ["wor", "wr", "trunc"])
def test_jit_vmap_grad_in_both_x64_modes(kind, x64):
    # Integer orders for the truncated event (its fractional-order curves over ~70 buckets
    # take a minute to compile); one fractional order for the others.
    orders = (2.0, 4.0, 8.0, 32.0) if kind == "trunc" else (2.0, 3.5, 8.0, 32.0)
    with jax.enable_x64(True):
        ref = float(A.epsilon(_events(2.0)[kind], DELTA, orders=orders))
        h = 1e-5
        fd = (float(A.epsilon(_events(2.0 + h)[kind], DELTA, orders=orders))
              - float(A.epsilon(_events(2.0 - h)[kind], DELTA, orders=orders))) / (2 * h)
    with jax.enable_x64(x64):
        f = lambda s: A.epsilon(_events(s)[kind], DELTA, orders=orders)  # noqa: E731
        assert f(2.0).dtype == jnp.float64
        assert float(jax.jit(f)(2.0)) == pytest.approx(ref, rel=1e-12)
        sig = jnp.asarray([1.5, 2.0, 3.0])
        v = np.asarray(jax.vmap(f)(sig))
        assert v[1] == pytest.approx(ref, rel=1e-12) and v[0] > v[1] > v[2]
        g = float(jax.grad(f)(2.0))
        assert g == pytest.approx(fd, rel=1e-4)
        assert float(jax.jit(jax.grad(f))(2.0)) == pytest.approx(g, rel=1e-10)


def test_dp_accounting_interop_both_ways():
    from jaxdp.interop import from_dp_event, to_dp_event

    wor = A.SelfComposed(A.SampledWithoutReplacement(60000, 256, A.Gaussian(1.1, relation="replace_one")), 1000)
    dp, rel = to_dp_event(wor)
    assert rel == "replace_one" and isinstance(dp.event, dpa.SampledWithoutReplacementDpEvent)
    acc = R.RdpAccountant(neighboring_relation=REPLACE)
    acc.compose(dp)
    assert float(A.epsilon(from_dp_event(dp, "replace_one"), DELTA)) == pytest.approx(acc.get_epsilon(DELTA),
                                                                                      rel=1e-9)
    wr = A.SampledWithReplacement(1000, 20, A.Gaussian(2.0, relation="replace_one"))
    back = from_dp_event(to_dp_event(wr).dp_event, "replace_one")
    assert isinstance(back, A.SampledWithReplacement) and back.batch_size == 20 and back.num_records == 1000
    tp = A.TruncatedPoissonSampled(0.01, 1000, 15, A.Gaussian(1.5))
    dp_tp, rel_tp = to_dp_event(tp)
    assert rel_tp == "add_remove" and isinstance(dp_tp, dpa.TruncatedSubsampledGaussianDpEvent)
    assert (dp_tp.dataset_size, dp_tp.sampling_probability, dp_tp.truncated_batch_size,
            dp_tp.noise_multiplier) == (1000, 0.01, 15, 1.5)
    back = from_dp_event(dp_tp)
    assert isinstance(back, A.TruncatedPoissonSampled) and back.max_batch_size == 15
    with pytest.raises(ValueError, match="replace_one"):
        from_dp_event(dp)  # relation defaults to add_remove: refused, named
    with pytest.raises(ValueError, match="add_remove"):
        from_dp_event(dp_tp, "replace_one")


def test_shuffled_event_is_the_gaussian_composition_under_replace_one():
    # Reference: dp_accounting's RDP accountant (REPLACE_ONE) on P Gaussian steps with
    # noise σC over the replace-one sensitivity 2C.
    for sigma, passes in [(1.0, 1), (2.0, 10), (8.0, 50)]:
        acc = R.RdpAccountant(neighboring_relation=REPLACE)
        acc.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(sigma / 2), passes))
        ev = A.shuffled_event(sigma, passes)
        assert A.relation_of(ev) == "replace_one"
        assert float(A.epsilon(ev, DELTA)) == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)
    # It takes no credit for the shuffle: far above Poisson at the batch's rate.
    shuffled = float(A.epsilon(A.shuffled_event(1.0, 10), DELTA))
    poisson = float(A.epsilon(A.dpsgd_event(256 / 60000, 1.0, 10 * 60000 // 256), DELTA))
    assert shuffled > 3 * poisson
    with pytest.raises(ValueError, match="noise_multiplier"):
        A.shuffled_event(0.0, 3)
