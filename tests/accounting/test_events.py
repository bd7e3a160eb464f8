"""Privacy events: Laplace RDP against mpmath, events against their primitives, jit/vmap/grad, bad input."""

import math

import jax
import jax.numpy as jnp
import mpmath as mp
import numpy as np
import pytest

import jaxdp.accounting as A
from tests.diagnostics import recheck

# Laplace RDP is arranged without cancellation; measured error vs 60-digit mpmath is
# 2e-14 over λ in [1e-3, 1e6] and α in [1.0001, 1e5]. 1e-12 leaves room for other CPUs.
LAPLACE_RTOL = 1e-12
# An event and the primitive it stands for run the same float64 operations, up to the
# order of additions in a composition: agreement to 1e-12 relative.
CONSISTENCY_RTOL = 1e-12
# Central differences with step h = 1e-5·x have truncation error ~h² and rounding error
# ~1e-16/h relative: 1e-6 is loose for both.
GRAD_RTOL = 1e-6
DELTA = 1e-5
# A short grid of orders where the test is about the event layer, not the RDP values:
# compiling for it is several times faster than for the 156 default orders.
FEW_ORDERS = (1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0, 32.0, 64.0)


# --------------------------------------------------------------------------- laplace_rdp


def _laplace_ref(alpha, lam, dps=60):
    """Mironov 2017, Proposition 6, straight from the formula in multiple precision."""
    with mp.workdps(dps):
        a, t = mp.mpf(alpha), 1 / mp.mpf(lam)
        s = a / (2 * a - 1) * mp.exp((a - 1) * t) + (a - 1) / (2 * a - 1) * mp.exp(-a * t)
        return float(mp.log(s) / (a - 1))


def test_laplace_rdp_against_mpmath():
    orders = [1.0001, 1.01, 1.1, 1.5, 2.0, 3.7, 10.0, 64.0, 1024.0, 1e5]
    lams = np.array([1e-3, 0.05, 0.3, 1.0, 3.0, 10.0, 100.0, 1e4, 1e6])
    got = np.asarray(A.laplace_rdp(orders, lams))
    assert got.shape == (lams.size, len(orders))
    ref = np.array([[_laplace_ref(a, lam) for a in orders] for lam in lams])
    np.testing.assert_allclose(got, ref, rtol=LAPLACE_RTOL, atol=0)


def test_laplace_rdp_limits_and_bad_input():
    # α → ∞: ε → 1/λ (pure DP); never above it.
    r = np.asarray(A.laplace_rdp([1e9], [0.5, 2.0]))[:, 0]
    np.testing.assert_allclose(r, [2.0, 0.5], rtol=1e-8)
    assert np.all(np.asarray(A.laplace_rdp(A.DEFAULT_ORDERS, 0.7)) <= 1 / 0.7)
    with pytest.raises(ValueError, match="noise_multiplier"):
        A.laplace_rdp([2.0], -1.0)
    with pytest.raises(ValueError, match="orders"):
        A.laplace_rdp([1.0], 1.0)
    bad = jax.jit(lambda s: A.laplace_rdp(jnp.array([2.0]), s))(jnp.array([0.0, -1.0, jnp.inf, jnp.nan]))
    assert np.all(np.isnan(np.asarray(bad)))


# --------------------------------------------------------------------- random event trees


def _random_tree(rng, depth=0):
    kind = rng.choice(["gauss", "laplace", "sampled", "self", "composed"] if depth < 2 else ["gauss", "laplace",
                                                                                           "sampled"])
    if kind == "gauss":
        return A.Gaussian(float(10 ** rng.uniform(-0.3, 1.3)))
    if kind == "laplace":
        return A.Laplace(float(10 ** rng.uniform(-0.3, 1.5)))
    if kind == "sampled":
        return A.PoissonSampled(float(10 ** rng.uniform(-4, -0.5)), A.Gaussian(float(rng.uniform(0.6, 5.0))))
    if kind == "self":
        return A.SelfComposed(_random_tree(rng, depth + 1), float(rng.integers(1, 2000)) + rng.choice([0.0, 0.3]))
    return A.Composed(tuple(_random_tree(rng, depth + 1) for _ in range(int(rng.integers(1, 4)))))


def _reference_rdp(event, orders):
    """The RDP curve from the primitives, by an independent walk of the tree."""
    if isinstance(event, A.Gaussian):
        return np.asarray(A.gaussian_rdp(orders, event.noise_multiplier))
    if isinstance(event, A.Laplace):
        return np.asarray(A.laplace_rdp(orders, event.noise_multiplier))
    if isinstance(event, A.PoissonSampled):
        return np.asarray(A.sampled_gaussian_rdp(orders, event.q, event.event.noise_multiplier))
    if isinstance(event, A.SelfComposed):
        return math.ceil(event.count) * _reference_rdp(event.event, orders)
    return sum(_reference_rdp(e, orders) for e in event.events)


def random_trees(n, seed):
    rng = np.random.default_rng(seed)
    return [_random_tree(rng) for _ in range(n)]


def test_random_trees_match_primitives():
    orders = A.DEFAULT_ORDERS
    # Each tree is a new program (~1.5 CPU-s under load): 4 here; test_interop's 8 random trees
    # are checked against dp_accounting.
    for tree in random_trees(4, seed=1):
        ref_rdp = _reference_rdp(tree, orders)
        np.testing.assert_allclose(np.asarray(A.rdp(tree, orders)), ref_rdp, rtol=CONSISTENCY_RTOL)
        ref_eps = float(A.rdp_to_epsilon(ref_rdp, orders, DELTA).epsilon)
        eps = float(A.epsilon(tree, DELTA))
        # (recheck runs only when an assertion fails: see tests/diagnostics.py)
        assert eps == pytest.approx(ref_eps, rel=CONSISTENCY_RTOL), recheck(f"A.epsilon({tree!r}, {DELTA!r})")
        ref_delta = float(A.rdp_to_delta(ref_rdp, orders, eps).delta)
        got_delta = float(A.delta(tree, eps))
        assert got_delta == pytest.approx(ref_delta, rel=CONSISTENCY_RTOL), recheck(f"A.delta({tree!r}, {eps!r})")


def test_dpsgd_event_equals_dpsgd_epsilon_and_schedule():
    q = np.array([1e-3, 0.01, 256 / 60000, 0.1])
    s = np.array([0.8, 1.1, 1.1, 3.0])
    t = np.array([1000.0, 10000.0, 14040.0, 250.5])
    got = np.asarray(A.epsilon(A.dpsgd_event(q, s, t), DELTA))
    np.testing.assert_allclose(got, np.asarray(A.dpsgd_epsilon(q, s, t, DELTA)), rtol=CONSISTENCY_RTOL)
    sched = A.Composed(tuple(A.dpsgd_event(q[i], s[i], t[i]) for i in range(4)))
    np.testing.assert_allclose(float(A.epsilon(sched, DELTA)), float(A.schedule_epsilon(q, s, t, DELTA)),
                               rtol=CONSISTENCY_RTOL)


PNSGD_RUN = dict(lipschitz=1.0, smoothness=0.5, learning_rate=0.5, noise_std=2.0, diameter=1.0)


def _privacy(**kw):
    return A.pnsgd_privacy(lipschitz=1.0, smoothness=0.5, learning_rate=0.5, noise_std=2.0, diameter=1.0, num_records=40,
                           delta=DELTA, **kw)


def test_pnsgd_event_equals_primitives():
    ref = _privacy()
    hidden = A.PNSGD(**PNSGD_RUN, num_records=40)
    assert float(A.epsilon(hidden, DELTA)) == pytest.approx(float(ref.best[-1]), rel=CONSISTENCY_RTOL)
    np.testing.assert_allclose(np.asarray(A.pnsgd_record_epsilon(hidden, DELTA)), np.asarray(ref.best),
                               rtol=CONSISTENCY_RTOL, atol=1e-300)
    released = A.PNSGD(**PNSGD_RUN, num_records=40, hidden=False)
    assert float(A.epsilon(released, DELTA)) == pytest.approx(float(ref.composition[-1]), rel=CONSISTENCY_RTOL)
    # Random stop: the better of Theorem 5 (contraction) and Theorem 26 (RDP), worst record i = 1.
    stop = A.PNSGD(**PNSGD_RUN, num_records=40, schedule="random_stop")
    m_c = A.step_contraction(0.5, 0.5)
    e_c = float(A.stop_pnsgd_contraction_epsilon(1e-3, 40, 1.0, 2.0, 0.5, 1.0, m_c, positions=1))
    rdp_s = A.stop_pnsgd_iteration_rdp(A.DEFAULT_ORDERS, 40, 1.0, 2.0, positions=1, form="logmeanexp")
    e_r = float(A.rdp_to_epsilon(rdp_s, A.DEFAULT_ORDERS, 1e-3).epsilon)
    assert float(A.epsilon(stop, 1e-3)) == pytest.approx(min(e_c, e_r), rel=CONSISTENCY_RTOL)
    per = np.asarray(A.pnsgd_record_epsilon(stop, 1e-3))
    assert per[0] == pytest.approx(min(e_c, e_r), rel=CONSISTENCY_RTOL)
    assert np.all(np.diff(per) <= 1e-12)  # later records are safer under random stopping


@pytest.mark.parametrize("kw, slack", [({}, 1.0), ({"hidden": False}, 1.0), ({"schedule": "random_stop"}, 1.0),
                                       ({"batch_size": 4, "passes": 3}, 1.02)],
                         ids=["hidden", "released", "random_stop", "batches"])
def test_pnsgd_delta_is_consistent_with_epsilon(kw, slack):
    # Where ε comes from the contraction or composition analysis, δ(ε) inverts it exactly:
    # δ at the reported (rounded-up) ε is at most the target. With mini-batches and
    # several passes ε comes from the RDP bound at the best continuous order, which δ
    # evaluates on the orders grid: within 2% of ε the target is met.
    ev = A.PNSGD(**PNSGD_RUN, num_records=40, **kw)
    e = float(A.epsilon(ev, DELTA))
    assert float(A.delta(ev, slack * e)) <= DELTA * (1 + 1e-9), kw
    assert float(A.delta(ev, 0.9 * e)) > DELTA, kw  # and ε is not loose by 10%


def test_pnsgd_rdp_inside_a_composition():
    ev = A.PNSGD(**PNSGD_RUN, num_records=40)
    orders = [2.0, 8.0]
    ref = np.asarray(A.pnsgd_iteration_rdp(orders, 40, 40, 1.0, 2.0))
    np.testing.assert_allclose(np.asarray(A.rdp(ev, orders)), ref, rtol=CONSISTENCY_RTOL)
    both = A.Composed((ev, A.SelfComposed(ev, 2)))
    np.testing.assert_allclose(np.asarray(A.rdp(both, orders)), 3 * ref, rtol=CONSISTENCY_RTOL)


# ----------------------------------------------------------------------- jit, vmap, grad


def _full_batch(event, n):
    """jax.vmap maps every leaf: give the broadcast (scalar) leaves the batch axis too."""
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.float64), (n,)), event)


def test_batch_vmap_and_loop_agree():
    q = np.array([1e-3, 0.01, 0.05])
    s = np.array([0.9, 1.3, 2.0])
    lam = np.array([5.0, 10.0, 20.0])
    batch = A.Composed((A.dpsgd_event(q, s, 500), A.Laplace(lam)))

    def eps(e):
        return A.epsilon(e, DELTA, orders=FEW_ORDERS)

    broadcast = np.asarray(eps(batch))
    vmapped = np.asarray(jax.jit(jax.vmap(eps))(_full_batch(batch, 3)))
    loop = np.array([float(eps(A.Composed((A.dpsgd_event(q[i], s[i], 500), A.Laplace(lam[i]))))) for i in range(3)])
    np.testing.assert_allclose(broadcast, loop, rtol=CONSISTENCY_RTOL)
    np.testing.assert_allclose(vmapped, loop, rtol=CONSISTENCY_RTOL)


@pytest.mark.slow  # CI: the DP-SGD batch test covers the batching rule
def test_pnsgd_batch_vmap_and_loop_agree():
    sig = np.array([1.5, 4.0])
    batch = A.PNSGD(1.0, 0.5, 0.5, sig, 1.0, num_records=20)
    loop = np.array([float(A.pnsgd_privacy(lipschitz=1.0, smoothness=0.5, learning_rate=0.5, noise_std=s, diameter=1.0,
                                           num_records=20, delta=DELTA, positions=np.array([20.0])).best[0])
                     for s in sig])
    # A batched PNSGD event is evaluated by jax.vmap over its flattened leaves inside
    # epsilon (pnsgd_privacy takes scalar runs), so this is the vmap path; an outer
    # jax.vmap traces the same program (it is not repeated here: compiling the PNSGD
    # analyses under vmap takes tens of seconds on a loaded 2-core machine).
    np.testing.assert_allclose(np.asarray(A.epsilon(batch, DELTA)), loop, rtol=CONSISTENCY_RTOL)


def test_jit_traces_once_for_new_values():
    traces = []

    def f(ev):
        traces.append(1)
        return A.epsilon(ev, DELTA, orders=FEW_ORDERS)

    jf = jax.jit(f)
    a = jf(A.dpsgd_event(0.01, 1.1, 1000.0))
    b = jf(A.dpsgd_event(0.02, 1.5, 3000.0))
    assert len(traces) == 1
    ref = A.dpsgd_epsilon(np.array([0.01, 0.02]), np.array([1.1, 1.5]), np.array([1000, 3000]), DELTA, FEW_ORDERS)
    np.testing.assert_allclose([float(a), float(b)], np.asarray(ref), rtol=CONSISTENCY_RTOL)


def _central(f, x, h_rel=1e-5):
    h = h_rel * abs(x)
    return (f(x + h) - f(x - h)) / (2 * h)


@pytest.mark.slow  # CI: test_transformations checks grad(jit) of the event evaluations
@pytest.mark.parametrize(
    "make, x0",
    [
        (lambda v: A.dpsgd_event(0.01, v, 1000.0), 1.1),
        (lambda v: A.dpsgd_event(v, 1.1, 1000.0), 0.013),
        (lambda v: A.Composed((A.Laplace(v), A.SelfComposed(A.Gaussian(8.0), 3.0))), 7.0),
        (lambda v: A.PNSGD(1.0, 0.5, 0.5, v, 1.0, num_records=40), 2.0),
    ],
)
def test_grad_matches_central_differences(make, x0):
    eps = jax.jit(lambda v: A.epsilon(make(v), DELTA, orders=FEW_ORDERS))
    g = float(jax.jit(jax.grad(eps))(x0))
    fd = _central(lambda v: float(eps(v)), x0)
    assert np.isfinite(g) and g != 0
    assert g == pytest.approx(fd, rel=GRAD_RTOL)


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "event, match",
    [
        (A.Gaussian(-1.0), r"noise_multiplier \(Gaussian\)"),
        (A.Laplace(0.0), r"noise_multiplier \(Laplace\)"),
        (A.PoissonSampled(1.5, A.Gaussian(1.0)), r"\.q \(PoissonSampled\)"),
        (A.SelfComposed(A.Gaussian(1.0), -2), r"count \(SelfComposed\)"),
        (A.Composed((A.Gaussian(1.0), A.Gaussian(np.array([1.0, -1.0])))), r"events\[1\]\.noise_multiplier"),
        (A.PoissonSampled(0.1, A.Laplace(1.0)), "PoissonSampled only of a Gaussian"),
        (A.PoissonSampled(0.1, A.Gaussian(1.0, relation="replace_one")), "covers relation 'add_remove'"),
        (A.Composed((A.Gaussian(1.0), A.Gaussian(1.0, relation="replace_one"))), "mixes neighbouring relations"),
        (A.PNSGD(1.0, 0.5, 0.5, 2.0, 1.0, num_records=4, relation="add_remove"), "relation 'replace_one' only"),
        (A.PNSGD(1.0, 0.5, 0.5, 2.0, 1.0, num_records=4, schedule="random_stop", hidden=False), "random_stop"),
        (A.PNSGD(1.0, 0.5, 0.5, 2.0, 1.0, num_records=4, schedule="random_stop", passes=2), "passes=1"),
        (A.PNSGD(1.0, 0.5, 5.0, 2.0, 1.0, num_records=4), r"learning_rate \(PNSGD\)"),
        (A.PNSGD(1.0, 0.5, 0.5, -2.0, 1.0, num_records=4), r"noise_std \(PNSGD\)"),
        (A.Composed(()), "empty"),
    ],
)
def test_bad_events_raise_naming_the_field(event, match):
    with pytest.raises(ValueError, match=match):
        A.epsilon(event, DELTA)


def test_bad_static_fields_and_arguments():
    with pytest.raises(ValueError, match="Gaussian.relation"):
        A.Gaussian(1.0, relation="add_or_remove")
    with pytest.raises(ValueError, match="PNSGD.schedule"):
        A.PNSGD(1.0, 0.5, 0.5, 2.0, 1.0, num_records=4, schedule="shuffled")
    with pytest.raises(ValueError, match="PNSGD.num_records"):
        A.PNSGD(1.0, 0.5, 0.5, 2.0, 1.0, num_records=0)
    with pytest.raises(ValueError, match="delta"):
        A.epsilon(A.Gaussian(1.0), 1.5)
    with pytest.raises(ValueError, match="epsilon"):
        A.delta(A.Gaussian(1.0), -1.0)
    with pytest.raises(ValueError, match="accountant"):
        A.epsilon(A.Gaussian(1.0), DELTA, accountant="prv")  # not registered
    with pytest.raises(TypeError):
        A.epsilon(1.0, DELTA)


@pytest.mark.parametrize(
    "make",
    [
        lambda v: A.Gaussian(v - 2.0),
        lambda v: A.dpsgd_event(v, 1.0, 100.0),
        lambda v: A.SelfComposed(A.Laplace(1.0), -v),
        lambda v: A.PNSGD(1.0, 0.5, 0.5, v - 2.0, 1.0, num_records=4),
        lambda v: A.PNSGD(1.0, 0.5, 3.0 * v, 2.0, 1.0, num_records=4),
        lambda v: A.PNSGD(1.0, 0.5, 3.0 * v, 2.0, 1.0, num_records=4, schedule="random_stop"),
    ],
)
def test_bad_values_under_jit_are_nan(make):
    # v = 1.5: q = 1.5, noise -0.5, count -1.5, learning rate 4.5 > 2/β: never a finite ε.
    out = jax.jit(lambda v: A.epsilon(make(v), DELTA, orders=FEW_ORDERS))(1.5)
    assert np.isnan(float(out))
    out_d = jax.jit(lambda v: A.delta(make(v), 1.0, orders=FEW_ORDERS))(1.5)
    assert np.isnan(float(out_d))


# ------------------------------------------------------------------- pytree and registry


def test_events_are_pytrees_with_static_structure():
    ev = A.Composed((A.dpsgd_event(0.01, 1.1, 100), A.Laplace(2.0, relation="add_remove")))
    leaves, treedef = jax.tree_util.tree_flatten(ev)
    assert leaves == [0.01, 1.1, 100, 2.0]
    doubled = jax.tree_util.tree_map(lambda x: 2 * x, ev)
    assert doubled.events[1].noise_multiplier == 4.0 and doubled.events[1].relation == "add_remove"
    p = A.PNSGD(1.0, 0.5, 0.5, 2.0, 1.0, num_records=40, batch_size=4)
    assert len(jax.tree_util.tree_leaves(p)) == 6
    assert jax.tree_util.tree_map(lambda x: x, p).batch_size == 4
    with pytest.raises(dataclass_error()):
        ev.events = ()



def test_event_classes_have_distinct_tree_structures():
    # Two CI runs got ε of Laplace(19.89) for Gaussian(19.89) (0.067 for 0.182) and δ of
    # Gaussian(3.744) for Laplace(3.744) (0.0498 for 1e-5): registered with JAX's
    # register_dataclass (jax 0.10.2), their tree structures compared equal though their
    # hashes differ, so jit's caches could run one class's compiled program on the other
    # (jaxdp/_pytree.py). Each class and static value needs a structure of its own.
    pn = dict(lipschitz=1.0, smoothness=0.5, learning_rate=0.5, noise_std=2.0, diameter=1.0, num_records=4)
    events = [A.Gaussian(1.0), A.Laplace(1.0), A.Gaussian(1.0, "replace_one"), A.Laplace(1.0, "replace_one"),
              A.Composed((A.Gaussian(1.0),)), A.Composed((A.Laplace(1.0),)), A.SelfComposed(A.Gaussian(1.0), 2.0),
              A.SelfComposed(A.Laplace(1.0), 2.0), A.PoissonSampled(0.1, A.Gaussian(1.0)),
              A.PNSGD(**pn), A.PNSGD(**pn, hidden=False)]
    structs = [jax.tree_util.tree_structure(e) for e in events]
    for i, a in enumerate(structs):
        for j, b in enumerate(structs):
            assert (a == b) == (i == j), (events[i], events[j])
    # Other values, same class: the same structure (one compiled program), and a round trip.
    assert jax.tree_util.tree_structure(A.Laplace(3.0)) == structs[1]
    back = jax.tree_util.tree_unflatten(structs[6], [5.0, 7.0])
    assert type(back.event) is A.Gaussian and (back.event.noise_multiplier, back.count) == (5.0, 7.0)
    # The accountant itself, each class after the other (the failing CI order, then reversed).
    for first, second in ((A.Laplace, A.Gaussian), (A.Gaussian, A.Laplace)):
        for cls in (first, second):
            ref = float(A.rdp_to_epsilon(_reference_rdp(cls(19.89), FEW_ORDERS), FEW_ORDERS, DELTA).epsilon)
            assert float(A.epsilon(cls(19.89), DELTA, orders=FEW_ORDERS)) == pytest.approx(ref, rel=CONSISTENCY_RTOL)

def dataclass_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_register_accountant():
    def eps_fn(event, target_delta, orders):
        return jnp.full(jnp.shape(target_delta), 7.0)

    A.register_accountant("constant_test", epsilon=eps_fn, delta=lambda e, x, o: 0.0)
    assert float(A.epsilon(A.Gaussian(1.0), DELTA, accountant="constant_test")) == 7.0
    with pytest.raises(ValueError, match="built in"):
        A.register_accountant("rdp", epsilon=eps_fn, delta=eps_fn)


def test_float64_with_global_flag_off():
    with jax.enable_x64(False):
        out = A.epsilon(A.dpsgd_event(0.01, 1.1, 1000), DELTA, orders=FEW_ORDERS)
        assert out.dtype == jnp.float64
        g = jax.jit(lambda s: A.epsilon(A.dpsgd_event(0.01, s, 1000.0), DELTA, orders=FEW_ORDERS))(1.1)
        assert float(g) == pytest.approx(float(out), rel=1e-6)
