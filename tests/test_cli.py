"""The jaxdp command: outputs against the library's references, one-line errors, exit codes."""

import json
import math
import os
import subprocess
import sys

import pytest

from jaxdp.cli import main


def test_epsilon_text_and_json(capsys):
    assert main(["epsilon", "--q", "0.0042666667", "--noise-multiplier", "1.1", "--num-steps", "14040", "--delta", "1e-5"]) == 0
    out = capsys.readouterr().out
    assert "epsilon = 2.594363" in out  # notes 004 §3.2: 2.594363355
    assert main(["epsilon", "--q", "1", "--noise-multiplier", "5", "--num-steps", "1", "--delta", "1e-5", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["epsilon"] == pytest.approx(0.794522033, rel=1e-9)  # notes 004 §3.2


def test_calibrate(capsys):
    assert main(["calibrate", "--epsilon", "1", "--q", "0.0042666667", "--num-steps", "14040", "--delta", "1e-5", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["epsilon"] <= 1.0 and 2.17 < payload["noise_multiplier"] < 2.1785


def test_grid_writes_csv_and_png(tmp_path, capsys):
    rc = main(["grid", "--q", "1e-3:1e-1:3", "--noise-multiplier", "0.8,2", "--num-steps", "100:1000:2", "--delta", "1e-5",
               "--out", str(tmp_path), "--json"])
    assert rc == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["configurations"] == 12
    lines = (tmp_path / "epsilon_grid.csv").read_text().splitlines()
    assert lines[0] == "q,noise_multiplier,num_steps,delta,epsilon" and len(lines) == 13
    assert (tmp_path / "epsilon_grid.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["epsilon", "--q", "2", "--noise-multiplier", "1", "--num-steps", "10", "--delta", "1e-5"], "--q"),
        (["epsilon", "--q", "0.1", "--noise-multiplier", "0", "--num-steps", "10", "--delta", "1e-5"], "--noise-multiplier"),
        (["epsilon", "--q", "0.1", "--noise-multiplier", "1", "--num-steps", "-3", "--delta", "1e-5"], "--num-steps"),
        (["epsilon", "--q", "0.1", "--noise-multiplier", "1", "--num-steps", "10", "--delta", "1"], "--delta"),
        (["epsilon", "--q", "x", "--noise-multiplier", "1", "--num-steps", "10", "--delta", "0.1"], "--q"),
        (["epsilon", "--q", "0.1", "--noise-multiplier", "1", "--num-steps", "10", "--delta", "0.1", "--orders", "1,2"], "--orders"),
        (["calibrate", "--epsilon", "-1", "--q", "0.1", "--num-steps", "10", "--delta", "1e-5"], "--epsilon"),
        (["grid", "--q", "0:1:3", "--noise-multiplier", "1", "--num-steps", "10", "--delta", "1e-5"], "--q"),
        (["grid", "--q", "0.1", "--noise-multiplier", "-1,2", "--num-steps", "10", "--delta", "1e-5"], "--noise-multiplier"),
        (["epsilon", "--noise-multiplier", "1", "--num-steps", "10", "--delta", "0.1"], "--q"),
    ],
)
def test_bad_arguments_one_line_exit_2(argv, needle, capsys):
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse-level errors exit from the parser
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxdp: error:") and "\n" not in err and needle in err and "Traceback" not in err


def test_console_script_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "jaxdp", "epsilon", "--q", "0.5", "--noise-multiplier", "-1", "--num-steps", "1",
                           "--delta", "0.1"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("jaxdp: error: --noise-multiplier") and "Traceback" not in proc.stderr


def test_compilation_cache_folder_and_switch(tmp_path):
    """The command keeps compiled programs in JAXDP_CACHE_DIR, and 'off' writes nothing."""
    argv = [sys.executable, "-m", "jaxdp", "calibrate", "--epsilon", "1", "--q", "0.01", "--num-steps", "1000",
            "--delta", "1e-5", "--json"]
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    cache = tmp_path / "cache"
    first = subprocess.run(argv, capture_output=True, text=True, env={**env, "JAXDP_CACHE_DIR": str(cache)})
    assert first.returncode == 0, first.stderr
    assert any(cache.iterdir())  # the calibration's compilation (> 0.5 s) was written
    again = subprocess.run(argv, capture_output=True, text=True, env={**env, "JAXDP_CACHE_DIR": str(cache)})
    assert again.returncode == 0 and json.loads(again.stdout) == json.loads(first.stdout)
    off = tmp_path / "off"
    proc = subprocess.run(argv, capture_output=True, text=True,
                          env={**env, "JAXDP_CACHE_DIR": "off", "XDG_CACHE_HOME": str(off)})
    assert proc.returncode == 0 and not off.exists()


def test_old_option_names_are_gone(capsys):
    """One name per quantity: the noise multiplier is --noise-multiplier, never --sigma."""
    for argv in (["epsilon", "--q", "0.1", "--noise-multiplier", "1", "--num-steps", "10", "--delta", "1e-5",
                  "--sigma", "1"],
                 ["pnsgd", "--lipschitz", "1", "--smoothness", "1", "--learning-rate", "0.5", "--noise-std", "1",
                  "--diameter", "2", "--num-records", "10", "--delta", "1e-5", "--lr", "0.5"],
                 ["train", "--lr", "0.5"], ["train", "--epochs", "2"], ["train", "--seed", "1"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err


def test_grid_checks_the_output_folder_first(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc = main(["grid", "--q", "0.01", "--noise-multiplier", "1", "--num-steps", "10", "--delta", "1e-5",
               "--out", str(blocker / "sub")])
    assert rc == 2 and "--out cannot write" in capsys.readouterr().err


def test_train_checks_the_plot_path_before_training(tmp_path, capsys):
    rc = main(["train", "--smoke", "--plot", str(tmp_path / "missing" / "eps.png")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("jaxdp: error: --plot cannot write") and "Traceback" not in err


# ---------------------------------------------------------------------------------------
# `jaxdp train`
# ---------------------------------------------------------------------------------------


def _run_cli(argv):
    return main(argv)


@pytest.mark.parametrize(
    "argv, start",
    [
        (["--learning-rate", "3"], "jaxdp: error: --learning-rate must be"),
        (["--noise-multiplier", "0"], "jaxdp: error: --noise-multiplier must be in (0, inf)"),
        (["--batch-size", "5000"], "jaxdp: error: --batch-size must be <= the number of training examples"),
        (["--dataset", "mnist", "--data-path", "/nonexistent/mnist.npz"], "jaxdp: error: --data-path: MNIST data not"),
        (["--dataset", "mnist"], "jaxdp: error: --data-path is required"),
        (["--resume"], "jaxdp: error: --resume needs --checkpoint-dir"),
    ],
)
def test_cli_bad_arguments_give_one_line_and_status_2(capsys, argv, start):
    assert _run_cli(["train", "--plot", "none", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(start) and err.count("\n") == 1 and "Traceback" not in err


def test_cli_smoke_json_and_plot(tmp_path, capsys):
    import json

    plot = tmp_path / "eps.png"
    assert _run_cli(["train", "--smoke", "--json", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["analysis"] == "hidden-state" and out["model"] == "softmax" and out["dataset"] == "digits"
    assert out["amplified"]["worst"] <= out["composition"]["worst"]
    assert 0 < out["test_accuracy"] <= 1 and plot.stat().st_size > 0


# `jaxdp pnsgd`: the values are the accountant's (tests/accounting/test_pnsgd.py checks those)
BASE = ["pnsgd", "--lipschitz", "1", "--smoothness", "0.5", "--learning-rate", "0.5", "--noise-std", "2", "--diameter", "1",
        "--num-records", "40", "--delta", "1e-5"]


def test_pnsgd_json_and_table(capsys, tmp_path):
    assert main(BASE + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["epsilon"]["contraction"]["last"] == pytest.approx(4.37717809568, rel=1e-9)
    assert data["epsilon"]["best"]["worst_position"] == 40
    assert data["epsilon"]["best"]["first"] == 0.0
    plot = tmp_path / "eps.png"
    assert main(BASE + ["--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "contraction" in out and "worst" in out and "4.37718" in out
    assert plot.exists() and plot.stat().st_size > 1000


@pytest.mark.parametrize(
    "flag,value,name",
    [("--learning-rate", "5", "--learning-rate"), ("--noise-std", "0", "--noise-std"), ("--diameter", "-1", "--diameter"),
     ("--delta", "1.5", "--delta"), ("--strong-convexity", "0.9", "--strong-convexity")],
)
def test_pnsgd_invalid_arguments(capsys, flag, value, name):
    argv = list(BASE)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxdp: error:") and name in err[0]


# ---------------------------------------------------------------------------------------
# `jaxdp per-instance`
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dpsgd_run(tmp_path_factory):
    """A one-pass DP-SGD MLP run on digits, checkpointed (steps 0 and 23)."""
    folder = tmp_path_factory.mktemp("pi") / "ck"
    argv = ["train", "--algorithm", "dpsgd", "--model", "mlp", "--smoke", "--clip-norm", "5", "--plot", "none",
            "--insecure-noise-seed", "1", "--checkpoint-dir", str(folder), "--json"]
    assert main(argv) == 0
    return folder


def test_per_instance_checks_outputs_and_folder_first(tmp_path, capsys):
    rc = main(["per-instance", "--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "missing" / "a.csv")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("jaxdp: error: --out cannot write") and err.count("\n") == 1
    rc = main(["per-instance", "--checkpoint-dir", str(tmp_path / "none"), "--out", "none", "--histogram", "none"])
    err = capsys.readouterr().err
    assert rc == 2 and "--checkpoint-dir" in err and "no checkpoint" in err and err.count("\n") == 1


def test_per_instance_plumbing(dpsgd_run, tmp_path, capsys, monkeypatch):
    """The command's own work (model rebuilt from the checkpoint, norms, CSV, histogram, the
    guarantee printed first), with the accountant replaced by a stand-in: the accountants are
    tested against their references in tests/accounting and tests/training."""
    import numpy as np

    import jaxdp.accounting as A
    import jaxdp.training as T

    seen = {}

    def fake(norms, *, delta=None, r_grid=None):
        seen["norms"], seen["r_grid"] = norms, r_grid
        eps = 4.0 * norms.r.mean(axis=1)
        est = A.PerInstancePrivacy(eps, eps, eps[:, None], None, "estimate", ("ESTIMATE: stand-in",))
        return T.PerPointPrivacy(2.0, 1e-5, "dpsgd", "reason", est, est, norms.checkpoint_steps, 23)

    monkeypatch.setattr(T, "per_point_privacy", fake)
    csv, png = tmp_path / "p.csv", tmp_path / "h.png"
    rc = main(["per-instance", "--checkpoint-dir", str(dpsgd_run), "--r-grid", "1000", "--out", "none"])
    err = capsys.readouterr().err
    assert rc == 2 and "--r-grid must be a power of two" in err and err.count("\n") == 1
    assert main(["per-instance", "--checkpoint-dir", str(dpsgd_run), "--out", str(csv), "--histogram", str(png),
                 "--r-grid", "1024"]) == 0
    assert seen["r_grid"] == 1024
    out = capsys.readouterr().out
    assert out.startswith("NOT PRIVATE") and out.splitlines()[1].startswith("guarantee of the released model: epsilon = 2")
    norms = seen["norms"]
    assert norms.checkpoint_steps.tolist() == [0] and norms.r.shape == (1438, 1)
    assert np.all((norms.r > 0) & (norms.r <= 1)) and np.mean(norms.r < 1) > 0.5  # C = 5: mostly unclipped
    table = np.loadtxt(csv, delimiter=",", skiprows=1)
    np.testing.assert_allclose(table[:, 1], 4.0 * norms.r[:, 0], rtol=1e-8)
    share = np.mean(4.0 * norms.r[:, 0] < 2.0)
    assert f"{100 * share:.1f} % of 1438 records below the guarantee" in out
    assert png.stat().st_size > 0
    # A full disk while writing the CSV: one line naming it and the free space, exit 1 (issue 26).
    import errno

    from jaxdp.cli import per_instance

    def full(path, res):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(per_instance, "_write_csv", full)
    assert main(["per-instance", "--checkpoint-dir", str(dpsgd_run), "--out", str(csv), "--histogram", "none"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"jaxdp: error: no space left on the device writing '{csv}' (") and err.count("\n") == 1, err


@pytest.mark.slow  # compiles the Theorem 3.3 accountant (~25 s); the plumbing test above covers the rest
def test_per_instance_end_to_end(dpsgd_run, tmp_path, capsys):
    import numpy as np

    assert main(["per-instance", "--checkpoint-dir", str(dpsgd_run), "--out", str(tmp_path / "p.csv"),
                 "--histogram", "none", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["estimate"]["analysis"] == "thudi2024_theorem_3.3_estimate" and data["num_steps"] == 23
    assert any("ESTIMATE" in a for a in data["estimate"]["assumptions"])
    assert any("NOT a guarantee" in a for a in data["ledger"]["assumptions"])
    table = np.loadtxt(tmp_path / "p.csv", delimiter=",", skiprows=1)
    assert np.all(table[:, 3] == pytest.approx(data["epsilon"]))
    assert np.all(table[:, 2] <= data["epsilon"] * 1.05)  # the realised ledger (17 orders) vs the guarantee (156)


# ---------------------------------------------------------------------------------------
# Fuzzing failures: extreme inputs, lost work, edited checkpoints
# ---------------------------------------------------------------------------------------

EPS = ["epsilon", "--q", "0.01", "--num-steps", "1000"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        ([*EPS, "--noise-multiplier", "1.1", "--delta", "1e-320"], "--delta must be in [2.2250738585072014e-308, 1)"),
        ([*EPS, "--noise-multiplier", "nan", "--delta", "1e-5"], "--noise-multiplier"),
        (["grid", "--q", ",", "--noise-multiplier", "1", "--num-steps", "10", "--delta", "1e-5"], "--q"),
        (["grid", "--q", "0.1", "--noise-multiplier", "1", "--num-steps", "10", "--delta", "1e-320"], "--delta"),
        (["train", "--smoke", "--plot", "eps.notanimage"], "--plot"),
    ],
)
def test_edge_inputs_one_line_exit_2(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxdp: error:") and "\n" not in err and needle in err, err


def test_extreme_noise_multipliers_give_zero_and_inf(capsys):
    assert main([*EPS, "--noise-multiplier", "1e300", "--delta", "1e-5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["epsilon"] == 0.0  # sigma -> inf: epsilon -> 0
    assert main([*EPS, "--noise-multiplier", "1e-300", "--delta", "1e-5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["epsilon"] == "inf"  # not certifiable: +inf (strict JSON: a string)


def test_grid_heat_map_failure_keeps_the_results(tmp_path, capsys, monkeypatch):
    from jaxdp.cli import grid

    def broken(*a, **k):
        raise RuntimeError("no display\nsecond line")

    monkeypatch.setattr(grid, "_heatmap", broken)
    rc = main(["grid", "--q", "0.01,0.02", "--noise-multiplier", "1", "--num-steps", "10", "--delta", "1e-5",
               "--out", str(tmp_path)])
    cap = capsys.readouterr()
    assert rc == 1 and "epsilon from" in cap.out and (tmp_path / "epsilon_grid.csv").exists()
    assert cap.err.count("\n") == 1 and "heat map" in cap.err and "second line" not in cap.err


def test_train_plot_failure_keeps_the_result_and_edited_checkpoint_is_refused(tmp_path, capsys, monkeypatch):
    from jaxdp.cli import train as train_cli

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(train_cli, "_plot", broken)
    ck = tmp_path / "ck"
    rc = main(["train", "--smoke", "--plot", str(tmp_path / "eps.png"), "--checkpoint-dir", str(ck)])
    cap = capsys.readouterr()
    assert rc == 1 and "guarantee of the released model: epsilon =" in cap.out  # the result came first
    assert cap.err.count("\n") == 1 and "--plot cannot write" in cap.err
    # Edit the ledger of the saved checkpoint (the fuzzing attack), then resume: refused in one line.
    meta_file = max((p for p in ck.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)) / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["ledger"]["noise_multiplier"] = 100.0
    meta_file.write_text(json.dumps(meta))
    rc = main(["train", "--smoke", "--plot", "none", "--checkpoint-dir", str(ck), "--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("jaxdp: error:") and err.count("\n") == 1 and "integrity" in err, err


def test_calibrate_says_when_the_target_is_met_at_the_lower_bound(capsys):
    argv = ["calibrate", "--epsilon", "1e6", "--q", "0.01", "--num-steps", "1000", "--delta", "1e-5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "any noise multiplier >= 0.05 meets the target; the smallest searched is 0.05" in out
    assert main(argv + ["--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["at_lower_bound"] is True and payload["noise_multiplier"] == 0.05


@pytest.mark.slow  # compiles the PLD calibration (about a minute); the PLD accountant has its own tests
def test_calibrate_with_the_pld_accountant(capsys):
    """Independent reference: dp_accounting's PLD accountant at the returned noise multiplier."""
    from dp_accounting import dp_event, pld

    argv = ["calibrate", "--epsilon", "1", "--q", str(256 / 60000), "--num-steps", "14040", "--delta", "1e-5", "--json"]
    assert main(argv) == 0
    rdp = json.loads(capsys.readouterr().out)
    assert main([*argv, "--accountant", "pld"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["accountant"] == "pld" and got["epsilon"] <= 1.0 and got["noise_multiplier"] < rdp["noise_multiplier"]
    acc = pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_event.PoissonSampledDpEvent(256 / 60000, dp_event.GaussianDpEvent(got["noise_multiplier"])), 14040)
    assert acc.get_epsilon(1e-5) <= 1.0 * (1 + 5e-3)


def test_json_output_is_strict_for_non_finite_numbers(capsys):
    # `--json` must parse with a strict JSON parser: +inf (an uncertifiable bound) is the string "inf".
    import argparse

    from jaxdp.cli._common import emit

    emit(argparse.Namespace(json=True), {"epsilon": float("inf"), "rows": [float("-inf"), 1.5], "x": float("nan")}, [])

    def refuse(name):
        raise ValueError(name)

    payload = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert payload == {"epsilon": "inf", "rows": ["-inf", 1.5], "x": "nan"}


def test_train_devices_option_is_checked_before_training(capsys):
    assert main(["train", "--smoke", "--devices", "0", "--plot", "none"]) == 2
    assert "--devices must be an integer >= 1" in capsys.readouterr().err
    assert main(["train", "--smoke", "--devices", "4096", "--plot", "none"]) == 2
    err = capsys.readouterr().err
    assert "--devices must be an integer in [1," in err and "Traceback" not in err
    assert main(["train", "--smoke", "--algorithm", "dpsbcd", "--model", "mlp", "--devices", "1"]) == 2
    assert "not supported with --algorithm dpsbcd" in capsys.readouterr().err


def test_train_dpsgd_target_epsilon(capsys):
    """--target-epsilon calibrates DP-SGD's noise multiplier for the run's q and steps."""
    import jaxdp.accounting as A

    argv = ["train", "--algorithm", "dpsgd", "--model", "softmax", "--smoke", "--batch-size", "128", "--plot", "none",
            "--target-epsilon", "2", "--insecure-noise-seed", "0", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    led = data["ledger"]
    steps = math.ceil(1438 / 128)  # one pass of the 1,438 training digits
    ref = A.calibrate_noise_multiplier(2.0, 128 / 1438, steps, 1e-5).noise_multiplier
    assert led["noise_multiplier"] == pytest.approx(float(ref), rel=1e-12) and led["total_steps"] == steps
    assert data["epsilon_worst"] <= 2.0
    assert data["epsilon_worst"] == pytest.approx(float(A.dpsgd_epsilon(128 / 1438, ref, steps, 1e-5)), rel=1e-12)
    for extra, needle in ((["--noise-multiplier", "2"], "not both"), (["--target-epsilon", "0"], "positive")):
        bad = [a for a in argv if a != "--json"]
        if extra[0] == "--target-epsilon":
            bad = bad[:bad.index("--target-epsilon")] + bad[bad.index("--target-epsilon") + 2:]
        assert main(bad + extra) == 2
        assert needle in capsys.readouterr().err
    assert main(["train", "--target-epsilon", "1", "--smoke", "--plot", "none", "--json"]) == 0  # PNSGD too
    assert 0.98 <= json.loads(capsys.readouterr().out)["epsilon_worst"] <= 1.0
    assert main(["train", "--algorithm", "dpsbcd", "--model", "mlp", "--noise-temperature", "1e-3", "--contraction",
                 "1", "--target-epsilon", "1", "--smoke", "--plot", "none"]) == 2
    assert "give --noise-temperature" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# Issue 26: data files, checkpoint folders and a full disk, each in one line naming the option
# ---------------------------------------------------------------------------------------


def _one_line(capsys, rc_expected, *words):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxdp: error:") and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


def _no_training(monkeypatch):
    import jaxdp.training as T

    def refuse(*a, **k):
        raise AssertionError("the bad option must be refused before training")

    monkeypatch.setattr(T, "train", refuse)


def test_train_damaged_data_file_names_the_option_and_file(tmp_path, capsys, monkeypatch):
    _no_training(monkeypatch)
    bad = tmp_path / "mnist.npz"
    bad.write_bytes(b"\x80\x04garbage that numpy would try to unpickle")
    assert main(["train", "--dataset", "mnist", "--data-path", str(bad), "--plot", "none"]) == 2
    err = _one_line(capsys, 2, f"--data-path '{bad}' is not a .npz archive", "expected a NumPy .npz archive")
    assert "pickle" not in err
    import numpy as np

    rng = np.random.default_rng(0)
    np.savez(bad, x_train=rng.integers(0, 256, (4, 28, 28)), y_train=np.arange(4), x_test=np.zeros((2, 14, 14)),
             y_test=np.arange(2))
    assert main(["train", "--dataset", "mnist", "--data-path", str(bad), "--plot", "none"]) == 2
    err = _one_line(capsys, 2, f"--data-path '{bad}': x_test must hold 28x28 images")
    assert "--x-test" not in err  # before: the array's name was turned into an option that does not exist


def test_train_checkpoint_folder_file_or_read_only_fails_before_training(tmp_path, capsys, monkeypatch):
    _no_training(monkeypatch)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["train", "--smoke", "--plot", "none", "--checkpoint-dir", str(blocker)]) == 2
    _one_line(capsys, 2, f"--checkpoint-dir '{blocker}' is a file, not a folder")
    import errno
    import tempfile

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)  # root ignores permission bits: simulate the mount
    assert main(["train", "--smoke", "--plot", "none", "--checkpoint-dir", str(tmp_path / "ck")]) == 2
    _one_line(capsys, 2, "--checkpoint-dir cannot write to", "Read-only file system")


def test_per_instance_data_of_another_run_and_damaged_files(dpsgd_run, tmp_path, capsys):
    import numpy as np

    rng = np.random.default_rng(0)
    other = tmp_path / "mnist.npz"
    np.savez(other, x_train=rng.integers(0, 256, (5, 28, 28)), y_train=np.arange(5), x_test=rng.integers(0, 256, (3, 28, 28)),
             y_test=np.arange(3))
    argv = ["per-instance", "--checkpoint-dir", str(dpsgd_run), "--out", "none", "--histogram", "none"]
    assert main([*argv, "--data", str(other)]) == 2
    # Before: the parameter signature's repr, cut off at its first line.
    _one_line(capsys, 2, f"--data '{other}' is not the training data of the run in --checkpoint-dir",
              "1438 records of 64 features", "5 records of 784")
    other.write_bytes(b"")
    assert main([*argv, "--data", str(other)]) == 2
    _one_line(capsys, 2, f"--data '{other}' is an empty file")
    assert main(["per-instance", "--checkpoint-dir", str(other), "--out", "none", "--histogram", "none"]) == 2
    _one_line(capsys, 2, f"--checkpoint-dir '{other}' is a file, not a folder")


def test_disk_full_is_found_through_wrapping_exceptions(tmp_path):
    import errno

    from jaxdp.cli._common import disk_full

    inner = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ck" / "0" / "state"))
    try:
        try:
            raise inner
        except OSError as e:
            raise RuntimeError("orbax: save failed") from e
    except RuntimeError as outer:
        msg = disk_full(outer)
    assert msg.startswith(f"no space left on the device writing '{tmp_path / 'ck' / '0' / 'state'}' (")
    assert " free)" in msg and "\n" not in msg
    assert disk_full(ValueError("x")) is None and disk_full(OSError(errno.EACCES, "denied")) is None
    group = ExceptionGroup("async", [ValueError("x"), OSError(errno.ENOSPC, "No space left on device")])
    assert disk_full(group).startswith("no space left on the device (")


def test_train_full_disk_in_a_checkpoint_write_one_line_exit_1(tmp_path, capsys, monkeypatch):
    import errno

    from jaxdp.training import _checkpoint

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.directory))

    monkeypatch.setattr(_checkpoint.Checkpointer, "save", full)
    assert main(["train", "--smoke", "--plot", "none", "--checkpoint-dir", str(tmp_path / "ck")]) == 1
    _one_line(capsys, 1, "jaxdp: error: no space left on the device writing", " free)")
