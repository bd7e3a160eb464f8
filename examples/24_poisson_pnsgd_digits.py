"""PNSGD on secret Poisson batches for logistic regression on digits, at a target epsilon that stops growing.

Projected noisy SGD with Poisson batches (rate q = b/N, cut to B records, the clipped sum
divided by the fixed b) on a convex model: only the final model is released, and its
hidden-state epsilon (docs/hidden_state_poisson.md) stops growing after a burn-in, however
long the run, while composition (every iterate released) keeps growing. The mechanism
calibrates its noise for the target at the run's own number of steps; the script then prints
the bound of the same run's constants against the number of steps, and the report, which
leads with the guarantee's assumptions and where epsilon becomes flat.

What you should see (full run, 150 passes = 1,800 steps of expected batch 128, about 5 min on
the shared 2-core CPU under load 18): noise multiplier 1.27 for epsilon = 8 at delta = 1e-5,
82 % test accuracy (odd vs even; one run), and the report's first line "epsilon <= 20.11 for
any number of steps from 5,313 to 1e+09 (flat after the burn-in)". At 1,800 steps the bound is
still composition's (8); from about 10,000 steps on it stays at 20.1 while composition grows
(23 at 10⁴, 119 at 10⁵, 834 at 10⁶ steps). Honest limits: 1,438 records are few for a
last-iterate guarantee; at epsilon = 2 (R = 1) the same run is at chance (48 %), and the
hidden-state bound pays only for runs longer than its burn-in (about D·n/(ηL) steps).

    python examples/24_poisson_pnsgd_digits.py            # full run
    python examples/24_poisson_pnsgd_digits.py --smoke    # two passes, seconds
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
from flax import nnx

import jaxdp.accounting as A
from jaxdp.data import load_digits
from jaxdp.models import LogisticRegression
from jaxdp.training import PNSGDMechanism, RunOptions, train


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="two passes (seconds)")
    args = ap.parse_args(argv)
    passes = 2 if args.smoke else 150
    target, delta, batch, cap, radius, eta = 8.0, 1e-5, 128, 256, 2.0, 2.0

    ds = load_digits()
    odd = ds._replace(y_train=ds.y_train % 2, y_test=ds.y_test % 2, num_classes=2, name=ds.name + " (odd vs even)")
    # eta*beta*B/b = 2 * 0.5 * 256/128 = 2 <= 2: every batch's step is a contraction (checked).
    mech = PNSGDMechanism(learning_rate=eta, radius=radius, target_epsilon=target, batch_size=batch, passes=passes,
                          sampling="poisson", max_batch_size=cap)
    res = train(LogisticRegression(64, rngs=nnx.Rngs(0)), odd, mech, delta=delta, options=RunOptions(progress=False))
    rep, led = res.privacy, res.ledger
    print(rep.table())
    print(f"test accuracy: {100 * res.test_accuracy:.1f} %  ({led.total_steps} steps, noise multiplier "
          f"{res.mechanism.noise_multiplier:.4g})")

    # The same run's record (its event: PNSGD(..., sampling="poisson")) at other numbers of steps T.
    ev = led.event()
    steps = [10, 100, 1_000, 3_000, 10_000, 100_000, 1_000_000]
    outs = [A.pnsgd_privacy(dataclasses.replace(ev, num_steps=t), delta) for t in steps]
    hidden = np.array([float(o.best[0]) for o in outs])
    comp = np.array([float(o.composition[0]) for o in outs])
    print("\nsteps T      hidden state   composition (every iterate released)")
    for t, h, c in zip(steps, hidden, comp):
        print(f"{t:>9,}  {h:>13.4f}  {c:>12.4f}")

    eps = rep.summary()["worst"]
    assert 0.98 * target <= eps <= target and rep.analysis == "hidden-state"
    assert "flat after the burn-in" in rep.note.splitlines()[0]
    assert np.all(np.diff(hidden) >= -1e-12) and hidden[-1] == hidden[-2]  # flat: the same at 1e5 and 1e6 steps
    assert hidden[-1] < comp[-1] / 10  # composition keeps growing
    print("all claims hold")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
