"""What a fresh process imports: the command parses before JAX, the accountants load no trainer.

Each check runs in a new interpreter and reads ``sys.modules`` there (the test process has
long imported everything). Times are measured in ``benchmarks/first_answer.py``, not here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("flax", "optax", "orbax", "matplotlib", "sklearn", "jaxdp.training", "jaxdp.models")
# Accountant modules a first dpsgd_epsilon does not need (public names load on first use).
NOT_FOR_DPSGD = ("jaxdp.accounting._pld", "jaxdp.accounting._accountants", "jaxdp.accounting._pnsgd")


def _modules_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; return which watched modules it left imported."""
    probe = (f"{code}\nimport json, sys\n"
             f"print(json.dumps({{m: m in sys.modules for m in {('jax', *HEAVY, *NOT_FOR_DPSGD)!r}}}))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_jaxdp_loads_no_jax():
    loaded = _modules_after("import jaxdp")
    assert not any(loaded.values()), loaded


def test_accounting_loads_no_trainer_flax_optax_orbax_or_matplotlib():
    loaded = _modules_after("import jaxdp.accounting\nimport jaxdp\njaxdp.accounting.dpsgd_epsilon")
    assert loaded["jax"]
    assert not any(loaded[m] for m in HEAVY), loaded
    assert not any(loaded[m] for m in NOT_FOR_DPSGD), loaded  # issue 21: a fresh process's first ε


def test_accounting_freezes_the_collector_at_exit_only():
    """Importing the accountants registers ``gc.freeze`` with atexit: nothing frozen while the
    program runs; frozen when exit handlers registered before the import run (after it), so
    Python's final collections skip JAX's objects (issue 21: ~0.2 s of a fresh process)."""
    code = ("import atexit, gc, sys\n"
            "atexit.register(lambda: print('at exit', gc.get_freeze_count() > 0, flush=True))\n"
            "import jaxdp.accounting\n"
            "print('running', gc.get_freeze_count() > 0, flush=True)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["running False", "at exit True"], proc.stdout
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "JAXDP_GC_FREEZE_AT_EXIT": "0"}, cwd=ROOT)
    assert proc.stdout.split("\n")[:2] == ["running False", "at exit False"], proc.stdout  # the opt-out


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["epsilon", "--help"],
    ["epsilon", "--q", "0.5"],  # a required option is missing
    ["epsilon", "--q", "2", "--noise-multiplier", "1", "--num-steps", "10", "--delta", "1e-5"],
    ["calibrate", "--epsilon", "0", "--q", "0.1", "--num-steps", "10", "--delta", "1e-5"],
    ["epsilon", "--q", "0.1", "--noise-multiplier", "1", "--num-steps", "10", "--delta", "nan"],
])
def test_command_parses_and_reports_before_importing_jax(argv):
    code = ("import contextlib, io, sys\nfrom jaxdp.cli import main\n"
            "err = io.StringIO()\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):\n"
            "    try:\n"
            f"        rc = main({argv!r})\n"
            "    except SystemExit as exc:\n"
            "        rc = exc.code\n"
            "assert rc in (0, 2), rc\n"
            "assert rc == 0 or err.getvalue().startswith('jaxdp: error:'), err.getvalue()")
    loaded = _modules_after(code)
    assert not any(loaded.values()), loaded
