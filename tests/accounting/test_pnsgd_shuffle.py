"""Hidden-state RDP of PNSGD with batches reshuffled every pass (shuffle_pnsgd_rdp / shuffle_pnsgd_epsilon).

The independent check: the actual shuffled process on a 1-D linear and a 1-D quadratic loss
over a bounded interval. Its last iterate's law is computed by an exact recursion of the
transition on a grid (NumPy/SciPy only, no jaxdp): one pass is the kernel
M = Σ_j w_j P^{j−1} R P^{m−j} (the record in batch j with probability w_j = b_j/n, R the batch
step with the record, P without), k passes are M^k. Its Rényi divergences (both directions,
every order) and its ε at δ (hockey-stick) may not exceed the bound; nor may a Monte Carlo
audit's lower bound (95 %).
"""

import jax
import numpy as np
import pytest
from scipy.special import logsumexp, ndtr

import jaxdp

from .test_pnsgd_poisson import _eps_of_laws  # smallest ε with both hockey-stick divergences ≤ δ (NumPy)

A = jaxdp.accounting
ORD = (1.5, 2.0, 4.0, 8.0, 32.0, 128.0)


def _transition(grid, shift, s):
    """Row-stochastic matrix of y_i ↦ grid cell of clip(mean_i + N(0, s²), 0, D)."""
    edges = np.concatenate([[-np.inf], 0.5 * (grid[1:] + grid[:-1]), [np.inf]])
    return np.diff(ndtr((edges[None, :] - shift[:, None]) / s), axis=1)


def _pass_kernels(steps_with, step_without, sizes):
    """One pass's kernel: the record in batch j (probability b_j/n), the other batches without it."""
    m, n = len(sizes), float(np.sum(sizes))
    G = step_without(sizes[0]).shape[0]
    out = np.zeros((G, G))
    before = np.eye(G)
    for j in range(m):
        after = np.eye(G)
        for i in range(j + 1, m):
            after = after @ step_without(sizes[i])
        out += sizes[j] / n * before @ steps_with(sizes[j]) @ after
        before = before @ step_without(sizes[j])
    return out


def _sizes(n, b):
    m = -(-n // b)
    return [b] * (m - 1) + [n - (m - 1) * b]


def _linear_laws(n, b, k, lip, eta, sig, D, G):
    """ℓ(y, x) = g_x y on [0, D]: the record's g = +L in one data set, −L in the other, the others' g = 0."""
    grid = np.linspace(0.0, D, G)
    s = eta * sig
    P = lambda bj: _transition(grid, grid, s)  # noqa: E731
    R_in = lambda bj: _transition(grid, grid - eta * lip / bj, s)  # noqa: E731
    R_out = lambda bj: _transition(grid, grid + eta * lip / bj, s)  # noqa: E731
    return _last_iterate_laws(_pass_kernels(R_in, P, _sizes(n, b)), _pass_kernels(R_out, P, _sizes(n, b)), k)


def _last_iterate_laws(M_in, M_out, k):
    """The laws after k passes from the grid's middle point (the data-independent start)."""
    p = np.zeros(M_in.shape[0])
    p[p.size // 2] = 1.0
    r = p.copy()
    for _ in range(k):
        p, r = p @ M_in, r @ M_out
    return p, r


def _quadratic_laws(n, b, k, eta, sig, G):
    """ℓ(y, x) = (y − x)²/2 on [0, 1] (L = 1, β = 1): the record at 0 or at 1, the others at 1/2."""
    grid = np.linspace(0.0, 1.0, G)
    s = eta * sig

    def step(x_record):
        # the batch's mean gradient y − x̄, x̄ = (x_record + (b_j − 1)/2)/b_j
        return lambda bj: _transition(grid, grid - eta * (grid - (x_record + 0.5 * (bj - 1)) / bj), s)

    P = lambda bj: _transition(grid, grid - eta * (grid - 0.5), s)  # noqa: E731
    return _last_iterate_laws(_pass_kernels(step(0.0), P, _sizes(n, b)), _pass_kernels(step(1.0), P, _sizes(n, b)), k)


def _renyi(p, r, alpha):
    ok = (p > 0) & (r > 0)
    x = alpha * np.log(p[ok]) + (1 - alpha) * np.log(r[ok])
    return (x.max() + np.log(np.sum(np.exp(x - x.max())))) / (alpha - 1)




# (n, b, L, η, σ, D) of the linear loss (β = 0); (n, b, η, σ) of the quadratic (L = D = β = 1).
LINEAR = [(6, 2, 1.0, 1.0, 0.5, 1.0), (4, 1, 1.0, 1.0, 1.0, 2.0), (5, 2, 1.0, 1.0, 0.7, 1.5),
          (8, 1, 1.0, 1.0, 1.0, 1.0)]
QUADRATIC = [(4, 1, 0.5, 0.5), (6, 2, 1.0, 0.5), (5, 2, 0.8, 0.3)]


def _check(p, r, bound_rdp, bound_eps, delta):
    truth = np.array([max(_renyi(p, r, a), _renyi(r, p, a)) for a in ORD])
    assert np.all(truth <= np.asarray(bound_rdp)), (truth, bound_rdp)
    e = _eps_of_laws(p, r, delta)
    assert e <= float(bound_eps), (e, bound_eps)
    return truth / np.asarray(bound_rdp)


def _check_linear(params, passes, G, delta=1e-3):
    n, b, lip, eta, sig, D = params
    for k in passes:
        p, r = _linear_laws(n, b, k, lip, eta, sig, D, G)
        kw = dict(num_records=n, batch_size=b, passes=k)
        _check(p, r, A.shuffle_pnsgd_rdp(ORD, lip, 0.0, eta, sig, D, **kw),
               A.shuffle_pnsgd_epsilon(delta, lip, 0.0, eta, sig, D, **kw), delta)


def _check_quadratic(params, passes, G, delta=1e-3):
    n, b, eta, sig = params
    for k in passes:
        p, r = _quadratic_laws(n, b, k, eta, sig, G)
        kw = dict(num_records=n, batch_size=b, passes=k)
        _check(p, r, A.shuffle_pnsgd_rdp(ORD, 1.0, 1.0, eta, sig, 1.0, **kw),
               A.shuffle_pnsgd_epsilon(delta, 1.0, 1.0, eta, sig, 1.0, **kw), delta)


def test_numerical_process_linear_loss_never_above_the_bound():
    # Observed (G = 300): the exact Rényi divergence is 0.02-0.32 of the bound at α = 1.5..32.
    _check_linear(LINEAR[0], (1, 2), G=160)


def test_numerical_process_quadratic_loss_never_above_the_bound():
    _check_quadratic(QUADRATIC[1], (1, 2), G=160)


@pytest.mark.slow  # finer grids, every parameter set, up to 4 passes (~1 min)
@pytest.mark.parametrize("params", LINEAR)
def test_numerical_process_linear_loss_slow(params):
    _check_linear(params, (1, 2, 4), G=400)
    _check_linear(params, (1, 3), G=400, delta=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("params", QUADRATIC)
def test_numerical_process_quadratic_loss_slow(params):
    _check_quadratic(params, (1, 2, 4), G=400)


def _simulate_linear(n, b, k, lip, eta, sig, D, runs, rng, sign):
    """Monte Carlo runs of the shuffled linear process: the record's batch drawn uniformly per pass (w_j = b_j/n)."""
    sizes = np.asarray(_sizes(n, b), np.float64)
    y = np.full(runs, D / 2)
    for _ in range(k):
        pos = rng.integers(0, n, runs)  # the record's place in this pass's permutation
        batch = pos // b
        for j in range(len(sizes)):
            push = np.where(batch == j, sign * eta * lip / sizes[j], 0.0)
            y = np.clip(y - push + eta * sig * rng.standard_normal(runs), 0.0, D)
    return y


def _audit(params, k, runs, delta, seed):
    n, b, lip, eta, sig, D = params
    rng = np.random.default_rng(seed)
    y_in = _simulate_linear(n, b, k, lip, eta, sig, D, runs, rng, 1.0)
    y_out = _simulate_linear(n, b, k, lip, eta, sig, D, runs, rng, -1.0)
    lb = float(jaxdp.audit.epsilon_lower_bound(-y_in, -y_out, delta).epsilon)  # the record pushes towards 0
    bound = float(A.shuffle_pnsgd_epsilon(delta, lip, 0.0, eta, sig, D, num_records=n, batch_size=b, passes=k))
    return lb, bound


def test_monte_carlo_audit_linear_loss_below_the_bound():
    lb, bound = _audit(LINEAR[0], 2, 20_000, 1e-3, seed=0)
    assert 0.0 < lb <= bound, (lb, bound)


@pytest.mark.slow  # 2·10⁵ runs per side, every parameter set
def test_monte_carlo_audit_linear_loss_slow():
    for params in LINEAR:
        for k in (1, 3):
            lb, bound = _audit(params, k, 200_000, 1e-3, seed=k)
            assert 0.0 < lb <= bound, (params, k, lb, bound)


# ---------------------------------------------------------------------------------------
# Closed forms, flat in the passes, transformations, validation, the event.

RUN = dict(lipschitz=1.0, smoothness=1.0, learning_rate=0.5, noise_std=1.0, diameter=1.0)
GEOM = dict(num_records=1000, batch_size=10)


def test_one_pass_is_the_log_mean_exp_of_the_fixed_order_bound_written_out():
    # One pass, n = 12, b = 4, a huge diameter (no shift from a distance pays): the record in batch j of m = 3
    # has Feldman et al.'s (α, 2αL²/(b²σ²(m−j+1)))-RDP; the mixture over j (w_j = 1/3) is their log-mean-exp.
    L, sig, b, m = 1.5, 0.8, 4, 3
    got = np.asarray(A.shuffle_pnsgd_rdp(ORD, L, 0.0, 1.0, sig, 1e9, num_records=12, batch_size=b))
    a = np.asarray(ORD)
    c = [2 * L**2 / (b**2 * sig**2 * (m - j + 1)) for j in (1, 2, 3)]
    want = (logsumexp([(a - 1) * a * cj for cj in c], axis=0) - np.log(3)) / (a - 1)
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_without_amplification_it_is_the_composition_of_the_passes():
    # One record per batch (b = 1): the last position has no later step, and with a huge diameter every pass
    # after the first is composed; the bound never exceeds k passes of the mixture of Gaussian steps.
    k, L, sig = 3, 1.0, 2.0
    got = np.asarray(A.shuffle_pnsgd_rdp(ORD, L, 0.0, 1.0, sig, 1e9, num_records=1, batch_size=1, passes=k))
    np.testing.assert_allclose(got, k * np.asarray(ORD) * 2 * L**2 / sig**2, rtol=1e-12)


def test_flat_in_the_passes_and_below_composition_at_the_defaults():
    eps = [float(A.shuffle_pnsgd_epsilon(1e-5, **RUN, **GEOM, passes=k)) for k in (1, 2, 3, 10, 1000)]
    assert all(b >= a for a, b in zip(eps, eps[1:])), eps
    assert eps[2] == eps[3] == eps[4], eps  # flat from the third pass
    ev = A.PNSGD(**RUN, **GEOM, passes=10, sampling="shuffle", hidden=False)
    assert eps[3] < 0.5 * float(A.epsilon(ev, 1e-5))


# jit, vmap and grad (both x64 modes): the rows shuffle_pnsgd_rdp/_epsilon of tests/accounting/test_transformations.py.


def test_bad_inputs_raise_eagerly_and_are_nan_under_jit():
    with pytest.raises(ValueError, match="learning_rate must be at most 2/smoothness"):
        A.shuffle_pnsgd_rdp(ORD, 1.0, 1.0, 2.5, 1.0, 1.0, num_records=10, batch_size=2)
    with pytest.raises(ValueError, match="batch_size must be <= num_records"):
        A.shuffle_pnsgd_rdp(ORD, 1.0, 1.0, 0.5, 1.0, 1.0, num_records=10, batch_size=20)
    with pytest.raises(ValueError, match="passes"):
        A.shuffle_pnsgd_rdp(ORD, 1.0, 1.0, 0.5, 1.0, 1.0, num_records=10, batch_size=2, passes=0)
    with pytest.raises(ValueError, match="noise_std"):
        A.shuffle_pnsgd_rdp(ORD, 1.0, 1.0, 0.5, -1.0, 1.0, num_records=10, batch_size=2)
    f = jax.jit(lambda eta: A.shuffle_pnsgd_rdp(ORD, 1.0, 1.0, eta, 1.0, 1.0, num_records=10, batch_size=2))
    assert np.all(np.isnan(f(2.5))) and np.all(np.isfinite(f(0.5)))


def test_event_is_the_accountant_and_in_pnsgd_privacy_best_of():
    ev = A.PNSGD(**RUN, **GEOM, passes=5, sampling="shuffle")
    want = float(A.shuffle_pnsgd_epsilon(1e-5, **RUN, **GEOM, passes=5))
    assert float(A.epsilon(ev, 1e-5)) == want
    out = A.pnsgd_privacy(ev, 1e-5, positions=[1, 1000])
    np.testing.assert_array_equal(out.best, [want, want])
    assert np.all(out.composition > out.best) and np.all(np.isinf(out.contraction))
    # The GDP mixture binds here (the RDP curve's conversion is looser), below the RDP one.
    np.testing.assert_array_equal(out.shifted_gdp, [want, want])
    assert np.all(out.iteration > out.shifted_gdp)
    assert float(A.delta(ev, want)) <= 1e-5 * (1 + 1e-9)
    with pytest.raises(ValueError, match="relation='replace_one'"):
        A.PNSGD(**RUN, **GEOM, sampling="shuffle", relation="add_remove")
    with pytest.raises(ValueError, match="field of Poisson sampling only"):
        A.PNSGD(**RUN, **GEOM, sampling="shuffle", q=0.1)
