"""Every public accountant in every cell of the transformation matrix, x64 flag off and on.

Forms: ``f``, ``jit(f)``, ``vmap(f)``, ``jit(vmap(f))``, ``vmap(jit(f))``, a ``lax.scan`` body,
``grad(f)``, ``vmap(grad(f))``, ``grad(jit(f))``, ``jit(grad(f))``. The dtype policy checked
(docs/dtype_policy.md): values are float64 in every cell; a gradient has the dtype of the
argument it is taken with respect to (float32 with x64 off, float64 with it on).

References: values and gradients of each form are compared with the eager function evaluated
at the same input in float64 (with x64 off at the float32-rounded input, since the user's own
``jit``/``vmap``/``scan`` boundary rounds a Python float to float32); that eager reference is
itself anchored to central differences for the gradient here and to independent references
(mpmath, dp_accounting, closed forms) in the other test files.

Regression: with x64 off, ``vmap(jit(f))`` and ``grad(jit(f))`` raised ``TypeError: lax.mul
requires arguments to have the same dtypes, got float64, float32``.

"""

from __future__ import annotations

import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdp.accounting as A

# Few orders, one integer and two fractional (both series paths of the sampled Gaussian),
# so that each form compiles quickly.
ORD = (2.0, 3.5, 8.0)


def _rdp_curve(x):
    # The user's own arithmetic runs in the user's dtype: with x64 off, x * 3.5 would be
    # rounded to float32 before the accountant sees it. Powers of two keep it exact. (Also
    # not x * np.asarray(...): with jax 0.10.2 an eager multiply by a NumPy float64 array
    # under x64 on, after the same multiply ran under x64 off, fails with
    # RuntimeProgramInputMismatch, a JAX issue unrelated to jaxdp.)
    return (x, 2.0 * x, 4.0 * x)


def _fn(*names):
    """The first of ``names`` that jaxdp.accounting exports (names are being renamed)."""
    for n in names:
        if hasattr(A, n):
            return n, getattr(A, n)
    raise AttributeError(names)


def _kw(fn, **kwargs):
    """Keyword arguments whose key may list alternative spellings, ``"lr|learning_rate"``."""
    params = inspect.signature(fn).parameters
    out = {}
    for key, value in kwargs.items():
        names = key.split("|")
        out[next((n for n in names if n in params), names[-1])] = value
    return out


_PNSGD_RUN = {"lipschitz": 1.0, "smoothness": 1.0, "lr|learning_rate": 0.5, "diameter": 1.0,
              "steps|num_steps|num_records": 40}


def _pnsgd_privacy(x):
    fn = A.pnsgd_privacy
    return fn(**_kw(fn, **_PNSGD_RUN, noise_std=x, delta=1e-5, positions=np.array([39.0]))).best[0]


def _calibrate_pnsgd(x):
    fn = A.calibrate_pnsgd_noise_std
    return fn(x, 1e-5, **_kw(fn, **_PNSGD_RUN, **{"position|positions": 39.0}))


_CAL_NAME, _CAL = _fn("calibrate_noise_multiplier", "calibrate_sigma")

# name -> (one-scalar-argument function returning a scalar, point x0). Points are chosen away
# from kinks (argmin switches between orders) so that derivatives are smooth there.
CASES = {
    "log_gaussian_hockey_stick": (lambda x: A.log_gaussian_hockey_stick(1.0, x), 1.3),
    "gaussian_hockey_stick": (lambda x: A.gaussian_hockey_stick(1.0, x), 1.3),
    "gaussian_hockey_stick_complement": (lambda x: A.gaussian_hockey_stick_complement(1.0, x), 1.3),
    "laplace_hockey_stick": (lambda x: A.laplace_hockey_stick(1.0, x, 1.0), 1.3),
    "step_contraction": (lambda x: A.step_contraction(x, 2.0, 1.0), 0.3),
    "log_pnsgd_contraction_delta": (lambda x: A.log_pnsgd_contraction_delta(1.0, 39, 40, 1.0, x, 0.5, 1.0), 1.3),
    "pnsgd_contraction_delta": (lambda x: A.pnsgd_contraction_delta(1.0, 39, 40, 1.0, x, 0.5, 1.0), 1.3),
    "pnsgd_contraction_epsilon": (lambda x: A.pnsgd_contraction_epsilon(1e-5, 39, 40, 1.0, x, 0.5, 1.0), 1.3),
    "pnsgd_laplace_delta": (lambda x: A.pnsgd_laplace_delta(1.0, 39, 40, 1.0, x, 0.5, 1.0), 1.3),
    "stop_pnsgd_contraction_delta": (lambda x: A.stop_pnsgd_contraction_delta(1.0, 40, 1.0, x, 0.5, 1.0), 1.3),
    "stop_pnsgd_contraction_epsilon": (lambda x: A.stop_pnsgd_contraction_epsilon(1e-5, 40, 1.0, x, 0.5, 1.0), 1.3),
    "rdp_to_epsilon": (lambda x: A.rdp_to_epsilon(_rdp_curve(x), ORD, 1e-5).epsilon, 0.13),
    "rdp_to_delta": (lambda x: A.rdp_to_delta(_rdp_curve(x), ORD, 1.0).delta, 0.13),
    _CAL_NAME: (lambda x: _CAL(x, 0.01, 1000, 1e-5, ORD)[0], 1.3),
    "dpsgd_epsilon": (lambda x: A.dpsgd_epsilon(0.01, x, 1000, 1e-5, ORD), 1.3),
    "schedule_epsilon": (lambda x: A.schedule_epsilon((0.01, 0.02), (x, 2.0 * x), (1000.0, 500.0), 1e-5, ORD), 1.3),
    "linear_rdp_epsilon": (lambda x: A.linear_rdp_epsilon(x, 1e-5), 0.13),
    "linear_rdp_delta": (lambda x: A.linear_rdp_delta(1.0, x), 0.13),
    "pnsgd_iteration_rdp": (lambda x: A.pnsgd_iteration_rdp(ORD, 1, 40, 1.0, x)[-1], 1.3),
    "skip_pnsgd_iteration_rdp": (lambda x: A.skip_pnsgd_iteration_rdp(ORD, 1, 40, 1.0, x)[-1], 1.3),
    # The harmonic form needs σ ≥ L √(2α(α−1)) ≈ 10.6 at α = 8.
    "stop_pnsgd_iteration_rdp": (lambda x: A.stop_pnsgd_iteration_rdp(ORD, 40, 1.0, x)[-1], 13.0),
    "strongly_convex_iteration_rdp": (
        lambda x: A.strongly_convex_iteration_rdp(ORD, 1, 40, 1.0, x, 0.9)[-1], 1.3),
    "pnsgd_privacy": (_pnsgd_privacy, 1.3),
    "calibrate_pnsgd_noise_std": (_calibrate_pnsgd, 1.3),
    # Strongly convex, several passes, diameter start possible: the search over starts runs.
    "pnsgd_shifted_gdp": (lambda x: A.pnsgd_shifted_gdp(7, 8, 1.0, x, 0.5, 0.5, smoothness=1.0,
                                                        strong_convexity=0.25, batch_size=2, passes=3), 1.3),
    "pnsgd_shifted_rdp": (lambda x: A.pnsgd_shifted_rdp(ORD, 7, 8, 1.0, x, 0.5, 0.5, smoothness=1.0,
                                                        batch_size=2, passes=3)[-1], 1.3),
    "shifted_contraction": (lambda x: A.shifted_contraction(0.5, 1.0, x), 0.25),
    "gaussian_rdp": (lambda x: A.gaussian_rdp(ORD, x)[-1], 1.3),
    "sampled_gaussian_rdp": (lambda x: A.sampled_gaussian_rdp(ORD, 0.02, x)[-1], 1.3),
    "heterogeneous_rdp": (lambda x: A.heterogeneous_rdp(ORD, (0.01, 0.02), (x, 2.0 * x), (100.0, 200.0))[-1], 1.3),
}

def _pnsgd_event(x):
    return A.PNSGD(lipschitz=1.0, smoothness=1.0, learning_rate=0.5, noise_std=x, diameter=1.0, num_records=40)


def _p(a, b):  # a fixed probability vector (exact in float32)
    return jnp.array([a, b])


CASES.update({
    # Event evaluations (the analysis is chosen by the event).
    "epsilon": (lambda x: A.epsilon(A.dpsgd_event(0.01, x, 1000), 1e-5, orders=ORD), 1.3),
    "delta": (lambda x: A.delta(A.dpsgd_event(0.01, x, 1000), 1.0, orders=ORD), 1.3),
    "rdp": (lambda x: A.rdp(A.SelfComposed(A.PoissonSampled(0.02, A.Gaussian(x)), 10), ORD)[-1], 1.3),
    "pnsgd_record_epsilon": (lambda x: A.pnsgd_record_epsilon(_pnsgd_event(x), 1e-5, orders=ORD)[-1], 1.3),
    "laplace_rdp": (lambda x: A.laplace_rdp(ORD, x)[-1], 1.3),
    # Trade-off curves (the RDP conversion: a bisection with its implicit derivative) and μ.
    "tradeoff": (lambda x: A.tradeoff(A.Gaussian(x), 0.05, orders=ORD), 1.3),
    "gdp_mu": (lambda x: A.gdp_mu(_pnsgd_event(x)), 1.3),
    # Classic mechanisms and theorems.
    "calibrate_laplace_scale": (lambda x: A.calibrate_laplace_scale(x, 1.0), 1.3),
    "gaussian_mechanism_delta": (lambda x: A.gaussian_mechanism_delta(1.0, x), 1.3),
    "gaussian_mechanism_epsilon": (lambda x: A.gaussian_mechanism_epsilon(1e-5, x), 1.3),
    "calibrate_gaussian_noise_multiplier": (lambda x: A.calibrate_gaussian_noise_multiplier(x, 1e-5), 1.3),
    "basic_composition": (lambda x: A.basic_composition(jnp.stack([x, 2.0 * x]), _p(0.0, 0.0))[0], 0.13),
    "advanced_composition": (lambda x: A.advanced_composition(x, 0.0, 10, 0.5**14), 0.13),
    "optimal_homogeneous_composition": (
        lambda x: A.optimal_homogeneous_composition(x, 0.0, 10, 0.5**14, max_num_steps=16), 0.13),
    "amplify_by_poisson_sampling": (lambda x: A.amplify_by_poisson_sampling(x, 0.0, 0.5**6)[0], 1.3),
    "amplify_by_sampling_without_replacement": (
        lambda x: A.amplify_by_sampling_without_replacement(x, 0.0, 10, 1000)[0], 1.3),
    "hockey_stick_divergence": (lambda x: A.hockey_stick_divergence(_p(0.25, 0.75), _p(0.5, 0.5), x), 0.13),
    "kl_divergence": (lambda x: A.kl_divergence(jnp.stack([x, 1.0 - x]), _p(0.5, 0.5)), 0.25),
    # Per-instance accounting (r is a clipped-norm ratio in [0, 1]).
    "per_instance_sampled_gaussian_rdp": (lambda x: A.per_instance_sampled_gaussian_rdp(ORD, 0.02, 1.3, x)[-1], 0.5),
    "per_instance_dpsgd_privacy": (
        lambda x: A.per_instance_dpsgd_privacy(ORD, 0.02, 1.3, jnp.stack([x] * 8), 1e-5).epsilon, 0.5),
    "individual_filter_privacy": (
        lambda x: A.individual_filter_privacy(ORD, 0.02, 1.3, jnp.stack([x] * 8), 4.0, 1e-5).rdp[-1], 0.5),
    "individual_filter_step": (
        lambda x: A.individual_filter_step(jnp.zeros(3), False, ORD, 0.02, 1.3, x, 4.0)[1][-1], 0.5),
    # DP-SBCD (x: the sensitivity S_g; the noise schedule is a fixed per-pass array).
    "dpsbcd_composition_rdp": (lambda x: A.dpsbcd_composition_rdp(ORD, (0.01, 0.02, 0.01), learning_rate=0.05,
                                                                  sensitivity=x, num_records=12, batch_size=3)[-1, -1],
                               1.3),
    # Batch schemes: fixed-size sampling with and without replacement, truncated Poisson, shuffling,
    # balls-in-bins.
    "sampled_without_replacement_rdp": (lambda x: A.sampled_without_replacement_rdp(ORD, 0.01, x)[-1], 1.3),
    "sampled_with_replacement_rdp": (lambda x: A.sampled_with_replacement_rdp(ORD, 1000, 10, x)[-1], 1.3),
    "truncated_poisson_rdp": (lambda x: A.truncated_poisson_rdp(ORD, 0.01, 1000, 20, x)[-1], 1.3),
    "shuffled_event": (lambda x: A.epsilon(A.shuffled_event(x, 3), 1e-5, orders=ORD), 1.3),
    "random_allocation_rdp": (lambda x: A.random_allocation_rdp(ORD, 50, x)[-1], 1.3),
    "balls_in_bins_event": (lambda x: A.epsilon(A.balls_in_bins_event(x, 50, 3), 1e-5, orders=ORD), 1.3),
    "random_allocation_event": (lambda x: A.epsilon(A.random_allocation_event(x, 50, 2, 3), 1e-5, orders=ORD), 1.3),
    "shuffled_lower_epsilon": (lambda x: A.shuffled_lower_epsilon(x, 100, 1, 1e-5), 1.3),
    # dp_accounting parity events (x: p = x/4 of randomized response, ρ = x/8, the tree's σ;
    # powers of two: the user's own division runs in float32 with x64 off).
    "RandomizedResponse": (lambda x: A.epsilon(A.SelfComposed(A.RandomizedResponse(x / 4.0, 3), 10), 1e-5,
                                               orders=ORD), 1.3),
    "ZCDP": (lambda x: A.epsilon(A.ZCDP(x / 8.0, 0.01), 1e-5, orders=ORD), 1.3),
    "SingleEpochTreeAggregation": (lambda x: A.epsilon(A.SingleEpochTreeAggregation(x, (16, 5)), 1e-5, orders=ORD),
                                   1.3),
    # PNSGD with Poisson batches (x: σ; the shift branch is the minimum at T = 3,000).
    "poisson_pnsgd_rdp": (lambda x: A.poisson_pnsgd_rdp(ORD, 0.01, 1.0, 0.0, 0.5, x, 1.0, 10.0, 3000,
                                                        num_records=1000)[-1], 1.3),
    "poisson_pnsgd_epsilon": (lambda x: A.poisson_pnsgd_epsilon(1e-5, 0.01, 1.0, 0.0, 0.5, x, 1.0, 10.0, 3000,
                                                                num_records=1000, orders=ORD), 1.3),
    # PNSGD with shuffled batches (x: σ; two passes, the shifted rows bind at the larger orders).
    "shuffle_pnsgd_rdp": (lambda x: A.shuffle_pnsgd_rdp(ORD, 1.0, 1.0, 0.5, x, 1.0, num_records=100, batch_size=10,
                                                        passes=2)[-1], 1.3),
    "shuffle_pnsgd_epsilon": (lambda x: A.shuffle_pnsgd_epsilon(1e-5, 1.0, 1.0, 0.5, x, 1.0, num_records=100,
                                                                batch_size=10, passes=2, orders=ORD), 1.3),
    "dpsbcd_rdp": (lambda x: A.dpsbcd_rdp(ORD, (0.01, 0.02, 0.01), learning_rate=0.05, sensitivity=x,
                                          contraction=0.97, prox_lipschitz=1.0, num_records=12, batch_size=3)[-1], 1.3),
    "dpsbcd_rdp_per_batch": (lambda x: A.dpsbcd_rdp_per_batch(ORD, (0.01, 0.02, 0.01), learning_rate=0.05,
                                                              sensitivity=x, contraction=0.97, prox_lipschitz=1.0,
                                                              num_records=12, batch_size=3)[0, -1], 1.3),
    "dpsbcd_epsilon": (lambda x: A.dpsbcd_epsilon(1e-5, (0.01, 0.02, 0.01), learning_rate=0.05, sensitivity=x,
                                                  contraction=0.97, prox_lipschitz=1.0, num_records=12, batch_size=3,
                                                  orders=ORD), 0.13),
})
# Not accountants: event constructors and helpers, the samplers (they keep the user's dtype,
# tested in test_mechanisms.py), and a function of static orders returning NumPy.
# The PLD functions (pld_epsilon, pld_delta, pld_bracket, calibrate_pld_noise_multiplier) are
# tested under jit, vmap and grad in test_pld.py with their own tolerances: their forms agree
# to ~1e-10 (not 1e-12: the read-out's log amplifies last-bit differences of the FFT sums)
# and their derivative matches central differences to ~1e-4 (the grid moves with σ).
NOT_ACCOUNTANTS = {"pld_epsilon", "pld_delta", "pld_bracket", "calibrate_pld_noise_multiplier",
                   "dpsgd_event", "relation_of", "register_accountant", "laplace_mechanism", "gaussian_mechanism",
                   "per_instance_composition_orders"}
NAMES = list(CASES)

# Values: after the argument has crossed the user's boundary, the body runs in float64 in
# every form; forms differ only by XLA's fusion and reassociation choices (a few ulp,
# amplified by at most a few orders of magnitude in the log-space sums and the bisections).
RTOL_VALUE = 1e-12
# Gradients with x64 off are float32 (the argument's dtype): the float64 gradient rounded
# once, 2^-24 relative, plus the ulps of the float64 computation. Two float32 ulps.
RTOL_GRAD_X32 = 2.0**-23
RTOL_GRAD_X64 = 1e-12
# Central differences in float64 with h = 1e-5·x: truncation O(h²·f‴/f′) ≈ 1e-10 and
# rounding ≈ 1e-16/h ≈ 1e-11 relative. Against a float32 gradient: its 2 ulps plus 1e-8.
RTOL_FD = 1e-8
RTOL_GRAD_X32_FD = RTOL_GRAD_X32 + RTOL_FD


def _round(x, x64: bool) -> float:
    """The value a Python float ``x`` takes after crossing a JAX boundary in that mode."""
    return float(x) if x64 else float(np.float32(x))


def _points(name) -> np.ndarray:
    x0 = CASES[name][1]
    return np.array([x0, 1.25 * x0])


_CACHE: dict = {}


def _cached(key, compute):
    if key not in _CACHE:
        _CACHE[key] = compute()
    return _CACHE[key]


def _value(name, x: float) -> float:
    """Eager float64 value (x64 on: no rounding anywhere)."""
    def compute():
        with jax.enable_x64(True):
            return float(CASES[name][0](float(x)))
    return _cached(("value", name, x), compute)


def _fd(name, x: float) -> float:
    """Central difference of the eager float64 function: the independent gradient reference."""
    h = 1e-5 * x
    return (_value(name, x + h) - _value(name, x - h)) / (2 * h)


def _grad(name, x: float) -> float:
    """Eager float64 gradient (x64 on)."""
    def compute():
        with jax.enable_x64(True):
            return float(jax.grad(CASES[name][0])(float(x)))
    return _cached(("grad", name, x), compute)


def _jitted(name, x64):
    """One ``jit(f)`` per accountant and mode, shared by the forms (traced once)."""
    return _cached(("jit", name, x64), lambda: jax.jit(CASES[name][0]))


def _forms(name, x64):
    """The transformation matrix: form -> (callable of a 1-D array of points, is_gradient)."""
    f = CASES[name][0]
    jf = _jitted(name, x64)

    def each(g):
        return lambda xs: jnp.stack([g(float(x)) for x in xs])

    def scan(xs):
        return jax.lax.scan(lambda c, x: (c, f(x)), 0.0, jnp.asarray(xs))[1]

    return {
        "f": (each(f), False),
        "jit": (each(jf), False),
        "vmap": (lambda xs: jax.vmap(f)(jnp.asarray(xs)), False),
        "jit_vmap": (lambda xs: jax.jit(jax.vmap(f))(jnp.asarray(xs)), False),
        "vmap_jit": (lambda xs: jax.vmap(jf)(jnp.asarray(xs)), False),
        "scan": (scan, False),
        "grad": (each(jax.grad(f)), True),
        "vmap_grad": (lambda xs: jax.vmap(jax.grad(f))(jnp.asarray(xs)), True),
        "grad_jit": (each(jax.grad(jf)), True),
        "jit_grad": (each(jax.jit(jax.grad(f))), True),
    }


FORMS = ("f", "jit", "vmap", "jit_vmap", "vmap_jit", "scan", "grad", "vmap_grad", "grad_jit", "jit_grad")


def _check_cell(name, form, x64, grad_reference="eager"):
    run, is_grad = _forms(name, x64)[form]
    xs = _points(name)
    # An eager Python float is not rounded; everything that crosses a JAX boundary is.
    seen = [float(x) if form == "f" else _round(x, x64) for x in xs]
    with jax.enable_x64(x64):
        out = run(xs)
    if not is_grad:
        assert out.dtype == jnp.float64, (name, form, out.dtype)
        np.testing.assert_allclose(np.asarray(out), [_value(name, x) for x in seen], rtol=RTOL_VALUE, atol=0)
        return
    assert out.dtype == (jnp.float64 if x64 else jnp.float32), (name, form, out.dtype)
    if grad_reference == "fd":
        want, rtol = [_fd(name, x) for x in seen], (RTOL_FD if x64 else RTOL_GRAD_X32_FD)
    else:
        want, rtol = [_grad(name, x) for x in seen], (RTOL_GRAD_X64 if x64 else RTOL_GRAD_X32)
    np.testing.assert_allclose(np.asarray(out, dtype=np.float64), want, rtol=rtol, atol=1e-300)


@pytest.mark.parametrize("name", NAMES)
def test_vmap_jit_and_grad_jit_with_x64_off(name):
    """Every accountant with x64 off in one program that batches its jitted value and gradient,
    ``vmap(value_and_grad(jit f))`` (the cells vmap(jit f) and grad(jit f) used to raise), against
    the eager float64 values and central differences (the eager float64 gradient would cost one
    more compilation per accountant). One program instead of the two cells' programs: ~30 % of
    this test's compilation (session 17); JAXDP_SLOW=1 runs both cells separately (test_all_cells)."""
    xs = _points(name)
    seen = [_round(x, False) for x in xs]
    with jax.enable_x64(False):
        value, grad = jax.vmap(jax.value_and_grad(_jitted(name, False)))(jnp.asarray(xs))
    assert value.dtype == jnp.float64 and grad.dtype == jnp.float32, (name, value.dtype, grad.dtype)
    np.testing.assert_allclose(np.asarray(value), [_value(name, x) for x in seen], rtol=RTOL_VALUE, atol=0)
    np.testing.assert_allclose(np.asarray(grad, dtype=np.float64), [_fd(name, x) for x in seen],
                               rtol=RTOL_GRAD_X32_FD, atol=1e-300)


# Every cell, both modes, for a representative accountant of each mechanism that compiles
# quickly: the hockey-stick's own custom_jvp, a NamedTuple output with a min over orders, an
# array output over orders, a closed form. The rest (the sampled Gaussian's gathers, the
# bisections, the PNSGD analyses) take minutes of compilation: JAXDP_SLOW=1 pytest -m slow.
REPRESENTATIVE = ("gaussian_hockey_stick", "rdp_to_epsilon", "pnsgd_iteration_rdp", "linear_rdp_epsilon")


@pytest.mark.parametrize("x64", [False, True], ids=["x64_off", "x64_on"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_representative_cells(name, form, x64):
    _check_cell(name, form, x64)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("JAXDP_SLOW"), reason="exhaustive matrix (minutes); set JAXDP_SLOW=1")
@pytest.mark.parametrize("x64", [False, True], ids=["x64_off", "x64_on"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", [n for n in NAMES if n not in REPRESENTATIVE])
def test_all_cells(name, form, x64):
    _check_cell(name, form, x64)


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_eager_gradient_matches_central_differences(name):
    """Anchors the eager gradient used as the reference above to an independent estimate."""
    for x in _points(name):
        assert _grad(name, float(x)) == pytest.approx(_fd(name, float(x)), rel=RTOL_FD, abs=1e-12)


def test_every_public_accountant_is_in_the_matrix():
    public = {n for n in A.__all__ if inspect.isfunction(getattr(A, n))} - NOT_ACCOUNTANTS
    assert public - set(CASES) == set(), "add these to CASES"


def test_float32_boundary_caveat():
    """With x64 off, the user's jit rounds a Python float argument to float32 before we see it."""
    f = CASES["dpsgd_epsilon"][0]
    with jax.enable_x64(False):
        eager = float(f(1.3))
        jitted = float(jax.jit(f)(1.3))
        closed = float(jax.jit(lambda: f(1.3))())  # a constant inside the user's jit is not rounded
    with jax.enable_x64(True):
        at_rounded = float(f(_round(1.3, False)))
    assert jitted == pytest.approx(at_rounded, rel=RTOL_VALUE)
    assert closed == pytest.approx(eager, rel=RTOL_VALUE)
    assert abs(jitted - eager) > 1e-9 * eager  # the rounding is visible: 1.3 is not a float32


def test_static_arguments_pass_through_under_transformations():
    """Strings, tuples of orders and concrete numbers stay untouched; eager validation still raises."""
    def eps(c, delta=1e-5, method="classic"):
        return A.rdp_to_epsilon(_rdp_curve(c), ORD, delta, method=method).epsilon

    with jax.enable_x64(False):
        out = jax.vmap(jax.jit(eps))(jnp.array([0.125, 0.25]))
        assert out.dtype == jnp.float64
        # Classic conversion (Mironov 2017, Prop. 3) of the curve c·(1, 2, 4): min over α of ρ(α) + log(1/δ)/(α − 1).
        want = [min(c * r + np.log(1e5) / (a - 1) for a, r in zip(ORD, (1, 2, 4))) for c in (0.125, 0.25)]
        np.testing.assert_allclose(np.asarray(out), want, rtol=RTOL_VALUE)
        with pytest.raises(ValueError, match="method"):
            jax.jit(lambda c: eps(c, method="nope"))(0.125)
        with pytest.raises(ValueError, match="delta"):
            jax.vmap(lambda c: eps(c, delta=2.0))(jnp.array([0.125, 0.25]))
        # Invalid traced values give NaN, never a finite ε.
        bad = jax.vmap(jax.jit(lambda d: eps(0.125, delta=d)))(jnp.array([1e-5, 2.0]))
        assert np.isfinite(bad[0]) and np.isnan(bad[1])


def test_deeper_compositions_with_x64_off():
    """vmap(vmap(jit f)), jit(vmap(vmap(jit f))), jit(vmap(grad f)), grad of a sum over jit(vmap f)."""
    name = "gaussian_hockey_stick"
    f = CASES[name][0]
    xs = np.array([[1.25, 1.5], [2.0, 3.0]])  # float32-representable
    with jax.enable_x64(False):
        v1 = jax.vmap(jax.vmap(jax.jit(f)))(jnp.asarray(xs))
        v2 = jax.jit(jax.vmap(jax.vmap(jax.jit(f))))(jnp.asarray(xs))
        g1 = jax.jit(jax.vmap(jax.grad(f)))(jnp.asarray(xs[1]))
        # (Indexing, not jnp.sum: a user's jnp reduction with x64 off casts our float64 to float32.)
        g2 = jax.grad(lambda v: jax.jit(jax.vmap(f))(v)[1])(jnp.asarray(xs[1]))[1:]
    assert v1.dtype == v2.dtype == jnp.float64 and g1.dtype == g2.dtype == jnp.float32
    val = np.array([[_value(name, float(x)) for x in row] for row in xs])
    np.testing.assert_allclose(np.asarray(v1), val, rtol=RTOL_VALUE)
    np.testing.assert_allclose(np.asarray(v2), val, rtol=RTOL_VALUE)
    fd = [_fd(name, float(x)) for x in xs[1]]
    np.testing.assert_allclose(np.asarray(g1, np.float64), fd, rtol=RTOL_GRAD_X32_FD)
    np.testing.assert_allclose(np.asarray(g2, np.float64), fd[1:], rtol=RTOL_GRAD_X32_FD)


# A guarded function built like the PLD accountant (its FFTs and comparisons are float64
# only inside the scope; its custom JVP returns partials times tangents, as _pld._one's),
# small enough to compile in well under a second.
_TOY_BASE = np.linspace(0.5, 2.0, 16)


def _toy_value(s):
    r = jnp.fft.irfft(jnp.fft.rfft(jnp.exp(-s * _TOY_BASE)) ** 2, 16)  # a circular self-convolution
    return jnp.log(jnp.sum(jnp.where(r > 1e-3, r, 0.0)))


@jax.custom_jvp
def _toy_partials(s):
    return _toy_value(s)


@_toy_partials.defjvp
def _toy_partials_jvp(primals, tangents):
    (s,), (t,) = primals, tangents
    return _toy_value(s), jax.jacfwd(_toy_value)(s) * t


def test_vmap_outside_a_jitted_derivative_with_x64_off():
    """Regression (close15): with x64 off, vmap(grad(jit f)), vmap(jit(grad f)) and vmap(jvp(jit f))
    of a guarded function whose program holds FFTs and float64 comparisons raised ``TypeError:
    lax.gt requires arguments to have the same dtypes``: the derivative's program, traced in the
    float64 scope, was batched outside it. Against the x64-on gradient and central differences;
    the PLD accountant's own forms are test_pld's (slow: seconds of compilation each)."""
    from jaxdp._numerics import f64, float64

    toy = float64(lambda s: _toy_partials(f64(s)))
    xs = np.array([0.5, 1.5], np.float32)
    with jax.enable_x64(True):
        want = [float(jax.grad(toy)(float(x))) for x in xs]
        h = 1e-5
        fd = [(float(toy(float(x) + h)) - float(toy(float(x) - h))) / (2 * h) for x in xs]
    np.testing.assert_allclose(want, fd, rtol=1e-8)
    f = CASES["gaussian_hockey_stick"][0]
    with jax.enable_x64(False):
        got = {
            "vmap(grad(jit))": jax.vmap(jax.grad(jax.jit(toy)))(jnp.asarray(xs)),
            "vmap(jit(grad))": jax.vmap(jax.jit(jax.grad(toy)))(jnp.asarray(xs)),
            "vmap(jvp(jit))": jax.vmap(lambda s: jax.jvp(jax.jit(toy), (s,), (jnp.ones_like(s),))[1])(jnp.asarray(xs)),
        }
        hs = jax.vmap(jax.grad(jax.jit(f)))(jnp.asarray(_points("gaussian_hockey_stick")))
    for form, g in got.items():
        assert g.dtype == (jnp.float64 if form.startswith("vmap(jvp") else jnp.float32), form
        np.testing.assert_allclose(np.asarray(g, np.float64), want, rtol=RTOL_GRAD_X32, err_msg=form)
    seen = [_round(x, False) for x in _points("gaussian_hockey_stick")]
    np.testing.assert_allclose(np.asarray(hs, np.float64), [_grad("gaussian_hockey_stick", x) for x in seen],
                               rtol=RTOL_GRAD_X32)


def test_numerics_where_against_numpy():
    """``_numerics.where`` (jnp.where without its jit wrapper, session 20) against NumPy's where:
    broadcasting, Python numbers, a scalar condition, float32 and float64; under jit and vmap; its
    gradient against the select's closed form; operands it leaves to jnp.where (ints, weak types)."""
    from jaxdp._numerics import where

    rng = np.random.default_rng(0)
    x4, y31 = rng.normal(size=4), rng.normal(size=(3, 1))
    c34 = rng.normal(size=(3, 4)) > 0
    cases = [(c34, x4, y31), (c34, x4, 0.5), (c34, -1.0, y31), (np.bool_(True), x4, y31), (x4 > 0, x4, -np.inf)]
    for dtype in (np.float32, np.float64):
        with jax.enable_x64(dtype == np.float64):
            for c, x, y in cases:
                args = [jnp.asarray(c)] + [v if type(v) is float else jnp.asarray(v, dtype) for v in (x, y)]
                want = np.where(c, *[v if type(v) is float else np.asarray(v, dtype) for v in (x, y)])
                for got in (where(*args), jax.jit(where)(*args)):
                    assert got.dtype == dtype and got.shape == want.shape
                    np.testing.assert_array_equal(np.asarray(got), want)
            xs = jnp.asarray(rng.normal(size=(5, 4)), dtype)
            np.testing.assert_array_equal(np.asarray(jax.vmap(lambda v: where(v > 0, v, 0.0))(xs)),
                                          np.where(np.asarray(xs) > 0, np.asarray(xs), 0.0))
            g = jax.grad(lambda v: jnp.sum(where(v > 0, v * v, 3.0 * v)))(xs[0])
            np.testing.assert_allclose(np.asarray(g), np.where(np.asarray(xs[0]) > 0, 2 * np.asarray(xs[0]), 3.0),
                                       rtol=1e-6)
    # Left to jnp.where: integer operands, both Python numbers.
    np.testing.assert_array_equal(np.asarray(where(jnp.asarray(c34), jnp.arange(4), 7)), np.where(c34, np.arange(4), 7))
    assert float(where(jnp.asarray(True), 1.0, 2.0)) == 1.0
