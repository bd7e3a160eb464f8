"""DP-SBCD: the updates against closed forms and numerical minimisation; train(algorithm="dpsbcd"): noise,
ledger, resume, tampering and bad input.

Every run uses one network shape, data shape, batch and rho so that the jitted segment compiles once
per process (test time)."""

import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.optimize import minimize

import jaxdp.accounting as A
from jaxdp.models import LipschitzMLP, spectral_norms
from jaxdp.training import DPSBCDLedger, privacy_report, train, train_dpsbcd
from jaxdp.training._checkpoint import Checkpointer
from jaxdp.training._dpsbcd import activation_update, preactivation_update, weight_decay_prox


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture
def _x32():
    """Training in float32, as in the shared runs (one compilation of the step)."""
    with jax.enable_x64(False):
        yield


def test_weight_decay_prox_is_the_argmin():
    # Prox_{η,r}(θ) = argmin_t r(t) + ‖t − θ‖²/(2η), r = (λ/2)‖t‖²: θ/(1 + ηλ) (the paper prints
    # ηθ/(1+η) for λ = 1, which is not the argmin).
    rng = np.random.default_rng(0)
    theta = rng.normal(size=6)
    for eta, lam in ((0.01, 1.0), (0.5, 2.0), (1.0, 0.0)):
        res = minimize(lambda t, eta=eta, lam=lam: 0.5 * lam * t @ t + (t - theta) @ (t - theta) / (2 * eta),
                       np.zeros(6), tol=1e-14)
        np.testing.assert_allclose(np.asarray(weight_decay_prox(jnp.asarray(theta), eta, lam)), res.x, atol=1e-7)
    assert not np.allclose(np.asarray(weight_decay_prox(jnp.asarray(theta), 0.01, 1.0)), 0.01 * theta / 1.01)


def _eq6(a, w):
    """Eq. 6 of the paper, cases in order (a = x_{d+1} ≥ 0 as in a ReLU network)."""
    if -a <= w <= -(math.sqrt(2) - 1) * a <= 0:
        return w
    if w + a <= 0:
        return min(0.0, w)
    return 0.5 * (w + a)


def test_preactivation_update_is_the_exact_minimiser_and_eq6():
    rng = np.random.default_rng(1)
    a = np.concatenate([rng.normal(size=300) * 2, np.abs(rng.normal(size=300))])
    w = rng.normal(size=600) * 2
    got = np.asarray(preactivation_update(jnp.asarray(a), jnp.asarray(w)))
    grid = np.linspace(-8, 8, 160001)  # brute force, spacing 1e-4

    def cost(u, a, w):
        return (a - np.maximum(u, 0)) ** 2 + (u - w) ** 2

    for ai, wi, gi in zip(a, w, got):
        best = cost(grid, ai, wi).min()
        assert cost(gi, ai, wi) <= best + 1e-12
        if ai >= 0:
            assert cost(gi, ai, wi) == pytest.approx(cost(_eq6(ai, wi), ai, wi), abs=1e-12)


def test_activation_update_solves_the_least_squares_problems():
    rng = np.random.default_rng(2)
    relu_prev, u_next, w, y = rng.normal(size=(5, 4)), rng.normal(size=(5, 3)), rng.normal(size=(4, 3)), \
        rng.normal(size=(5, 3))
    got = np.asarray(activation_update(jnp.asarray(relu_prev), jnp.asarray(u_next), jnp.asarray(w)))
    gamma = 0.7
    got_last = np.asarray(activation_update(jnp.asarray(relu_prev), None, jnp.asarray(w), y=jnp.asarray(y),
                                            penalty=gamma))
    for i in range(5):  # each row: min ‖x − p‖² + ‖u − xW‖², a stacked least-squares problem
        lhs = np.vstack([np.eye(4), w.T])
        sol = np.linalg.lstsq(lhs, np.concatenate([relu_prev[i], u_next[i]]), rcond=None)[0]
        np.testing.assert_allclose(got[i], sol, rtol=1e-10, atol=1e-12)
        lhs = np.vstack([math.sqrt(gamma) * np.eye(4), w.T])  # ½‖xW − y‖² + (γ/2)‖x − p‖²
        sol = np.linalg.lstsq(lhs, np.concatenate([math.sqrt(gamma) * relu_prev[i], y[i]]), rcond=None)[0]
        np.testing.assert_allclose(got_last[i], sol, rtol=1e-10, atol=1e-12)



# ----------------------------------------------------------------------------------------
# train(algorithm="dpsbcd"): one shape for all runs (60 records of 12 features, 10 classes,
# network 12-16-10, b = 20: m = 3 steps per pass, rho = 2).
# ----------------------------------------------------------------------------------------

N, FEATURES, CLASSES, B = 60, 12, 10, 20
RUN = dict(algorithm="dpsbcd", learning_rate=0.2, noise_temperature=[0.01, 0.005], clip_norm=0.5, contraction=0.99,
           batch_size=B, delta=1e-5, weight_decay=1.0, noise_seed=7, progress=False)
ORDERS = np.asarray(A.DEFAULT_ORDERS)
KW = dict(learning_rate=0.2, sensitivity=np.ones(2), contraction=0.99, prox_lipschitz=1 / 1.2, num_records=N,
          batch_size=B)


@jax.jit
def _reference(temps):
    """ε at δ = 1e-5 per batch position j = 0, 1, 2 and the paper's mixture, from the accountant's RDP curves
    (compiled once: eager calls would cost seconds of per-op compilation)."""
    curves = [A.dpsbcd_rdp(ORDERS, temps, batch_index=j, **KW) for j in range(3)] + [A.dpsbcd_rdp(ORDERS, temps, **KW)]
    return jnp.stack([A.rdp_to_epsilon(c, ORDERS, 1e-5).epsilon for c in curves])


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, FEATURES)).astype(np.float32)
    return x, rng.integers(0, CLASSES, size=N)


def _model():
    return LipschitzMLP((FEATURES, 16, CLASSES), rngs=nnx.Rngs(0), max_spectral_norm=2.0)


def _leaves(state):
    parts = (state.params, state.opt_state, state.step, state.order, state.max_grad_norm, state.clipped)
    return [np.asarray(jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a)
            for a in jax.tree.leaves(parts)]


class _Crash(Exception):
    pass


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run, and one crashed after its first pass (checkpoint at step 3) then resumed."""
    with jax.enable_x64(False):  # training stays in float32 (the accountant switches to float64 itself)
        full = train(_model(), _data(), **RUN)
        ckdir = tmp_path_factory.mktemp("sbcd") / "ck"

        def crash(state):
            if int(state.step) >= 3:
                raise _Crash

        with pytest.raises(_Crash):
            train(_model(), _data(), checkpoint_dir=ckdir, callback=crash, **RUN)
        crashed = tmp_path_factory.mktemp("sbcd") / "crashed"
        shutil.copytree(ckdir, crashed)
        resumed = train(_model(), _data(), checkpoint_dir=ckdir, resume=True, **RUN)
    return full, resumed, crashed


def test_resume_is_bit_identical_and_the_input_model_untouched(runs):
    full, resumed, _ = runs
    assert int(full.state.step) == 6 and int(resumed.state.step) == 6
    for a, b in zip(_leaves(resumed.state), _leaves(full.state)):
        np.testing.assert_array_equal(a, b)
    assert resumed.state.ledger == full.state.ledger
    for a, b in zip(resumed.model.layers, full.model.layers):
        np.testing.assert_array_equal(np.asarray(a.kernel[...]), np.asarray(b.kernel[...]))
    fresh = _model()
    assert not np.array_equal(np.asarray(fresh.layers[0].kernel[...]), np.asarray(full.model.layers[0].kernel[...]))
    assert np.all(np.asarray(spectral_norms(full.model)) <= 2.0 * (1 + 0.05))  # power-iteration tolerance


def test_ledger_states_the_run_and_its_epsilon_is_the_accountant_per_batch_position(runs):
    full = runs[0]
    led, rep = full.state.ledger, full.privacy
    # 60 records, b = 20: m = 3, all used; S_g = 2C; L_T = 1/(1 + eta*lambda); L_F as stated.
    assert (led.records, led.unused, led.steps_per_pass, led.passes, led.steps_done) == (60, 0, 3, 2, 6)
    assert led.sensitivity == [1.0, 1.0] and led.contraction == [0.99, 0.99]
    assert led.prox_lipschitz == [pytest.approx(1 / 1.2)] * 2
    assert "WITHOUT PROOF" in led.reason and "LSI" in led.reason and "public order" in led.reason
    order = np.asarray(full.state.order)
    want = _reference(np.array([0.01, 0.005]))  # the whole RDP curve at every order, per batch position
    for j in range(3):  # positions of batch j (1-based b j + 1 .. b (j + 1)) get its bound
        np.testing.assert_allclose(rep.epsilon[j * B:(j + 1) * B], want[j], rtol=1e-12)
    # The public order rules out the paper's mixture over a secret position: the worst position is above it.
    assert rep.summary()["worst"] >= want[3]
    np.testing.assert_allclose(rep.record_epsilon(order)[order[:B]], rep.epsilon[:B])
    # Composition (every iterate released): per layer and use a Gaussian mechanism with std sqrt(2 eta o)
    # moved by eta S_g / b, i.e. noise multiplier sqrt(2 o / eta) b / S_g; two layers, one use per pass.
    z = [math.sqrt(2 * o / 0.2) * B / 1.0 for o in (0.01, 0.005)]
    rdp = sum(2 * A.gaussian_rdp(ORDERS, zi) for zi in z)
    np.testing.assert_allclose(rep.composition, float(A.rdp_to_epsilon(rdp, ORDERS, 1e-5).epsilon), rtol=1e-9)
    assert np.all(rep.epsilon <= rep.composition)
    from jaxdp.cli.train import _SBCD_HIDDEN  # the plot's style for the reported line

    assert list(rep.by_analysis) == [_SBCD_HIDDEN, "composition"]
    assert full.history == [(6, rep.summary())] and json.loads(json.dumps(led.to_json())) == led.to_json()
    assert DPSBCDLedger.from_json(json.loads(json.dumps(led.to_json()))) == led


def test_report_after_one_pass_and_mid_pass(runs):
    led = runs[0].state.ledger
    one = privacy_report(led._replace(steps_done=3))  # the run so far: the first pass
    # The last batch was used by the last step: nothing hides it, its bound is its composition (checked below);
    # earlier batches are hidden by the later steps.
    assert one.exact and one.epsilon[-1] == pytest.approx(one.composition[-1], rel=1e-12)
    assert one.epsilon[0] < one.epsilon[B] < one.epsilon[-1]
    mid = privacy_report(led._replace(steps_done=4))
    assert mid.analysis == "composition" and not mid.exact and mid.amplified is None
    # Batch 0 was used twice (o = 0.01, 0.005), batches 1, 2 once (0.01): per layer and use a Gaussian
    # mechanism with noise multiplier sqrt(2 o / eta) b / S_g.
    for j, temps in ((0, (0.01, 0.005)), (1, (0.01,)), (2, (0.01,))):
        rdp = sum(2 * A.gaussian_rdp(ORDERS, math.sqrt(2 * o / 0.2) * B / 1.0) for o in temps)
        np.testing.assert_allclose(mid.epsilon[B * j:B * (j + 1)], float(A.rdp_to_epsilon(rdp, ORDERS, 1e-5).epsilon),
                                   rtol=1e-9)
    assert np.all(privacy_report(led._replace(steps_done=0)).epsilon == 0)


def test_forged_or_edited_ledger_is_refused(runs, tmp_path):
    crashed = runs[2]
    for field, value in (("noise_temperature", [1.0, 1.0]), ("steps_done", 0), ("contraction", [0.5, 0.5])):
        ckdir = tmp_path / field
        shutil.copytree(crashed, ckdir)
        newest = max((p for p in ckdir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
        names = json.loads((newest / "meta" / "metadata").read_text())["_arrays"]
        ck = Checkpointer(ckdir)
        arrays, meta = ck.restore({k: np.zeros(shape, dtype) for k, (shape, dtype) in names.items()})
        meta = {k: v for k, v in meta.items() if k in ("ledger", "config", "_arrays")}
        meta["ledger"] = dict(meta["ledger"], **{field: value})
        ck.save(meta["_step"] if "_step" in meta else 3, arrays, meta)  # a fresh, valid hash over the forgery
        ck.close()
        with pytest.raises(ValueError, match=f"disagrees with its configuration.*{field}") as err:
            train(_model(), _data(), checkpoint_dir=ckdir, resume=True, **RUN)
        assert "\n" not in str(err.value)
    # An edit without a new hash fails the integrity check; another configuration is refused by name.
    ckdir = tmp_path / "edited"
    shutil.copytree(crashed, ckdir)
    newest = max((p for p in ckdir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    meta = json.loads((newest / "meta" / "metadata").read_text())
    meta["ledger"]["noise_temperature"] = [1.0, 1.0]
    (newest / "meta" / "metadata").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="integrity check"):
        train(_model(), _data(), checkpoint_dir=ckdir, resume=True, **RUN)
    with pytest.raises(ValueError, match="different run configuration.*noise_temperature"):
        train(_model(), _data(), checkpoint_dir=crashed, resume=True, **{**RUN, "noise_temperature": [0.02, 0.005]})


@pytest.mark.usefixtures("_x32")
def test_noise_has_variance_2_eta_o():
    # Gradients clipped to ~0, no weight decay, start weights small (no rescaling): after two passes of
    # m = 3 steps, W_out − W_in = sqrt(2ηo)·(Z_1 + ... + Z_6), std sqrt(6·2ηo).
    model = _model()
    for layer in model.layers:
        layer.kernel[...] = 0.01 * layer.kernel[...]
    w0 = [np.asarray(layer.kernel[...], np.float64) for layer in model.layers]
    eta, o = 0.1, 0.02
    res = train_dpsbcd(model, _data(), learning_rate=eta, noise_temperature=[o, o], clip_norm=1e-30, contraction=1.0,
                       batch_size=B, delta=1e-5, noise_seed=3)
    diff = np.concatenate([(np.asarray(layer.kernel[...], np.float64) - w).ravel()
                           for layer, w in zip(res.model.layers, w0)])
    std = math.sqrt(6 * 2 * eta * o)
    # 352 entries: the sample std has relative standard error 1/sqrt(2·352) ≈ 3.8 %; 5 SE.
    assert np.std(diff) == pytest.approx(std, rel=0.19)
    assert abs(np.mean(diff)) < 5 * std / math.sqrt(diff.size)
    # The shortcut's epsilon is the worst position's; its event is the run's.
    ev = res.event
    assert isinstance(ev, A.DPSBCD) and (ev.num_records, ev.batch_size) == (N, B)
    np.testing.assert_array_equal(np.asarray(ev.noise_temperature), [o, o])
    np.testing.assert_array_equal(np.asarray(ev.sensitivity), [2e-30, 2e-30])
    assert res.epsilon == 0.0 or math.isfinite(res.epsilon)


@pytest.mark.parametrize("bad, match", [
    (dict(noise_temperature=[0.01 - 0.003 * k for k in range(5)]), "noise_temperature"),  # goes negative
    (dict(noise_temperature=None), "noise_temperature"),
    (dict(contraction=None), "contraction"),
    (dict(contraction=[1.0, 1.0, 1.0]), "contraction"),
    (dict(contraction=-1.0), "contraction"),
    (dict(clip_norm=0.0), "clip_norm"),
    (dict(penalty=0.0), "penalty"),
    (dict(weight_decay=-1.0), "weight_decay"),
    (dict(learning_rate=None), "learning_rate"),
    (dict(passes=3), "passes"),
    (dict(noise_multiplier=1.0), "noise_multiplier"),
    (dict(radius=1.0), "radius"),
    (dict(batch_size=61), "batch_size"),
])
def test_bad_input_names_the_parameter(bad, match):
    with pytest.raises(ValueError, match=match):
        train(_model(), _data(), **{**RUN, **bad})


def test_bad_model_and_data():
    with pytest.raises(ValueError, match="model"):
        train(nnx.Linear(FEATURES, CLASSES, rngs=nnx.Rngs(0)), _data(), **RUN)
    x, y = _data()
    with pytest.raises(ValueError, match="y must hold integer labels"):
        train(_model(), (x, y + CLASSES), **RUN)
    with pytest.raises(ValueError, match="x must have 12 features"):
        train(_model(), (x[:, :5], y), **RUN)
    with pytest.raises(ValueError, match="contraction is not used by algorithm"):
        train(_model(), _data(), algorithm="dpsgd", noise_multiplier=1.0, clip_norm=1.0, learning_rate=0.1,
              contraction=1.0)


def test_command_line_refuses_missing_constants(capsys):
    from jaxdp.cli.main import main

    base = ["train", "--algorithm", "dpsbcd", "--plot", "none", "--smoke"]
    assert main([*base, "--model", "mlp", "--noise-temperature", "1e-4"]) == 2
    assert "--contraction is required" in capsys.readouterr().err
    assert main([*base, "--model", "mlp", "--contraction", "1"]) == 2
    assert "--noise-temperature is required" in capsys.readouterr().err
    assert main([*base, "--noise-temperature", "1e-4", "--contraction", "1"]) == 2
    assert "--model mlp" in capsys.readouterr().err


@pytest.mark.slow  # about 10 s: a new network shape to compile; the pieces are covered above
def test_command_line_end_to_end(tmp_path, capsys):
    from jaxdp.cli.main import main

    png = tmp_path / "e.png"
    assert main(["train", "--algorithm", "dpsbcd", "--model", "mlp", "--noise-temperature", "1e-4", "--contraction", "1",
                 "--learning-rate", "0.5", "--batch-size", "288", "--smoke", "--plot", str(png), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["analysis"] == "dpsbcd" and out["private"] and png.exists()
    assert out["epsilon_worst"] == out["by_analysis"][_HIDDEN_NAME]["worst"] < out["by_analysis"]["composition"]["worst"]
    assert "WITHOUT PROOF" in out["reason"] and out["ledger"]["passes"] == 1


_HIDDEN_NAME = "dpsbcd hidden-state (Chen & Liu Thm 4.6, layers summed)"


def test_devices_refused_with_dpsbcd():
    import jaxdp.training as T

    with pytest.raises(ValueError, match="devices"):
        T.train(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), (np.zeros((4, 2)), np.zeros(4, dtype=int)), algorithm="dpsbcd",
                learning_rate=0.1, noise_temperature=1e-3, clip_norm=1.0, contraction=1.0, devices=1)
