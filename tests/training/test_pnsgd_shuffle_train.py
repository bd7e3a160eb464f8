"""PNSGDMechanism(sampling="shuffle"): a fresh secret permutation every pass, the report, target_epsilon, resume.

Small runs (42 records, b = 8: six batches a pass, the last of 2; logistic regression, L = √2,
β = 1/2 on unit rows). The hidden-state bound itself is checked against the exact shuffled
process in ``tests/accounting/test_pnsgd_shuffle.py``; here the run is checked to be the
process that bound describes, and the report to be that bound at the run's constants.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdp.accounting import PNSGD, shuffle_pnsgd_epsilon
from jaxdp.training import PNSGDMechanism, RunOptions, pnsgd, train

from .test_pnsgd_poisson_train import BETA, ETA, QUIET, R, L, _model, _params, check_resume
from .test_pnsgd_poisson_train import _data as _poisson_data

N, B = 42, 8


def _data():
    return _poisson_data(N)


def _mech(**kw):
    base = dict(learning_rate=ETA, radius=R, noise_multiplier=1.0, batch_size=B, passes=2, sampling="shuffle")
    return PNSGDMechanism(**{**base, **kw})


def _expected_epsilon(nu, passes):
    """The accountant at the run's constants written out: σ = ν·2C/b (C = L), D = 2R."""
    return float(shuffle_pnsgd_epsilon(1e-5, L, BETA, ETA, nu * 2.0 * L / B, 2.0 * R, num_records=N, batch_size=B,
                                       passes=passes))


def test_random_stop_with_shuffled_batches_is_refused_in_one_line():
    with pytest.raises(ValueError, match="not available with sampling='shuffle'") as err:
        _mech(schedule="random_stop", passes=1)
    assert "\n" not in str(err.value)


def test_steps_are_a_fresh_secret_permutation_every_pass_averaged_then_pnsgd():
    ds = _data()
    res = train(_model(), ds, _mech(), noise_seed=5, options=RunOptions(progress=False, account=False))
    # The same steps by hand: the secret key split as (noise, batches); pass p's permutation from fold_in(batches, p).
    k_noise, k_batches = jax.random.split(jax.random.key(5))
    tx = pnsgd(ETA, 1.0, L, R, k_noise, batch_size=B)
    graphdef, params, rest = nnx.split(_model(), nnx.Param, ...)
    x, y = jnp.asarray(ds.x_train, jnp.float32), jnp.asarray(ds.y_train)

    def loss_mean(p, xb, yb):
        return jnp.mean(nnx.merge(graphdef, p, rest).loss(xb, yb))

    state, orders = tx.init(params), []
    for p in range(2):
        order = np.asarray(jax.random.permutation(jax.random.fold_in(k_batches, p), N))
        orders.append(order)
        for j in range(math.ceil(N / B)):
            idx = order[j * B:(j + 1) * B]  # the last batch has N - 5B = 2 records, averaged over 2
            upd, state = tx.update(jax.grad(loss_mean)(params, x[idx], y[idx]), state, params)
            params = jax.tree.map(lambda a, u: a + u, params, upd)
    assert not np.array_equal(orders[0], orders[1])
    assert res.ledger.steps_done == 12 and res.ledger.sampling == "shuffle" and res.ledger.unused == 0
    for a, b in zip(_params(res.state.params), _params(params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def three_passes():
    return train(_model(), _data(), _mech(passes=3), noise_seed=1, options=QUIET)


def test_the_report_is_the_shuffle_events_hidden_state_bound(three_passes):
    res = three_passes
    assert res.privacy.analysis == "hidden-state" and res.privacy.steps_done == 18
    assert res.privacy.summary()["worst"] == pytest.approx(_expected_epsilon(1.0, 3), rel=1e-9)
    ev = res.ledger.event()
    assert isinstance(ev, PNSGD) and (ev.sampling, ev.relation, ev.passes) == ("shuffle", "replace_one", 3)
    assert np.all(res.privacy.epsilon == res.privacy.epsilon[0])  # every record alike


def test_the_report_leads_with_the_assumptions_and_the_bound_for_any_number_of_passes(three_passes):
    rep = three_passes.privacy
    first = rep.table().splitlines()[1]  # after the NOT PRIVATE line of the test's fixed noise seed
    assert first.startswith("hidden state, shuffled batches: epsilon of the final iterate only")
    for part in ("convex", "L=1.414", "beta=0.5", "D=2", "fresh secret permutation every pass",
                 "for any number of passes"):
        assert part in first, part
    bound = float(first.split("epsilon <= ")[1].split()[0])
    assert rep.summary()["worst"] <= bound
    assert "secret batches reshuffled every pass, replace-one neighbours" in rep.reason


def test_target_epsilon_calibrates_the_shuffled_hidden_state_bound():
    res = train(_model(), _data(), _mech(noise_multiplier=None, target_epsilon=2.0, passes=3), noise_seed=1,
                options=QUIET)
    worst = res.privacy.summary()["worst"]
    assert 0.98 * 2.0 <= worst <= 2.0 and res.privacy.analysis == "hidden-state"
    assert worst == pytest.approx(_expected_epsilon(res.mechanism.noise_multiplier, 3), rel=1e-9)


def test_shuffle_resume_is_bit_identical(tmp_path):
    # Checkpoint at step 4, crash at 6, resume mid-pass (6 steps a pass): the pass's permutation is redrawn.
    check_resume(_mech(passes=2), _data(), tmp_path, 6, "shuffle")


@pytest.mark.slow  # the digits smoke run (~3 s idle; the API tests above cover the run and its report)
def test_the_command_line_trains_pnsgd_on_shuffled_batches(capsys):
    from jaxdp.cli.main import main

    argv = ["train", "--smoke", "--plot", "none", "--sampler", "shuffle", "--insecure-noise-seed", "1", "--json"]
    assert main(argv) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["analysis"] == "hidden-state" and payload["note"].startswith("hidden state, shuffled batches")
    assert payload["ledger"]["sampling"] == "shuffle"
