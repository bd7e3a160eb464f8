"""The Gaussian hockey-stick curve's pieces against mpmath (50 digits), over the whole range.

``erfc_parts`` (a scaled erfc as one ratio, no log) and ``_delta_gauss`` / ``_delta_sgm`` (the
PLD's curves for the Gaussian and the Poisson-sampled Gaussian, which DP-SGD uses) are
compared to mpmath's ``erfc`` / ``ncdf`` at the same float64 inputs, deep tails and x ≫ 0
included; derivatives likewise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp._numerics import erfc_parts
from jaxdp.accounting._pld_curves import _delta_gauss, _delta_sgm

mp = pytest.importorskip("mpmath")
TINY = float(np.finfo(np.float64).tiny)


def _ratio(x):
    num, den, mid = erfc_parts(x)
    return num / den, mid


def test_erfc_parts_against_mpmath():
    """Relative error ≤ 1e-15 for |x| ≤ 140 (≤ 7e-16 measured), ≤ 3e-15 beyond (Cephes' R
    has 1/√π to 2e-15 as its leading coefficient, the limit of t erfc(t)e^{t²})."""
    rng = np.random.default_rng(0)
    xs = np.concatenate([rng.uniform(-40.0, 40.0, 600), -(10.0 ** rng.uniform(0.0, 8.0, 300)),
                         10.0 ** rng.uniform(0.0, 8.0, 200), rng.uniform(-1.5, 1.5, 200),
                         [0.0, -0.0, 2.0**0.5, -(2.0**0.5), 8 * 2.0**0.5, -8 * 2.0**0.5]])
    r, mid = (np.asarray(v) for v in jax.jit(_ratio)(xs))
    with mp.workdps(50):
        want = []
        for x in xs:
            t = abs(mp.mpf(x)) / mp.sqrt(2)
            want.append(float(mp.erfc(t) if t < 1 else mp.erfc(t) * mp.exp(t * t)))  # (no underflow in mpmath)
    assert np.array_equal(mid, np.abs(xs) / 2.0**0.5 < 1.0)
    rel = np.abs(r / np.array(want) - 1.0)
    assert rel[np.abs(xs) <= 140.0].max() <= 1e-15
    assert rel.max() <= 3e-15
    # Far out: erfc(t)e^{t²} = (1 - 1/(2t²) + ...)/(t√π), and 0 at ±∞.
    for x in (1e150, -1e300):
        t = abs(x) / 2.0**0.5
        assert abs(float(_ratio(jnp.float64(x))[0]) * (t * np.pi**0.5) - 1.0) <= 3e-15
    assert float(_ratio(jnp.float64(jnp.inf))[0]) == float(_ratio(jnp.float64(-jnp.inf))[0]) == 0.0


def _delta_ref(eps, mu):
    e, m = mp.mpf(eps), mp.mpf(mu)
    return mp.ncdf(-e / m + m / 2) - mp.exp(e) * mp.ncdf(-e / m - m / 2)


def test_delta_gauss_against_mpmath():
    """Relative error ≤ 1e-10 wherever δ is a normal float (≤ 2e-11 measured; the previous
    evaluation through two log Φ: up to 1e-8 in the lower tail), else absolute ≤ 2.3e-308;
    μ from 1e-3 to 1e2, ε such that x₁ = -ε/μ + μ/2 spans [-40, 40], and ε near 0."""
    rng = np.random.default_rng(1)
    n = 600
    mu = np.concatenate([1.0 / rng.uniform(0.5, 10.0, n // 2), 10.0 ** rng.uniform(-3.0, 2.0, n // 2)])
    x1 = rng.uniform(-40.0, 40.0, n)
    x1[: n // 6] = rng.uniform(-3.0, 3.0, n // 6)
    eps = mu * (mu / 2.0 - x1)
    eps[:60] = rng.uniform(-5.0, 5.0, 60)
    got = np.asarray(jax.jit(_delta_gauss)(eps, mu))
    with mp.workdps(50):
        want = np.array([float(_delta_ref(e, m)) for e, m in zip(eps, mu)])
    normal = want >= TINY
    assert np.all(np.abs(got - want)[normal] <= 1e-10 * want[normal])
    assert np.all(np.abs(got - want)[~normal] <= TINY)
    assert np.all((got >= 0.0) & (got <= 1.0))


@pytest.mark.parametrize("direction", ["remove", "add"])
def test_delta_sgm_against_mpmath(direction):
    """DP-SGD's curve: q in [1e-5, 1], σ in [0.5, 10], ε over the PLD's grids (|ε| ≤ 60)."""
    rng = np.random.default_rng(2 if direction == "remove" else 3)
    n = 300
    q = np.concatenate([10.0 ** rng.uniform(-5.0, 0.0, n - 2), [1.0, 1e-5]])
    sigma = rng.uniform(0.5, 10.0, n)
    eps = np.concatenate([rng.uniform(-1.0, 1.0, n // 2), rng.uniform(-60.0, 60.0, n - n // 2)])
    got = np.asarray(jax.jit(lambda e, q, s: _delta_sgm(e, q, s, direction))(eps, q, sigma))
    with mp.workdps(50):
        want = []
        for e, qq, s in zip(eps, q, sigma):
            e, qq, mu = mp.mpf(e), mp.mpf(qq), 1 / mp.mpf(s)
            if direction == "remove":  # q δ(y), y = log((e^ε - 1 + q)/q), for ε > log(1 - q)
                arg = (mp.exp(e) - 1 + qq) / qq
                want.append(float(qq * _delta_ref(mp.log(arg), mu)) if arg > 0 else float(1 - mp.exp(e)))
            else:  # (1 - (1-q)e^ε) δ(-y'), y' = log((e^{-ε} - 1 + q)/q), for ε < -log(1 - q)
                arg = (mp.exp(-e) - 1 + qq) / qq
                want.append(float((1 - (1 - qq) * mp.exp(e)) * _delta_ref(-mp.log(arg), mu)) if arg > 0 else 0.0)
    want = np.array(want)
    normal = want >= TINY
    # (the ε → y map's own rounding, shared with the previous evaluation, dominates here)
    assert np.all(np.abs(got - want)[normal] <= 1e-9 * want[normal])
    assert np.all(np.abs(got - want)[~normal] <= TINY)


def test_delta_gauss_derivatives_against_mpmath():
    """Both partial derivatives (autodiff through the one-ratio form) against mpmath.diff.

    (Not dδ/dε where δ is within ~1e-12 of 1 - e^ε: jax's expm1 JVP, expm1(x) + 1, cancels
    there, as it did before.)
    """
    cases = [(0.3, 1.0), (5.0, 0.9), (30.0, 0.5), (-2.0, 1.3), (1e-3, 0.1), (40.0, 2.0), (-3.0, 0.7),
             (-0.5, 0.2), (12.0, 3.0), (200.0, 10.0)]
    grad = jax.jit(jax.grad(_delta_gauss, argnums=(0, 1)))
    with mp.workdps(50):
        for e, m in cases:
            de, dm = (float(v) for v in grad(e, m))
            want_e = mp.diff(lambda z: _delta_ref(z, m), e)
            want_m = mp.diff(lambda z: _delta_ref(e, z), m)
            assert de == pytest.approx(float(want_e), rel=1e-9, abs=0.0), (e, m)
            assert dm == pytest.approx(float(want_m), rel=1e-9, abs=0.0), (e, m)
