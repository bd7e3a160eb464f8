"""Second derivatives of the accountants: equal to central differences of the first (x64 on),
one clear error with x64 off (never NaN, never a raw dtype TypeError).

The reference is a float64 central difference of the gradient, (g(σ+h) - g(σ-h)) / 2h,
computed independently of the second-order program.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import jaxdp.accounting as A
from jaxdp._numerics import SecondDerivativeX64Error, log_ndtr
from jaxdp.accounting._pld import PLDSecondDerivativeError

Q, STEPS, DELTA, SIGMA = 256 / 60000, 14040, 1e-5, 1.1

CASES = {
    "dpsgd_epsilon": (lambda s: A.dpsgd_epsilon(Q, s, STEPS, DELTA), 1e-6),
    "epsilon(event)": (lambda s: A.epsilon(A.dpsgd_event(Q, s, STEPS), DELTA), 1e-6),
}


def _central_difference(f, x, h=1e-4):
    g = jax.grad(f)
    return (float(g(x + h)) - float(g(x - h))) / (2 * h)


@pytest.mark.parametrize("name", ["dpsgd_epsilon", "epsilon(event)"])
def test_second_derivative_matches_central_differences_x64_on(name):
    f, rtol = CASES[name]
    with jax.enable_x64(True):
        want = _central_difference(f, SIGMA)
        # jax.hessian (forward over reverse) is a second program of the same derivative:
        # checked with JAXDP_SLOW=1; CI checks grad(grad(f)).
        forms = (jax.grad(jax.grad(f)), jax.hessian(f)) if os.environ.get("JAXDP_SLOW") else (jax.grad(jax.grad(f)),)
        for second in forms:
            got = float(second(SIGMA))
            assert np.isfinite(got)
            assert got == pytest.approx(want, rel=rtol)


@pytest.mark.parametrize("name", ["dpsgd_epsilon", "epsilon(event)"])
def test_second_derivative_with_x64_off_is_one_clear_error(name):
    f, _ = CASES[name]
    with jax.enable_x64(False):
        for second in (jax.grad(jax.grad(f)), jax.hessian(f)):
            with pytest.raises(SecondDerivativeX64Error, match="jax_enable_x64"):
                second(np.float32(SIGMA))


def test_pld_second_derivative_is_one_clear_error():
    """The PLD's gradient holds its grid plan fixed while the plan moves with σ: grad of grad
    gave -91.35 where a difference quotient of the gradient gave 6.265 (σ = 1.1, T = 14040).
    A second derivative now raises (at trace time) instead of returning that number; first
    derivatives are tested in test_pld.py."""
    f = lambda s: A.epsilon(A.dpsgd_event(Q, s, 100), DELTA, accountant="pld", grid_size=256)
    with jax.enable_x64(True):
        # ~3 s of tracing each: CI checks grad(grad(f)); JAXDP_SLOW=1 the other forms too.
        forms = (jax.grad(jax.grad(f)),)
        if os.environ.get("JAXDP_SLOW"):
            forms += (jax.jacfwd(jax.jacfwd(f)), jax.hessian(jax.jit(f)))
        for second in forms:
            with pytest.raises(PLDSecondDerivativeError, match="accountant='rdp'"):
                second(SIGMA)


def test_log_ndtr_derivatives_against_mpmath():
    """(log Φ)' = φ/Φ = r and (log Φ)'' = -r (x + r), at 50 digits; differentiating
    log(erfc) twice gave 0/0 = NaN below x = -26."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    with jax.enable_x64(True):
        for x in (-5.0, -26.5, -30.0, -36.9, -37.1, -100.0, 0.3, 5.0):
            r = mpmath.npdf(x) / mpmath.ncdf(x)
            d1 = float(jax.grad(log_ndtr)(x))
            d2 = float(jax.grad(jax.grad(log_ndtr))(x))
            assert d1 == pytest.approx(float(r), rel=1e-12)
            # -r (x + r) cancels to ~1/x² of r x in the lower tail: a few ulps of r x there.
            assert d2 == pytest.approx(float(-r * (x + r)), rel=1e-8, abs=1e-14)
