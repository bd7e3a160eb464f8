"""``jaxdp audit``: results printed and written before the plot, paths checked first, one-line errors."""

import csv

import pytest

from jaxdp.cli.main import main


def test_audit_command_prints_writes_and_plots(tmp_path, capsys):
    # 20000 runs at delta 1e-3: the shapes of tests/audit/test_drivers.py (one compiled program).
    rc = main(["audit", "--settings", "gaussian", "--runs", "20000", "--delta", "1e-3", "--seed", "0",
               "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "claimed eps" in out and "gaussian" in out and "WARNING" not in out
    rows = list(csv.DictReader(open(tmp_path / "audit.csv")))
    assert len(rows) == 1
    claimed, lower = float(rows[0]["claimed_epsilon"]), float(rows[0]["lower_bound"])
    assert 0 < lower <= claimed
    assert float(rows[0]["ratio"]) == pytest.approx(lower / claimed)
    assert (tmp_path / "audit.png").stat().st_size > 0


@pytest.mark.parametrize("argv,needle", [
    (["--settings", "nope"], "--settings"),
    (["--runs", "1"], "--runs"),
    (["--confidence", "1.5"], "--confidence"),
    (["--delta", "0"], "--delta"),
])
def test_audit_command_rejects_bad_options_in_one_line(argv, needle, tmp_path, capsys):
    rc = main(["audit", "--out", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_audit_command_checks_out_before_work(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc = main(["audit", "--out", str(blocker / "sub")])
    err = capsys.readouterr().err
    assert rc == 2 and "--out" in err
