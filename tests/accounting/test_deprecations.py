"""One door per job: each second door of ``jaxdp.accounting`` warns, names its replacement, and
gives the same value as the door it forwards to (the values themselves are checked against
references in test_pld.py)."""

import numpy as np
import pytest

import jaxdp.accounting as A

SMALL = 2**12  # a small PLD grid: these tests compare two doors, not accuracy
EVENT = A.SelfComposed(A.PoissonSampled(0.01, A.Gaussian(1.1)), 200)

# old name -> (the replacement its warning names, old call, new call)
CASES = {
    "pld_epsilon": (
        "epsilon(event, delta, accountant='pld')",
        lambda f: f(EVENT, 1e-5, grid_size=SMALL, estimate="lower"),
        lambda: A.epsilon(EVENT, 1e-5, accountant="pld", grid_size=SMALL, estimate="lower"),
    ),
    "pld_delta": (
        "delta(event, epsilon, accountant='pld')",
        lambda f: f(EVENT, 1.0, grid_size=SMALL),
        lambda: A.delta(EVENT, 1.0, accountant="pld", grid_size=SMALL),
    ),
    "calibrate_pld_noise_multiplier": (
        "calibrate_noise_multiplier(target_epsilon, q, num_steps, delta, accountant='pld')",
        lambda f: f(2.0, 0.01, 200, 1e-5, grid_size=SMALL, solver_iterations=8),
        lambda: A.calibrate_noise_multiplier(2.0, 0.01, 200, 1e-5, accountant="pld", grid_size=SMALL,
                                             solver_iterations=8),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_old_name_warns_naming_the_replacement_and_gives_the_same_value(name):
    replacement, old_call, new_call = CASES[name]
    with pytest.warns(DeprecationWarning, match=name) as record:
        old = getattr(A, name)
    assert replacement in str(record[0].message)
    assert record[0].filename == __file__  # the warning points at the caller's line
    np.testing.assert_array_equal(np.asarray(old_call(old)), np.asarray(new_call()))


def test_old_names_are_off_the_public_surface_but_importable():
    for name in CASES:
        assert name not in A.__all__ and name not in dir(A)
        with pytest.warns(DeprecationWarning, match=name):
            exec(f"from jaxdp.accounting import {name}", {})
    with pytest.raises(AttributeError, match="no attribute 'pld_epsilonn'"):
        A.pld_epsilonn  # noqa: B018


def test_the_door_takes_each_accountant_options_only():
    with pytest.raises(ValueError, match="grid_size is an option of accountant='pld'"):
        A.epsilon(EVENT, 1e-5, grid_size=SMALL)
    with pytest.raises(ValueError, match="estimate is an option of accountant='pld'"):
        A.delta(EVENT, 1.0, estimate="lower")
    with pytest.raises(ValueError, match="tail_bound is an option of accountant='pld'"):
        A.calibrate_noise_multiplier(1.0, 0.01, 200, 1e-5, tail_bound=1e-12)
    with pytest.raises(ValueError, match="grid_size"):
        A.epsilon(EVENT, 1e-5, accountant="pld", grid_size=1000)  # the PLD's own check
    with pytest.raises(ValueError, match="built in"):
        A.register_accountant("pld", epsilon=lambda e, d, o: 0.0, delta=lambda e, x, o: 0.0)

