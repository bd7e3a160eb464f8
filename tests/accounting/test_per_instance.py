"""Per-instance accounting (Thudi et al. 2024; Feldman and Zrnic 2021) against independent references.

References written here with mpmath: the Rényi divergence of the Gaussian mixture by
quadrature, the integer-order binomial sum, Theorem 3.3 in its literal form (Eq. 2), and a
plain-Python individual Rényi filter. Published test values are from the extraction of
Thudi et al. (its test vectors TV-1, TV-2, TV-3, TV-6, TV-7, TV-12).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import mpmath as mp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxdp.accounting as A
from jaxdp.accounting import _per_instance as PI
from tests.references import rdp_to_epsilon_improved

# Quadrature at 30 digits is exact to far below this; the accountant's own error (log-space
# float64 sums, certified margin on fractional orders) is below 2e-10 relative for σ/r ≤ 50.
QUAD_RTOL = 1e-9
# The r = 1 value must be the data-independent one to rounding.
R1_RTOL = 1e-12
# Published tables are rounded to 6-10 significant digits.
TABLE6_RTOL = 2e-5
# Monotonicity is exact in real arithmetic; float64 sums may wobble by a few ulps.
MONO_RTOL = 1e-12


# ---------------------------------------------------------------- references (mpmath)


def quad_rdp(q, sigma, delta, alpha, reverse=False, dps=30):
    """D_α(mix ‖ N(0,σ²)) (or the reverse) with mix = (1-q)N(0,σ²) + qN(Δ,σ²), by quadrature."""
    with mp.workdps(dps):
        q, s, d, a = (mp.mpf(x) for x in (q, sigma, delta, alpha))

        def ratio(z):  # mix / N0
            return 1 - q + q * mp.exp((2 * z * d - d * d) / (2 * s * s))

        def integrand(z):
            base = mp.npdf(z, 0, s)
            lr = ratio(z)
            return base * (lr ** (1 - a) if reverse else lr**a)

        hi = float(a) * float(d) + 14 * float(sigma)
        pts = [mp.mpf(-14 * float(sigma)) + (hi + 14 * float(sigma)) * k / 60 for k in range(61)]
        val = mp.quad(integrand, [-mp.inf] + pts + [mp.inf])
        return float(mp.log(val) / (a - 1))


def int_rdp(q, sigma, r, alpha, dps=50):
    """Thudi et al. Theorem 3.2 (integer α) in multiple precision."""
    with mp.workdps(dps):
        q_, s, r_ = mp.mpf(q), mp.mpf(sigma), mp.mpf(r)
        tot = mp.mpf(0)
        for k in range(2, int(alpha) + 1):
            tot += mp.binomial(alpha, k) * q_**k * (1 - q_) ** (alpha - k) * mp.expm1(r_**2 * (k * k - k) / (2 * s**2))
        return mp.log1p(tot) / (alpha - 1)


def literal_theorem_33(runs_r, q, sigma, alpha, p):
    """Eq. 2 of Thudi et al. verbatim (proof's g_p), per-step D at ⌈β_i⌉ (the paper's rule).

    runs_r: list of runs, each a list of n per-step r (r[0] the same in every run).
    """
    n = len(runs_r[0])
    with mp.workdps(40):
        p_ = mp.mpf(p)
        a = mp.mpf(alpha)
        total = mp.mpf(0)
        for i in range(n):
            t = n - i  # 1-based step
            beta = 1 + (p_ / (p_ - 1)) ** i * (a - 1)
            order = int(alpha) if i == 0 else int(math.ceil(float(beta) * (1 + 1e-13)))
            ds = [int_rdp(q, sigma, run[t - 1], order) for run in runs_r]
            if t == 1:
                total += max(ds) * ((p_ - 1) / p_) ** (n - 1) * (beta - 1) / (a - 1)
            else:
                mean = sum(mp.exp((beta - 1) * d * p_) for d in ds) / len(ds)
                total += (p_ - 1) ** i / p_ ** (i + 1) / (a - 1) * mp.log(mean)
        return float(total)


# ---------------------------------------------------------------- one step (Theorem 3.2)

TV1 = [  # q, σ, Δ, α, Thm 3.2 value, reverse-direction quadrature
    (0.1, 1.0, 1.0, 2, 0.01703686324, 0.01147565453),
    (0.1, 1.0, 0.5, 4, 0.006003282964, 0.005020518986),
    (0.3, 2.0, 1.0, 8, 0.1608587424, 0.06746875372),
    (0.05, 0.8, 0.7, 3, 0.004635466084, 0.003455290786),
]


@pytest.mark.parametrize("q,sigma,delta,alpha,value,rev", TV1)
def test_tv1_against_quadrature(q, sigma, delta, alpha, value, rev):
    got = float(A.per_instance_sampled_gaussian_rdp([float(alpha)], q, sigma, delta)[0])
    quad = quad_rdp(q, sigma, delta, alpha)
    assert got == pytest.approx(quad, rel=QUAD_RTOL)
    assert got == pytest.approx(value, rel=1e-9)
    # The formula bounds both directions: the reverse divergence is below it.
    rquad = quad_rdp(q, sigma, delta, alpha, reverse=True)
    assert rquad == pytest.approx(rev, rel=1e-9)
    assert rquad <= got


@pytest.mark.parametrize(
    "q,sigma,r,alpha,value",
    [(0.1, 1.0, 0.5, 2.5, 0.003594077199), (0.05, 0.8, 0.7, 3.7, 0.0060649102), (0.01, 1.0, 0.02, 5.5, None)],
)
def test_fractional_orders_are_upper_bounds_by_quadrature(q, sigma, r, alpha, value):
    """Fractional orders: exact series plus a certified margin, so at or above the truth."""
    got = float(A.per_instance_sampled_gaussian_rdp([alpha], q, sigma, r)[0])
    quad = quad_rdp(q, sigma, r, alpha)
    assert got >= quad * (1 - 1e-15)
    assert got == pytest.approx(quad, rel=QUAD_RTOL)
    if value is not None:
        assert got == pytest.approx(value, rel=1e-9)


TV2_ALPHAS = [2, 4, 8, 16, 32, 64]
TV2_R = [1.0, 0.5, 0.25, 0.1, 0.01]
TV2 = [  # MNIST batch 128: q = 128/60000, σ = 0.469
    [4.24434e-4, 9.63032e-6, 1.49559e-6, 2.11681e-7, 2.06952e-9],
    [0.915341, 1.95623e-5, 2.99583e-6, 4.23446e-7, 4.13906e-9],
    [11.1564, 4.05105e-5, 6.01038e-6, 8.47234e-7, 8.27814e-9],
    [29.81, 2.53247, 1.20967e-5, 1.69583e-6, 1.65564e-8],
    [66.3917, 11.8366, 2.45059e-5, 3.39715e-6, 3.31133e-8],
    [139.233, 30.1224, 2.84484, 6.81636e-6, 6.62287e-8],
]


def test_tv2_table_and_mpmath():
    q, sigma = 128 / 60000, 0.469
    got = np.asarray(A.per_instance_sampled_gaussian_rdp([float(a) for a in TV2_ALPHAS], q, sigma, np.array(TV2_R)))
    for j, a in enumerate(TV2_ALPHAS):
        for i, r in enumerate(TV2_R):
            assert got[i, j] == pytest.approx(TV2[j][i], rel=TABLE6_RTOL), (a, r)
            assert got[i, j] == pytest.approx(float(int_rdp(q, sigma, r, a)), rel=1e-10), (a, r)
    # CIFAR-10 batch 128.
    c = np.asarray(A.per_instance_sampled_gaussian_rdp([2.0, 8.0], 0.00256, 0.625, np.array([1.0, 0.5, 0.1])))
    assert c[0, 1] == pytest.approx(3.41972, rel=TABLE6_RTOL)
    assert c[1, 1] == pytest.approx(2.39313e-5, rel=TABLE6_RTOL)
    assert c[2, 1] == pytest.approx(6.80025e-7, rel=TABLE6_RTOL)
    assert c[0, 0] == pytest.approx(7.82195e-5, rel=TABLE6_RTOL)
    assert c[1, 0] == pytest.approx(5.87516e-6, rel=TABLE6_RTOL)


def test_r_equal_one_is_the_data_independent_rdp():
    orders = A.DEFAULT_ORDERS
    for q, sigma in [(0.01, 1.0), (128 / 60000, 0.469), (0.3, 5.0), (1.0, 2.0)]:
        got = np.asarray(A.per_instance_sampled_gaussian_rdp(orders, q, sigma, 1.0))
        ref = np.asarray(A.sampled_gaussian_rdp(orders, q, sigma))
        np.testing.assert_allclose(got, ref, rtol=R1_RTOL, atol=0)
    # ... and that value is the mpmath binomial sum at integer orders.
    for a in [2, 11, 63, 256]:
        got = float(A.per_instance_sampled_gaussian_rdp([float(a)], 0.01, 1.0, 1.0)[0])
        assert got == pytest.approx(float(int_rdp(0.01, 1.0, 1.0, a)), rel=1e-11)


@pytest.mark.parametrize("r", [1.0, 0.5, 0.01])
def test_high_orders_are_stable(r):
    orders = [256.0, 512.0, 1024.0]
    got = np.asarray(A.per_instance_sampled_gaussian_rdp(orders, 128 / 60000, 0.469, r))
    assert np.all(np.isfinite(got))
    for g, a in zip(got, orders):
        assert g == pytest.approx(float(int_rdp(128 / 60000, 0.469, r, int(a))), rel=1e-10)


def test_limits_and_validation():
    orders = [1.5, 2.0, 8.0]
    assert np.all(np.asarray(A.per_instance_sampled_gaussian_rdp(orders, 0.01, 1.0, 0.0)) == 0.0)
    assert np.all(np.asarray(A.per_instance_sampled_gaussian_rdp(orders, 0.0, 1.0, 0.7)) == 0.0)
    tiny = np.asarray(A.per_instance_sampled_gaussian_rdp(orders, 0.01, 1.0, 1e-9))
    assert np.all((tiny > 0) & (tiny < 1e-15))
    # q = 1: the Gaussian mechanism with sensitivity r: α r²/(2σ²).
    g = np.asarray(A.per_instance_sampled_gaussian_rdp(orders, 1.0, 2.0, 0.5))
    np.testing.assert_allclose(g, np.array(orders) * 0.25 / 8.0, rtol=1e-14)
    for kw, bad in [("r", 1.5), ("r", -0.1), ("q", 1.2), ("noise_multiplier", 0.0)]:
        args = {"q": 0.01, "noise_multiplier": 1.0, "r": 0.5, kw: bad}
        with pytest.raises(ValueError, match=kw):
            A.per_instance_sampled_gaussian_rdp(orders, args["q"], args["noise_multiplier"], args["r"])
    jitted = jax.jit(lambda r: A.per_instance_sampled_gaussian_rdp(orders, 0.01, 1.0, r))
    assert np.all(np.isnan(np.asarray(jitted(1.5))))
    assert np.all(np.isnan(np.asarray(jitted(jnp.nan))))


@settings(max_examples=40, deadline=None)
@given(
    q=st.floats(1e-4, 1.0),
    sigma=st.floats(0.3, 10.0),
    r1=st.floats(0.0, 1.0),
    r2=st.floats(0.0, 1.0),
)
def test_monotone_in_r(q, sigma, r1, r2):
    lo, hi = min(r1, r2), max(r1, r2)
    orders = [1.5, 2.0, 3.7, 8.0, 64.0]
    e = np.asarray(A.per_instance_sampled_gaussian_rdp(orders, q, sigma, np.array([lo, hi])))
    assert np.all(np.isfinite(e))
    assert np.all(e[0] <= e[1] * (1 + MONO_RTOL))


def test_jit_vmap_grad_and_dtype():
    orders = [1.5, 2.0, 8.0]
    f = lambda r: A.per_instance_sampled_gaussian_rdp(orders, 0.02, 0.8, r)  # noqa: E731
    r = jnp.array([0.0, 0.3, 0.9, 1.0])
    eager = np.asarray(f(r))
    np.testing.assert_allclose(np.asarray(jax.jit(f)(r)), eager, rtol=1e-14)
    np.testing.assert_allclose(np.asarray(jax.vmap(f)(r)), eager, rtol=1e-14)
    g = jax.grad(lambda x: f(x)[-1])(0.6)
    h = 1e-6
    fd = (float(f(0.6 + h)[-1]) - float(f(0.6 - h)[-1])) / (2 * h)
    assert float(g) == pytest.approx(fd, rel=1e-6)
    assert np.all(np.isfinite(np.asarray(jax.grad(lambda x: f(x).sum())(0.0))))
    with jax.enable_x64(False):
        out = jax.jit(f)(jnp.float32(0.5))
        assert out.dtype == jnp.float64


# ---------------------------------------------------------------- Theorem 3.3


@pytest.mark.parametrize(
    "alpha,n,p,beta",
    [(8, 10, 30, 10.49745734), (8, 100, 300, 10.74214554), (8, 4687, 14061, 10.76870799),
     (2, 4687, 14061, 2.395529713), (64, 4687, 14061, 88.91837192)],
)
def test_tv3_composition_orders(alpha, n, p, beta):
    b = A.per_instance_composition_orders([float(alpha)], n, float(p))
    assert b.shape == (1, n)
    assert b[0, 0] == pytest.approx(beta, rel=1e-9)  # step 1 has the largest order
    assert b[0, -1] == alpha
    assert np.all(np.diff(b[0]) < 0)


def test_tv3_ceil_orders_alpha8():
    b = A.per_instance_composition_orders([8.0], 4687)  # default p = 3n
    ceil = np.ceil(b[0][::-1])  # indexed by i, steps from the end
    assert ceil[0] == 8 and np.all(ceil[1:1878] == 9) and np.all(ceil[1878:3534] == 10) and np.all(ceil[3534:] == 11)


@pytest.mark.parametrize(
    "q,sigma,r,n,alpha,classical,thm33",
    [(0.01, 1.0, 1.0, 1000, 8, 0.893644, 122.636), (0.01, 1.0, 0.5, 1000, 8, 0.115756, 0.14331),
     (128 / 60000, 0.469, 0.5, 4687, 8, 0.189873, 0.962925), (128 / 60000, 0.469, 0.5, 4687, 2, 0.0451373, 0.0682216)],
)
def test_tv6_deterministic_composition(q, sigma, r, n, alpha, classical, thm33):
    rr = np.full(n, r)
    res = A.per_instance_dpsgd_privacy([float(alpha)], q, sigma, rr, 1e-5, order_rounding="ceil")
    assert float(res.rdp[0]) == pytest.approx(thm33, rel=5e-5)
    worst = A.per_instance_dpsgd_privacy([float(alpha)], q, sigma, rr, 1e-5, p=math.inf)
    assert float(worst.rdp[0]) == pytest.approx(classical, rel=5e-5)
    assert res.analysis == "thudi2024_theorem_3.3_estimate"
    assert any("ESTIMATE" in a for a in res.assumptions)


TV7_RUNS = [  # per-step r of three runs (step 1 is the fixed initial model)
    [0.9, 0.8, 0.5, 0.3, 0.1],
    [0.9, 0.7, 0.6, 0.2, 0.15],
    [0.9, 0.9, 0.4, 0.35, 0.05],
]


def test_tv7_five_steps_three_runs():
    r = np.array(TV7_RUNS)
    res = A.per_instance_dpsgd_privacy([8.0], 0.01, 1.0, r, 1e-5, runs=True, p=15.0, order_rounding="ceil")
    assert float(res.rdp[0]) == pytest.approx(0.0019122486, rel=1e-7)
    assert float(res.rdp[0]) == pytest.approx(literal_theorem_33(TV7_RUNS, 0.01, 1.0, 8, 15.0), rel=1e-10)


def test_random_runs_against_literal_equation():
    rng = np.random.default_rng(0)
    n, n_runs = 7, 3
    r = rng.uniform(0.05, 1.0, size=(2, n_runs, n))
    r[:, :, 0] = r[:, :1, 0]  # the same initial model in every run
    res = A.per_instance_dpsgd_privacy([2.0, 5.0], 0.05, 1.2, r, 1e-5, runs=True, p=4.0, order_rounding="ceil")
    for pt in range(2):
        for a_i, a in enumerate([2, 5]):
            ref = literal_theorem_33(r[pt].tolist(), 0.05, 1.2, a, 4.0)
            assert float(res.rdp[pt, a_i]) == pytest.approx(ref, rel=1e-10)
    eps = rdp_to_epsilon_improved([2.0, 5.0], np.asarray(res.rdp[1]).tolist(), 1e-5)
    assert float(res.epsilon[1]) == pytest.approx(eps, rel=1e-12)


def test_checkpoints_nearest_fill():
    rng = np.random.default_rng(1)
    n = 12
    ckpt = [0, 3, 8]
    rc = rng.uniform(0.1, 1.0, size=(4, 3))
    nearest = [int(np.argmin([abs(c - (t - 1)) for c in ckpt])) for t in range(1, n + 1)]
    full = rc[:, nearest]  # step t uses the checkpoint nearest to the model after t - 1 steps
    kw = dict(p=6.0, order_rounding="ceil")
    a = A.per_instance_dpsgd_privacy([3.0], 0.05, 1.0, rc, 1e-5, num_steps=n, checkpoint_steps=ckpt, **kw)
    for pt in range(4):
        ref = literal_theorem_33([full[pt].tolist()], 0.05, 1.0, 3, 6.0)
        assert float(a.rdp[pt, 0]) == pytest.approx(ref, rel=1e-10)
    assert any("checkpoints" in s for s in a.assumptions)
    # With several runs, grouped steps use their largest λ: never below the literal value.
    rr = np.stack([rc, rng.uniform(0.1, 1.0, size=(4, 3))], axis=1)
    rr[:, 1, 0] = rr[:, 0, 0]
    b = A.per_instance_dpsgd_privacy([3.0], 0.05, 1.0, rr, 1e-5, num_steps=n, checkpoint_steps=ckpt, runs=True, **kw)
    for pt in range(4):
        ref = literal_theorem_33([rr[pt, 0, nearest].tolist(), rr[pt, 1, nearest].tolist()], 0.05, 1.0, 3, 6.0)
        assert ref <= float(b.rdp[pt, 0]) <= ref * 1.05
    with pytest.raises(ValueError, match="checkpoint_steps"):
        A.per_instance_dpsgd_privacy([3.0], 0.05, 1.0, rc, 1e-5, num_steps=n, checkpoint_steps=[0, 5, 3])


@pytest.mark.parametrize("levels", [1, 4])
def test_levels_round_orders_up(levels):
    orders = (1.5, 3.7, 64.0)
    n, p = 50, 150.0
    plan = PI._plan(orders, n, tuple(range(n)), p, "levels", levels)
    beta = A.per_instance_composition_orders(list(orders), n, p)
    # Decode the evaluated layout: block after block, checkpoint-major.
    col_of = np.concatenate([np.repeat(cs, len(os_)) for cs, os_ in plan.blocks])
    order_of = np.concatenate([np.tile(os_, len(cs)) for cs, os_ in plan.blocks])
    assert np.all(order_of[plan.first] >= beta[:, 0]) and np.all(col_of[plan.first] == 0)
    for a in range(len(orders)):
        idx = plan.flat[plan.starts[a]:plan.stops[a]]
        ev = order_of[idx]
        step = col_of[idx] + 1  # checkpoint c is the model after c steps: step c + 1
        assert np.all(ev >= beta[a, step - 1])
        assert np.all(plan.lam[plan.starts[a]:plan.stops[a]] == pytest.approx(p * (beta[a, step - 1] - 1)))
    # Levels are at least as tight as ceil on the same run, and both bound the r = 0 case by 0.
    r = np.linspace(0.2, 0.9, n)
    lv = A.per_instance_dpsgd_privacy(list(orders), 0.01, 1.0, r, 1e-5, p=p, order_levels=levels)
    assert np.all(np.isfinite(np.asarray(lv.rdp)))
    zero = A.per_instance_dpsgd_privacy(list(orders), 0.01, 1.0, np.zeros(n), 1e-5, p=p, order_levels=levels)
    assert np.all(np.asarray(zero.rdp) == 0)


def test_composition_chunking_jit_and_broadcast():
    rng = np.random.default_rng(2)
    r = rng.uniform(0, 1, size=(7, 20))
    orders = [2.0, 8.0]
    kw = dict(order_rounding="ceil")  # one block: compiles faster ("levels" is tested above)
    a = A.per_instance_dpsgd_privacy(orders, 0.01, 1.0, r, 1e-5, chunk_size=3, **kw)  # 3 chunks, one padded
    run = jax.jit(lambda x, d: A.per_instance_dpsgd_privacy(orders, 0.01, 1.0, x, d, **kw))
    b = run(r, 1e-5)  # one chunk, under jit: the result is a pytree
    assert isinstance(b, A.PerInstancePrivacy) and b.halt_step is None
    np.testing.assert_allclose(np.asarray(a.rdp), np.asarray(b.rdp), rtol=1e-14)
    np.testing.assert_allclose(np.asarray(a.epsilon), np.asarray(b.epsilon), rtol=1e-14)
    single = A.per_instance_dpsgd_privacy(orders, 0.01, 1.0, r[3], 1e-5, chunk_size=3, **kw)
    assert single.epsilon.shape == () and single.rdp.shape == (2,)
    np.testing.assert_allclose(np.asarray(single.rdp), np.asarray(a.rdp[3]), rtol=1e-14)
    # Per-point ε from rdp_to_epsilon over the target orders (independent conversion).
    ref = rdp_to_epsilon_improved(orders, np.asarray(a.rdp[0]).tolist(), 1e-5)
    assert float(a.epsilon[0]) == pytest.approx(ref, rel=1e-12)
    # Under jit an r out of [0, 1] gives NaN for that point, never a finite ε.
    bad = np.asarray(run(np.where(r > 0.9, 1.5, r), 1e-5).epsilon)
    hit = np.any(r > 0.9, axis=-1)
    assert hit.any() and np.all(np.isnan(bad[hit])) and np.all(np.isfinite(bad[~hit]))


# ---------------------------------------------------------------- Rényi filter


def filter_reference(orders, q, sigma, r, budget):
    """Plain-Python individual filter with mpmath per-step RDP (integer orders)."""
    consumed = [0.0] * len(orders)
    halted, count = False, 0
    for rt in r:
        rho = [float(int_rdp(q, sigma, rt, a)) if rt > 0 else 0.0 for a in orders]
        cand = [c + x for c, x in zip(consumed, rho)]
        fits = all(c <= b for c, b in zip(cand, budget))
        if fits and not halted:
            consumed, count = cand, count + 1
        else:
            halted = True
    return consumed, count


def test_filter_against_reference_and_budget():
    rng = np.random.default_rng(3)
    orders, budget = [2.0, 8.0], [0.04, 0.2]
    r = rng.uniform(0, 1, size=(6, 25))
    r[0] = 0.05  # never reaches the budget
    res = A.individual_filter_privacy(orders, 0.1, 1.5, r, budget, 1e-5)
    for pt in range(6):
        consumed, count = filter_reference([2, 8], 0.1, 1.5, r[pt], budget)
        assert int(res.halt_step[pt]) == count
        np.testing.assert_allclose(np.asarray(res.rdp[pt]), consumed, rtol=1e-10)
    assert int(res.halt_step[0]) == 25
    assert np.all(np.asarray(res.rdp) <= np.array(budget))
    assert int(res.halt_step.min()) < 25  # some point hits the budget
    eps = rdp_to_epsilon_improved(orders, budget, 1e-5)
    np.testing.assert_allclose(np.asarray(res.epsilon), eps, rtol=1e-12)
    assert res.analysis == "feldman_zrnic2021_individual_renyi_filter"


def test_filter_step_matches_replay_and_halts_for_good():
    orders, budget = [2.0], [0.06]
    r = np.array([[0.9, 0.9, 0.9, 0.01, 0.01], [0.3, 0.3, 0.3, 0.3, 0.3]])
    consumed, halted = jnp.zeros((2, 1)), jnp.zeros(2, bool)
    steps = jax.jit(lambda c, h, x: A.individual_filter_step(c, h, orders, 0.2, 1.0, x, budget))
    masks = []
    for t in range(r.shape[1]):
        active, consumed, halted = steps(consumed, halted, r[:, t])
        masks.append(np.asarray(active))
    masks = np.stack(masks, axis=1)
    res = A.individual_filter_privacy(orders, 0.2, 1.0, r, budget, 1e-5)
    np.testing.assert_array_equal(masks.sum(axis=1), np.asarray(res.halt_step))
    np.testing.assert_allclose(np.asarray(consumed), np.asarray(res.rdp), rtol=1e-14)
    # A dropped point stays dropped even when a later step would fit.
    assert masks[0].tolist() == [True, False, False, False, False]
    with pytest.raises(ValueError, match="budget"):
        A.individual_filter_privacy(orders, 0.2, 1.0, r, -1.0, 1e-5)


def test_composition_gradient_in_r():
    r = np.array([0.9, 0.6, 0.4, 0.3, 0.2])
    kw = dict(p=15.0, order_rounding="ceil")
    f = lambda x: A.per_instance_dpsgd_privacy([2.0], 0.05, 1.0, x, 1e-5, **kw).rdp[0]  # noqa: E731
    g = np.asarray(jax.grad(f)(jnp.asarray(r)))
    h = 1e-6
    for t in (0, 3):
        e = np.zeros_like(r)
        e[t] = h
        fd = (float(f(r + e)) - float(f(r - e))) / (2 * h)
        assert g[t] == pytest.approx(fd, rel=1e-5)


def test_r_grid_rounds_r_up_to_the_grid():
    # r_grid = M evaluates every r at the next multiple of 1/M: the literal theorem (mpmath)
    # at the rounded norms, and never below the exact estimate (monotone in r).
    rng = np.random.default_rng(3)
    n, m = 6, 16
    r = rng.uniform(0.0, 1.0, size=(3, n))
    r[0, 1], r[0, 2], r[1, 3], r[2, 4] = 0.0, 1.0, 5 / 16, 1e-9  # zero, one, on the grid, tiny
    rounded = np.ceil(r * m) / m
    assert np.all(rounded >= r) and np.all(rounded - r < 1 / m)
    kw = dict(p=4.0, order_rounding="ceil")
    got = A.per_instance_dpsgd_privacy([2.0, 5.0], 0.05, 1.2, r, 1e-5, r_grid=m, **kw)
    for pt in range(3):
        for a_i, a in enumerate([2, 5]):
            ref = literal_theorem_33([rounded[pt].tolist()], 0.05, 1.2, a, 4.0)
            assert float(got.rdp[pt, a_i]) == pytest.approx(ref, rel=1e-10)
    exact = A.per_instance_dpsgd_privacy([2.0, 5.0], 0.05, 1.2, r, 1e-5, **kw)
    assert np.all(np.asarray(got.rdp) >= np.asarray(exact.rdp))
    assert any("rounded up" in s for s in got.assumptions)
    for bad in (3, 1, True, 2.5, 0):
        with pytest.raises(ValueError, match="r_grid"):
            A.per_instance_dpsgd_privacy([2.0], 0.05, 1.2, r, 1e-5, r_grid=bad, **kw)
    # Derivatives in q and σ: those of the exact path at the rounded norms (reverse mode,
    # also with x64 off, where a differentiated gather would fail).
    def total(qq, s, rr, grid):
        return A.per_instance_dpsgd_privacy([2.0, 5.0], qq, s, rr, 1e-5, r_grid=grid, **kw).rdp.sum()

    ref = jax.grad(total, argnums=(0, 1))(0.05, 1.2, rounded, None)
    for x64 in (True, False):
        with jax.enable_x64(x64):
            d = jax.grad(jax.jit(lambda qq, s: total(qq, s, r, m)), argnums=(0, 1))(0.05, 1.2)
        np.testing.assert_allclose(np.asarray(d, np.float64), np.asarray(ref), rtol=1e-9 if x64 else 1e-5)
    run = jax.jit(lambda x: A.per_instance_dpsgd_privacy([2.0, 5.0], 0.05, 1.2, x, 1e-5, r_grid=m, **kw).epsilon)
    out = np.asarray(run(np.where(r > 0.9, 1.5, r)))
    hit = np.any(r > 0.9, axis=-1)
    assert hit.any() and np.all(np.isnan(out[hit])) and np.all(np.isfinite(out[~hit]))
