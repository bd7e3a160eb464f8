"""Faults and hostile input (issue 26): secret stopping time, broken models, shared folders, forged checkpoints.

Each test states the fault it guards against. References are the run's own secrets
(the stopping time is recomputed from the fixed test seed, as the training loop draws it)
and plain NumPy; nothing here compares an accountant with itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdp import cli
from jaxdp.data import load_digits
from jaxdp.models import SoftmaxRegression
from jaxdp.training import Checkpointer, TrainingDivergedError, clipped_grad_sum, project_onto_l2_ball, train

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(learning_rate=1.0, noise_multiplier=1.0, radius=30.0, batch_size=64, progress=False)


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def _stopping_time(seed: int, steps_per_pass: int) -> int:
    """The stopping time train() draws from noise_seed=seed (the key's second half)."""
    _, k_stop = jax.random.split(jax.random.key(seed))
    return int(jax.random.randint(k_stop, (), 1, steps_per_pass + 1))


# ---------------------------------------------------------------------------------------
# 1. The secret stopping time reaches no output
# ---------------------------------------------------------------------------------------


def _cli_json(capsys, seed: int, tmp_path) -> dict:
    status = cli.main(["train", "--schedule", "random-stop", "--insecure-noise-seed", str(seed), "--json",
                       "--plot", "none", "--checkpoint-dir", str(tmp_path / f"ck{seed}")])
    out, err = capsys.readouterr()
    assert status == 0, err
    return json.loads(out), out + err


def test_random_stop_outputs_do_not_depend_on_the_stopping_time(capsys, tmp_path, digits):
    m = -(-(digits.x_train.shape[0] // 64 * 64) // 64)  # 22 steps per pass (drop_remainder)
    stops = {seed: _stopping_time(seed, m) for seed in (1, 2)}
    assert stops[1] != stops[2]
    payloads, texts = {}, {}
    for seed in stops:
        payloads[seed], texts[seed] = _cli_json(capsys, seed, tmp_path)
    varying = ("test_accuracy", "train_seconds", "total_seconds")
    a, b = ({k: v for k, v in payloads[s].items() if k not in varying} for s in stops)
    assert a == b  # nothing else differs between two stopping times
    for seed, t in stops.items():
        led = payloads[seed]["ledger"]
        assert not {"steps_done", "total_steps", "clipped", "max_grad_norm"} & set(led)
        for pattern in (f"after {t} steps", f'"steps_done": {t}', f'"total_steps": {t}', f"{t} steps"):
            assert pattern not in texts[seed]
        # The checkpoint listing is the same for both runs.
    assert sorted(os.listdir(tmp_path / "ck1")) == sorted(os.listdir(tmp_path / "ck2"))


def test_random_stop_library_report_history_and_progress_hide_the_stopping_time(capsys, digits):
    res = train(SoftmaxRegression(64, 10, rngs=nnx.Rngs(0)), digits, schedule="random_stop", noise_seed=3,
                **dict(SMALL, progress=True))
    out, err = capsys.readouterr()
    t = int(res.state.total_steps)
    assert int(res.state.step) == t  # the run did stop at t ...
    assert res.privacy.steps_done is None  # ... and the report does not say so
    assert f"after {t} steps" not in out + err
    assert [h[0] for h in res.history][-1] == res.state.ledger.steps_per_pass  # public positions only
    assert "steps_done" not in res.state.ledger.public()


_CACHE_SCRIPT = textwrap.dedent("""
    import os, sys
    import jax
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from flax import nnx
    from jaxdp.data import load_digits
    from jaxdp.models import SoftmaxRegression
    from jaxdp.training import train
    res = train(SoftmaxRegression(64, 10, rngs=nnx.Rngs(0)), load_digits(), learning_rate=1.0, noise_multiplier=1.0,
                radius=30.0, batch_size=64, schedule="random_stop", noise_seed=int(sys.argv[2]), progress=False,
                account=False)
    print(int(res.state.total_steps))
""")


def test_random_stop_compiled_programs_do_not_depend_on_the_stopping_time(tmp_path):
    """The persistent compilation cache gets no new program when only the stopping time changes."""
    cache = tmp_path / "xla"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    listings, stops = [], []
    for seed in (1, 2):
        run = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT, str(cache), str(seed)], capture_output=True,
                             text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        stops.append(int(run.stdout.split()[-1]))
        listings.append(sorted(p for p in os.listdir(cache) if p.endswith("-cache")))
    assert stops[0] != stops[1]
    assert any("run_full" in p for p in listings[0])
    assert listings[0] == listings[1]


def test_random_stop_refuses_intermediates(digits):
    with pytest.raises(ValueError, match="secret stopping time"):
        train(SoftmaxRegression(64, 10, rngs=nnx.Rngs(0)), digits, schedule="random_stop",
              return_intermediates=True, **SMALL)


# ---------------------------------------------------------------------------------------
# 2. A broken model gets no report
# ---------------------------------------------------------------------------------------


def _nan_gradient_loss(model, x, y):
    return jnp.sqrt(-jnp.sum(model(x) ** 2, axis=-1) - 1.0)  # sqrt of a negative: NaN value and gradient


@pytest.mark.parametrize("kw", [
    dict(SMALL, loss_fn=_nan_gradient_loss, lipschitz=2.0, smoothness=1.0, convex=True, clip_norm=2.0),
    dict(algorithm="dpsgd", learning_rate=0.1, noise_multiplier=1.0, clip_norm=1.0, loss_fn=_nan_gradient_loss,
         progress=False),
    dict(algorithm="dpsgd", learning_rate=1e39, noise_multiplier=1.0, clip_norm=1.0, progress=False),
], ids=["pnsgd-nan-loss", "dpsgd-nan-loss", "dpsgd-huge-learning-rate"])
def test_non_finite_training_stops_without_a_report(digits, kw):
    with pytest.raises(TrainingDivergedError, match="NaN or infinite") as info:
        train(SoftmaxRegression(64, 10, rngs=nnx.Rngs(0)), digits, noise_seed=0, **kw)
    assert "\n" not in str(info.value)


def test_cli_non_finite_run_exits_1_with_one_line_and_no_epsilon(capsys):
    status = cli.main(["train", "--algorithm", "dpsgd", "--learning-rate", "1e39", "--smoke", "--plot", "none",
                       "--insecure-noise-seed", "0"])
    out, err = capsys.readouterr()
    assert status == 1
    assert "epsilon" not in out
    lines = [ln for ln in err.splitlines() if ln.startswith("jaxdp: error:")]
    assert len(lines) == 1 and "NaN or infinite" in lines[0] and "Traceback" not in err


def test_nan_gradient_norm_counts_as_above_the_clip_norm():
    m = SoftmaxRegression(4, 3, rngs=nnx.Rngs(0))
    for fast in (True, False):
        cg = clipped_grad_sum(_nan_gradient_loss, m, (jnp.ones((2, 4)), jnp.zeros(2, int)), 1.0, use_fast_path=fast)
        assert bool(jnp.all(jnp.isnan(cg.norms)))  # was 0: the check "no norm above C" passed on NaN


def test_projection_overflow_gives_nan_not_a_zeroed_model():
    """R^2 or the squared norm overflowing float32 used to scale the point to 0 (ε reported at 7.8 % accuracy)."""
    for radius, value in [(1e20, [3.0, 4.0]), (1e-3, [3e30, 4e30])]:
        out = project_onto_l2_ball({"a": jnp.asarray(value, jnp.float32)}, radius)["a"]
        assert bool(jnp.all(jnp.isnan(out)))
    out = project_onto_l2_ball({"a": jnp.asarray([3.0, 4.0], jnp.float32)}, 1.0)["a"]
    np.testing.assert_allclose(np.asarray(out), [0.6, 0.8], rtol=1e-6)


def test_radius_whose_square_overflows_is_refused(digits):
    with pytest.raises(ValueError, match="radius must be below 1.84e\\+19 for float32"):
        train(SoftmaxRegression(64, 10, rngs=nnx.Rngs(0)), digits, **dict(SMALL, radius=1e20))


# ---------------------------------------------------------------------------------------
# 3. One run per checkpoint folder
# ---------------------------------------------------------------------------------------


def test_second_run_on_a_locked_folder_fails_at_once(tmp_path, digits):
    holder = Checkpointer(tmp_path / "ck")
    holder.acquire()
    try:
        with pytest.raises(ValueError, match="in use by another run"):
            train(SoftmaxRegression(64, 10, rngs=nnx.Rngs(0)), digits, checkpoint_dir=tmp_path / "ck", **SMALL)
    finally:
        holder.close()
    # Released: the folder can be used again (and a killed run's lock dies with its process).
    train(SoftmaxRegression(64, 10, rngs=nnx.Rngs(0)), digits, checkpoint_dir=tmp_path / "ck", noise_seed=0, **SMALL)


def test_concurrent_start_in_another_process_fails_with_one_line(tmp_path):
    folder = tmp_path / "ck"
    holder = Checkpointer(folder)
    holder.acquire()
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", JAXDP_CACHE_DIR="off")
        run = subprocess.run([sys.executable, "-m", "jaxdp", "train", "--smoke", "--plot", "none",
                              "--checkpoint-dir", str(folder)], capture_output=True, text=True, env=env, timeout=600)
    finally:
        holder.close()
    assert run.returncode != 0
    assert run.stderr.strip().splitlines() == [run.stderr.strip()]
    assert "in use by another run" in run.stderr and "Traceback" not in run.stderr


def test_checkpoint_dir_that_is_a_file_or_read_only_fails_before_training(tmp_path, digits):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        train(SoftmaxRegression(64, 10, rngs=nnx.Rngs(0)), digits, checkpoint_dir=f, **SMALL)
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(ValueError, match="cannot be written"):
            train(SoftmaxRegression(64, 10, rngs=nnx.Rngs(0)), digits, checkpoint_dir=ro, **SMALL)


def test_folder_with_two_runs_is_refused(tmp_path):
    folder = tmp_path / "ck"
    for _ in range(2):  # two runs, each saving its step 0
        ck = Checkpointer(folder, max_to_keep=None)
        ck.save(0, {"w": np.zeros(2)}, {"note": "run"})
        ck.close()
    with pytest.raises(ValueError, match="more than one run"):
        Checkpointer(folder).check_one_run()


# ---------------------------------------------------------------------------------------
# 6. Keyed checkpoints: forged ones are refused
# ---------------------------------------------------------------------------------------

KEY = "a test key of 32 characters ...."


def _forge(folder: Path, edit) -> None:
    """Edit the newest checkpoint's metadata and recompute its SHA-256 record, as a forger would."""
    from jaxdp.training._checkpoint import _RESERVED, _digest, _index_dirs

    index = _index_dirs(folder)[0]
    path = folder / str(index) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    like = {k: np.zeros(shape, dtype) for k, (shape, dtype) in meta["_arrays"].items()}
    reader = Checkpointer(folder, key=KEY)
    arrays, _ = reader.restore(like)
    reader.close()
    edit(meta)
    core = {k: v for k, v in meta.items() if k not in _RESERVED}
    meta["_integrity"] = {"sha256": _digest(core, arrays)}  # the SHA-256 recomputed; the HMAC cannot be
    path.write_text(json.dumps(meta))


def _lower_noise(meta):
    meta["config"]["noise_multiplier"] = 4.0
    meta["ledger"]["noise_multiplier"] = 4.0


def _halve_steps(meta):
    meta["_step"] //= 2


def _clear_fixed_seed(meta):
    meta["ledger"]["fixed_noise_seed"] = False


@pytest.mark.parametrize("edit", [_lower_noise, _halve_steps, _clear_fixed_seed])
def test_forged_checkpoints_are_refused_under_a_key(tmp_path, digits, edit):
    folder = tmp_path / "ck"
    kw = dict(SMALL, passes=2, checkpoint_dir=folder, checkpoint_key=KEY, noise_seed=0)
    train(SoftmaxRegression(64, 10, rngs=nnx.Rngs(0)), digits, **kw)
    _forge(folder, edit)
    resumed = dict(kw, passes=3, resume=True)
    if edit is _lower_noise:
        resumed["noise_multiplier"] = 4.0
    with pytest.raises(ValueError, match="wrong signature|refusing"):
        train(SoftmaxRegression(64, 10, rngs=nnx.Rngs(0)), digits, **resumed)


def test_signed_and_unsigned_checkpoints_do_not_mix(tmp_path):
    signed, unsigned = tmp_path / "s", tmp_path / "u"
    ck = Checkpointer(signed, key=KEY)
    ck.save(1, {"w": np.ones(2)}, {})
    ck.close()
    ck = Checkpointer(unsigned)
    ck.save(1, {"w": np.ones(2)}, {})
    ck.close()
    like = {"w": np.zeros(2)}
    assert Checkpointer(signed, key=KEY).restore(like)[0]["w"].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="is signed"):
        Checkpointer(signed).restore(like)
    with pytest.raises(ValueError, match="not signed"):
        Checkpointer(unsigned, key=KEY).restore(like)
    with pytest.raises(ValueError, match="wrong signature"):
        Checkpointer(signed, key=KEY[::-1]).restore(like)
    with pytest.raises(ValueError, match="at least 16"):
        Checkpointer(signed, key="short")


# ---------------------------------------------------------------------------------------
# 4. Labels at the boundary
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["pnsgd", "dpsgd"])
def test_labels_are_checked_at_trains_boundary(digits, algorithm):
    kw = SMALL if algorithm == "pnsgd" else dict(algorithm="dpsgd", learning_rate=0.1, noise_multiplier=1.0,
                                                 clip_norm=1.0, progress=False)
    y = digits.y_train.copy()
    y[3] = 15
    model = SoftmaxRegression(64, 10, rngs=nnx.Rngs(0))
    for data, match in [((digits.x_train, y), "label 15, outside \\[0, 10\\)"),
                        (digits._replace(y_train=y), "label 15"),
                        ((digits.x_train, digits.y_train.astype(float)), "integer class labels"),
                        ((digits.x_train[:0], digits.y_train[:0]), "no training record")]:
        with pytest.raises(ValueError, match=match):
            train(model, data, **kw)


@pytest.mark.parametrize("name", ["noise_seed", "order_seed"])
def test_seed_beyond_64_bits_is_a_named_error(digits, name):
    from jaxdp.training import PNSGDMechanism, RunOptions

    with pytest.raises(ValueError, match=f"{name} must be"):
        train(SoftmaxRegression(64, 10, rngs=nnx.Rngs(0)), digits,
              PNSGDMechanism(learning_rate=1.0, noise_multiplier=1.0, radius=30.0), options=RunOptions(progress=False),
              **{name: 2**63})
