"""Acceptance: the audit catches a weakened mechanism and stays below honest claims.

Fixed keys make each statistical check deterministic; the lower bounds hold with 95 %
confidence, so an honest claim is exceeded with probability at most 5 % per key.
"""

import jax
import numpy as np
import pytest

import jaxdp.accounting as A
from jaxdp import audit

RUNS = 20_000


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def test_weakened_gaussian_is_caught():
    # The accountant claims ε for σ = 2; the mechanism adds σ/2 = 1 (noise halved).
    delta = 1e-3
    claimed = float(A.gaussian_mechanism_epsilon(delta, 2.0))
    s_in, s_out = audit.gaussian_scores(1.0, RUNS, key=jax.random.key(7))
    lower = float(audit.epsilon_lower_bound(s_in, s_out, delta).epsilon)
    assert lower > claimed * 1.2, (lower, claimed)


def test_honest_gaussian_stays_below_claim():
    res = audit.audit_gaussian(1.0, 1e-3, runs=RUNS, key=jax.random.key(8))
    assert 0.4 * res.claimed_epsilon < res.lower_bound <= res.claimed_epsilon
    assert res.ratio == pytest.approx(res.lower_bound / res.claimed_epsilon)


def test_pnsgd_positions_amplified_and_below_composition():
    # Fast check (the accountant's per-record ε takes long to compile; see the slow test
    # below): one pass, batch 1, so every record's exact unamplified ε is that of one
    # Gaussian step with noise multiplier nu; the audit stays below it and the last record
    # audits higher than the first (amplification by the later noisy, projected steps).
    nu, delta = 0.5, 1e-3
    s_in, s_out = audit.pnsgd_scores([1, 6], 6, 0.5, nu, 1.0, 1.0, RUNS, key=jax.random.key(3))
    lower = [float(audit.epsilon_lower_bound(a, b, delta).epsilon) for a, b in zip(s_in, s_out)]
    composition = float(A.gaussian_mechanism_epsilon(delta, nu))
    assert lower[1] > lower[0] + 0.5, lower
    assert max(lower) <= composition


@pytest.mark.slow  # compiles pnsgd_record_epsilon (~50 s); the fast test above covers the driver
def test_pnsgd_per_position_below_reported_and_amplified():
    res = audit.audit_pnsgd([1, 3, 6], 6, 0.5, 0.5, 1.0, 1.0, 1e-3, runs=RUNS, key=jax.random.key(3))
    assert np.all(res.lower_bound <= res.claimed_epsilon), res
    assert np.all(np.diff(res.lower_bound) > 0), res  # later records audit higher
    assert np.all(np.diff(res.claimed_epsilon) > 0)


def test_dpsgd_one_run_below_exact_gaussian():
    # q = 1, one step: each canary's release is a Gaussian mechanism with noise multiplier 1,
    # whose exact ε (below the RDP claim of dpsgd_epsilon) bounds the audit.
    scores, included = audit.dpsgd_one_run_scores(1.0, 1.0, 1, 1000, key=jax.random.key(0))
    lower = float(audit.one_run_audit(scores, included, 1e-5).epsilon)
    assert 0.5 < lower <= float(A.gaussian_mechanism_epsilon(1e-5, 1.0))


@pytest.mark.slow  # compiles dpsgd_epsilon; the pieces are covered above and in test_one_run.py
def test_dpsgd_audits_below_claim():
    res = audit.audit_dpsgd_one_run(1.0, 1.0, 1, 1e-5, num_canaries=1000, key=jax.random.key(0))
    assert 0 < res.lower_bound <= res.claimed_epsilon
    res = audit.audit_dpsgd(0.5, 1.0, 4, 1e-5, runs=RUNS, key=jax.random.key(0))
    assert 0 < res.lower_bound <= res.claimed_epsilon


def test_default_key_is_fresh_entropy():
    a, _ = audit.gaussian_scores(1.0, 4)
    b, _ = audit.gaussian_scores(1.0, 4)
    assert not np.array_equal(np.asarray(a), np.asarray(b))
