"""PNSGD's analyses take the run's record (a PNSGD event); random stopping with mini-batches per record.

The record door must give exactly what the loose-argument door gave (kept one release,
with a DeprecationWarning). Random stopping with batches is checked against the theorem
functions themselves (Asoodeh et al. Theorem 5, Feldman et al. Theorem 26, the Gaussian
mechanism), each tested against independent references in test_contraction.py,
test_iteration.py and test_hockey_stick; the ledger's numbers against main's in
tests/training/test_ledger_numbers.py.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import jaxdp.accounting as A

DELTA = 1e-5
RUN = dict(lipschitz=1.0, smoothness=0.5, learning_rate=0.5, noise_std=2.0, diameter=1.0)


def _event(**kw):
    return A.PNSGD(RUN["lipschitz"], RUN["smoothness"], RUN["learning_rate"], RUN["noise_std"], RUN["diameter"], **kw)


# Eight records or fewer everywhere: one padded size, so every test reuses the compiled programs.
@pytest.mark.parametrize("kw", [dict(num_records=8), dict(num_records=7, batch_size=3, passes=2, strong_convexity=0.2)])
def test_record_and_loose_doors_agree_and_the_loose_one_warns(kw):
    new = A.pnsgd_privacy(_event(**kw), DELTA)
    with pytest.warns(DeprecationWarning, match=r"pnsgd_privacy\(PNSGD\("):
        old = A.pnsgd_privacy(**RUN, **kw, delta=DELTA)
    for name in A.PNSGDPrivacy._fields:
        np.testing.assert_array_equal(np.asarray(getattr(new, name)), np.asarray(getattr(old, name)), err_msg=name)


def test_calibration_record_and_loose_doors_agree():
    run = _event(num_records=8, batch_size=2)
    new = float(A.calibrate_pnsgd_noise_std(1.0, DELTA, run))
    with pytest.warns(DeprecationWarning, match="calibrate_pnsgd_noise_std"):
        old = float(A.calibrate_pnsgd_noise_std(1.0, DELTA, **{k: v for k, v in RUN.items() if k != "noise_std"},
                                                num_records=8, batch_size=2))
    assert new == old
    # The calibrated run meets the target (its noise_std was not read).
    met = float(A.epsilon(A.PNSGD(1.0, 0.5, 0.5, new, 1.0, num_records=8, batch_size=2), DELTA))
    assert met <= 1.0 and met >= 0.99


def test_record_door_warns_nothing_and_refuses_mixed_calls():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        A.pnsgd_privacy(_event(num_records=8), DELTA)
    with pytest.raises(TypeError, match="come from the record"):
        A.pnsgd_privacy(_event(num_records=8), DELTA, lipschitz=2.0)
    with pytest.raises(TypeError, match="PNSGD event"):
        A.pnsgd_privacy(A.Gaussian(1.0), DELTA)
    with pytest.raises(ValueError, match="schedule='fixed'"):
        A.calibrate_pnsgd_noise_std(1.0, DELTA, _event(num_records=8, schedule="random_stop"))


def test_released_iterates_leave_only_composition():
    out = A.pnsgd_privacy(_event(num_records=8, batch_size=3, hidden=False), DELTA)
    assert np.all(np.isinf(np.asarray(out.contraction))) and np.all(np.isinf(np.asarray(out.shifted_gdp)))
    np.testing.assert_array_equal(np.asarray(out.best), np.asarray(out.composition))


@pytest.mark.parametrize("n, b", [(8, 3), (8, 4), (7, 1)])
def test_random_stop_with_batches_is_the_theorems_with_batches_as_steps(n, b):
    ev = _event(num_records=n, batch_size=b, schedule="random_stop")
    out = A.pnsgd_privacy(ev, DELTA)
    m = -(-n // b)
    sizes = [min(b, n - j * b) for j in range(m)]
    lip = 1.0 / min(sizes)
    m_c = float(A.step_contraction(0.5, 0.5))
    thm5 = np.asarray(A.stop_pnsgd_contraction_epsilon(DELTA, m, lip, 2.0, 0.5, 1.0, m_c,
                                                       positions=np.arange(1, m + 1.0)))
    rdp = A.stop_pnsgd_iteration_rdp(A.DEFAULT_ORDERS, m, lip, 2.0, positions=np.arange(1, m + 1.0), form="logmeanexp")
    thm26 = np.asarray(A.rdp_to_epsilon(rdp, A.DEFAULT_ORDERS, DELTA).epsilon)
    batch = np.arange(n) // b
    # One use per record: the Gaussian mechanism with ratio 2L/(b_j σ), ε exact: δ(ε) meets the target, tightly.
    comp = np.asarray(out.composition)
    r = np.asarray([2.0 / (sizes[j] * 2.0) for j in batch])
    assert np.all(np.asarray(A.gaussian_hockey_stick(comp, r)) <= DELTA * (1 + 1e-9))
    assert np.all(np.asarray(A.gaussian_hockey_stick(comp * (1 - 1e-6), r)) > DELTA)
    np.testing.assert_allclose(np.asarray(out.contraction), thm5[batch], rtol=1e-12)
    np.testing.assert_allclose(np.asarray(out.iteration), thm26[batch], rtol=1e-12)
    best = np.minimum(np.minimum(thm5[batch], thm26[batch]), np.asarray(out.composition))
    np.testing.assert_allclose(np.asarray(out.best), best, rtol=1e-12)
    # The event's ε is its worst record's, and δ at that ε meets the target.
    per = np.asarray(A.pnsgd_record_epsilon(ev, DELTA))
    np.testing.assert_allclose(per, best, rtol=1e-12)
    eps = float(A.epsilon(ev, DELTA))
    assert eps == pytest.approx(per.max(), rel=1e-12)
    assert float(A.delta(ev, eps)) <= DELTA * (1 + 1e-9)
    assert float(A.delta(ev, 0.9 * eps)) > DELTA
