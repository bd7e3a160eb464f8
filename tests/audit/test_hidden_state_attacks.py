"""Hidden-state attacks (issue 24): crafted gradients audit PNSGD tighter, never above a claim;
a non-convex loss leaks through the last iterate what composition allows.

References are independent of the audited code: the claims are jaxdp's accountants, checked
against mpmath and dp_accounting elsewhere; the per-record bounds used here are closed
forms of one Gaussian step (composition) and shifted interpolation's μ = r/√(n − j + 1)
(c = 1, τ = 0: Bok, Su & Altschuler 2024), evaluated with the exact GDP → (ε, δ) curve.
Fixed keys make each statistical check deterministic; the lower bounds hold with 95 %
confidence, so an honest claim is exceeded with probability at most 5 % per key.
Smoke sizes: 20,000 runs per side (seconds); full figures: benchmarks/hidden_state_audits.py.
"""

import math

import jax
import numpy as np
import pytest

import jaxdp.accounting as A
from jaxdp import audit

RUNS = 20_000
DELTA = 1e-3


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _lower(s_in, s_out):
    return [float(audit.epsilon_lower_bound(a, b, DELTA).epsilon) for a, b in zip(s_in, s_out)]


def test_boundary_attack_beats_the_zero_canary_and_stays_below_the_claim():
    # README setting: n = 6, η = 0.5, ν = 0.5 (noise 2Cν = 1), C = 1, R = 1; the last record's
    # claim is one Gaussian step with ratio r = 2C/(2Cν) = 2 (no later step to amplify it).
    key = jax.random.key(5)
    zero = _lower(*audit.pnsgd_scores([3, 6], 6, 0.5, 0.5, 1.0, 1.0, RUNS, attack="zero", key=key))
    boundary = _lower(*audit.pnsgd_scores([3, 6], 6, 0.5, 0.5, 1.0, 1.0, RUNS, attack="boundary", key=key))
    claim_last = float(A.gaussian_mechanism_epsilon(DELTA, 0.5))
    assert boundary[0] > 1.3 * zero[0], (boundary, zero)
    assert boundary[1] > zero[1], (boundary, zero)
    assert max(boundary) <= claim_last
    # Position 3 of 6: shifted interpolation's per-record μ = 2/√4 (c = 1, τ = 0) bounds it.
    assert boundary[0] <= float(A.gaussian_mechanism_epsilon(DELTA, math.sqrt(4) / 2))


def test_nonconvex_loss_leaks_more_than_the_convex_hidden_state_bound():
    # n = 20, record at position 1, R = 3: the convex analysis would give μ = 2/√20; composition
    # (every iterate released) μ = 2. The audit of the last iterate lands in between.
    s_in, s_out = audit.pnsgd_scores([1], 20, 0.5, 0.5, 1.0, 3.0, RUNS, attack="nonconvex", key=jax.random.key(2))
    lower = _lower(s_in, s_out)[0]
    convex = float(A.gaussian_mechanism_epsilon(DELTA, math.sqrt(20) / 2))
    composition = float(A.gaussian_mechanism_epsilon(DELTA, 0.5))
    assert convex < lower < composition, (convex, lower, composition)
    # The same run with convex (zero) records after the canary stays below the convex bound.
    z_in, z_out = audit.pnsgd_scores([1], 20, 0.5, 0.5, 1.0, 3.0, RUNS, attack="zero", key=jax.random.key(2))
    assert _lower(z_in, z_out)[0] <= convex


def test_dpsgd_canary_at_chosen_steps():
    # q = 1: the final model's canary coordinate is k·C + N(0, Tσ²C²) for a canary at k of T
    # steps, a Gaussian mechanism with ratio k/(σ√T): every step (k = T = 4) ratio 2, the last
    # step only ratio 1/2. Each exact ε bounds its audit, and the every-step audit is stronger.
    every = audit.dpsgd_scores(1.0, 1.0, 4, RUNS, key=jax.random.key(4))
    last = audit.dpsgd_scores(1.0, 1.0, 4, RUNS, canary_steps=[3], key=jax.random.key(4))
    lo_every, lo_last = _lower([every[0]], [every[1]])[0], _lower([last[0]], [last[1]])[0]
    assert lo_every <= float(A.gaussian_mechanism_epsilon(DELTA, 0.5))
    assert lo_last <= float(A.gaussian_mechanism_epsilon(DELTA, 2.0))
    assert lo_every > lo_last + 1.0


def test_bad_attack_options():
    with pytest.raises(ValueError, match="attack"):
        audit.pnsgd_scores([1], 6, 0.5, 0.5, 1.0, 1.0, 4, attack="worst")
    with pytest.raises(ValueError, match="canary_steps"):
        audit.dpsgd_scores(0.5, 1.0, 4, 4, canary_steps=[4])
