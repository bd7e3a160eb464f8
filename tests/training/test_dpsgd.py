"""DP-SGD with Poisson sampling: batch sizes are Binomial(N, q), no sampled record is dropped,
the update is the analysed formula, hyper-parameters can be traced."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from scipy import stats

from jaxdp.models import MLP, softmax_cross_entropy_loss
from jaxdp.training import batch_capacity, dpsgd, dpsgd_step, per_example_grads, poisson_sample

# A chi-square test at this level fails by chance once in 10^4 runs (fixed keys make it
# deterministic; the level only says how surprising a failure would be).
P_VALUE = 1e-4


def test_poisson_batch_sizes_follow_binomial():
    n, q, draws = 500, 0.03, 4000
    keys = jax.random.split(jax.random.key(0), draws)
    idx, sizes = jax.vmap(lambda k: poisson_sample(k, n, q))(keys)
    sizes = np.asarray(sizes)
    # Chi-square goodness of fit of the realised sizes to Binomial(n, q), tails pooled.
    lo, hi = int(stats.binom.ppf(0.001, n, q)), int(stats.binom.ppf(0.999, n, q))
    edges = np.arange(lo, hi + 2)
    observed = np.array([np.sum(sizes < lo)] + [np.sum(sizes == k) for k in edges[:-1]] + [np.sum(sizes > hi)])
    p = np.concatenate([[stats.binom.cdf(lo - 1, n, q)], stats.binom.pmf(edges[:-1], n, q),
                        [stats.binom.sf(hi, n, q)]])
    # Pool cells with expected counts below 5 into their neighbour.
    obs, exp = [], []
    acc_o = acc_e = 0.0
    for o, e in zip(observed, p * draws):
        acc_o, acc_e = acc_o + o, acc_e + e
        if acc_e >= 5:
            obs.append(acc_o)
            exp.append(acc_e)
            acc_o = acc_e = 0.0
    obs[-1] += acc_o
    exp[-1] += acc_e
    assert stats.chisquare(obs, np.array(exp) * sum(obs) / sum(exp)).pvalue > P_VALUE
    # Each record enters independently with probability q: inclusion counts are Binomial(draws, q).
    idx = np.asarray(idx)
    counts = np.zeros(n)
    for row, s in zip(idx, sizes):
        counts[row[:s]] += 1
        assert np.all(np.diff(row[:s]) > 0) and np.all(row[s:] == 0)  # sampled first, increasing; then zeros
    z = (counts - draws * q) / math.sqrt(draws * q * (1 - q))
    assert stats.kstest(z, "norm").pvalue > P_VALUE


def test_batch_capacity_is_the_exact_binomial_quantile():
    n, q, overflow = 200, 0.05, 1e-6

    def sf(c):  # P(Binomial(n, q) > c), exact in rationals' floating image
        return sum(math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(c + 1, n + 1))

    c = batch_capacity(n, q, overflow)
    assert sf(c) <= overflow < sf(c - 1)
    with pytest.raises(ValueError, match="q"):
        batch_capacity(10, 0.0)
    with pytest.raises(ValueError, match="num_records"):
        batch_capacity(0, 0.5)


def _mlp_setup(n=40):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 5)).astype(np.float32)
    y = rng.integers(0, 3, size=n)
    model = MLP((5, 4, 3), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return model, graphdef, params, rest, jnp.asarray(x), jnp.asarray(y)


@pytest.mark.parametrize("capacity", [3, 64])  # 3: the batch overflows into several chunks
def test_step_equals_the_formula_and_drops_no_sampled_record(capacity):
    model, graphdef, params, rest, x, y = _mlp_setup()
    q, clip, lr = 0.5, 0.7, 0.3
    tx = dpsgd(optax.sgd(lr), 0.0, clip, q * x.shape[0], jax.random.key(1))  # no noise: compare exactly
    key = jax.random.key(5)
    step = jax.jit(lambda p, s, k: dpsgd_step(softmax_cross_entropy_loss, graphdef, rest, tx, p, s, k, x, y, q, clip,
                                              capacity))
    new, _, out = step(params, tx.init(params), key)
    idx, size = poisson_sample(key, x.shape[0], q)
    sampled = np.asarray(idx)[: int(size)]
    assert int(out.batch_size) == sampled.size and int(out.chunks) == math.ceil(sampled.size / capacity)
    g = per_example_grads(softmax_cross_entropy_loss, model, (x[sampled], y[sampled]))
    flat = [np.asarray(v, np.float64).reshape(sampled.size, -1) for v in jax.tree.leaves(g)]
    norms = np.sqrt(sum(np.sum(f**2, axis=1) for f in flat))
    factor = np.minimum(1.0, clip / norms)
    for p0, p1, f in zip(jax.tree.leaves(params), jax.tree.leaves(new), flat):
        expected = np.asarray(p0, np.float64).ravel() - lr * (factor @ f) / (q * x.shape[0])
        np.testing.assert_allclose(np.asarray(p1).ravel(), expected, rtol=2e-5, atol=2e-6)
    assert float(out.max_grad_norm) == pytest.approx(norms.max(), rel=1e-5)


def test_noise_has_std_noise_multiplier_times_clip_over_expected_batch():
    nu, clip, ebs = 1.5, 2.0, 8.0
    tx = dpsgd(1.0, nu, clip, ebs, jax.random.key(3))  # a float is the learning rate of plain SGD
    u, _ = tx.update(jnp.zeros(200_000), tx.init(jnp.zeros(200_000)))
    # SGD negates: u = -(S + Z)/ebs with S = 0. The std's relative standard error is 1/sqrt(2n).
    assert float(jnp.std(u)) == pytest.approx(nu * clip / ebs, rel=5 / math.sqrt(2 * 200_000))


def test_hyper_parameters_can_be_traced():
    def run(nu):
        tx = dpsgd(optax.sgd(0.1), nu, 1.0, 4.0, jax.random.key(0))
        u, _ = tx.update(jnp.zeros(3), tx.init(jnp.zeros(3)))
        return u

    a = jax.jit(run)(0.5)
    b = run(0.5)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    with pytest.raises(ValueError, match="noise_multiplier"):
        dpsgd(0.1, -1.0, 1.0, 4.0, jax.random.key(0))
    with pytest.raises(ValueError, match="clip_norm"):
        dpsgd(0.1, 1.0, 0.0, 4.0, jax.random.key(0))


def test_realised_rate_never_exceeds_the_accounted_q():
    """Inclusion is bits < floor(q 2^32): rate floor(q 2^32)/2^32 <= q, computed here with Python ints.

    (A float32 uniform compared with q includes with probability ceil(q 2^23)/2^23 >= q, a rate
    above the one accounted: an under-reported epsilon, however slightly.)
    """
    key, n = jax.random.key(7), 5000
    bits = np.asarray(jax.random.bits(key, (n,), jnp.uint32)).astype(np.int64)
    for q in (0.1, 256 / 60000, 1 / 3, 0.999999999):
        t = math.floor(q * 2**32)  # exact: q * 2^32 is exact in float64, floor of it too
        assert t <= q * 2**32
        idx, size = poisson_sample(key, n, q)
        expected = np.flatnonzero(bits < t)
        assert int(size) == expected.size
        np.testing.assert_array_equal(np.asarray(idx)[: int(size)], expected)


def test_noise_keys_tied_to_the_sum_keep_their_values():
    """dpsgd_step ties the noise's keys to the clipped sum (only to order the draw after it):
    the keys' data and every other state leaf come back unchanged, for a finite or NaN sum."""
    from jaxdp.training._dpsgd import _drawn_after

    for key in (jax.random.key(3), jax.random.PRNGKey(3)):  # typed and raw uint32 keys
        tx = dpsgd(optax.adam(0.1), 1.1, 0.7, 8.0, key)
        state = tx.update(jnp.ones(3), tx.init(jnp.zeros(3)), jnp.zeros(3))[1]
        for x in (0.5, float("nan"), float("inf")):
            out = jax.jit(_drawn_after)(state, jnp.float32(x))
            for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(out), strict=True):
                if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
                    a, b = jax.random.key_data(a), jax.random.key_data(b)
                assert a.dtype == b.dtype
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
