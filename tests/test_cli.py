"""The jaxdp command: outputs against the library's references, one-line errors, exit codes."""

import json
import os
import subprocess
import sys

import pytest

from jaxdp.cli import main


def test_epsilon_text_and_json(capsys):
    assert main(["epsilon", "--q", "0.0042666667", "--sigma", "1.1", "--steps", "14040", "--delta", "1e-5"]) == 0
    out = capsys.readouterr().out
    assert "epsilon = 2.594363" in out  # notes 004 §3.2: 2.594363355
    assert main(["epsilon", "--q", "1", "--sigma", "5", "--steps", "1", "--delta", "1e-5", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["epsilon"] == pytest.approx(0.794522033, rel=1e-9)  # notes 004 §3.2


def test_calibrate(capsys):
    assert main(["calibrate", "--epsilon", "1", "--q", "0.0042666667", "--steps", "14040", "--delta", "1e-5", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["epsilon"] <= 1.0 and 2.17 < payload["sigma"] < 2.1785


def test_grid_writes_csv_and_png(tmp_path, capsys):
    rc = main(["grid", "--q", "1e-3:1e-1:3", "--sigma", "0.8,2", "--steps", "100:1000:2", "--delta", "1e-5",
               "--out", str(tmp_path), "--json"])
    assert rc == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["configurations"] == 12
    lines = (tmp_path / "epsilon_grid.csv").read_text().splitlines()
    assert lines[0] == "q,sigma,steps,delta,epsilon" and len(lines) == 13
    assert (tmp_path / "epsilon_grid.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["epsilon", "--q", "2", "--sigma", "1", "--steps", "10", "--delta", "1e-5"], "--q"),
        (["epsilon", "--q", "0.1", "--sigma", "0", "--steps", "10", "--delta", "1e-5"], "--sigma"),
        (["epsilon", "--q", "0.1", "--sigma", "1", "--steps", "-3", "--delta", "1e-5"], "--steps"),
        (["epsilon", "--q", "0.1", "--sigma", "1", "--steps", "10", "--delta", "1"], "--delta"),
        (["epsilon", "--q", "x", "--sigma", "1", "--steps", "10", "--delta", "0.1"], "--q"),
        (["epsilon", "--q", "0.1", "--sigma", "1", "--steps", "10", "--delta", "0.1", "--orders", "1,2"], "--orders"),
        (["calibrate", "--epsilon", "-1", "--q", "0.1", "--steps", "10", "--delta", "1e-5"], "--epsilon"),
        (["grid", "--q", "0:1:3", "--sigma", "1", "--steps", "10", "--delta", "1e-5"], "--q"),
        (["grid", "--q", "0.1", "--sigma", "-1,2", "--steps", "10", "--delta", "1e-5"], "--sigma"),
        (["epsilon", "--sigma", "1", "--steps", "10", "--delta", "0.1"], "--q"),
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
    proc = subprocess.run([sys.executable, "-m", "jaxdp", "epsilon", "--q", "0.5", "--sigma", "-1", "--steps", "1",
                           "--delta", "0.1"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("jaxdp: error: --sigma") and "Traceback" not in proc.stderr


def test_compilation_cache_folder_and_switch(tmp_path):
    """The command keeps compiled programs in JAXDP_CACHE_DIR, and 'off' writes nothing."""
    argv = [sys.executable, "-m", "jaxdp", "calibrate", "--epsilon", "1", "--q", "0.01", "--steps", "1000",
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
