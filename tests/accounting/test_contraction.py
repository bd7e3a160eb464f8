"""Hockey-stick divergences and contraction bounds (Asoodeh, Diaz, Calmon 2020).

References used (never jaxdp itself): the 50-digit test vectors of
shared/notes/seeds/000_contraction.md, mpmath at 50 digits of the paper's closed forms,
and scipy quadrature of the hockey-stick integral ∫ [p − e^ε q]_+.
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
from scipy import integrate, optimize, stats

from jaxdp.accounting import _contraction as C
from jaxdp.accounting import _hockey_stick as H
from jaxdp.accounting import _iteration as I

# Values printed to 15 significant digits in the notes; float64 evaluation of θ in the
# cancelling regime loses ~100 ulp (measured 6e-14), so 1e-12 leaves margin.
RTOL_VECTOR = 1e-12
# Vectors printed to 12 significant digits.
RTOL_12 = 5e-11
# Quadrature (scipy.quad, default tolerances ~1.5e-8).
RTOL_QUAD = 1e-7
# Inverse ε by bisection: 64 halvings, rounded up; the notes print 12 digits.
RTOL_INVERSE = 1e-10


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


mp.mp.dps = 50


def theta_mp(eps, r):
    eps, r = mp.mpf(eps), mp.mpf(r)
    if r == 0:
        return mp.mpf(0)
    q = lambda t: mp.ncdf(-t)  # noqa: E731
    return q(eps / r - r / 2) - mp.e**eps * q(eps / r + r / 2)


def one_minus_theta_mp(eps, r):
    eps, r = mp.mpf(eps), mp.mpf(r)
    return mp.ncdf(eps / r - r / 2) + mp.e**eps * mp.ncdf(-(eps / r + r / 2))


def hockey_stick_quad(eps, r):
    """∫ [φ(x − r) − e^ε φ(x)]_+ dx by scipy quadrature (independent of the closed form)."""
    gamma = math.exp(eps)
    x_star = eps / r + r / 2  # the densities cross here
    f = lambda x: max(stats.norm.pdf(x - r) - gamma * stats.norm.pdf(x), 0.0)  # noqa: E731
    val, _ = integrate.quad(f, x_star, x_star + 40.0, epsabs=0.0, epsrel=1e-12, limit=200)
    return val


THETA_TABLE = {
    0.0: [0.0398776116767449, 0.197412651365847, 0.382924922548026, 0.682689492137086, 0.954499736103642],
    0.1: [0.00875176814580959, 0.159260507413992, 0.352325171681367, 0.666639515528846, 0.952178043855435],
    0.5: [6.85658245583874e-9, 0.0524403232876697, 0.238421708134877, 0.599185618533933, 0.941916156687795],
    1.0: [1.23083598364271e-25, 0.00682959498311458, 0.126936737506644, 0.50986166005467, 0.92671128125548],
    2.0: [3.71945072680472e-91, 9.43916863494723e-6, 0.0209236358211137, 0.331897998776829, 0.887309233283398],
    5.0: [None, 4.41544347029962e-24, 5.79372169191949e-7, 0.0322819847500728, 0.68773453820062],
}
R_COLS = [0.1, 0.5, 1.0, 2.0, 4.0]


@pytest.mark.parametrize("eps", sorted(THETA_TABLE))
def test_theta_table_against_notes(eps):
    got = np.asarray(H.gaussian_hockey_stick(eps, jnp.array(R_COLS)))
    for r, g, want in zip(R_COLS, got, THETA_TABLE[eps]):
        if want is None:  # 2.6e-547 underflows float64
            assert g == 0.0
            continue
        # Table values with ≤15 digits (the 0.50986166005467-type entries have 14).
        assert g == pytest.approx(want, rel=RTOL_VECTOR if len(repr(want)) >= 17 else 1e-13), (eps, r)


def test_theta_hand_values_and_limits():
    assert float(H.gaussian_hockey_stick(0.0, 1.0)) == pytest.approx(0.382924922548026, rel=1e-14)
    assert float(H.gaussian_hockey_stick(1.0, 0.0)) == 0.0
    assert float(H.gaussian_hockey_stick(0.0, 0.0)) == 0.0
    assert float(H.gaussian_hockey_stick(1.0, jnp.inf)) == 1.0
    assert float(H.gaussian_hockey_stick(jnp.inf, 1.0)) == 0.0
    # θ_1(r) = erf(r/(2√2)) (total variation), exact at ε = 0.
    for r in [1e-8, 1e-3, 0.3, 3.0]:
        assert float(H.gaussian_hockey_stick(0.0, r)) == pytest.approx(math.erf(r / (2 * math.sqrt(2))), rel=1e-14)


@pytest.mark.parametrize(
    "eps,r,want",
    [
        (0.5, 0.01, -1263.0993655444768),
        (1.0, 0.01, -5014.2347614837394),
        (10.0, 0.1, -5007.4334136434181),
        (20.0, 0.5, -799.02292664378086),
        (50.0, 1.0, -1233.8690831424055),
        (1.0, 1e-3, -500021.14220749512),
    ],
)
def test_log_theta_deep_tail(eps, r, want):
    assert float(H.log_gaussian_hockey_stick(eps, r)) == pytest.approx(want, rel=1e-13)


@pytest.mark.parametrize(
    "eps,r,want",
    [(0.0, 8.0, 6.33424836662398e-5), (1.0, 8.0, 1.03700427397336e-4), (0.0, 20.0, 1.52397060483211e-23), (1.0, 40.0, 9.07709428974362e-89)],
)
def test_complement_large_r(eps, r, want):
    assert float(H.gaussian_hockey_stick_complement(eps, r)) == pytest.approx(want, rel=RTOL_12)


def test_theta_random_points_against_mpmath_and_quadrature():
    rng = np.random.default_rng(0)
    eps = rng.uniform(0.0, 6.0, 40)
    r = np.exp(rng.uniform(np.log(0.05), np.log(8.0), 40))
    got = np.asarray(H.gaussian_hockey_stick(eps, r))
    got_log = np.asarray(H.log_gaussian_hockey_stick(eps, r))
    got_c = np.asarray(H.gaussian_hockey_stick_complement(eps, r))
    for e, rr, g, gl, gc in zip(eps, r, got, got_log, got_c):
        ref = theta_mp(e, rr)
        assert gl == pytest.approx(float(mp.log(ref)), rel=1e-12, abs=1e-12)
        assert gc == pytest.approx(float(one_minus_theta_mp(e, rr)), rel=1e-12)
        if ref > 1e-300:
            assert g == pytest.approx(float(ref), rel=1e-11)
        if ref > 1e-10:
            assert g == pytest.approx(hockey_stick_quad(e, rr), rel=RTOL_QUAD)


def test_theta_derivatives_match_identities():
    d_r = jax.grad(H.gaussian_hockey_stick, argnums=1)
    d_e = jax.grad(H.gaussian_hockey_stick, argnums=0)
    for (e, r), want in [((0.5, 1.0), 0.398942280401), ((1.0, 2.0), 0.352065326764), ((0.0, 1.0), 0.352065326764), ((2.0, 0.5), 3.52595682367e-4)]:
        assert float(d_r(e, r)) == pytest.approx(want, rel=RTOL_12)
    for (e, r), want in [((0.5, 1.0), -0.261578291865), ((1.0, 2.0), -0.181600801219), ((2.0, 0.5), -7.89781165659e-5)]:
        assert float(d_e(e, r)) == pytest.approx(want, rel=RTOL_12)
    # Finite at the boundaries.
    for e, r in [(0.0, 0.0), (1.0, 0.0), (0.0, 1e-9), (1.0, 40.0)]:
        assert np.isfinite(float(d_r(e, r))) and np.isfinite(float(d_e(e, r)))
    # log θ gradient deep in the tail vs. the analytic slope -e^ε Q(b)/θ.
    e, r = 1.0, 0.01
    b = e / r + r / 2
    want = -float(mp.e**e * mp.ncdf(-b) / theta_mp(e, r))
    assert float(jax.grad(H.log_gaussian_hockey_stick)(e, r)) == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize(
    "eps,shift,scale,want",
    [(0.0, 1.0, 1.0, 0.393469340287367), (0.5, 1.0, 1.0, 0.221199216928595), (1.0, 3.0, 1.0, 0.632120558828558), (0.2, 0.5, 0.25, 0.593430340259401), (2.0, 1.0, 1.0, 0.0)],
)
def test_laplace_lemma1(eps, shift, scale, want):
    got = float(H.laplace_hockey_stick(eps, shift, scale))
    assert got == pytest.approx(want, rel=1e-14, abs=0.0)
    # Quadrature of ∫[p − e^ε q]_+ for Laplace densities.
    p = lambda x: math.exp(-abs(x - shift) / scale) / (2 * scale)  # noqa: E731
    q = lambda x: math.exp(-abs(x) / scale) / (2 * scale)  # noqa: E731
    f = lambda x: max(p(x) - math.exp(eps) * q(x), 0.0)  # noqa: E731
    val = integrate.quad(f, -60 * scale, 60 * scale + shift, points=[0.0, shift, (shift + scale * eps) / 2], limit=400)[0]
    assert got == pytest.approx(val, rel=1e-8, abs=1e-12)


def test_step_contraction_and_errors():
    assert float(C.step_contraction(0.5, 1.0, 0.5)) == pytest.approx(0.816496580928, rel=RTOL_12)
    assert float(C.step_contraction(0.5, 1.0, 0.0)) == 1.0
    assert float(C.step_contraction(1.0, 1.0, 0.5)) == pytest.approx(math.sqrt(1 - 2 * 0.5 / 1.5), rel=1e-15)
    # The one step-size rule is 0 < η ≤ 2/(β+ρ): the boundary is accepted (the proof holds
    # with equality), anything above it is rejected eagerly and gives NaN under jit.
    assert float(C.step_contraction(2.0, 0.5, 0.5)) == 0.0
    assert float(C.step_contraction(2.0 / 1.3, 1.0, 0.3)) == pytest.approx(0.7 / 1.3, rel=1e-15)
    with pytest.raises(ValueError, match="learning_rate"):
        C.step_contraction(2.0 * (1 + 1e-12), 0.5, 0.5)
    with pytest.raises(ValueError, match="learning_rate"):
        C.step_contraction(2.1, 1.0, 0.0)  # ρ = 0: η ≤ 2/β
    with pytest.raises(ValueError, match="strong_convexity"):
        C.step_contraction(0.1, 0.3, 0.4)
    with pytest.raises(ValueError, match="smoothness"):
        C.step_contraction(0.1, 0.0)
    f = jax.jit(C.step_contraction)
    assert np.isnan(float(f(2.0 * (1 + 1e-12), 0.5, 0.5)))
    assert np.isnan(float(f(0.1, 0.3, 0.4)))


THM4 = [
    # (L, σ, η, D, β, ρ, n, i, ε, δ)
    (1, 2, 0.5, 1, 0.5, 0, 40, 1, 0.0, 2.11127753919e-17),
    (1, 2, 0.5, 1, 0.5, 0, 40, 40, 1.0, 0.126936737507),
    (1, 1, 0.7, 1, 0.3, 0.4, 40, 20, 1.0, 3.34761919513e-14),
    (1, 4, 0.1, 1, 1, 0, 100, 50, 0.5, 8.7619248651e-9),
    (1, 4, 0.1, 0.1, 1, 0, 100, 50, 0.5, 2.28641704076e-130),
    (0.5, 1, 1, 2, 1, 0.5, 10, 3, 2.0, 1.03072467771e-11),
]


def _m(lr, beta, rho):
    # Lemma 4 written out (Fig. 3 has ρ > β, which step_contraction rightly rejects).
    return 1.0 if rho == 0 else math.sqrt(1 - 2 * lr * beta * rho / (beta + rho))


@pytest.mark.parametrize("row", THM4)
def test_theorem4_vectors(row):
    lip, sig, eta, dia, beta, rho, n, i, eps, want = row
    m = _m(eta, beta, rho)
    got = float(C.pnsgd_contraction_delta(eps, i, n, lip, sig, eta, dia, m))
    assert got == pytest.approx(want, rel=RTOL_12)
    ref = theta_mp(eps, 2 * lip / sig) * theta_mp(eps, m * dia / (eta * sig)) ** (n - i)
    assert got == pytest.approx(float(ref), rel=1e-11)


def test_theorem4_log_and_edge_conventions():
    got = float(C.log_pnsgd_contraction_delta(5.0, 1, 2000, 1.0, 4.0, 0.1, 0.1))
    ref = mp.log(theta_mp(5.0, 0.5)) + 1999 * mp.log(theta_mp(5.0, 0.25))
    assert got == pytest.approx(float(ref), rel=1e-12)
    # M = 0: later steps erase the record (δ = 0), but 0^0 = 1 for the last record.
    assert float(C.pnsgd_contraction_delta(1.0, 3, 10, 1.0, 2.0, 0.5, 1.0, 0.0)) == 0.0
    last = float(C.pnsgd_contraction_delta(1.0, 10, 10, 1.0, 2.0, 0.5, 1.0, 0.0))
    assert last == pytest.approx(float(theta_mp(1.0, 1.0)), rel=1e-13)


@pytest.mark.parametrize(
    "eps,i,want",
    [(0.0, 1, 0.00634030478686), (0.1, 1, 0.00444579748898), (0.5, 1, 7.01091091138e-4), (0.9, 1, 2.11682485775e-5), (1.0, 1, 0.0), (0.0, 10, 0.393469340287), (0.5, 10, 0.221199216929), (0.9, 10, 0.0487705754993), (1.5, 10, 0.0)],
)
def test_theorem3_laplace(eps, i, want):
    got = float(C.pnsgd_laplace_delta(eps, i, 10, 1.0, 2.0, 0.25, 1.0))
    assert got == pytest.approx(want, rel=RTOL_12, abs=0.0)


def test_theorem3_strongly_convex_and_last_record_caveat():
    m = _m(0.5, 1.0, 0.5)
    assert float(C.pnsgd_laplace_delta(0.0, 5, 20, 1.0, 4.0, 0.5, 2.0, m)) == pytest.approx(1.67523485788e-8, rel=RTOL_12)
    assert float(C.pnsgd_laplace_delta(0.1, 5, 20, 1.0, 4.0, 0.5, 2.0, m)) == pytest.approx(2.74786742146e-9, rel=RTOL_12)
    assert float(C.pnsgd_laplace_delta(0.5, 5, 20, 1.0, 4.0, 0.5, 2.0, m)) == 0.0
    # §2.8 of the notes: i = n is NOT zero at ε = min{2L/v, M(b−a)/(ηv)} = 0.5.
    assert float(C.pnsgd_laplace_delta(0.5, 10, 10, 1.0, 2.0, 0.25, 0.25)) == pytest.approx(0.221199216929, rel=RTOL_12)
    assert float(C.pnsgd_laplace_delta(0.75, 10, 10, 1.0, 2.0, 0.25, 0.25)) == pytest.approx(0.117503097415, rel=RTOL_12)
    assert float(C.pnsgd_laplace_delta(0.5, 9, 10, 1.0, 2.0, 0.25, 0.25)) == 0.0


FIG2 = dict(lipschitz=1.0, noise_std=2.0, learning_rate=0.5, diameter=1.0, contraction=1.0)
FIG3 = dict(lipschitz=1.0, noise_std=1.0, learning_rate=0.7, diameter=1.0, contraction=math.sqrt(0.76))


@pytest.mark.parametrize(
    "eps,want_uniform,want_i1,want_in",
    [(0.0, 0.0155137088071, 0.0155137088071, 0.0095731230637), (0.5, 0.00782656591849, None, None), (1.0, 0.00363480926755, None, None), (2.0, 5.34269761447e-4, None, None)],
)
def test_theorem5_fig2(eps, want_uniform, want_i1, want_in):
    args = (40, 1.0, 2.0, 0.5, 1.0, 1.0)
    assert float(C.stop_pnsgd_contraction_delta(eps, *args)) == pytest.approx(want_uniform, rel=RTOL_12)
    if want_i1 is not None:
        assert float(C.stop_pnsgd_contraction_delta(eps, *args, positions=1)) == pytest.approx(want_i1, rel=RTOL_12)
        assert float(C.stop_pnsgd_contraction_delta(eps, *args, positions=40)) == pytest.approx(want_in, rel=RTOL_12)


def test_theorem5_other_vectors_and_vacuous_case():
    fig3 = [(0.0, 0.0319921652095), (0.5, 0.0225424135484), (1.0, 0.0163252257336), (2.0, 0.00889602684248)]
    m = math.sqrt(0.76)
    for eps, want in fig3:
        got = float(C.stop_pnsgd_contraction_delta(eps, 40, 1.0, 1.0, 0.7, 1.0, m))
        ref = theta_mp(eps, 2) / 40 / one_minus_theta_mp(eps, m / 0.7)
        assert got == pytest.approx(float(ref), rel=1e-11)
        assert got == pytest.approx(want, rel=5e-10)  # notes print M = .8718 in the header only
    for eps, want in [(0.0, 0.0093427862888), (0.5, 0.00195608391683), (1.0, 2.05624023158e-4), (2.0, 1.98517586418e-7)]:
        assert float(C.stop_pnsgd_contraction_delta(eps, 100, 1.0, 4.0, 0.1, 1.0)) == pytest.approx(want, rel=RTOL_12)
    assert float(C.stop_pnsgd_contraction_delta(0.0, 100, 1.0, 4.0, 0.1, 1.0, positions=1)) == pytest.approx(0.00934278628834, rel=RTOL_12)
    # Vacuous (> 1) bound is clipped at 1; E_γ ≤ 1.
    assert float(C.stop_pnsgd_contraction_delta(0.0, 10, 1.0, 0.5, 0.1, 1.0)) == 1.0


@pytest.mark.parametrize(
    "i,delta,want",
    [(39, 1e-3, 1.80465145839), (39, 1e-5, 2.75400907565), (39, 1e-10, 4.37717809568), (40, 1e-3, 3.13867054858), (40, 1e-5, 4.37717809568), (40, 1e-10, 6.54792406686), (20, 1e-3, 0.0), (20, 1e-10, 0.160722222803)],
)
def test_inverse_epsilon_fig2(i, delta, want):
    got = float(C.pnsgd_contraction_epsilon(delta, i, 40, **FIG2))
    assert got == pytest.approx(want, rel=RTOL_INVERSE, abs=1e-14)
    if want > 0:  # certified: δ(ε) ≤ target, computed independently
        ref = theta_mp(got, 1.0) ** (40 - i + 1)
        assert ref <= delta * (1 + 1e-12)


@pytest.mark.parametrize("i,delta,want", [(39, 1e-3, 3.30783760271), (39, 1e-5, 4.67838913335), (30, 1e-3, 0.0), (30, 1e-5, 0.51011489059), (30, 1e-10, 1.63205674903)])
def test_inverse_epsilon_fig3(i, delta, want):
    assert float(C.pnsgd_contraction_epsilon(delta, i, 40, **FIG3)) == pytest.approx(want, rel=RTOL_INVERSE, abs=1e-14)


def test_inverse_random_stop_and_single_step():
    assert float(C.stop_pnsgd_contraction_epsilon(1e-3, 40, 1.0, 2.0, 0.5, 1.0)) == pytest.approx(1.70662194756, rel=RTOL_INVERSE)
    assert float(C.stop_pnsgd_contraction_epsilon(1e-5, 40, 1.0, 2.0, 0.5, 1.0)) == pytest.approx(3.41769706715, rel=RTOL_INVERSE)
    m = math.sqrt(0.76)
    assert float(C.stop_pnsgd_contraction_epsilon(1e-3, 40, 1.0, 1.0, 0.7, 1.0, m)) == pytest.approx(4.79567333907, rel=1e-9)
    assert float(C.stop_pnsgd_contraction_epsilon(1e-5, 40, 1.0, 1.0, 0.7, 1.0, m)) == pytest.approx(8.12301645733, rel=1e-9)
    # Single step (i = n): θ_{e^ε}(r) = 1e-5.
    assert float(C.pnsgd_contraction_epsilon(1e-5, 1, 1, 1.0, 1.0, 1.0, 1.0)) == pytest.approx(9.99725614643, rel=RTOL_INVERSE)


def test_inverse_gradient_matches_finite_differences():
    f = lambda s: C.pnsgd_contraction_epsilon(1e-5, 39, 40, 1.0, s, 0.5, 1.0)  # noqa: E731
    g = float(jax.grad(f)(2.0))
    h = 1e-5
    fd = (float(f(2.0 + h)) - float(f(2.0 - h))) / (2 * h)
    assert g == pytest.approx(fd, rel=1e-6)
    f2 = lambda d: C.log_pnsgd_contraction_delta(0.7, 20, 40, 1.0, 1.0, 0.7, d, 0.8)  # noqa: E731
    fd2 = (float(f2(1.0 + h)) - float(f2(1.0 - h))) / (2 * h)
    assert float(jax.grad(f2)(1.0)) == pytest.approx(fd2, rel=1e-6)


def test_theta_gradient_at_the_origin_is_the_one_sided_slope():
    """θ(0, r) = erf(r/(2√2)): slope 1/√(2π) at r = 0 (one-sided; r ≥ 0). For ε > 0, θ is
    flat at r = 0, and θ(ε, 0) = 0 for every ε, so ∂θ/∂ε = 0 there."""
    with jax.enable_x64(True):
        d_r = jax.grad(H.gaussian_hockey_stick, 1)
        d_e = jax.grad(H.gaussian_hockey_stick, 0)
        want = 1.0 / math.sqrt(2.0 * math.pi)
        assert float(d_r(0.0, 0.0)) == pytest.approx(want, rel=1e-14)
        # One-sided finite difference from the closed form erf(h/(2√2))/h.
        h = 1e-6
        assert float(d_r(0.0, 0.0)) == pytest.approx(float(mp.erf(h / (2 * mp.sqrt(2))) / h), rel=1e-10)
        assert float(d_r(0.5, 0.0)) == 0.0 and float(d_e(0.0, 0.0)) == 0.0
        assert float(d_r(0.0, 1e-9)) == pytest.approx(want, rel=1e-12)


def test_jit_vmap_agree():
    i = jnp.arange(1, 41)
    eager = C.pnsgd_contraction_delta(0.5, i, 40, 1.0, 1.0, 0.7, 1.0, 0.9)
    jitted = jax.jit(C.pnsgd_contraction_delta)(0.5, i, 40, 1.0, 1.0, 0.7, 1.0, 0.9)
    vm = jax.vmap(lambda p: C.pnsgd_contraction_delta(0.5, p, 40, 1.0, 1.0, 0.7, 1.0, 0.9))(i)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-14)
    np.testing.assert_allclose(np.asarray(vm), np.asarray(eager), rtol=1e-14)


def test_eager_errors_name_the_parameter():
    args = dict(lipschitz=1.0, noise_std=1.0, learning_rate=0.5, diameter=1.0)
    with pytest.raises(ValueError, match="position"):
        C.pnsgd_contraction_delta(1.0, 41, 40, **args)
    with pytest.raises(ValueError, match="position"):
        C.pnsgd_contraction_delta(1.0, 0, 40, **args)
    with pytest.raises(ValueError, match="diameter"):
        C.pnsgd_contraction_delta(1.0, 1, 40, 1.0, 1.0, 0.5, 0.0)
    with pytest.raises(ValueError, match="noise_std"):
        C.pnsgd_contraction_delta(1.0, 1, 40, 1.0, -1.0, 0.5, 1.0)
    with pytest.raises(ValueError, match="contraction"):
        C.pnsgd_contraction_delta(1.0, 1, 40, 1.0, 1.0, 0.5, 1.0, 1.5)
    with pytest.raises(ValueError, match="epsilon"):
        H.gaussian_hockey_stick(-1.0, 1.0)
    with pytest.raises(ValueError, match="delta"):
        C.pnsgd_contraction_epsilon(1.0, 1, 40, **args)
    with pytest.raises(ValueError, match="num_records"):
        C.stop_pnsgd_contraction_delta(0.0, 2.5, 1.0, 1.0, 0.5, 1.0)
    with pytest.raises(ValueError, match="scale"):
        H.laplace_hockey_stick(1.0, 1.0, 0.0)


def test_invalid_inputs_under_jit_give_nan_and_valid_ones_agree():
    f = jax.jit(C.pnsgd_contraction_delta)
    assert np.isnan(float(f(1.0, 41, 40, 1.0, 1.0, 0.5, 1.0, 1.0)))
    assert np.isnan(float(f(1.0, 1, 40, 1.0, 1.0, 0.5, 0.0, 1.0)))  # D = 0
    assert np.isnan(float(f(1.0, 1.5, 40, 1.0, 1.0, 0.5, 1.0, 1.0)))  # non-integer position
    g = jax.jit(C.pnsgd_contraction_epsilon)
    assert np.isnan(float(g(1e-5, 1, 40, 1.0, 1.0, 0.5, -1.0, 1.0)))
    assert np.isnan(float(g(1.5, 1, 40, 1.0, 1.0, 0.5, 1.0, 1.0)))
    # jit and eager agree on valid inputs (eager runs its own jitted core).
    assert float(g(1e-5, 39, 40, 1.0, 2.0, 0.5, 1.0, 1.0)) == float(C.pnsgd_contraction_epsilon(1e-5, 39, 40, **FIG2))
    assert np.isnan(float(jax.jit(H.gaussian_hockey_stick)(-1.0, 1.0)))


@settings(max_examples=25, deadline=None)
@given(
    e1=st.floats(0.0, 8.0),
    e2=st.floats(0.0, 8.0),
    noise_std=st.floats(0.3, 5.0),
    m=st.floats(0.0, 1.0),
    k1=st.integers(0, 60),
    k2=st.integers(0, 60),
)
def test_delta_monotone_in_epsilon_and_later_steps(e1, e2, noise_std, m, k1, k2):
    lo, hi = min(e1, e2), max(e1, e2)
    a, b = min(k1, k2), max(k1, k2)
    n = 61
    d = lambda e, later: float(C.log_pnsgd_contraction_delta(e, n - later, n, 1.0, noise_std, 0.5, 1.0, m))  # noqa: E731
    assert _leq(d(hi, a), d(lo, a))
    assert _leq(d(lo, b), d(lo, a))


def _leq(x, y):
    """x ≤ y up to 1e-12 relative rounding (−inf handled)."""
    return x <= y or (math.isfinite(y) and x <= y + 1e-12 * abs(y))


def test_minibatch_and_multipass_reduce_and_match_derivation():
    # b = 1, k = 1 is exactly Theorem 4.
    base = float(C.pnsgd_contraction_delta(0.8, 7, 30, 1.0, 1.5, 0.4, 1.0, 0.9))
    assert float(C.pnsgd_contraction_delta(0.8, 7, 30, 1.0, 1.5, 0.4, 1.0, 0.9, batch_size=1, passes=1)) == base
    rc = 0.9 * 1.0 / (0.4 * 1.5)
    assert base == pytest.approx(float(theta_mp(0.8, 2 / 1.5) * theta_mp(0.8, rc) ** 23), rel=1e-11)
    # Batches of 4 over n = 30: m = 8 steps, the record 7 is in batch 2; the last batch has 2 records.
    got = float(C.pnsgd_contraction_delta(0.8, 7, 30, 1.0, 1.5, 0.4, 1.0, 0.9, batch_size=4))
    assert got == pytest.approx(float(theta_mp(0.8, 2 / (4 * 1.5)) * theta_mp(0.8, rc) ** 6), rel=1e-11)
    last = float(C.pnsgd_contraction_delta(0.8, 30, 30, 1.0, 1.5, 0.4, 1.0, 0.9, batch_size=4))
    assert last == pytest.approx(float(theta_mp(0.8, 2 / (2 * 1.5))), rel=1e-11)
    # Three passes: first factor θ(rc + r1), then m − j later steps of the last pass.
    mp3 = float(C.pnsgd_contraction_delta(0.8, 7, 30, 1.0, 1.5, 0.4, 1.0, 0.9, batch_size=4, passes=3))
    assert mp3 == pytest.approx(float(theta_mp(0.8, rc + 2 / (4 * 1.5)) * theta_mp(0.8, rc) ** 6), rel=1e-11)


# ----------------------------- Figures 2 and 3 claims -----------------------------


def _kappa(i, fig, n=40):
    """κ of Proposition 1 (statement version, with σ²), written from the paper."""
    lip, sig, m = fig["lipschitz"], fig["noise_std"], fig["contraction"]
    if i == n:
        return 2 * lip**2 / sig**2
    return 2 * lip**2 / ((n - i) * sig**2) * m ** (n - i + 1)


def _log_gap(eps, i, fig):
    """log δ_Thm4 (jaxdp) − log δ̃_Prop1 (closed form (15), in logs so it never underflows)."""
    d4 = float(C.log_pnsgd_contraction_delta(eps, i, 40, **fig))
    k = _kappa(i, fig)
    log_dp = -((eps - k) ** 2) / (4 * k) if eps > k else 0.0
    return d4 - log_dp


def test_prop1_delta_and_kappa_against_paper_formula():
    for i in (1, 20, 39):
        k = float(I.strongly_convex_iteration_rdp([2.0], i, 40, 1.0, 2.0, 1.0)[0]) / 2
        assert k == pytest.approx(_kappa(i, FIG2), rel=1e-14)
    for i in (20, 30, 39):
        k = float(I.strongly_convex_iteration_rdp([2.0], i, 40, 1.0, 1.0, FIG3["contraction"])[0]) / 2
        assert k == pytest.approx(_kappa(i, FIG3), rel=1e-13)
    # Notes §4 tables (Prop1a, Fig. 2 and Fig. 3).
    for eps, k, want in [(0.5, 1 / 78, 0.00977228), (1.0, 0.025, 7.43855e-5), (2.0, 0.5, 0.324652), (1.0, 0.04420839553, 5.70686e-3)]:
        assert float(I.linear_rdp_delta(eps, k)) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("i,want", [(20, 0.78400), (30, 2.68063)])
def test_fig3_crossover(i, want):
    root = optimize.brentq(lambda e: _log_gap(e, i, FIG3), 0.05, 9.0, xtol=1e-10)
    assert root == pytest.approx(want, abs=1e-5)
    # Theorem 4 wins at small ε, Proposition 1 beyond the crossover.
    assert _log_gap(0.5 * want, i, FIG3) < 0 < _log_gap(min(2 * want, 5.0), i, FIG3)


def test_fig3_no_crossing_for_late_record_and_fig2_everywhere():
    grid = np.linspace(0.01, 10.0, 80)
    assert all(_log_gap(e, 39, FIG3) < 0 for e in grid)
    for i in (1, 20, 39):
        assert all(_log_gap(e, i, FIG2) < 0 for e in grid)


def test_step_contraction_bounds_gradient_step_of_quadratics():
    """Independent check of the step-size rule: for ℓ(y) = yᵀHy/2 with spec(H) ⊂ [ρ, β] the
    gradient step's exact Lipschitz constant is max|1 − ηλ| (closed form); M must bound it
    for every η ≤ 2/(β+ρ), boundary included."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        beta = float(rng.uniform(0.1, 10.0))
        rho = float(rng.uniform(0.0, beta))
        eta = float(rng.uniform(0.0, 1.0)) * 2.0 / (beta + rho) if rng.uniform() < 0.8 else 2.0 / (beta + rho)
        if eta <= 0:
            continue
        lam = np.concatenate([[rho, beta], rng.uniform(rho, beta, 8)])
        exact = float(np.max(np.abs(1.0 - eta * lam)))
        assert exact <= float(C.step_contraction(eta, beta, rho)) * (1 + 1e-12) + 1e-15


# Relative tolerance for ε from an mpmath inversion: the jaxdp value is rounded up by at
# most the 1e-12 safety margin on log δ divided by the slope, far below this.
EPS_INV_RTOL = 1e-9


def _stop_delta_mp(eps, n, r1, rc, position):
    """Theorem 5 with the exact sum, at 50 digits: θ1/n · Σ_{k<K} θc^k (θc via 1 − (1 − θc))."""
    k = n - position + 1
    t1 = theta_mp(eps, r1)
    tc = 1 - one_minus_theta_mp(eps, rc)
    total = mp.fsum(tc**j for j in range(k))
    return min(t1 * total / n, mp.mpf(1))


def _stop_eps_mp(delta, n, r1, rc, position):
    lo, hi = mp.mpf(0), mp.mpf(60)
    for _ in range(80):
        mid = (lo + hi) / 2
        if _stop_delta_mp(mid, n, r1, rc, position) <= delta:
            hi = mid
        else:
            lo = mid
    return float(hi)


@pytest.mark.parametrize(
    "delta,n,lip,sig,eta,dia,position",
    [
        (1e-5, 10, 1.0, 1.0, 1.0, 80.0, 10),  # r_c = 80: 1 − θ_c ≈ e^{-804} (was 30.49)
        (1e-5, 10, 1.0, 1.0, 1.0, 80.0, 1),
        (1e-5, 10, 1.0, 1.0, 1.0, 80.0, 5),
        (1e-5, 200, 1.0, 2.0, 0.5, 40.0, 3),  # r_c = 40
        (1e-5, 50, 1.0, 1.0, 0.1, 10.0, 7),  # r_c = 100
        (1e-3, 40, 1.0, 2.0, 0.5, 1.0, 3),  # small r_c: the ordinary branch
    ],
)
def test_stop_epsilon_with_position_against_mpmath(delta, n, lip, sig, eta, dia, position):
    """Theorem 5 with a given position where 1 − θ_c underflows as a number (r_c ≥ 75)."""
    want = _stop_eps_mp(delta, n, 2 * lip / sig, dia / (eta * sig), position)
    got = float(C.stop_pnsgd_contraction_epsilon(delta, n, lip, sig, eta, dia, 1.0, positions=position))
    assert got >= want * (1 - 1e-13)  # never below the exact ε
    assert got == pytest.approx(want, rel=EPS_INV_RTOL)
    d = float(C.stop_pnsgd_contraction_delta(want, n, lip, sig, eta, dia, 1.0, positions=position))
    assert d == pytest.approx(float(_stop_delta_mp(want, n, 2 * lip / sig, dia / (eta * sig), position)), rel=1e-10)


def test_stop_epsilon_regression_value():
    got = float(C.stop_pnsgd_contraction_epsilon(1e-5, 10, 1.0, 1.0, 1.0, 80.0, 1.0, positions=10))
    assert got == pytest.approx(8.8769, abs=1e-4)
