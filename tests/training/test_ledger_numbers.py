"""The PNSGD ledger's reports keep every number of main before the ledger moved onto accounting calls.

``ledger_reports_main.json`` was written by this module's ``__main__`` on main at aa993ac
(before per-record PNSGD ε moved from ``training/_ledger.py`` into ``jaxdp.accounting``):
each case is a :class:`PrivacyLedger` and the :class:`PrivacyReport` main gave for it. The
cases cover fixed schedules (first pass partial, pass ends, mid-pass after the first pass,
a smaller last batch, strong convexity, b = 1), runs demoted to composition, and random
stopping with and without batches. The reports must agree to 1e-12 (relative), every
analysis, every position. Regenerate only on purpose: ``python -m tests.training.test_ledger_numbers out.json``.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

from jaxdp.training._ledger import DPSBCDLedger, PrivacyLedger, privacy_report

_DATA = pathlib.Path(__file__).with_name("ledger_reports_main.json")

_BASE = dict(analysis="hidden-state", reason="convex", convex=True, lipschitz=2.0, smoothness=1.0,
             strong_convexity=0.0, learning_rate=1.0, noise_multiplier=2.0, noise_std=2.0, clip_norm=2.0,
             lipschitz_bound=2.0, diameter=2.0, records=8, unused=0, batch_size=4, passes=1, steps_per_pass=2,
             schedule="fixed", order_seed=0, fixed_noise_seed=False, total_steps=2, steps_done=2, delta=1e-5,
             clipped=0, max_grad_norm=1.5, intermediates_released=False)

_STOP = dict(analysis="random-stop", schedule="random_stop")
_COMP = dict(analysis="composition", smoothness=None)
CASES = {
    "fixed_b4_full": dict(),
    "fixed_b4_zero": dict(steps_done=0),
    "fixed_b4_half": dict(steps_done=1),
    "fixed_n10_b4_lastsmall": dict(records=10, steps_done=3, total_steps=3),
    "fixed_n10_b4_partial": dict(records=10, steps_done=2, total_steps=3),
    "fixed_2pass_end": dict(records=10, passes=2, steps_done=6, total_steps=6, learning_rate=0.5,
                            strong_convexity=0.3, noise_std=1.3),
    "fixed_2pass_mid": dict(records=10, passes=2, steps_done=4, total_steps=6, learning_rate=0.5, noise_std=1.3),
    "fixed_3pass_after1": dict(records=12, batch_size=3, passes=3, steps_done=4, total_steps=12, noise_std=0.7),
    "composition_demoted": dict(**_COMP, reason="clipped", records=10, steps_done=3),
    "composition_2pass": dict(**_COMP, reason="nonconvex", records=10, passes=2, steps_done=6),
    "composition_first_partial": dict(**_COMP, reason="nonconvex", records=10, steps_done=1),
    "fixed_b1": dict(records=20, batch_size=1, steps_done=20, total_steps=20, noise_std=3.0, learning_rate=0.4,
                     smoothness=2.0),
    "sc_b1": dict(records=15, batch_size=1, steps_done=15, strong_convexity=0.5, smoothness=2.0, learning_rate=0.5,
                  noise_std=1.5),
    "stop_b4": dict(**_STOP, records=10, steps_done=2, total_steps=2),
    "stop_b1": dict(**_STOP, records=20, batch_size=1, steps_done=7, total_steps=13, noise_std=1.0,
                    learning_rate=0.5, strong_convexity=0.2),
    "stop_b5_sc": dict(**_STOP, records=23, batch_size=5, steps_done=1, total_steps=4, noise_std=0.8,
                       learning_rate=0.6, strong_convexity=0.4, smoothness=1.5, delta=1e-6),
    "stop_b3_composition": dict(**_COMP, reason="clipped", schedule="random_stop", records=11, batch_size=3,
                                steps_done=2, total_steps=3),
    "stop_fixed_seed": dict(**_STOP, records=9, batch_size=2, fixed_noise_seed=True, steps_done=1, total_steps=5),
}


def _ledger(**kw) -> PrivacyLedger:
    d = dict(_BASE, **kw)
    d["steps_per_pass"] = -(-d["records"] // d["batch_size"])
    return PrivacyLedger(**d)


def _arr(x):
    return None if x is None else np.asarray(x, np.float64).tolist()


def _report_dict(ledger: PrivacyLedger) -> dict:
    r = privacy_report(ledger)
    return dict(ledger=ledger._asdict(), analysis=r.analysis, reason=r.reason, delta=r.delta, steps_done=r.steps_done,
                positions=np.asarray(r.positions).tolist(), epsilon=_arr(r.epsilon), composition=_arr(r.composition),
                amplified=_arr(r.amplified), by_analysis={k: _arr(v) for k, v in r.by_analysis.items()},
                unused=r.unused, exact=bool(r.exact), not_private=bool(r.not_private), table=r.table())


def _close(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-12, atol=0, err_msg=what)


@pytest.fixture(scope="module")
def main_reports():
    return json.loads(_DATA.read_text())


def test_cases_match_the_recorded_ledgers(main_reports):
    assert set(main_reports) == set(CASES)
    for name, kw in CASES.items():
        # A ledger written before Poisson batches reads back with the fixed order's defaults.
        assert PrivacyLedger.from_json(main_reports[name]["ledger"]) == _ledger(**kw), name
        assert _ledger(**kw).sampling == "sequential" and "sampling" not in _ledger(**kw).public()


@pytest.mark.parametrize("name", sorted(CASES))
def test_report_numbers_unchanged(name, main_reports):
    want = main_reports[name]
    got = _report_dict(_ledger(**CASES[name]))
    for key in ("analysis", "reason", "delta", "steps_done", "positions", "unused", "exact", "not_private", "table"):
        assert got[key] == want[key], (name, key)
    for key in ("epsilon", "composition", "amplified"):
        _close(got[key], want[key], f"{name}.{key}")
    assert list(got["by_analysis"]) == list(want["by_analysis"]), name
    for k in want["by_analysis"]:
        _close(got["by_analysis"][k], want["by_analysis"][k], f"{name}.by_analysis[{k}]")


# ---------------------------------------------------------------------------------------
# DP-SBCD: ledger_reports_dpsbcd_main.json, main's reports (aa993ac) of DPSBCD_CASES (pinned
# for the day its composition bound, still computed in training/_ledger_dp.py, moves into
# jaxdp.accounting).
# ---------------------------------------------------------------------------------------

_DPSBCD_DATA = pathlib.Path(__file__).with_name("ledger_reports_dpsbcd_main.json")


def _dpsbcd_ledger(steps_done, temps, passes=2, n=12, b=3, unused=1) -> DPSBCDLedger:
    return DPSBCDLedger(analysis="dpsbcd", reason="lsi", learning_rate=0.05, noise_temperature=temps,
                        sensitivity=[2.0, 2.0], contraction=[1.0, 0.9], prox_lipschitz=[1.0, 1.0 / 1.01],
                        clip_norm=1.0, weight_decay=0.01, penalty=1.0, records=n, unused=unused, batch_size=b,
                        passes=passes, steps_per_pass=n // b, total_steps=passes * (n // b), steps_done=steps_done,
                        delta=1e-5, order_seed=0, fixed_noise_seed=False, max_grad_norm=1.0)


DPSBCD_CASES = {
    **{f"per_pass_s{s}": (s, [1e-3, 2e-3]) for s in (0, 2, 4, 6, 8)},
    **{f"per_step_s{s}": (s, [[1e-3, 1.5e-3, 2e-3, 1e-3], [2e-3, 2e-3, 3e-3, 1e-3]]) for s in (0, 2, 4, 6, 8)},
    "three_pass_s8": (8, [1e-3, 2e-3, 4e-3], 3),
}


def test_dpsbcd_report_numbers_unchanged():
    want_all = json.loads(_DPSBCD_DATA.read_text())
    assert set(want_all) == set(DPSBCD_CASES)
    for name, args in DPSBCD_CASES.items():
        led, want = _dpsbcd_ledger(*args), want_all[name]
        assert led._asdict() == want["ledger"], name
        r = privacy_report(led)
        assert (r.analysis, r.reason, bool(r.exact), r.steps_done, r.table()) == (
            want["analysis"], want["reason"], want["exact"], want["steps_done"], want["table"]), name
        for key in ("epsilon", "composition", "amplified"):
            _close(None if getattr(r, key) is None else np.asarray(getattr(r, key)).tolist(), want[key],
                   f"{name}.{key}")
        assert list(r.by_analysis) == list(want["by_analysis"]), name
        for k, v in want["by_analysis"].items():
            _close(np.asarray(r.by_analysis[k]).tolist(), v, f"{name}.by_analysis[{k}]")


if __name__ == "__main__":  # regenerate (on purpose only): python -m tests.training.test_ledger_numbers out.json
    out = {name: _report_dict(_ledger(**kw)) for name, kw in CASES.items()}
    pathlib.Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
