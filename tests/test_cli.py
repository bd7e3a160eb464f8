"""The jaxdp command: outputs against the library's references, one-line errors, exit codes."""

import json
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


def test_calibrate_says_when_the_target_is_met_at_the_lower_bound(capsys):
    argv = ["calibrate", "--epsilon", "1e6", "--q", "0.01", "--num-steps", "1000", "--delta", "1e-5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "any noise multiplier >= 0.05 meets the target; the smallest searched is 0.05" in out
    assert main(argv + ["--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["at_lower_bound"] is True and payload["noise_multiplier"] == 0.05
