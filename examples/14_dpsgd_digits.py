"""DP-SGD with Poisson sampling for a Flax MLP on the bundled digits, at epsilon below 2.

What you should see (full run, about 20 s on a 2-core CPU): the noise multiplier
calibrated so that 30 passes of expected batch 128 give epsilon = 1.9 at delta = 1e-5,
then the guarantee of the released model first (epsilon = 1.90 for every record, any
model, every iterate may be released), and a test accuracy of about 90 % (89-90 % over
noise draws). jaxdp's noise multiplier is relative to the clip norm C on the clipped sum,
the same convention as Opacus, so the printed value can be used there directly.

    python examples/14_dpsgd_digits.py            # full run
    python examples/14_dpsgd_digits.py --smoke    # one pass, a few seconds
"""

from __future__ import annotations

import argparse
import math

import optax
from flax import nnx

import jaxdp.accounting as A
from jaxdp.data import load_digits
from jaxdp.models import MLP
from jaxdp.training import DPSGDMechanism, RunOptions, train


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one pass (seconds)")
    args = ap.parse_args(argv)
    passes = 1 if args.smoke else 30
    target, delta, batch = 1.9, 1e-5, 128

    ds = load_digits()
    n = len(ds.x_train)
    num_steps = passes * math.ceil(n / batch)
    # The mechanism calibrates its noise multiplier for the target (its q, steps and delta).
    mech = DPSGDMechanism(target_epsilon=target, clip_norm=1.0, optimizer=optax.sgd(1.0), batch_size=batch,
                          passes=passes)
    res = train(MLP((64, 64, 10), rngs=nnx.Rngs(0)), ds, mech, delta=delta, options=RunOptions(progress=False))
    nm = res.mechanism.noise_multiplier
    print(f"noise multiplier {nm:.4f} gives epsilon <= {target} for {num_steps} steps at q = {batch / n:.4f}")
    assert nm == float(A.calibrate_noise_multiplier(target, batch / n, num_steps, delta).noise_multiplier)
    eps = res.privacy.summary()["worst"]
    print(f"guarantee of the released model: epsilon = {eps:.3f} at delta = {delta:g} for every record")
    print(f"  ({res.privacy.reason})")
    print(f"test accuracy: {100 * res.test_accuracy:.1f} %")

    assert eps <= target and abs(eps - float(A.dpsgd_epsilon(batch / n, nm, num_steps, delta))) < 1e-12
    if not args.smoke:
        assert res.test_accuracy >= 0.85, res.test_accuracy
    print("all claims hold")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
