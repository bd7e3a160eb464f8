"""PNSGDMechanism(sampling="poisson"): the batches, the step, the contraction check, the ledger's event, resume.

Small runs (40 records, logistic regression, L = √2, β = 1/2 on unit rows): uncut Poisson
batches keep ηβ(n+1)/b ≤ 2 at η = 0.5, b = 8, and compile the accountant quickly. The
hidden-state bound itself is checked against the exact process in
``tests/accounting/test_pnsgd_poisson.py``; here the run is checked to be the process that
bound describes, and the report to be that bound at the run's constants, written out by hand.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdp.accounting import PNSGD, poisson_pnsgd_epsilon, sampled_gaussian_rdp
from jaxdp.data import from_arrays
from jaxdp.models import LogisticRegression
from jaxdp.training import PNSGDMechanism, RunOptions, pnsgd, samplers, train

QUIET = RunOptions(progress=False)
N, B_EXP, ETA, R = 40, 8, 0.5, 1.0
L, BETA = math.sqrt(2.0), 0.5  # LogisticRegression's constants on unit rows (bias included)


def _data(n=N):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 5))
    return from_arrays(x, (x[:, 0] > 0).astype(np.int32), test_fraction=0.0)


def _model():
    return LogisticRegression(5, rngs=nnx.Rngs(0))


def _mech(**kw):
    base = dict(learning_rate=ETA, radius=R, noise_multiplier=1.0, batch_size=B_EXP, passes=2, sampling="poisson")
    return PNSGDMechanism(**{**base, **kw})


def _params(tree):
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


# ---------------------------------------------------------------------------------------
# Construction: one-line refusals
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(sampling="random"), "sampling must be one of"),
    (dict(sampling="sequential", max_batch_size=16), "max_batch_size is a field of sampling='poisson' only"),
    (dict(schedule="random_stop", passes=1), "not available with sampling='poisson'"),
    (dict(max_batch_size=0), "max_batch_size must be an integer >= 1"),
    # ηβB/b = 1 · 1 · 40/8 = 5 > 2, known at construction once smoothness is declared.
    (dict(learning_rate=1.0, lipschitz=1.0, smoothness=1.0, max_batch_size=40),
     r"learning_rate must be at most 2\*batch_size/\(smoothness\*B\) = 0.4 with Poisson batches"),
])
def test_poisson_configurations_are_refused_in_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as err:
        _mech(**kw)
    assert "\n" not in str(err.value)


def test_the_contraction_is_checked_with_the_models_smoothness_when_training_starts():
    # Uncut batches: B = n + 1 = 41, ηβB/b = 1 · 0.5 · 41/8 = 2.56 > 2.
    with pytest.raises(ValueError, match=r"eta\*beta\*B/b <= 2, B = N \+ 1 \(uncut Poisson batches; set max_batch_size"):
        train(_model(), _data(), _mech(learning_rate=1.0), noise_seed=0, options=QUIET)


# ---------------------------------------------------------------------------------------
# The run is the process of the analysis: sampler batches, the fixed denominator b, PNSGD's noise
# ---------------------------------------------------------------------------------------


def test_steps_are_the_samplers_batches_summed_over_b_then_pnsgd():
    ds, cap = _data(), 12
    res = train(_model(), ds, _mech(max_batch_size=cap, passes=1), noise_seed=5,
                options=RunOptions(progress=False, account=False))
    # The same steps by hand, from the public pieces: the secret key split as (noise, batches).
    k_noise, k_sample = jax.random.split(jax.random.key(5))
    sampler = samplers.TruncatedPoisson(max_batch_size=cap).bind(N, B_EXP)
    tx = pnsgd(ETA, 1.0, L, R, k_noise, batch_size=B_EXP)
    model = _model()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x, y = jnp.asarray(ds.x_train, jnp.float32), jnp.asarray(ds.y_train)

    def loss_sum(p, xb, yb, mask):
        return jnp.sum(jnp.where(mask, nnx.merge(graphdef, p, rest).loss(xb, yb), 0.0))

    state, key, sizes = tx.init(params), k_sample, []
    for t in range(sampler.steps_per_pass):
        key, idx, size = sampler.sample(key, t)
        sizes.append(int(size))
        g = jax.grad(loss_sum)(params, x[idx], y[idx], jnp.arange(idx.shape[0]) < size)
        g = jax.tree.map(lambda a: a / B_EXP, g)  # the fixed b, not the realised batch
        upd, state = tx.update(g, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, upd)
    assert res.ledger.steps_done == sampler.steps_per_pass == 5 and len(set(sizes)) > 1
    for a, b in zip(_params(res.state.params), _params(params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------
# The report: the Poisson event's bound at the run's constants, target_epsilon, assumptions first
# ---------------------------------------------------------------------------------------


def _expected_epsilon(nu, steps):
    """The accountant at the run's constants written out: q = b/n, σ = ν·2C/b (C = L), D = 2R."""
    return float(poisson_pnsgd_epsilon(1e-5, B_EXP / N, L, BETA, ETA, nu * 2.0 * L / B_EXP, 2.0 * R, float(B_EXP),
                                       steps, num_records=N))


@pytest.fixture(scope="module")
def three_passes():
    return train(_model(), _data(), _mech(passes=3), noise_seed=1, options=QUIET)


def test_the_report_is_the_poisson_events_hidden_state_bound(three_passes):
    res, steps = three_passes, 3 * math.ceil(N / B_EXP)
    assert res.privacy.analysis == "hidden-state" and res.privacy.steps_done == steps
    assert res.privacy.summary()["worst"] == pytest.approx(_expected_epsilon(1.0, steps), rel=1e-9)
    ev = res.ledger.event()
    assert isinstance(ev, PNSGD) and (ev.sampling, ev.relation, ev.num_steps, ev.max_batch_size) == (
        "poisson", "add_remove", steps, None)
    # Mid-run (the progress bar's and history's numbers): the bound after the steps done so far.
    assert res.history[0][0] == steps


def test_target_epsilon_calibrates_the_poisson_hidden_state_bound():
    res = train(_model(), _data(), _mech(noise_multiplier=None, target_epsilon=2.0, passes=3), noise_seed=1,
                options=QUIET)
    worst = res.privacy.summary()["worst"]
    assert 0.98 * 2.0 <= worst <= 2.0 and res.privacy.analysis == "hidden-state"
    assert worst == pytest.approx(_expected_epsilon(res.mechanism.noise_multiplier, 3 * math.ceil(N / B_EXP)),
                                  rel=1e-9)


def test_the_report_leads_with_the_hidden_state_assumptions_and_the_plateau(three_passes):
    rep = three_passes.privacy
    lines = rep.table().splitlines()
    assert lines[0].startswith("NOT PRIVATE")  # the fixed noise_seed of the test, then the guarantee
    first = lines[1]
    assert first.startswith("hidden state, Poisson batches: epsilon of the final iterate only")
    for part in ("convex", "L=1.414", "beta=0.5", "D=2", "secret Poisson sample", "flat after the burn-in"):
        assert part in first, part
    assert "secret Poisson batches (q=0.2" in rep.reason and "add/remove" in rep.reason
    assert np.all(rep.epsilon == rep.epsilon[0])  # every record alike


def test_composition_without_convexity_and_never_below_the_sampled_gaussian():
    # Declared non-convex: composition of the T sampled Gaussian steps (no contraction needed, β unused).
    res = train(_model(), _data(), _mech(learning_rate=1.0, convex=False, clip_norm=1.0, passes=1), noise_seed=1,
                options=QUIET)
    assert res.privacy.analysis == "composition" and res.privacy.amplified is None
    steps, nu_sum = math.ceil(N / B_EXP), 1.0 * 2.0  # σ = ν·2C/b on the average: ν·2 on C's sum
    rdp = steps * np.asarray(sampled_gaussian_rdp([2.0, 4.0, 8.0, 16.0, 32.0], B_EXP / N, nu_sum))
    eps_rdp = float(np.min(rdp + np.log(1 / 1e-5) / (np.array([2.0, 4.0, 8.0, 16.0, 32.0]) - 1)))
    assert res.privacy.summary()["worst"] <= eps_rdp  # the improved conversion is tighter than this classical one
    assert res.privacy.summary()["worst"] >= 0.5 * eps_rdp


# ---------------------------------------------------------------------------------------
# Resume: bit-identical, the sampling key checkpointed
# ---------------------------------------------------------------------------------------


def check_resume(mech, data, tmp_path, crash_at: int, sampling: str):
    """A run crashed at step ``crash_at`` (checkpoints every 4 steps) and resumed is bit-identical to the whole
    run: parameters, the secret sampling key and the ledger."""
    opts = dict(progress=False, account=False, steps_per_call=2)
    full = train(_model(), data, mech, noise_seed=7, options=RunOptions(**opts))

    class Crash(Exception):
        pass

    def crash(state, ledger):
        if int(state.step) >= crash_at:
            raise Crash

    with pytest.raises(Crash):
        train(_model(), data, mech, noise_seed=7,
              options=RunOptions(**opts, checkpoint_dir=tmp_path, checkpoint_every=4, callback=crash))
    res = train(_model(), data, mech, noise_seed=7, options=RunOptions(**opts, checkpoint_dir=tmp_path,
                                                                        resume=True))
    for a, b in zip(_params(res.state.params), _params(full.state.params)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(jax.random.key_data(res.state.sample_key), jax.random.key_data(full.state.sample_key))
    assert res.ledger == full.ledger and res.ledger.sampling == sampling


def test_poisson_resume_is_bit_identical(tmp_path):
    check_resume(_mech(max_batch_size=12, passes=3), _data(), tmp_path, 8, "poisson")


def test_the_command_line_trains_pnsgd_on_poisson_batches(capsys):
    from jaxdp.cli.main import main

    argv = ["train", "--smoke", "--plot", "none", "--sampler", "truncated-poisson", "--max-batch-size", "128",
            "--insecure-noise-seed", "1"]
    assert main([*argv, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["analysis"] == "hidden-state" and payload["note"].startswith("hidden state, Poisson batches")
    assert (payload["ledger"]["sampling"], payload["ledger"]["max_batch_size"]) == ("poisson", 128)
    # eta*beta*B/b = 1 * 1 * 200/64 > 2: refused in one line before training.
    assert main([*argv[:-4], "--max-batch-size", "200", "--insecure-noise-seed", "1"]) == 2
    assert "with Poisson batches (every batch's step must be a contraction" in capsys.readouterr().err
