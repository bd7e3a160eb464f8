"""The two-stage PLD upper bound (``stages=2``, _pld_stages.py) against independent references.

References: the closed form of the k-fold Gaussian (μ = √k/σ, mpmath) at several grid sizes
(never below it), dp_accounting's PLD (never below its optimistic estimate; close to its
pessimistic one at value step 1e-4). Small sizes: one compiled program per event structure.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxdp.accounting as A

from .test_pld import EXACT_CASES, _exact_gauss_delta, _exact_gauss_epsilon

SMALL = 2**12


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _check_exact(n, fallback="none"):
    sig = np.array([c[0] for c in EXACT_CASES])
    k = np.array([c[1] for c in EXACT_CASES], dtype=float)
    mu = np.sqrt(k) / sig
    deltas = np.array([_exact_gauss_delta(c[3], m) if c[3] is not None else c[2] for c, m in zip(EXACT_CASES, mu)])
    exact = np.array([_exact_gauss_epsilon(d, m) for d, m in zip(deltas, mu)])
    ev = A.SelfComposed(A.Gaussian(sig), k)
    up = np.asarray(A.epsilon(ev, deltas, accountant="pld", grid_size=n, stages=2, fallback=fallback))
    assert np.all(up >= exact), (n, up, exact)
    d_up = np.asarray(A.delta(ev, exact, accountant="pld", grid_size=n, stages=2))
    assert np.all(d_up >= deltas * (1 - 1e-12)), (n, d_up, deltas)
    return up, exact


def test_two_stage_never_below_closed_form():
    up, exact = _check_exact(SMALL)
    # Tight too at δ ≤ 1e-5: within 1e-3 relative of the exact ε at 2^12 bins. (At δ = 0.127,
    # 3 steps, it is 5.5% above: there the tilt is small and the blocks' round-off margins
    # far above it inflate stage 2's Chernoff tail bound; known, docs/pld.md.)
    np.testing.assert_array_less(up[1:] / exact[1:] - 1.0, 1e-3)
    assert up[0] / exact[0] - 1.0 < 0.1


@pytest.mark.slow
def test_two_stage_never_below_closed_form_every_grid_size():
    # (At the smallest grids the two-stage grid cannot certify δ = 1e-10 for one Gaussian step:
    # +inf there, so the RDP fallback answers; still never below the closed form.)
    for p in range(10, 21):
        _check_exact(2**p, fallback="rdp")


@pytest.mark.slow
def test_two_stage_dpsgd_against_dp_accounting_and_single_stage():
    from dp_accounting.pld import privacy_loss_distribution as pldlib

    cfg = [(0.001, 1.0, 10000), (256 / 60000, 1.1, 14063)]
    q, s, t = (np.array(x, dtype=float) for x in zip(*cfg))
    ev = A.dpsgd_event(q, s, t)
    two = np.asarray(A.epsilon(ev, 1e-5, accountant="pld", stages=2))
    one = np.asarray(A.epsilon(ev, 1e-5, accountant="pld"))
    for i, (qi, si, ti) in enumerate(cfg):
        kw = dict(sampling_prob=qi, value_discretization_interval=1e-4)
        opt = pldlib.from_gaussian_mechanism(si, pessimistic_estimate=False, use_connect_dots=False,
                                             **kw).self_compose(int(ti)).get_epsilon_for_delta(1e-5)
        pess = pldlib.from_gaussian_mechanism(si, **kw).self_compose(int(ti)).get_epsilon_for_delta(1e-5)
        # At the 24,576-bin default (s21) one stage is as tight as two on the first configuration
        # (0.475839 against 0.475848): two stages need only be no looser than 1e-4 relative.
        assert opt <= two[i] <= one[i] * (1 + 1e-4), (cfg[i], opt, two[i], one[i])
        assert two[i] <= pess * (1 + 1e-3), (cfg[i], two[i], pess)


def test_two_stage_validation():
    with pytest.raises(ValueError, match="stages"):
        A.epsilon(A.Gaussian(1.0), 1e-5, accountant="pld", stages=3)


# Known defect: under the test suite's XLA_FLAGS (--xla_backend_optimization_level=0) the
# jitted forward-mode partials of the two-stage program are NaN, and the PLD's jvp rule sets
# non-finite partials to 0; with the default XLA flags the gradient is right (-1.392 against
# the central difference -1.389). Not yet bisected.
@pytest.mark.xfail(strict=False, reason="NaN forward partials at XLA optimization level 0")
def test_two_stage_grad():
    f = lambda s: A.epsilon(A.dpsgd_event(0.01, s, 1000), 1e-5, accountant="pld", grid_size=SMALL,  # noqa: E731
                            stages=2)
    g = float(jax.grad(f)(1.3))
    h = 1e-4
    fd = (float(f(1.3 + h)) - float(f(1.3 - h))) / (2 * h)
    # The plan (spacings, windows, number of blocks) moves with σ: ε is smooth only up to
    # small steps, so the finite difference agrees to 1%.
    assert g < 0 and abs(g - fd) <= 1e-2 * abs(fd), (g, fd)
