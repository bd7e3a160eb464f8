"""Every example runs end to end in its --smoke mode (their claims are assertions)."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted(pathlib.Path(__file__).resolve().parent.parent.joinpath("examples").glob("[0-9]*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_smoke(path, tmp_path):
    proc = subprocess.run([sys.executable, str(path), "--smoke", *(["--out", str(tmp_path)] if "--out" in path.read_text() else [])],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
