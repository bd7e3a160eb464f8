"""pnsgd_privacy / calibrate_pnsgd_noise_std and the ``jaxdp pnsgd`` command.

References (never jaxdp itself): mpmath at 50 digits (θ and its root for the
contraction bound and the exact Gaussian mechanism), the improved RDP conversion over a
fine grid of orders (tests/references.py), and the test vectors of
shared/notes/seeds/000_contraction.md.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import mpmath as mp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxdp.accounting import _contraction as C
from jaxdp.accounting import _pnsgd as P
from jaxdp.accounting import _pnsgd_calibrate as PC

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from references import rdp_to_epsilon_improved

# Shared-grid inversion: candidate root + 1e-12 relative margin, certified exactly.
RTOL_EPS = 1e-9

mp.mp.dps = 50

FIG2 = dict(lipschitz=1.0, smoothness=0.5, learning_rate=0.5, noise_std=2.0, diameter=1.0, num_records=40, delta=1e-5)


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def theta_mp(eps, r):
    eps, r = mp.mpf(eps), mp.mpf(r)
    if r == 0:
        return mp.mpf(0)
    return mp.ncdf(-(eps / r - r / 2)) - mp.e**eps * mp.ncdf(-(eps / r + r / 2))


def eps_root_mp(log_delta_fn, delta, hi=50.0):
    """Smallest ε with log_delta_fn(ε) ≤ log δ, by mpmath bisection (0 if already at ε = 0)."""
    target = mp.log(delta)
    if log_delta_fn(mp.mpf(0)) <= target:
        return 0.0
    lo, hi = mp.mpf(0), mp.mpf(hi)
    for _ in range(120):
        mid = (lo + hi) / 2
        if log_delta_fn(mid) <= target:
            hi = mid
        else:
            lo = mid
    return float(hi)


def gaussian_eps_mp(r, delta):
    return eps_root_mp(lambda e: mp.log(theta_mp(e, r)), delta)


@pytest.fixture(scope="module")
def fig2_run():
    with jax.enable_x64(True):
        return P.pnsgd_privacy(**FIG2)


def test_fig2_contraction_against_mpmath(fig2_run):
    out = fig2_run
    for i in (1, 20, 30, 35, 38, 39, 40):
        k = 40 - i + 1  # r1 = rc = 1 in Fig. 2, so δ = θ(1)^{n−i+1}
        ref = eps_root_mp(lambda e, k=k: k * mp.log(theta_mp(e, 1)), 1e-5)
        assert float(out.contraction[i - 1]) == pytest.approx(ref, rel=RTOL_EPS, abs=1e-12), i
    # Notes: i = 39 → 2.75400907565, i = 40 → 4.37717809568.
    assert float(out.contraction[38]) == pytest.approx(2.75400907565, rel=1e-10)
    assert float(out.contraction[39]) == pytest.approx(4.37717809568, rel=1e-10)
    # Positions of any shape are padded to a bucket size (48 for 40 or 42 positions) and cut
    # back: the values are the full run's, reshaped (and no analysis is compiled again).
    idx = np.resize(np.arange(40, 0, -1), 42).reshape(6, 7)
    with jax.enable_x64(True):
        sub = P.pnsgd_privacy(**FIG2, positions=idx)
    for name in out._fields[1:]:
        np.testing.assert_array_equal(np.asarray(getattr(sub, name)), np.asarray(getattr(out, name))[idx - 1], err_msg=name)


def test_fig2_iteration_and_composition(fig2_run):
    out = fig2_run
    orders = np.geomspace(1.0101, 1e6, 20000)
    for i in (1, 20, 40):
        c = 2 * 1.0 / (4.0 * (40 - i + 1))
        ref = rdp_to_epsilon_improved(orders, c * orders, 1e-5)
        assert float(out.iteration[i - 1]) == pytest.approx(ref, rel=1e-7)
        assert float(out.iteration[i - 1]) <= ref + 1e-12
        # Proposition-1 κ (n − i in the denominator, M = 1) with the same conversion.
        k = 2 / 4.0 if i == 40 else 2 * 1.0 / ((40 - i) * 4.0)
        assert float(out.strongly_convex[i - 1]) == pytest.approx(rdp_to_epsilon_improved(orders, k * orders, 1e-5), rel=1e-7)
    np.testing.assert_allclose(np.asarray(out.composition), gaussian_eps_mp(1.0, 1e-5), rtol=1e-10)


def test_best_is_min_and_at_least_one_step_gaussian(fig2_run):
    out = fig2_run
    best = np.asarray(out.best)
    for name in ("contraction", "iteration", "strongly_convex", "composition"):
        assert np.all(best <= np.asarray(getattr(out, name)))
    one_step = gaussian_eps_mp(2 * 1.0 / 2.0, 1e-5)
    assert best[-1] >= one_step * (1 - 1e-12)
    assert best[-1] == pytest.approx(one_step, rel=1e-10)
    np.testing.assert_array_equal(np.asarray(out.positions), np.arange(1, 41))


@settings(max_examples=12, deadline=None)
@given(
    noise_std=st.floats(0.5, 4.0),
    diameter=st.floats(0.2, 3.0),
    rho=st.floats(0.0, 0.5),
    batch=st.integers(1, 6),
    passes=st.integers(1, 3),
    delta=st.sampled_from([1e-3, 1e-6]),
)
def test_properties_monotone_best_and_one_step(noise_std, diameter, rho, batch, passes, delta):
    out = P.pnsgd_privacy(
        lipschitz=1.0, smoothness=1.0, learning_rate=0.5, noise_std=noise_std, diameter=diameter, num_records=40, delta=delta,
        strong_convexity=rho, batch_size=batch, passes=passes,
    )
    best = np.asarray(out.best)
    for name in ("contraction", "iteration", "strongly_convex", "composition", "best"):
        v = np.asarray(getattr(out, name))
        assert not np.any(np.isnan(v))
        # ε per position is non-increasing in the number of later steps (non-decreasing in i).
        fin = np.isfinite(v)
        assert np.all(np.diff(v[fin]) >= -1e-9 * np.maximum(1.0, v[fin][1:]))
        assert np.all(best <= v)
    # Never below the exact ε of one Gaussian step of the record's (last) batch.
    m = math.ceil(40 / batch)
    b_last = 40 - (m - 1) * batch
    one_step = gaussian_eps_mp(2.0 / (b_last * noise_std), delta)
    assert best[-1] >= one_step * (1 - 1e-12)


def test_calibration_worst_record_is_gaussian():
    s = float(PC.calibrate_pnsgd_noise_std(1.0, 1e-5, lipschitz=1.0, smoothness=1.0, learning_rate=0.5, diameter=1.0, num_records=1000))
    assert theta_mp(1.0, 2.0 / s) <= 1e-5
    assert theta_mp(1.0, 2.0 / (s * (1 - 1e-9))) > 1e-5  # and it is the smallest such σ


def test_calibration_per_position_contraction():
    pos = jnp.array([1, 30, 39, 40])
    s = np.asarray(PC.calibrate_pnsgd_noise_std(1.0, 1e-5, lipschitz=1.0, smoothness=0.5, learning_rate=0.5, diameter=1.0, num_records=40, positions=pos, analysis="contraction"))
    for i, sig in zip([1, 30, 39, 40], s):
        logd = lambda x, i=i: mp.log(theta_mp(1.0, 2 / x)) + (40 - i) * mp.log(theta_mp(1.0, 1 / (0.5 * x)))  # noqa: E731
        assert logd(sig) <= mp.log(1e-5)
        assert logd(sig * (1 - 1e-9)) > mp.log(1e-5)
    assert np.all(np.diff(s) >= 0)


@pytest.mark.slow  # CI: covered by test_transformations and test_gradients
def test_gradients_of_every_analysis_match_finite_differences():
    """Forward-mode derivative in σ (noise_std) of each analysis at three positions vs central
    differences (h = 1e-5; the bounds are smooth there, so the O(h²) truncation and the 1e-12
    rounding of ε give agreement to well under 1e-6 relative)."""
    names = ("contraction", "iteration", "strongly_convex", "composition", "best")
    kw = dict(lipschitz=1.0, smoothness=1.0, learning_rate=0.5, diameter=1.0, delta=1e-5, strong_convexity=0.2, num_records=40,
              positions=jnp.array([1.0, 20.0, 40.0]))

    def f(s):
        out = P.pnsgd_privacy(noise_std=s, **kw)
        return jnp.stack([getattr(out, n) for n in names])

    with jax.enable_x64(True):
        g = np.asarray(jax.jacfwd(f)(2.0))
        h = 1e-5
        fd = (np.asarray(f(2.0 + h)) - np.asarray(f(2.0 - h))) / (2 * h)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-9)
    assert np.all(g[:4][np.asarray(f(2.0))[:4] > 0] < 0)  # more noise, less ε


def test_errors_name_the_parameter():
    with pytest.raises(ValueError, match="learning_rate"):
        P.pnsgd_privacy(**{**FIG2, "learning_rate": 4.5})
    with pytest.raises(ValueError, match="strong_convexity"):
        P.pnsgd_privacy(**{**FIG2, "strong_convexity": 0.6})
    with pytest.raises(ValueError, match="diameter"):
        P.pnsgd_privacy(**{**FIG2, "diameter": 0.0})
    with pytest.raises(ValueError, match="position"):
        P.pnsgd_privacy(**FIG2, positions=jnp.array([0, 3]))
    with pytest.raises(ValueError, match="noise_std"):
        P.pnsgd_privacy(**{**FIG2, "noise_std": jnp.array([1.0, 2.0])})
    with pytest.raises(ValueError, match="delta"):
        P.pnsgd_privacy(**{**FIG2, "delta": 1.0})
    with pytest.raises(ValueError, match="analysis"):
        PC.calibrate_pnsgd_noise_std(1.0, 1e-5, lipschitz=1.0, smoothness=1.0, learning_rate=0.5, diameter=1.0, num_records=10, analysis="x")


def test_traced_invalid_inputs_give_nan(fig2_run):
    # Under jit the public function runs this core with traced values (the eager
    # validators are skipped); same shapes as the fixture (its 40 positions padded to the
    # bucket size, cut back to 40), so no new compile.
    f64 = lambda x: jnp.asarray(x, jnp.float64)  # noqa: E731
    pos = jnp.asarray(np.concatenate([np.arange(1, 41), np.ones(P._bucket(40) - 40)]))

    def run(noise_std=2.0, learning_rate=0.5, diameter=1.0, delta=1e-5, rho=0.0):
        args = [f64(x) for x in (40, 1.0, 0.5, rho, learning_rate, noise_std, diameter, 1, 1, delta)]
        return np.asarray(P._privacy_core(pos, *args, sc_form="proposition1", size=40, shape=(40,))[-1])

    np.testing.assert_array_equal(run(), np.asarray(fig2_run.best))
    for bad in (dict(noise_std=-1.0), dict(learning_rate=4.5), dict(diameter=0.0), dict(delta=1.0), dict(rho=0.6)):
        assert np.all(np.isnan(run(**bad))), bad


# ----------------------------------- command line -----------------------------------


def test_nearly_zero_strong_convexity_stays_monotone():
    # Regression: with ρ = 2.2e-16 the order search for the last two positions stopped
    # early (16 iterations) and left position n-1 3e-8 above position n.
    out = P.pnsgd_privacy(lipschitz=1.0, smoothness=1.0, learning_rate=0.5, noise_std=1.5, diameter=1.0, num_records=40, delta=1e-3,
                          strong_convexity=2.220446049250313e-16)
    v = np.asarray(out.strongly_convex)
    assert np.all(np.diff(v) >= -1e-12 * v[1:])


def test_inconsistent_arguments_rejected_eagerly():
    with pytest.raises(ValueError, match="batch_size must be ≤ num_records"):
        P.pnsgd_privacy(**{**FIG2, "batch_size": 41})
    with pytest.raises(ValueError, match="positions must be ≤ num_records"):
        P.pnsgd_privacy(**FIG2, positions=[1, 41])
    with pytest.raises(ValueError, match="batch_size must be ≤ num_records"):
        PC.calibrate_pnsgd_noise_std(1.0, 1e-5, lipschitz=1.0, smoothness=1.0, learning_rate=0.5, diameter=1.0,
                                    num_records=10, batch_size=11)
    with pytest.raises(ValueError, match="positions must be ≤ num_records"):
        C.stop_pnsgd_contraction_delta(1.0, 10, 1.0, 1.0, 0.5, 1.0, positions=11)


def _contraction_eps_mp(delta, r_first, rc, later):
    """ε with log θ(ε, r_first) + later·log θ(ε, rc) = log δ, by 50-digit bisection."""
    mp.mp.dps = 50

    def theta(e, r):
        return mp.ncdf(-(e / r - r / 2)) - mp.e**e * mp.ncdf(-(e / r + r / 2))

    def log_d(e):
        return mp.log(theta(e, r_first)) + (later * mp.log(theta(e, rc)) if later else 0)

    lo, hi = mp.mpf(0), mp.mpf(5000)
    for _ in range(110):
        mid = (lo + hi) / 2
        if log_d(mid) <= mp.log(delta):
            hi = mid
        else:
            lo = mid
    return float(hi)


def test_grid_inversion_exact_where_hermite_fails():
    """Two passes with a large first ratio stretch the shared grid (cells of width 0.084):
    the Hermite root used to fail its check and return the cell's end (up to +148%)."""
    run = dict(lipschitz=4.783690154056197, smoothness=0.1332598003584945, learning_rate=9.204485757132925,
               noise_std=0.1413330135869621, diameter=1.8781907779682292, delta=1.1623403297716578e-06,
               num_records=1333, passes=2)
    pos = np.array([1300, 1312, 1315, 1320, 1333])
    got = np.asarray(P.pnsgd_privacy(**run, positions=pos).contraction)
    r1, rc = 2 * run["lipschitz"] / run["noise_std"], run["diameter"] / (run["learning_rate"] * run["noise_std"])
    for i, g in zip(pos, got):
        want = _contraction_eps_mp(run["delta"], r1 + rc, rc, 1333 - int(i))
        assert g >= want * (1 - 1e-13) - 1e-20, i  # never below the exact ε (bisection resolution 4e-30)
        assert g == pytest.approx(want, rel=1e-9, abs=1e-12), i
