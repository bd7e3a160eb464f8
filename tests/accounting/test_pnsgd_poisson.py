"""Hidden-state RDP of PNSGD with Poisson batches (poisson_pnsgd_rdp / poisson_pnsgd_epsilon).

The independent check: the actual process on a 1-D linear and a 1-D quadratic loss over a
bounded interval, its last iterate's law computed by an exact recursion of the transition
on a grid (NumPy/SciPy only, no jaxdp), and its hockey-stick divergence; and a Monte Carlo
audit of the same process (95 % confidence). Neither may exceed the bound.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import comb, ndtr

import jaxdp

A = jaxdp.accounting
ORD = (1.5, 2.0, 4.0, 8.0, 32.0, 128.0)
# The defaults of the docs plot: q = 0.01, L = 1, β = 1, η = 0.5, σ = 1, D = 1, b = 10,
# n = 1000, batches cut at B = 20 (ηβB/b = 1 ≤ 2).
RUN = dict(q=0.01, lipschitz=1.0, smoothness=1.0, learning_rate=0.5, noise_std=1.0, diameter=1.0, batch_size=10.0)
STATIC = dict(num_records=1000, max_batch_size=20)


def _eps(T, delta=1e-5, **kw):
    r = {**RUN, **kw}
    return A.poisson_pnsgd_epsilon(delta, r["q"], r["lipschitz"], r["smoothness"], r["learning_rate"], r["noise_std"],
                                   r["diameter"], r["batch_size"], T, **STATIC)


# ---------------------------------------------------------------------------------------
# (c) τ = T is plain composition.


@pytest.mark.parametrize("q", [0.05, 1.0])
def test_tau_equal_to_T_is_composition_of_the_sampled_gaussian(q):
    # With a diameter so large that no shift pays, the bound is T·S_α(σb/L) exactly; at
    # q = 1 that is the Gaussian mechanism's T·α/(2ν²) in closed form.
    T, L, sig, b = 50, 2.0, 1.0, 8.0
    got = np.asarray(A.poisson_pnsgd_rdp(ORD, q, L, 0.0, 1.0, sig, 1e9, b, T, num_records=100))
    want = T * np.asarray(A.sampled_gaussian_rdp(ORD, q, sig * b / L))
    np.testing.assert_allclose(got, want, rtol=1e-12)
    if q == 1.0:
        np.testing.assert_allclose(got, T * np.asarray(ORD) / (2.0 * (sig * b / L) ** 2), rtol=1e-12)


def test_one_step_is_composition_whatever_the_diameter():
    got = A.poisson_pnsgd_rdp(ORD, 0.1, 1.0, 0.0, 1.0, 1.0, 1e-3, 1.0, 1, num_records=100)
    np.testing.assert_allclose(got, A.sampled_gaussian_rdp(ORD, 0.1, 1.0), rtol=1e-12)


def test_truncated_batches_use_the_truncated_poisson_step():
    T = 7
    got = A.poisson_pnsgd_rdp(ORD, 0.01, 1.0, 1.0, 0.5, 1.0, 1e9, 10.0, T, num_records=1000, max_batch_size=20)
    np.testing.assert_allclose(got, T * np.asarray(A.truncated_poisson_rdp(ORD, 0.01, 1000, 20, 10.0)), rtol=1e-12)


# ---------------------------------------------------------------------------------------
# (b) Below composition at the defaults, and flat in T after the burn-in.


def test_defaults_below_composition_and_flat_after_burn_in():
    Ts = [1, 100, 1_000, 10_000, 100_000, 1_000_000]
    eps = [float(_eps(T)) for T in Ts]
    assert all(b >= a for a, b in zip(eps, eps[1:])), eps  # non-decreasing in T
    assert eps[-1] == eps[-2] == eps[-3], eps  # flat after the burn-in (~2,000 steps here)
    # The default orders (those of _eps): the same compiled program (ORD would compile another, ~10 CPU-s).
    orders = A.DEFAULT_ORDERS
    _, tau = A.poisson_pnsgd_rdp(orders, *RUN.values(), 1_000_000, **STATIC, return_burn_in=True)
    assert 1_000 < float(jnp.max(tau)) < 10_000
    # Composition of the same steps (truncated Poisson), converted the same way.
    step = A.truncated_poisson_rdp(orders, 0.01, 1000, 20, 10.0)
    for T, e in zip(Ts[3:], eps[3:]):
        comp = float(A.rdp_to_epsilon(T * step, orders, 1e-5).epsilon)
        assert e < comp, (T, e, comp)
    assert eps[-1] < 0.1 * float(A.rdp_to_epsilon(1_000_000 * step, orders, 1e-5).epsilon)


# ---------------------------------------------------------------------------------------
# Per record, transformations, validation.


def test_per_record_lipschitz_is_elementwise_and_monotone():
    lips = jnp.asarray([0.0, 0.1, 0.5, 1.0])
    got = np.asarray(_eps(20_000, lipschitz=lips))
    one = [float(_eps(20_000, lipschitz=float(x))) for x in lips]
    np.testing.assert_allclose(got, one, rtol=1e-12)
    assert got[0] == 0.0 and np.all(np.diff(got) > 0)


@pytest.mark.parametrize("x64", [False, True])
def test_jit_vmap_grad_in_both_x64_modes(x64):
    def f(s):
        return A.poisson_pnsgd_epsilon(1e-5, 0.01, 1.0, 0.0, 0.5, s, 1.0, 10.0, 5_000, num_records=1000, orders=ORD)

    with jax.enable_x64(x64):
        e = f(1.0)
        assert e.dtype == jnp.float64 or not x64
        np.testing.assert_allclose(jax.jit(f)(1.0), e, rtol=1e-12)
        np.testing.assert_allclose(jax.vmap(f)(jnp.asarray([1.0, 2.0]))[0], e, rtol=1e-12)
        g = float(jax.grad(f)(1.0))
    with jax.enable_x64(True):
        h = 1e-5
        fd = (float(f(1.0 + h)) - float(f(1.0 - h))) / (2 * h)
    assert g < 0
    np.testing.assert_allclose(g, fd, rtol=1e-5 if x64 else 1e-5)


def test_bad_inputs_raise_eagerly_and_are_nan_under_jit():
    with pytest.raises(ValueError, match="learning_rate must be at most"):
        A.poisson_pnsgd_rdp(ORD, 0.01, 1.0, 1.0, 0.5, 1.0, 1.0, 10.0, 100, num_records=1000)  # B = n + 1: ηβB/b > 50
    with pytest.raises(ValueError, match="q"):
        A.poisson_pnsgd_rdp(ORD, 1.5, 1.0, 0.0, 0.5, 1.0, 1.0, 10.0, 100, num_records=1000)
    with pytest.raises(ValueError, match="num_steps"):
        A.poisson_pnsgd_rdp(ORD, 0.1, 1.0, 0.0, 0.5, 1.0, 1.0, 10.0, 2.5, num_records=1000)
    with pytest.raises(ValueError, match="splits"):
        A.poisson_pnsgd_rdp(ORD, 0.1, 1.0, 0.0, 0.5, 1.0, 1.0, 10.0, 100, num_records=1000, splits=(0.5, 1.0))
    f = jax.jit(lambda eta: A.poisson_pnsgd_rdp(ORD, 0.01, 1.0, 1.0, eta, 1.0, 1.0, 10.0, 100, num_records=1000,
                                                max_batch_size=20))
    assert np.all(np.isnan(f(1.5)))  # ηβB/b = 3 > 2: not a contraction, not certified
    assert np.all(np.isfinite(f(1.0)))


# ---------------------------------------------------------------------------------------
# (a) The actual process, computed independently.


def _transition(grid, components, s):
    """Row-stochastic matrix of y_i ↦ grid cell of clip(m_i + N(0, s²), 0, D), a mixture of means."""
    edges = np.concatenate([[-np.inf], 0.5 * (grid[1:] + grid[:-1]), [np.inf]])
    out = 0.0
    for mean, w in components:
        out = out + w * np.diff(ndtr((edges[None, :] - mean[:, None]) / s), axis=1)
    return out


def _linear(D, h, s, q, G):
    """ℓ(y, x) = g_x·y on [0, D]: the record (g = L) moves the step by h = ηL/b when sampled."""
    grid = np.linspace(0.0, D, G)
    return grid, _transition(grid, [(grid, 1 - q), (grid - h, q)], s), _transition(grid, [(grid, 1.0)], s)


def _quadratic(D, eta, b, n, q, s, G):
    """ℓ(y, x) = (y − x)²/2 on [0, D]: the record at 0, n − 1 others at D, Poisson batches, sum/b."""
    grid = np.linspace(0.0, D, G)
    ks = np.arange(n)
    wk = comb(n - 1, ks) * q**ks * (1 - q) ** (n - 1 - ks)
    c_in, c_out = [], []
    for k, w in zip(ks, wk):
        base = grid - eta / b * k * (grid - D)
        c_out.append((base, w))
        c_in += [(base, w * (1 - q)), (base - eta / b * grid, w * q)]
    return grid, _transition(grid, c_in, s), _transition(grid, c_out, s)


def _eps_of_laws(p, r, delta):
    """Smallest ε with both hockey-stick divergences ≤ δ (bisection)."""
    def d(e):
        return max(np.maximum(p - np.exp(e) * r, 0).sum(), np.maximum(r - np.exp(e) * p, 0).sum())
    if d(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while d(hi) > delta:
        hi *= 2
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if d(mid) > delta else (lo, mid)
    return hi


def _simulate_linear(D, h, s, q, T, runs, rng, with_record):
    y = np.full(runs, D)
    for _ in range(T):
        push = h * (rng.random(runs) < q) if with_record else 0.0
        y = np.clip(y - push + s * rng.standard_normal(runs), 0.0, D)
    return y


# (D, h = ηL/b, s = ησ, q); accountant with η = 1, σ = s, L = h, b = 1, β = 0.
LINEAR = [(2.0, 1.0, 1.0, 0.2), (3.0, 1.0, 1.0, 0.5)]
# (n, b, η, σ, q); D = 1, L = D (|y − x| ≤ 1 on [0, 1]), β = 1, ηβ(n + 1)/b ≤ 2.
QUADRATIC = [(4, 2.0, 0.8, 1.0, 0.3), (6, 2.0, 0.55, 0.5, 0.5)]


def _simulate_quadratic(n, b, eta, sig, q, T, runs, rng, with_record):
    """Monte Carlo runs of :func:`_quadratic`'s process from y₀ = 1/2 (D = 1): each step Binomial(n − 1, q)
    others at D and, with the record, the record at 0 with probability q; gradient sum over b."""
    y = np.full(runs, 0.5)
    for _ in range(T):
        g = rng.binomial(n - 1, q, runs) * (y - 1.0)
        if with_record:
            g = g + (rng.random(runs) < q) * y
        y = np.clip(y - eta / b * g + eta * sig * rng.standard_normal(runs), 0.0, 1.0)
    return y


def _audit_quadratic(params, T, runs, delta, seed):
    """(lower bound at 95 %, bound): the record at 0 pulls towards 0, the others towards D = 1."""
    n, b, eta, sig, q = params
    rng = np.random.default_rng(seed)
    y_in = _simulate_quadratic(*params, T, runs, rng, True)
    y_out = _simulate_quadratic(*params, T, runs, rng, False)
    lb = float(jaxdp.audit.epsilon_lower_bound(-y_in, -y_out, delta).epsilon)
    return lb, float(A.poisson_pnsgd_epsilon(delta, q, 1.0, 1.0, eta, sig, 1.0, b, T, num_records=n))


def _check_linear(params, Ts, G, delta):
    D, h, s, q = params
    grid, P_in, P_out = _linear(D, h, s, q, G)
    p = np.zeros(G)
    p[-1] = 1.0
    r = p.copy()
    t = 0
    for T in Ts:
        for _ in range(T - t):
            p, r = p @ P_in, r @ P_out
        t = T
        truth = _eps_of_laws(p, r, delta)
        bound = float(A.poisson_pnsgd_epsilon(delta, q, h, 0.0, 1.0, s, D, 1.0, T, num_records=10))
        assert truth <= bound, (params, T, truth, bound)


def _check_quadratic(params, Ts, G, delta):
    n, b, eta, sig, q = params
    grid, P_in, P_out = _quadratic(1.0, eta, b, n, q, eta * sig, G)
    p = np.zeros(G)
    p[G // 2] = 1.0
    r = p.copy()
    t = 0
    for T in Ts:
        for _ in range(T - t):
            p, r = p @ P_in, r @ P_out
        t = T
        truth = _eps_of_laws(p, r, delta)
        bound = float(A.poisson_pnsgd_epsilon(delta, q, 1.0, 1.0, eta, sig, 1.0, b, T, num_records=n))
        assert truth <= bound, (params, T, truth, bound)


def test_numerical_process_linear_loss_never_above_the_bound():
    _check_linear(LINEAR[0], [1, 5, 30], G=300, delta=1e-3)


def test_numerical_process_quadratic_loss_never_above_the_bound():
    _check_quadratic(QUADRATIC[0], [1, 5, 30], G=300, delta=1e-3)


def test_monte_carlo_audit_linear_loss_below_the_bound():
    D, h, s, q = LINEAR[1]
    T, runs, delta = 20, 20_000, 1e-3
    rng = np.random.default_rng(0)
    y_in = _simulate_linear(D, h, s, q, T, runs, rng, True)
    y_out = _simulate_linear(D, h, s, q, T, runs, rng, False)
    lb = jaxdp.audit.epsilon_lower_bound(-y_in, -y_out, delta)  # the record pushes towards 0
    bound = float(A.poisson_pnsgd_epsilon(delta, q, h, 0.0, 1.0, s, D, 1.0, T, num_records=10))
    assert 0.0 < float(lb.epsilon) <= bound


def test_monte_carlo_audit_quadratic_loss_below_the_bound():
    # 2·10⁴ runs per side (0.3 s; the accountant compiled for n = 4 by the exact-process test);
    # observed lower bound 0.071 against the bound 1.31 at T = 5 (QUADRATIC[1]: 0.99 against 5.9).
    lb, bound = _audit_quadratic(QUADRATIC[0], 5, 20_000, 1e-3, seed=5)
    assert 0.0 < lb <= bound


@pytest.mark.slow  # finer grids, longer runs, every parameter set (~1 min)
@pytest.mark.parametrize("params", LINEAR)
def test_numerical_process_linear_loss_slow(params):
    _check_linear(params, [1, 2, 5, 10, 30, 100, 300], G=1000, delta=1e-3)
    _check_linear(params, [1, 10, 100], G=1000, delta=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("params", QUADRATIC)
def test_numerical_process_quadratic_loss_slow(params):
    _check_quadratic(params, [1, 2, 5, 10, 30, 100, 300], G=800, delta=1e-3)


@pytest.mark.slow  # 2·10⁵ runs per side
def test_monte_carlo_audit_linear_loss_slow():
    for D, h, s, q in LINEAR:
        for T in (1, 5, 50):
            rng = np.random.default_rng(T)
            y_in = _simulate_linear(D, h, s, q, T, 200_000, rng, True)
            y_out = _simulate_linear(D, h, s, q, T, 200_000, rng, False)
            lb = jaxdp.audit.epsilon_lower_bound(-y_in, -y_out, 1e-3)
            bound = float(A.poisson_pnsgd_epsilon(1e-3, q, h, 0.0, 1.0, s, D, 1.0, T, num_records=10))
            assert float(lb.epsilon) <= bound, (D, h, s, q, T, float(lb.epsilon), bound)


@pytest.mark.slow  # 2·10⁵ runs per side, every parameter set, T up to 50 (~20 s)
def test_monte_carlo_audit_quadratic_loss_slow():
    for params in QUADRATIC:
        for T in (1, 5, 20, 50):
            lb, bound = _audit_quadratic(params, T, 200_000, 1e-3, seed=T)
            assert 0.0 < lb <= bound, (params, T, lb, bound)


# ---------------------------------------------------------------------------------------
# The PNSGD event with sampling="poisson": epsilon, delta, rdp, pnsgd_privacy.


def _event(**kw):
    base = dict(num_records=1000, batch_size=10, relation="add_remove", sampling="poisson", q=0.01,
                num_steps=100_000, max_batch_size=20)
    return A.PNSGD(1.0, 1.0, 0.5, 1.0, 1.0, **{**base, **kw})


def test_event_is_the_accountant_and_in_pnsgd_privacy_best_of():
    ev = _event()
    e = float(A.epsilon(ev, 1e-5))
    assert e == float(_eps(100_000))
    orders = A.DEFAULT_ORDERS  # the program of _eps (and of test_defaults_below_composition_and_flat_after_burn_in)
    np.testing.assert_allclose(A.rdp(ev, orders), A.poisson_pnsgd_rdp(orders, *RUN.values(), 100_000, **STATIC),
                               rtol=1e-12)
    out = A.pnsgd_privacy(ev, 1e-5, positions=[1, 1000])
    np.testing.assert_array_equal(out.iteration, [e, e])
    np.testing.assert_array_equal(out.best, [e, e])
    assert np.all(np.isinf(out.contraction)) and np.all(np.isinf(out.shifted_gdp))


@pytest.mark.slow  # ~35 CPU-s of compilation (four more programs of the same accountant)
def test_event_composition_record_and_delta_doors():
    import dataclasses

    ev = _event()
    e = float(A.epsilon(ev, 1e-5))
    out = A.pnsgd_privacy(ev, 1e-5, positions=[1, 1000])
    comp = float(A.epsilon(dataclasses.replace(ev, hidden=False), 1e-5))
    np.testing.assert_array_equal(out.composition, [comp, comp])
    assert e < comp
    assert float(A.delta(ev, e)) <= 1e-5 * (1 + 1e-9)
    np.testing.assert_array_equal(A.pnsgd_record_epsilon(ev, 1e-5), np.full(1000, e))
    # Composes with other add/remove events through its RDP curve.
    assert float(A.epsilon(A.Composed((ev, A.dpsgd_event(0.01, 2.0, 100))), 1e-5)) > e


def test_event_fields_are_checked():
    with pytest.raises(ValueError, match="relation='add_remove'"):
        _event(relation="replace_one")
    with pytest.raises(ValueError, match="Poisson sampling only"):
        A.PNSGD(1.0, 1.0, 0.5, 1.0, 1.0, num_records=10, q=0.1)
    with pytest.raises(ValueError, match="num_steps"):
        _event(num_steps=None)
    with pytest.raises(ValueError, match="passes"):
        _event(passes=2)
    with pytest.raises(ValueError, match="contractive"):
        A.epsilon(_event(max_batch_size=None), 1e-5)  # ηβn/b = 50
    # Existing fixed-order events are unchanged (same fields, same defaults).
    assert A.PNSGD(1.0, 1.0, 0.5, 1.0, 1.0, num_records=10).sampling == "sequential"


def test_calibration_of_a_poisson_event_refuses_what_it_cannot_do():
    ev = _event()
    with pytest.raises(ValueError, match="runs eagerly"):
        jax.jit(lambda e: A.calibrate_pnsgd_noise_std(e, 1e-5, ev))(1.0)
    with pytest.raises(ValueError, match="analysis='best' or 'composition'"):
        A.calibrate_pnsgd_noise_std(1.0, 1e-5, ev, analysis="iteration")


@pytest.mark.slow  # compiles the 64-point σ grid (~1 min idle)
def test_calibration_of_a_poisson_event_meets_the_target():
    import dataclasses

    ev = _event()
    s = float(A.calibrate_pnsgd_noise_std(1.0, 1e-5, ev))
    assert float(A.epsilon(dataclasses.replace(ev, noise_std=s), 1e-5)) <= 1.0
    assert float(A.epsilon(dataclasses.replace(ev, noise_std=s * (1 - 1e-4)), 1e-5)) > 1.0
    s_comp = float(A.calibrate_pnsgd_noise_std(1.0, 1e-5, dataclasses.replace(ev, hidden=False)))
    assert s < s_comp  # the hidden-state bound needs less noise
