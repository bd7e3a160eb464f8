"""Derivatives of the public accountants, with the global x64 flag off (the default for users)
and on, against central differences (forward mode: the NaN regression below and
test_pnsgd.py).

Regressions covered: with x64 off, ``jax.grad`` of anything built on a gather (the
sampled-Gaussian RDP, DP-SGD ε, ``pnsgd_privacy``) failed with a float32/float64 scatter
error, because JAX transposes a gather onto zeros created outside our float64 scope; the
derivative of a max or min reduction divided by a count that XLA's fusion could make 0
(NaN at α = 9.7, q = 0.02, σ = 1.3); and an order whose RDP overflowed to +inf poisoned
the ε gradient (0·NaN in the backward pass).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdp.accounting as A

O = A.DEFAULT_ORDERS
# Integer and fractional orders (both series paths), small enough to compile quickly.
SMALL = (1.5, 2.0, 3.0, 9.7, 10.9, 64.0)
X0 = 1.3
H = 1e-6
# grad with x64 off returns float32 (the input's dtype): 6e-8 relative rounding of the
# result plus the float32 rounding of x0 itself; central differences in float64 with
# h = 1e-6 are good to ~1e-9 here. 2e-6 leaves a margin of 10x.
RTOL_X32 = 2e-6
# Both in float64: the analytic derivative against O(h²) central differences.
RTOL_X64 = 1e-6

CASES = {
    "sampled_gaussian_rdp(q)": lambda x: jnp.sum(A.sampled_gaussian_rdp(SMALL, x / 100, 1.1)),
    "sampled_gaussian_rdp(sigma)": lambda x: jnp.sum(A.sampled_gaussian_rdp(SMALL, 0.02, x)),
    "gaussian_rdp": lambda x: jnp.sum(A.gaussian_rdp(O, x)),
    "rdp_to_epsilon": lambda x: A.rdp_to_epsilon(A.gaussian_rdp(O, x), O, 1e-5).epsilon,
    "rdp_to_delta": lambda x: A.rdp_to_delta(A.gaussian_rdp(O, x), O, 1.0).delta,
    "dpsgd_epsilon": lambda x: A.dpsgd_epsilon(0.01, x, 1000, 1e-5),
    "heterogeneous_rdp": lambda x: jnp.sum(A.heterogeneous_rdp(SMALL, jnp.array([0.01, 0.02]), jnp.stack([x, x]),
                                                               jnp.array([100.0, 200.0]))),
    "gaussian_hockey_stick": lambda x: A.gaussian_hockey_stick(1.0, x),
    "log_gaussian_hockey_stick": lambda x: A.log_gaussian_hockey_stick(1.0, x),
    "laplace_hockey_stick": lambda x: A.laplace_hockey_stick(1.0, x, 1.0),
    "pnsgd_contraction_epsilon": lambda x: A.pnsgd_contraction_epsilon(1e-5, 39, 40, 1.0, x, 0.5, 1.0),
    "stop_pnsgd_contraction_epsilon": lambda x: A.stop_pnsgd_contraction_epsilon(1e-5, 40, 1.0, x, 0.5, 1.0),
    "pnsgd_iteration_rdp": lambda x: jnp.sum(A.pnsgd_iteration_rdp(O, 1, 40, 1.0, x)),
    "strongly_convex_iteration_rdp": lambda x: jnp.sum(A.strongly_convex_iteration_rdp(O, 1, 40, 1.0, x, 0.9)),
    "stop-PNSGD ε (some orders large)": lambda x: A.rdp_to_epsilon(
        A.stop_pnsgd_iteration_rdp(O, 40, 1.0, x, form="logmeanexp"), O, 1e-5).epsilon,
    "pnsgd_privacy": lambda x: A.pnsgd_privacy(lipschitz=1.0, smoothness=1.0, learning_rate=0.5, noise_std=x, diameter=1.0,
                                               num_records=40, delta=1e-5).best[-1],
}


def _central(f):
    with jax.enable_x64(True):
        return (float(f(X0 + H)) - float(f(X0 - H))) / (2 * H)


# Slow to compile three more times: checked with x64 off only (the failing mode); the
# float64 and forward-mode paths of the same code are covered by the other cases and by
# test_pnsgd.py's forward-mode test.
HEAVY = {"dpsgd_epsilon", "pnsgd_privacy"}


@pytest.mark.slow  # CI: test_transformations checks grad(jit(f)) of every accountant against central differences
@pytest.mark.parametrize("name", list(CASES))
def test_grad_with_x64_off_and_on_matches_central_differences(name):
    f = CASES[name]
    ref = _central(f)
    with jax.enable_x64(False):
        g32 = float(jax.grad(f)(X0))
    assert g32 == pytest.approx(ref, rel=RTOL_X32, abs=1e-12)
    if name in HEAVY:
        return
    with jax.enable_x64(True):
        g64 = float(jax.grad(f)(X0))
    assert g64 == pytest.approx(ref, rel=RTOL_X64, abs=1e-12)


def test_sampled_gaussian_jacobian_is_finite_where_fusion_made_nan():
    """α = 9.7 among the default orders at q = 0.02, σ = 1.3 gave a NaN derivative under jit."""
    with jax.enable_x64(True):
        jac = np.asarray(jax.jacfwd(lambda s: A.sampled_gaussian_rdp(O, 0.02, s))(1.3))
        step = 1e-6
        fd = (np.asarray(A.sampled_gaussian_rdp(O, 0.02, 1.3 + step))
              - np.asarray(A.sampled_gaussian_rdp(O, 0.02, 1.3 - step))) / (2 * step)
    assert np.all(np.isfinite(jac))
    np.testing.assert_allclose(jac, fd, rtol=1e-5, atol=1e-12)


CALIBRATIONS = {
    # (function, x64 flag under which it is differentiated). σ* as a function of the target
    # ε; for PNSGD also at a record where the contraction bound binds, as a function of D.
    "calibrate_noise_multiplier(target)": (lambda x: A.calibrate_noise_multiplier(x, 0.01, 1000, 1e-5, orders=SMALL).noise_multiplier, False),
    "calibrate_pnsgd_noise_std(target)": (lambda x: A.calibrate_pnsgd_noise_std(
        x, 1e-5, lipschitz=1.0, smoothness=1.0, learning_rate=0.5, diameter=1.0, num_records=40), False),
    "calibrate_pnsgd_noise_std(diameter)": (lambda x: A.calibrate_pnsgd_noise_std(
        1.3, 1e-5, lipschitz=1.0, smoothness=1.0, learning_rate=0.5, diameter=x, num_records=40, positions=30,
        analysis="contraction"), True),
}


@pytest.mark.parametrize("name", list(CALIBRATIONS))
def test_calibration_derivatives_follow_the_implicit_function_theorem(name):
    """The bisections have no derivative of their own; σ*'s comes from ε(σ*) = target. Central
    differences of the calibrated σ (each a full 64-step bisection, certified to ~1e-16
    relative) are the reference."""
    f, x64 = CALIBRATIONS[name]
    ref = _central(f)
    assert ref != 0
    with jax.enable_x64(x64):
        g = float(jax.grad(f)(X0))
    assert g == pytest.approx(ref, rel=RTOL_X64 if x64 else RTOL_X32)


def test_calibrated_epsilon_moves_with_the_target():
    with jax.enable_x64(True):
        d = jax.grad(lambda e: A.calibrate_noise_multiplier(e, 0.01, 1000, 1e-5, orders=SMALL).epsilon)(1.3)
    assert float(d) == pytest.approx(1.0, rel=1e-12)


def test_grad_through_the_chunked_batch_path_with_x64_off():
    """More than 64 configurations run in chunks (a padded lax.map); its padding must not
    break reverse mode either (jnp.pad's transpose made a float32 zero)."""
    # float32-representable points, so that both sides see the same inputs.
    s = np.linspace(0.8, 3.0, 100).astype(np.float32).astype(np.float64)
    with jax.enable_x64(False):
        g = np.asarray(jax.grad(lambda v: jnp.sum(A.sampled_gaussian_rdp(SMALL, 0.01, v)))(jnp.asarray(s)))
    with jax.enable_x64(True):
        step = 1e-6
        fd = np.sum(np.asarray(A.sampled_gaussian_rdp(SMALL, 0.01, s + step))
                    - np.asarray(A.sampled_gaussian_rdp(SMALL, 0.01, s - step)), axis=-1) / (2 * step)
    np.testing.assert_allclose(g, fd, rtol=RTOL_X32, atol=1e-9)


def test_calibration_derivatives_in_q_and_delta_follow_the_implicit_function_theorem():
    """σ*(q, δ): both partial derivatives in one reverse pass (the rule computes every
    parameter's slope of ε at σ* in one batched forward derivative), against central
    differences of fully converged calibrations."""
    def f(q, d):
        return A.calibrate_noise_multiplier(1.3, q, 1000, d, orders=SMALL).noise_multiplier

    with jax.enable_x64(True):
        gq, gd = (float(v) for v in jax.grad(f, argnums=(0, 1))(0.01, 1e-5))
        ref_q = (float(f(0.01 * (1 + 1e-5), 1e-5)) - float(f(0.01 * (1 - 1e-5), 1e-5))) / (2e-7)
        ref_d = (float(f(0.01, 1e-5 * (1 + 1e-5))) - float(f(0.01, 1e-5 * (1 - 1e-5)))) / (2e-10)
    assert gq == pytest.approx(ref_q, rel=1e-5)
    assert gd == pytest.approx(ref_d, rel=1e-5)



@pytest.mark.slow  # ~17 s under load (the second derivative compiles the accountant's second-order program)
def test_calibration_second_derivative_re_enters_the_rule():
    """d²σ*/d target²: the rule's primal goes through the calibration again, so a second
    derivative differentiates the rule (never the search's while_loop, which reverse mode
    cannot transpose), against central differences of the first derivative."""
    def g(e):
        return jax.grad(lambda t: A.calibrate_noise_multiplier(t, 0.01, 1000, 1e-5, orders=SMALL).noise_multiplier)(e)

    with jax.enable_x64(True):
        second = float(jax.grad(g)(X0))
        step = 1e-4
        ref = (float(g(X0 + step)) - float(g(X0 - step))) / (2 * step)
    assert second == pytest.approx(ref, rel=1e-6)


FORWARD_CASES = {
    "dpsgd_epsilon": lambda s: A.dpsgd_epsilon(0.01, s, 1000, 1e-5),
    "epsilon(dpsgd_event)": lambda s: A.epsilon(A.dpsgd_event(0.01, s, 1000), 1e-5),
}
FORWARD_FORMS = {
    "jit(jvp)": lambda f: jax.jit(lambda s: jax.jvp(f, (s,), (1.0,))[1]),
    "jvp(jit)": lambda f: lambda s: jax.jvp(jax.jit(f), (s,), (jnp.float32(1.0),))[1],
    "jit(grad)": lambda f: jax.jit(jax.grad(f)),
    "jacfwd": lambda f: jax.jacfwd(f),
}


@pytest.mark.parametrize("name,form", [
    pytest.param(n, m, marks=() if (n, m) == ("dpsgd_epsilon", "jit(jvp)") else pytest.mark.slow)
    for n in FORWARD_CASES for m in FORWARD_FORMS])  # CI: the regression; JAXDP_SLOW=1: all
def test_forward_mode_under_jit_with_x64_off(name, form):
    """jit(jvp) with a Python-number tangent raised a raw 'primal and tangent ... dtypes must
    be equal' TypeError with x64 off (a float32 primal met a float64 tangent in the float64
    wrapper's rule); every form gives the x64-on derivative within float32 rounding."""
    f = FORWARD_CASES[name]
    with jax.enable_x64(True):
        want = float(jax.grad(f)(X0))
    with jax.enable_x64(False):
        got = np.asarray(FORWARD_FORMS[form](f)(X0))
    assert got.shape == () and np.isfinite(got)
    assert float(got) == pytest.approx(want, rel=RTOL_X32)
