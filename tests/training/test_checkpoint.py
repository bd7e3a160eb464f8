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


_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import jax, numpy as np
    from flax import nnx
    from jaxdp.data import from_arrays
    from jaxdp.models import LogisticRegression
    from jaxdp.training import train

    ckdir, out, slow = sys.argv[1], sys.argv[2], sys.argv[3] == "slow"
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5))
    ds = from_arrays(x, (x[:, 0] > 0).astype(np.int32), test_fraction=0.0)

    def cb(state):
        print("STEP", int(state.step), flush=True)
        if slow:
            time.sleep(0.25)

    res = train(LogisticRegression(5, rngs=nnx.Rngs(0)), ds, learning_rate=0.5, noise_multiplier=1.0,
                radius=1.0, batch_size=4, passes=3, steps_per_call=2, order_seed=7, noise_seed=7, progress=False, account=False,
                checkpoint_dir=ckdir, checkpoint_every=2, resume=True, callback=cb)
    np.savez(out, *[np.asarray(v) for v in jax.tree.leaves(res.state.params)])
    with open(out + ".json", "w") as f:
        json.dump(res.state.ledger.to_json(), f)
""")


def test_sigkill_mid_run_then_resume_equals_uninterrupted(tmp_path, uninterrupted):
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    ckdir, out = tmp_path / "ck", str(tmp_path / "final")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(script), str(ckdir), out, "slow"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        for line in proc.stdout:
            if line.startswith("STEP") and int(line.split()[1]) >= 10:
                break
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed_at = latest_checkpoint_step(ckdir)
    assert killed_at is not None and 10 <= killed_at < 30
    assert not os.path.exists(out + ".npz")
    done = subprocess.run([sys.executable, str(script), str(ckdir), out, "fast"], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("STEP")]
    assert steps[0] == killed_at + 2 and steps[-1] == 30  # resumed right after the last checkpoint
    with np.load(out + ".npz") as z:
        got = [z[f"arr_{i}"] for i in range(len(z.files))]
    for a, b in zip(got, _leaves(uninterrupted.state)):
        np.testing.assert_array_equal(a, b)
    with open(out + ".json") as f:
        assert json.load(f) == json.loads(json.dumps(uninterrupted.state.ledger.to_json()))
