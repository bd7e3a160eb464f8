"""The shared bracketed search (jaxdp.accounting._solve) against closed-form roots."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.accounting._solve import search_certified, search_decreasing, solve_decreasing

# 64 halvings of a bracket of width 10: 10·2^-64 ≈ 5e-19 plus float64 rounding of the root.
ROOT_TOL = 1e-12
# Central differences with step 1e-6 on smooth functions: truncation ~1e-12, rounding ~1e-10.
GRAD_TOL = 1e-7


def _f(x, a):
    return jnp.exp(-a * x)  # decreasing in x; root of f = t is log(1/t)/a


def test_solve_decreasing_closed_form_safe_side_jit_vmap():
    a = np.array([0.5, 1.0, 3.0])
    t = np.array([0.5, 0.1, 0.9])
    ref = np.log(1.0 / t) / a
    x = jax.jit(jax.vmap(lambda a_, t_: solve_decreasing(_f, (a_,), t_, 0.0, 10.0, 64)))(a, t)
    np.testing.assert_allclose(x, ref, rtol=ROOT_TOL)
    assert np.all(np.exp(-a * np.asarray(x)) <= t)  # never on the wrong side


def test_solve_decreasing_ends_and_gradient():
    # f(lo) ≤ t: the lower end, constant; f(hi) > t: +inf.
    assert float(solve_decreasing(_f, (1.0,), 2.0, 0.0, 10.0, 64)) == 0.0
    assert math.isinf(float(solve_decreasing(_f, (1.0,), 1e-9, 0.0, 10.0, 64)))
    g = jax.grad(lambda a, t: solve_decreasing(_f, (a,), t, 0.0, 10.0, 64), argnums=(0, 1))(2.0, 0.3)
    h = 1e-6
    fd_a = (math.log(1 / 0.3) / (2 + h) - math.log(1 / 0.3) / (2 - h)) / (2 * h)
    fd_t = (math.log(1 / (0.3 + h)) / 2 - math.log(1 / (0.3 - h)) / 2) / (2 * h)
    np.testing.assert_allclose(g, (fd_a, fd_t), rtol=GRAD_TOL)


def test_search_with_proposal_converges_fast_and_stays_accepted():
    # A secant proposal on a smooth function: 8 steps reach the root to 1e-12 from a wide bracket.
    t = 0.2

    def accept(x):
        v = jnp.log(_f(x, 1.0)) - math.log(t)
        return v <= 0, v

    def propose(a, va, wa, b, vb, wb):
        return b - vb * wb * (b - a) / (vb * wb - va * wa)

    res = search_decreasing(accept, jnp.asarray(0.0), jnp.asarray(10.0), 8, propose=propose)
    assert bool(res.found) and not bool(res.at_low)
    assert float(res.x) >= math.log(1 / t) and abs(float(res.x) - math.log(1 / t)) < ROOT_TOL


def test_search_certified_per_element_ends_and_safe_side():
    """search_certified (one evaluation per step, the DP-SGD calibration's loop): every
    result is an accepted point within tol of the closed-form root; a target met at lo is
    flagged, one beyond hi is +inf; a poor first point and a biased model still converge."""
    t = jnp.array([0.2, 0.5, 1e-3, 2.0, 1e-9])  # roots log(1/t); 2.0: at lo = 0; 1e-9: beyond hi = 10
    root = np.log(1.0 / np.asarray(t))

    def evaluate(x):
        v = jnp.log(_f(x, 1.0)) - jnp.log(t)
        return v <= 0, _f(x, 1.0), v

    def propose(xp, vp, xc, vc, two):
        # A model that under-shoots by 10% (as a conservative fit would): the safeguards finish.
        return xc + 0.9 * vc

    tol = 1e-9
    res = search_certified(evaluate, propose, jnp.full(5, 5.0), jnp.zeros(5), 0.0, 10.0, tol, 60)
    x = np.asarray(res.x)
    assert np.all(np.asarray(res.certified))
    assert x[3] == 0.0 and bool(res.at_low[3]) and math.isinf(x[4]) and not bool(res.found[4])
    assert np.all(x[:3] >= root[:3]) and np.all(x[:3] - root[:3] <= tol)
    np.testing.assert_allclose(np.asarray(res.value)[:4], np.exp(-x[:4]), rtol=1e-15)
