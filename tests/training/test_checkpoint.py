"""Checkpoints: atomic saves, and resumed runs equal to uninterrupted ones bit for bit.

The kill test starts a real subprocess, kills it with SIGKILL after it has written a few
checkpoints (it may be anywhere: mid-step or mid-save), resumes it in a second
subprocess, and compares the parameters and the ledger with an uninterrupted run.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

from jaxdp.data import from_arrays
from jaxdp.models import LogisticRegression
from jaxdp.training import Checkpointer, latest_checkpoint_step, train

# Small logistic-regression run: 40 records, batches of 4 → 10 steps per pass, 3 passes.
RUN = dict(learning_rate=0.5, noise_multiplier=1.0, radius=1.0, batch_size=4, passes=3, steps_per_call=2,
           order_seed=7, noise_seed=7, progress=False, account=False)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5))
    y = (x[:, 0] > 0).astype(np.int32)
    return from_arrays(x, y, test_fraction=0.0)


def _model():
    return LogisticRegression(5, rngs=nnx.Rngs(0))


def _leaves(state):
    return [np.asarray(v) for v in jax.tree.leaves(state.params)]


class _Crash(Exception):
    pass


@pytest.fixture(scope="module")
def uninterrupted():
    return train(_model(), _data(), **RUN)


def test_checkpointer_round_trip_and_latest(tmp_path):
    ck = Checkpointer(tmp_path / "c", max_to_keep=2)
    for step in (1, 2, 3):
        ck.save(step, {"w": np.arange(3.0) * step, "k": np.array([1, 2], np.uint32)}, {"step": step})
    arrays, meta = ck.restore({"w": np.zeros(3), "k": np.zeros(2, np.uint32)})
    assert arrays["w"].tolist() == [0.0, 3.0, 6.0] and meta["step"] == 3
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["2", "3"]  # max_to_keep
    ck.close()


def test_failed_save_leaves_no_partial_checkpoint(tmp_path):
    ck = Checkpointer(tmp_path / "c")
    ck.save(1, {"w": np.zeros(2)}, {"ok": True})
    with pytest.raises(ValueError, match="JSON"):
        ck.save(2, {"w": np.zeros(2)}, {"bad": object()})
    # A failure inside orbax itself (an array it cannot write): the temporary directory goes.
    with pytest.raises(ValueError):
        ck.save(3, {"w": np.array([object()], dtype=object)}, {"ok": True})
    ck.close()
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["1"]
    assert latest_checkpoint_step(tmp_path / "c") == 1


def test_resume_after_crash_is_bit_identical(tmp_path, uninterrupted):
    ckdir = tmp_path / "ck"

    def crash_after_step_12(state):
        if int(state.step) >= 12:
            raise _Crash

    with pytest.raises(_Crash):
        train(_model(), _data(), checkpoint_dir=ckdir, checkpoint_every=4, callback=crash_after_step_12, **RUN)
    assert latest_checkpoint_step(ckdir) == 12
    seen = []
    res = train(_model(), _data(), checkpoint_dir=ckdir, checkpoint_every=4, resume=True,
                callback=lambda s: seen.append(int(s.step)), **RUN)
    assert seen[0] == 14  # continued from step 12: nothing re-done, nothing skipped
    for a, b in zip(_leaves(res.state), _leaves(uninterrupted.state)):
        np.testing.assert_array_equal(a, b)
    assert res.state.ledger == uninterrupted.state.ledger
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(res.state.opt_state[0].key)),
                                  np.asarray(jax.random.key_data(uninterrupted.state.opt_state[0].key)))
    # Resuming a finished run does no further step and spends nothing more.
    again = train(_model(), _data(), checkpoint_dir=ckdir, resume=True, **RUN)
    assert again.state.ledger == uninterrupted.state.ledger
    for a, b in zip(_leaves(again.state), _leaves(uninterrupted.state)):
        np.testing.assert_array_equal(a, b)


def test_non_empty_dir_without_resume_and_other_config_refused(tmp_path):
    ckdir = tmp_path / "ck"
    small = dict(RUN, passes=1)
    train(_model(), _data(), checkpoint_dir=ckdir, **small)
    with pytest.raises(ValueError, match="resume=True"):
        train(_model(), _data(), checkpoint_dir=ckdir, **small)
    with pytest.raises(ValueError, match="different run configuration \\(noise_multiplier"):
        train(_model(), _data(), checkpoint_dir=ckdir, resume=True, **dict(small, noise_multiplier=2.0))


# The SIGKILL test, once per mechanism on the new API: a subprocess runs with a callback that sleeps
# after every jitted call, is killed once it has passed step KILL_AFTER (anywhere: mid-step, mid-save),
# and a second subprocess resumes it, then runs the same training uninterrupted (no checkpoints; the
# compiled programs are reused, which saves a third process). The resumed run's whole final state
# (parameters, optimiser state, keys as key data, counters) and whole ledger (the secret part too)
# must equal the uninterrupted run's.
KILLED = {
    # name: (model, mechanism, noise seed): 48 records, batches of 4 (12 steps per pass).
    "pnsgd": ("SoftmaxRegression(6, 3, rngs=nnx.Rngs(0))",
              "PNSGDMechanism(learning_rate=1.0, radius=5.0, noise_multiplier=1.0, batch_size=4, passes=2)", 7),
    # Seed 15 stops at the secret step 11 of 12.
    "pnsgd_random_stop": ("SoftmaxRegression(6, 3, rngs=nnx.Rngs(0))",
                          "PNSGDMechanism(learning_rate=1.0, radius=5.0, noise_multiplier=1.0, batch_size=4, "
                          "schedule='random_stop')", 15),
    "dpsgd": ("MLP((6, 4, 3), rngs=nnx.Rngs(0))",
              "DPSGDMechanism(clip_norm=1.0, noise_multiplier=1.0, learning_rate=0.1, batch_size=4, passes=2)", 7),
    "dpsbcd": ("LipschitzMLP((6, 8, 3), rngs=nnx.Rngs(0), max_spectral_norm=2.0)",
               "DPSBCDMechanism(learning_rate=0.05, clip_norm=1.0, contraction=1.0, noise_temperature=[1e-3, 1e-3], "
               "batch_size=4)", 7),
}
KILL_AFTER = 6

_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jaxdp.data import from_arrays
    from jaxdp.models import MLP, LipschitzMLP, SoftmaxRegression
    from jaxdp.training import DPSBCDMechanism, DPSGDMechanism, PNSGDMechanism, RunOptions, train

    model, mechanism, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ckdir, out, slow = sys.argv[4], sys.argv[5], sys.argv[6] == "slow"
    rng = np.random.default_rng(0)
    ds = from_arrays(rng.normal(size=(48, 6)), rng.integers(0, 3, size=48), test_fraction=0.0)

    def cb(state, ledger):
        print("STEP", int(state.step), flush=True)
        if slow:
            time.sleep(0.25)

    def save(res, path):
        leaves = [jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v
                  for v in jax.tree.leaves(res.state)]
        np.savez(path, *[np.asarray(v) for v in leaves])
        with open(path + ".json", "w") as f:
            json.dump(res.ledger._asdict(), f)

    options = RunOptions(steps_per_call=2, checkpoint_dir=ckdir, checkpoint_every=2, resume=True, progress=False,
                         account=False, callback=cb)
    save(train(eval(model), ds, eval(mechanism), order_seed=3, noise_seed=seed, options=options), out)
    if not slow:  # the reference: the same run, uninterrupted
        plain = RunOptions(steps_per_call=2, progress=False, account=False)
        save(train(eval(model), ds, eval(mechanism), order_seed=3, noise_seed=seed, options=plain), out + "_ref")
""")


def _run_script(script, name, ckdir, out, mode, **kw):
    model, mech, seed = KILLED[name]
    args = [sys.executable, str(script), model, mech, str(seed), str(ckdir), out, mode]
    return subprocess.Popen(args, **kw) if mode == "slow" else subprocess.run(args, **kw)


def _saved(out):
    with np.load(out + ".npz") as z:
        arrays = [z[f"arr_{i}"] for i in range(len(z.files))]
    with open(out + ".json") as f:
        return arrays, json.load(f)


@pytest.mark.parametrize("name", sorted(KILLED))
def test_sigkill_mid_run_then_resume_equals_uninterrupted(tmp_path, name):
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    ckdir, out = tmp_path / "ck", str(tmp_path / "final")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = _run_script(script, name, ckdir, out, "slow", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                       text=True, env=env)
    try:
        for line in proc.stdout:
            if line.startswith("STEP") and int(line.split()[1]) >= KILL_AFTER:
                break
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed_at = latest_checkpoint_step(ckdir)
    assert killed_at is not None and KILL_AFTER <= killed_at
    assert not os.path.exists(out + ".npz")
    done = _run_script(script, name, ckdir, out, "fast", capture_output=True, text=True, env=env, timeout=300,
                       check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("STEP")]
    assert steps and steps[0] == killed_at + 2  # resumed right after the last checkpoint
    got, got_ledger = _saved(out)
    want, want_ledger = _saved(out + "_ref")
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert got_ledger == want_ledger


# ----------------------------------------------------------------------------------------
# Tamper evidence, fallback to the newest intact checkpoint, no secret in names.
# ----------------------------------------------------------------------------------------

SMALL = dict(RUN, passes=1)  # 10 steps


def _crashed_run(ckdir, at=6, **kw):
    def crash(state):
        if int(state.step) >= at:
            raise _Crash

    with pytest.raises(_Crash):
        train(_model(), _data(), checkpoint_dir=ckdir, checkpoint_every=2, callback=crash, **dict(SMALL, **kw))


def _newest(ckdir):
    return max((p for p in ckdir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def test_edited_ledger_is_refused_in_one_line(tmp_path):
    ckdir = tmp_path / "ck"
    _crashed_run(ckdir)
    meta_file = _newest(ckdir) / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["ledger"]["steps_done"] = 1  # the fuzzing attack: spend less than was spent
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="integrity check") as err:
        train(_model(), _data(), checkpoint_dir=ckdir, checkpoint_every=2, resume=True, **SMALL)
    assert "\n" not in str(err.value)


def test_forged_ledger_with_a_valid_hash_is_refused(tmp_path):
    # Someone who recomputes the hash: the ledger is recomputed from the configuration and
    # the step counter, and the disagreement is refused.
    import shutil

    for field, value in (("steps_done", 2), ("noise_multiplier", 100.0)):
        ckdir = tmp_path / field
        _crashed_run(ckdir)
        names = json.loads((_newest(ckdir) / "meta" / "metadata").read_text())["_arrays"]
        ck = Checkpointer(ckdir)
        arrays, meta = ck.restore({k: np.zeros(shape, dtype) for k, (shape, dtype) in names.items()})
        meta = {k: v for k, v in meta.items() if k in ("ledger", "config", "_arrays")}
        meta["ledger"] = dict(meta["ledger"], **{field: value})
        ck.save(6, arrays, meta)  # a fresh, valid hash over the forged ledger
        ck.close()
        with pytest.raises(ValueError, match=f"disagrees with its configuration.*{field}") as err:
            train(_model(), _data(), checkpoint_dir=ckdir, checkpoint_every=2, resume=True, **SMALL)
        assert "\n" not in str(err.value) and "100" not in str(err.value)
        shutil.rmtree(ckdir)


def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path):
    ckdir = tmp_path / "ck"
    full = train(_model(), _data(), **SMALL)
    _crashed_run(ckdir)
    import shutil

    shutil.copytree(_newest(ckdir) / "state", ckdir / "10" / "state")  # a newest one without metadata
    (ckdir / "9").mkdir()  # an empty newer directory
    with pytest.warns(UserWarning, match="checkpoint 10 has no metadata; checkpoint 9 has no arrays"):
        res = train(_model(), _data(), checkpoint_dir=ckdir, checkpoint_every=2, resume=True, **SMALL)
    for a, b in zip(_leaves(res.state), _leaves(full.state)):
        np.testing.assert_array_equal(a, b)
    assert res.state.ledger == full.state.ledger


def test_truncated_checkpoint_is_reported_in_one_line(tmp_path):
    ckdir = tmp_path / "ck"
    _crashed_run(ckdir, at=2)  # a single checkpoint
    for p in (ckdir / "1" / "state").rglob("*"):
        if p.is_file() and p.stat().st_size > 0 and p.name != "commit_success.txt":
            p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    with pytest.raises(ValueError) as err:
        train(_model(), _data(), checkpoint_dir=ckdir, checkpoint_every=2, resume=True, **SMALL)
    msg = str(err.value)
    assert "\n" not in msg and len(msg) < 500 and ("intact" in msg or "integrity" in msg), msg


def test_random_stop_checkpoint_names_do_not_reveal_the_stopping_step(tmp_path):
    listings, sizes, stops = [], [], []
    for seed in (0, 3):
        ckdir = tmp_path / f"ck{seed}"
        res = train(_model(), _data(), checkpoint_dir=ckdir, checkpoint_every=1,
                    **dict(SMALL, schedule="random_stop", noise_seed=seed))
        stops.append(int(res.state.ledger.total_steps))
        listings.append(sorted(str(p.relative_to(ckdir)) for p in ckdir.rglob("*")
                               if "ocdbt" not in str(p) and p.parent.name != "d" and p.name != ".jaxdp.lock"))
        sizes.append((ckdir / listings[-1][0].split("/")[0] / "meta" / "metadata").stat().st_size)
        assert latest_checkpoint_step(ckdir) == stops[-1]  # the step is inside, for resuming
    assert stops[0] != stops[1]
    assert listings[0] == listings[1] and sizes[0] == sizes[1]
    # The steps after the stop are masked and saves happen at public positions: the listing is the one of a
    # whole pass of the fixed schedule.
    fixed = tmp_path / "fixed"
    train(_model(), _data(), checkpoint_dir=fixed, checkpoint_every=1, **dict(SMALL, passes=1, noise_seed=0))
    assert [p for p in listings[0] if "/" not in p] == sorted(p.name for p in fixed.iterdir() if p.name.isdigit())
