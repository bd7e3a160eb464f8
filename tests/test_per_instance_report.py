"""Reports and help that explain themselves (issue 22).

`jaxdp per-instance` explains estimates above the guarantee in one line; `jaxdp train --help`
states what --noise-multiplier is relative to under each algorithm.
"""

from types import SimpleNamespace

import numpy as np

from jaxdp.cli.per_instance import _above_guarantee_line


def _res(estimates, guarantee):
    return SimpleNamespace(epsilon=guarantee, estimate=SimpleNamespace(epsilon=np.asarray(estimates)))


def test_estimates_above_the_guarantee_are_explained_in_one_line():
    norms = SimpleNamespace(r=np.array([[1.0, 1.0], [1.0, 0.5]]))
    line = _above_guarantee_line(_res([4.59, 3.0], 3.82), norms)
    assert "\n" not in line
    assert "50.0 % of the estimates exceed the guarantee" in line
    assert "inflated Renyi orders" in line and "75 % of the measured r are 1" in line
    assert "clip norm above most gradient norms" in line and "guarantee is unaffected" in line


def test_no_line_when_every_estimate_is_at_most_the_guarantee():
    assert _above_guarantee_line(_res([3.0, 3.82], 3.82), SimpleNamespace(r=np.ones((2, 1)))) is None


def test_train_help_states_the_noise_multiplier_for_every_algorithm():
    from jaxdp.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command" or hasattr(a, "choices") and
               isinstance(a.choices, dict) and "train" in a.choices)
    train = sub.choices["train"]
    help_text = next(a.help for a in train._actions if "--noise-multiplier" in a.option_strings)
    assert "pnsgd: relative to the replace-one sensitivity 2C/b" in help_text
    assert "dpsgd: relative to the clip norm C" in help_text and "dpsbcd" in help_text
