"""Randomized response, zCDP and single-epoch tree aggregation against dp_accounting and closed forms.

References: dp_accounting 0.6.0's RdpAccountant (ε on ≥ 200 random configurations of each
event, 1e-6 relative), the exact Rényi divergence of randomized response's two discrete
distributions in mpmath, the zCDP line ξ + ρα, and the interop round trip.
"""

import math

import jax
import jax.numpy as jnp
import mpmath as mp
import numpy as np
import pytest

import jaxdp.accounting as A
import jaxdp.interop as interop

dpa = pytest.importorskip("dp_accounting")
from dp_accounting.rdp import rdp_privacy_accountant as rdp_acc  # noqa: E402



@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


NR = dpa.NeighboringRelation
# ε agrees to rounding (same formulas, same orders): 1e-6 relative is the acceptance line.
RTOL = 1e-6
N_CONFIGS = 200


def _dp_eps(dp_event, relation, delta):
    acc = rdp_acc.RdpAccountant(neighboring_relation=relation)
    acc.compose(dp_event)
    return acc.get_epsilon(delta)


def _configs(seed):
    rng = np.random.default_rng(seed)
    return rng, 10.0 ** rng.uniform(-10, -2, N_CONFIGS), rng.integers(1, 2000, N_CONFIGS)


def _check_batch(events, dp_events, relation, deltas):
    """A batch of jaxdp events (one call, vmapped leaves) against dp_accounting one by one."""
    got = np.asarray(A.epsilon(events, jnp.asarray(deltas)))
    want = np.array([_dp_eps(e, relation, d) for e, d in zip(dp_events, deltas)])
    finite = np.isfinite(want)
    assert np.array_equal(finite, np.isfinite(got))
    np.testing.assert_allclose(got[finite], want[finite], rtol=RTOL)


def test_randomized_response_against_dp_accounting():
    rng, deltas, counts = _configs(1)
    p = rng.uniform(0.01, 1.0, N_CONFIGS)
    k = rng.integers(1, 50, N_CONFIGS).astype(float)
    ev = A.SelfComposed(A.RandomizedResponse(p, k), counts)
    dps = [dpa.SelfComposedDpEvent(dpa.RandomizedResponseDpEvent(float(a), int(b)), int(c))
           for a, b, c in zip(p, k, counts)]
    _check_batch(ev, dps, NR.REPLACE_ONE, deltas)


def test_zcdp_against_dp_accounting():
    rng, deltas, counts = _configs(2)
    rho = 10.0 ** rng.uniform(-6, 0, N_CONFIGS)
    xi = np.where(rng.uniform(size=N_CONFIGS) < 0.5, 0.0, 10.0 ** rng.uniform(-6, -1, N_CONFIGS))
    ev = A.SelfComposed(A.ZCDP(rho, xi), counts)
    dps = [dpa.SelfComposedDpEvent(dpa.ZCDpEvent(float(a), float(b)), int(c)) for a, b, c in zip(rho, xi, counts)]
    _check_batch(ev, dps, NR.ADD_OR_REMOVE_ONE, deltas)


def test_tree_aggregation_against_dp_accounting():
    rng, deltas, counts = _configs(3)
    sigma = rng.uniform(0.3, 30.0, N_CONFIGS)
    # step_counts is static: group configurations by a few tree shapes.
    shapes = [(1,), (7,), (100, 37), (1000,), (5, 5, 5, 4096)]
    for i, shape in enumerate(shapes):
        sl = slice(i, None, len(shapes))
        ev = A.SelfComposed(A.SingleEpochTreeAggregation(sigma[sl], shape), counts[sl])
        dps = [dpa.SelfComposedDpEvent(dpa.SingleEpochTreeAggregationDpEvent(float(s), list(shape)), int(c))
               for s, c in zip(sigma[sl], counts[sl])]
        _check_batch(ev, dps, NR.REPLACE_SPECIAL, deltas[sl])


def _rr_divergence(p, k, alpha):
    """D_α(P‖Q) of randomized response's output laws, summed bucket by bucket in mpmath."""
    mp.mp.dps = 50
    p, k, alpha = mp.mpf(p), int(k), mp.mpf(alpha)
    P = [1 - p + p / k] + [p / k] * (k - 1)
    Q = [p / k, 1 - p + p / k] + [p / k] * (k - 2)
    return float(mp.log(sum(a**alpha * b ** (1 - alpha) for a, b in zip(P, Q))) / (alpha - 1))


@pytest.mark.parametrize("p,k", [(0.1, 2), (0.5, 3), (0.9, 10), (0.01, 100), (0.999, 4)])
def test_randomized_response_is_the_exact_divergence(p, k):
    orders = (1.5, 2.0, 8.0, 64.0)
    got = np.asarray(A.rdp(A.RandomizedResponse(p, k), orders))
    want = [_rr_divergence(p, k, a) for a in orders]
    # The sum is 1 + O(ε(α)): near p = 1 its log loses ~1e-16/ε(α) relative (1e-11 at ε ~ 1e-5).
    np.testing.assert_allclose(got, want, rtol=1e-9)


def test_randomized_response_edges():
    o = (2.0, 8.0)
    assert np.all(np.asarray(A.rdp(A.RandomizedResponse(1.0, 5), o)) == 0.0)  # pure noise
    assert np.all(np.asarray(A.rdp(A.RandomizedResponse(0.3, 1), o)) == 0.0)  # one bucket
    assert np.all(np.isposinf(np.asarray(A.rdp(A.RandomizedResponse(0.0, 5), o))))  # the bucket itself


def test_zcdp_and_tree_closed_forms():
    o = np.array([1.5, 2.0, 10.0])
    np.testing.assert_allclose(A.rdp(A.ZCDP(0.25, 0.1), o), 0.1 + 0.25 * o, rtol=1e-15)
    # step counts 100 and 37: depth ⌈log2(101)⌉ = 7 Gaussian nodes of σ = 2.
    np.testing.assert_allclose(A.rdp(A.SingleEpochTreeAggregation(2.0, (100, 37)), o), o * 7 / 8.0, rtol=1e-15)
    assert A.SingleEpochTreeAggregation(2.0, 5).step_counts == (5,)


def test_interop_round_trip_and_relations():
    for e in (A.RandomizedResponse(0.3, 4), A.ZCDP(0.2, 0.01, relation="replace_one"),
              A.SingleEpochTreeAggregation(1.5, (10, 3))):
        out = interop.to_dp_event(A.SelfComposed(e, 3))
        back = interop.from_dp_event(out.dp_event, out.relation)
        assert float(A.epsilon(back, 1e-5)) == pytest.approx(float(A.epsilon(A.SelfComposed(e, 3), 1e-5)), rel=1e-15)
    with pytest.raises(ValueError, match="replace_one"):
        interop.from_dp_event(dpa.RandomizedResponseDpEvent(0.5, 2), "add_remove")
    with pytest.raises(ValueError, match="relation"):
        A.RandomizedResponse(0.5, 2, relation="add_remove")


@pytest.mark.parametrize("make,name", [
    (lambda: A.RandomizedResponse(1.5, 2), "noise_parameter"), (lambda: A.RandomizedResponse(0.5, 2.5), "num_buckets"),
    (lambda: A.ZCDP(-1.0), "rho"), (lambda: A.ZCDP(1.0, -0.1), "xi"),
    (lambda: A.SingleEpochTreeAggregation(0.0, 3), "noise_multiplier")])
def test_invalid_leaves_name_the_field(make, name):
    with pytest.raises(ValueError, match=name):
        A.epsilon(make(), 1e-5)


def test_bad_step_counts():
    for bad in ((), (-1,), (2.5,), "abc"):
        with pytest.raises(ValueError, match="step_counts"):
            A.SingleEpochTreeAggregation(1.0, bad)


def test_pld_refuses_with_a_clear_error():
    with pytest.raises(ValueError, match="ZCDP"):
        A.epsilon(A.ZCDP(0.1), 1e-5, accountant="pld")


def test_jit_vmap_grad():
    ev = lambda x: A.Composed((A.ZCDP(x / 10.0), A.RandomizedResponse(x / 4.0, 3),  # noqa: E731
                                A.SingleEpochTreeAggregation(x, (16,), relation="replace_one")))

    def f(x):
        return A.epsilon(A.Composed((A.ZCDP(x / 10.0, relation="replace_one"), A.RandomizedResponse(x / 4.0, 3),
                                     A.SingleEpochTreeAggregation(x, (16,), relation="replace_one"))), 1e-5)

    del ev
    x = 1.3
    assert float(jax.jit(f)(x)) == pytest.approx(float(f(x)), rel=1e-12)
    xs = jnp.array([1.1, 1.3, 2.0])
    np.testing.assert_allclose(jax.vmap(f)(xs), [float(f(float(v))) for v in xs], rtol=1e-12)
    h = 1e-6
    fd = (float(f(x + h)) - float(f(x - h))) / (2 * h)
    assert float(jax.grad(f)(x)) == pytest.approx(fd, rel=1e-5)
    assert math.isfinite(float(jax.grad(f)(x)))
