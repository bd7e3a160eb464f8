"""DP-SBCD's composition bound (every iterate released) against Gaussian mechanisms composed by hand.

Each step touching the record is, per layer, a Gaussian mechanism: the block moves by at most
ηS/b under noise of std sqrt(2ηo), i.e. noise multiplier sqrt(2ηo)/(ηS/b), whose RDP is
gaussian_rdp (α/(2ν²), checked against references in test_rdp.py); the steps and layers compose
by adding curves (Mironov 2017, Proposition 1).
"""

import numpy as np
import pytest

import jaxdp.accounting as A

ORDERS = [1.5, 2.0, 8.0, 64.0]


@pytest.mark.parametrize("temps, steps", [([1e-3, 2e-3], None), ([1e-3, 2e-3], 5),
                                          ([[1e-3, 2e-3, 3e-3], [4e-3, 1e-3, 2e-3]], 4), ([5e-3], 0)])
def test_composition_is_the_gaussian_steps_composed(temps, steps):
    eta, sens, n, b = 0.05, [2.0, 1.5], 12, 4
    m = n // b
    o = np.asarray(temps, np.float64)
    o = np.repeat(o[:, None], m, axis=1) if o.ndim == 1 else o
    total = o.size if steps is None else steps
    want = np.zeros((m, len(ORDERS)))
    for t in range(total):
        p, j = divmod(t, m)
        for s in sens:
            nu = np.sqrt(2 * eta * o[p, j]) / (eta * s / b)
            want[j] += np.asarray(A.gaussian_rdp(ORDERS, nu))
    got = np.asarray(A.dpsbcd_composition_rdp(ORDERS, temps, learning_rate=eta, sensitivity=sens, num_records=n,
                                              batch_size=b, num_steps=steps))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


def test_bad_arguments_name_the_parameter():
    kw = dict(learning_rate=0.1, sensitivity=1.0, num_records=12, batch_size=4)
    with pytest.raises(ValueError, match="num_steps"):
        A.dpsbcd_composition_rdp([2.0], [1e-3], num_steps=4, **kw)
    with pytest.raises(ValueError, match="noise_temperature"):
        A.dpsbcd_composition_rdp([2.0], [[1e-3, 1e-3]], **kw)
    with pytest.raises(ValueError, match="noise_temperature must be > 0"):
        A.dpsbcd_composition_rdp([2.0], [-1e-3], **kw)
    with pytest.raises(ValueError, match="multiple of batch_size"):
        A.dpsbcd_composition_rdp([2.0], [1e-3], **dict(kw, num_records=10))
