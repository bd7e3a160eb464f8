"""DP-SBCD accountant against an mpmath evaluation of the paper's formulas, closed forms and eq. 11.

The mpmath reference computes the LSI constants from the closed double sum of Lemma 4.7
(not the step recursion the library uses) and multiplies the decay factors of Corollary 4.5
one step at a time (not the log-space prefix/suffix sums of the library). ``dpsbcd_rdp_per_batch``
(every position in one call) is checked against the same reference, a hand-derived two-step
closed form and the per-position calls.
"""

import math

import jax
import jax.numpy as jnp
import mpmath as mp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxdp.accounting as A

mp.mp.dps = 40
# float64 log-space sums over ≤ a few hundred steps: a few hundred ulps at worst.
RTOL = 1e-12


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _inv_c(o, eta, lf, lt, k, j, m):
    """1/c_k^j from Lemma 4.7's closed form (double sum), o[k][j] per step."""
    a2 = mp.mpf(lf * lt) ** 2
    tot = mp.mpf(0)
    for kp in range(k):
        for jp in range(m):
            tot += mp.mpf(o[kp][jp]) * a2 ** ((k - kp) * m - jp + j - 1)
    for jp in range(j):
        tot += mp.mpf(o[k][jp]) * a2 ** (j - jp - 1)
    return 2 * mp.mpf(eta) * mp.mpf(lt) ** 2 * tot


def _ref_per_position(o, eta, s, lf, lt, b, j0):
    """ε(α, j0)/α of one layer: Corollary 4.5 step by step."""
    K, m = len(o), len(o[0])
    T = K * m
    touched = {k * m + j0 for k in range(K)}
    total = mp.mpf(0)
    for k in range(K):
        tk = k * m + j0
        term = mp.mpf(eta) * mp.mpf(s) ** 2 / (4 * b**2 * mp.mpf(o[k][j0]))
        for t in range(tk + 1, T):
            if t in touched:
                continue
            kk, jj = divmod(t, m)
            c_t = 1 / _inv_c(o, eta, lf, lt, kk, jj, m)
            term *= (1 + 2 * mp.mpf(eta) * mp.mpf(o[kk][jj]) * c_t / mp.mpf(lf) ** 2) ** (-1 / mp.mpf(lt) ** 2)
        total += term
    return total


def _ref_rdp(alpha, o, eta, layers, b):
    """Mixture over j0; layers composed at fixed j0 and, separately, the paper's order; the max."""
    m = len(o[0])
    alpha = mp.mpf(alpha)
    per = [[_ref_per_position(o, eta, s, lf, lt, b, j0) for (s, lf, lt) in layers] for j0 in range(m)]

    def mix(vals):
        return mp.log(mp.fsum(mp.exp((alpha - 1) * alpha * v) for v in vals) / m) / (alpha - 1)

    joint = mix([sum(p) for p in per])
    paper = sum(mix([per[j][d] for j in range(m)]) for d in range(len(layers)))
    return max(joint, paper), per


O_STEPS = [[0.03, 0.02, 0.05], [0.01, 0.04, 0.02], [0.02, 0.02, 0.06]]  # K = 3 passes, m = 3
LAYERS = [(1.5, 0.95, 1.0), (0.7, 1.02, 1 / 1.01)]  # (S_g, L_F, L_T) per layer
ORDERS = [1.5, 2.0, 10.0, 100.0]


def _lib(orders, o, *, n=6, b=2, batch_index=None, layers=LAYERS, eta=0.05):
    s, lf, lt = (np.array(v) for v in zip(*layers))
    return np.asarray(A.dpsbcd_rdp(orders, np.array(o), learning_rate=eta, sensitivity=s, contraction=lf,
                                   prox_lipschitz=lt, num_records=n, batch_size=b, batch_index=batch_index))


def test_matches_mpmath_reference_per_step_schedule():
    got = _lib(ORDERS, O_STEPS)
    for i, a in enumerate(ORDERS):
        want, per = _ref_rdp(a, O_STEPS, 0.05, LAYERS, 2)
        assert got[i] == pytest.approx(float(want), rel=RTOL)
    s, lf, lt = (np.array(v) for v in zip(*LAYERS))
    all_j = np.asarray(A.dpsbcd_rdp_per_batch(ORDERS, np.array(O_STEPS), learning_rate=0.05, sensitivity=s,
                                              contraction=lf, prox_lipschitz=lt, num_records=6, batch_size=2))
    assert all_j.shape == (3, len(ORDERS))
    for j0 in range(3):
        got_j = _lib(ORDERS, O_STEPS, batch_index=j0)
        np.testing.assert_allclose(got_j, [a * float(sum(per[j0])) for a in ORDERS], rtol=RTOL)
        # All positions in one call: the mpmath reference and the per-position call.
        np.testing.assert_allclose(all_j[j0], [a * float(sum(per[j0])) for a in ORDERS], rtol=RTOL)
        np.testing.assert_allclose(all_j[j0], got_j, rtol=RTOL)


def test_per_pass_schedule_is_constant_within_a_pass():
    per_pass = [0.03, 0.01, 0.02]
    np.testing.assert_allclose(_lib(ORDERS, per_pass), _lib(ORDERS, [[v] * 3 for v in per_pass]), rtol=1e-15)


def test_one_batch_per_pass_is_plain_composition():
    # m = 1: every step touches the record, nothing decays: ε(α) = α Σ_k η S²/(4 b² o_k).
    o, eta, s, b = [0.02, 0.05, 0.01], 0.05, 1.5, 4
    got = A.dpsbcd_rdp([3.0], o, learning_rate=eta, sensitivity=s, contraction=0.5, prox_lipschitz=0.5,
                       num_records=b, batch_size=b)
    assert float(got[0]) == pytest.approx(3.0 * sum(eta * s**2 / (4 * b**2 * v) for v in o), rel=RTOL)


def test_two_steps_by_hand():
    # m = 2, K = 1. j0 = 1: ηS²/(4b²o_1). j0 = 0: ηS²/(4b²o_0) · (1 + 2η o_1 c_1/L_F²)^(-1/L_T²),
    # c_1 = 1/(2η L_T² o_0). Mixture: log((e^{(α-1)α A_0} + e^{(α-1)α A_1})/2)/(α-1).
    eta, s, b, lf, lt, o0, o1, al = 0.1, 2.0, 3, 0.8, 0.9, 0.02, 0.03, 4.0
    c1 = 1 / (2 * eta * lt**2 * o0)
    a0 = eta * s**2 / (4 * b**2 * o0) * (1 + 2 * eta * o1 * c1 / lf**2) ** (-1 / lt**2)
    a1 = eta * s**2 / (4 * b**2 * o1)
    want = math.log((math.exp((al - 1) * al * a0) + math.exp((al - 1) * al * a1)) / 2) / (al - 1)
    got = A.dpsbcd_rdp([al], [[o0, o1]], learning_rate=eta, sensitivity=s, contraction=lf, prox_lipschitz=lt,
                       num_records=2 * b, batch_size=b)
    assert float(got[0]) == pytest.approx(want, rel=RTOL)
    per_batch = A.dpsbcd_rdp_per_batch([al], [[o0, o1]], learning_rate=eta, sensitivity=s, contraction=lf,
                                       prox_lipschitz=lt, num_records=2 * b, batch_size=b)
    np.testing.assert_allclose(np.asarray(per_batch)[:, 0], [al * a0, al * a1], rtol=RTOL)


def _eq11_literal(alpha, o, eta, s, lf, lt, b, m, K, j0):
    """The paper's eq. 11 as printed (0-based k, product l = k..K, c_K^{m-1})."""
    oo = [[o] * m for _ in range(K + 1)]
    memo = {}

    def c(k, j):
        if j == m:  # c_k^{m} is c_{k+1}^0
            k, j = k + 1, 0
        if (k, j) not in memo:
            memo[k, j] = 1 / _inv_c(oo, eta, lf, lt, k, j, m)
        return memo[k, j]

    tot = mp.mpf(0)
    a2 = mp.mpf(lf * lt) ** 2
    for k in range(K):
        prod = mp.mpf(1)
        for ell in range(k, K + 1):
            prod *= c(ell, j0 + 1) / c(ell, j0)
        inner = c(k, j0 + 1) / c(K, m - 1) * (1 / a2) ** ((m - 1) * (K - k) - j0) * prod
        tot += eta * s**2 / (4 * b**2 * o) * inner ** (-1 / mp.mpf(lt) ** 2)
    return alpha * tot


def test_agrees_with_literal_eq11_where_it_is_finite():
    # Table-1 geometry (n = 4800, b = 960) with L_F = 0.9: for j0 ≥ 1 the literal eq. 11
    # agrees with the telescoped form once K is large (their index conventions differ only in
    # boundary factors that decay away); at j0 = 0 the literal form is +inf.
    K, m, o, eta, s, lf, lt, b = 50, 5, 0.01, 0.01, 1.0, 0.9, 1.0, 960
    for j0 in (1, 3):
        lit = _eq11_literal(100.0, o, eta, s, lf, lt, b, m, K, j0)
        got = A.dpsbcd_rdp([100.0], [o] * K, learning_rate=eta, sensitivity=s, contraction=lf, prox_lipschitz=lt,
                           num_records=m * b, batch_size=b, batch_index=j0)
        assert float(got[0]) == pytest.approx(float(lit), rel=1e-9)


def test_paper_geometry_values():
    # Chen & Liu's Table 1 geometry, α = 100, o ≡ 0.01, S_g = 1: with L_F = L_T = 1 the bound
    # grows about linearly (1.51e-4 at K = 10, 7.54e-4 at K = 50; composition: 2.71e-4 and
    # 1.36e-3); with L_F = 0.99 it saturates (1.29e-4, 3.20e-4).
    def r(lf, K):
        return float(A.dpsbcd_rdp([100.0], [0.01] * K, learning_rate=0.01, sensitivity=1.0, contraction=lf,
                                  prox_lipschitz=1.0, num_records=4800, batch_size=960)[0])

    assert r(1.0, 10) == pytest.approx(1.51e-4, rel=5e-3)
    assert r(1.0, 50) == pytest.approx(7.54e-4, rel=5e-3)
    assert r(0.99, 10) == pytest.approx(1.29e-4, rel=5e-3)
    assert r(0.99, 50) == pytest.approx(3.20e-4, rel=5e-3)
    assert r(1.0, 50) < 100 * 50 * 0.01 / (4 * 960**2 * 0.01)  # below composition


@settings(max_examples=6, deadline=None)
@given(st.floats(0.002, 0.05), st.floats(1.01, 5.0))
def test_monotone_in_noise(o, factor):
    kw = dict(learning_rate=0.05, sensitivity=np.array([1.0, 2.0]), contraction=np.array([0.97, 1.0]),
              prox_lipschitz=1.0, num_records=12, batch_size=3)
    lo = A.dpsbcd_rdp(ORDERS, [o] * 4, **kw)
    hi = A.dpsbcd_rdp(ORDERS, [o * factor] * 4, **kw)
    assert np.all(np.asarray(hi) < np.asarray(lo))
    # Per position, the bound is exactly proportional to 1/o under a scaled schedule; all positions
    # in one call (two layers, per-pass schedule) equal the per-position calls.
    every = np.asarray(A.dpsbcd_rdp_per_batch([2.0], [o] * 4, **kw))
    for j0 in (0, 3):
        a = A.dpsbcd_rdp([2.0], [o] * 4, batch_index=j0, **kw)
        b = A.dpsbcd_rdp([2.0], [o * factor] * 4, batch_index=j0, **kw)
        assert float(b[0]) == pytest.approx(float(a[0]) / factor, rel=1e-12)
        assert every[j0, 0] == pytest.approx(float(a[0]), rel=RTOL)


def test_layers_sum_at_least_paper_order():
    want, per = _ref_rdp(10.0, O_STEPS, 0.05, LAYERS, 2)
    one = [_lib([10.0], O_STEPS, layers=[layer])[0] for layer in LAYERS]
    got = _lib([10.0], O_STEPS)[0]
    assert got >= sum(one) * (1 - 1e-14)


def test_epsilon_is_rdp_conversion_and_event():
    kw = dict(learning_rate=0.01, sensitivity=np.array([1.0, 1.0, 1.0]), contraction=0.99, prox_lipschitz=1.0,
              num_records=4800, batch_size=960)
    sched = np.linspace(0.0075 + 0.0008 * 29, 0.0075, 30)
    e = float(A.dpsbcd_epsilon(1e-5, sched, **kw))
    curve = A.dpsbcd_rdp(A.DEFAULT_ORDERS, sched, **kw)
    assert e == pytest.approx(float(A.rdp_to_epsilon(curve, A.DEFAULT_ORDERS, 1e-5).epsilon), rel=1e-14)
    # Never below the classic conversion's lower envelope minus the improvement term (sanity):
    classic = np.min(np.asarray(curve) + math.log(1e5) / (A.DEFAULT_ORDERS - 1))
    assert 0 < e <= classic
    ev = A.DPSBCD(sched, kw["learning_rate"], kw["sensitivity"], kw["contraction"], kw["prox_lipschitz"],
                  num_records=4800, batch_size=960)
    np.testing.assert_allclose(A.rdp(ev, ORDERS), A.dpsbcd_rdp(ORDERS, sched, **kw), rtol=1e-15)
    assert float(A.epsilon(ev, 1e-5)) == pytest.approx(e, rel=1e-14)
    g = A.Gaussian(5.0, relation="replace_one")
    np.testing.assert_allclose(A.rdp(A.Composed((ev, g)), ORDERS),
                               A.dpsbcd_rdp(ORDERS, sched, **kw) + np.array(ORDERS) / 50.0, rtol=1e-14)
    with pytest.raises(ValueError, match="relation"):
        A.rdp(A.Composed((ev, A.Gaussian(5.0))), ORDERS)


KW = dict(learning_rate=0.01, sensitivity=1.0, contraction=0.99, prox_lipschitz=1.0, num_records=2100,
          batch_size=100)


@pytest.mark.parametrize("bad, match", [
    (dict(noise_temperature=[0.01 - 0.003 * k for k in range(30)]), "noise_temperature"),  # the paper's Fig. 1a
    (dict(noise_temperature=[0.001 - 0.0003 * k for k in range(30)]), "noise_temperature"),  # Fig. 1b
    (dict(noise_temperature=[0.01, 0.0]), "noise_temperature"),
    (dict(noise_temperature=np.ones((3, 4))), "noise_temperature"),
    (dict(batch_index=30), "batch_index"),  # Fig. 1a's j0 = 30 > n/b - 1 = 20
    (dict(batch_index=-1), "batch_index"),
    (dict(num_records=2150), "num_records"),
    (dict(sensitivity=None), "sensitivity"),
    (dict(contraction=None), "contraction"),
    (dict(prox_lipschitz=0.0), "prox_lipschitz"),
    (dict(contraction=-1.0), "contraction"),
    (dict(learning_rate=0.0), "learning_rate"),
    (dict(sensitivity=-1.0), "sensitivity"),
])
def test_bad_input_names_the_parameter(bad, match):
    kw = {**KW, "noise_temperature": [0.01] * 3, **bad}
    o = kw.pop("noise_temperature")
    with pytest.raises(ValueError, match=match):
        A.dpsbcd_rdp([2.0], o, **kw)


def test_missing_constants_are_errors_not_defaults():
    for name in ("sensitivity", "contraction", "prox_lipschitz", "learning_rate"):
        kw = {k: v for k, v in KW.items() if k != name}
        with pytest.raises(TypeError, match=name):
            A.dpsbcd_rdp([2.0], [0.01], **kw)


def test_invalid_under_jit_is_nan_and_gradients_finite():
    f = jax.jit(lambda o: A.dpsbcd_rdp([2.0], o, **KW)[0])
    assert math.isnan(float(f(jnp.array([0.01, -0.01]))))
    assert math.isfinite(float(f(jnp.array([0.01, 0.02]))))
    g = jax.grad(lambda s: A.dpsbcd_rdp([2.0], [0.01, 0.02], **{**KW, "sensitivity": s})[0])(1.0)
    assert math.isfinite(float(g)) and float(g) > 0
    g0 = jax.grad(lambda s: A.dpsbcd_rdp([2.0], [0.01, 0.02], **{**KW, "sensitivity": s})[0])(0.0)
    assert math.isfinite(float(g0))
    f_all = jax.jit(lambda o: A.dpsbcd_rdp_per_batch([2.0, 4.0], o, **KW))
    assert np.all(np.isnan(np.asarray(f_all(jnp.array([0.01, -0.01])))))
    assert f_all(jnp.array([0.01, 0.02])).shape == (21, 2)
    with pytest.raises(ValueError, match="noise_temperature"):
        A.dpsbcd_rdp_per_batch([2.0], [0.01, 0.0], **KW)
