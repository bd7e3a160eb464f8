"""Train softmax regression on the bundled digits with PNSGD; report ε per record position.

What you should see (full run, 18-26 s of training on the 2-core CPU VM): test accuracy
77.4-85.5 % over six noise draws, and ε per record position (δ = 1e-5) of 2.79 / 2.93 / 5.35
(best / median / worst) with hidden iterates (shifted interpolation), against 17.9 for every
record under composition, i.e. if the intermediate iterates were released. Then, at ε ≤ 1 for
every record: logistic regression on odd vs even digits (b = 64, ν = 6, η = 0.1, R = 10, 20
passes) reaches 77-82 % with ε 0.56 / 0.58 / 0.84 (composition 3.1). The script asserts these claims (with margins), and
that a non-convex MLP trained the same way is reported under composition, not the
amplified bound.

    python examples/10_train_digits.py            # full run
    python examples/10_train_digits.py --smoke    # one pass, a few seconds
"""

from __future__ import annotations

import argparse

import numpy as np
from flax import nnx

from jaxdp.data import load_digits
from jaxdp.models import MLP, LogisticRegression, SoftmaxRegression
from jaxdp.training import PNSGDMechanism, RunOptions, train

QUIET = RunOptions(progress=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one pass (seconds)")
    args = ap.parse_args(argv)
    passes = 1 if args.smoke else 10

    ds = load_digits()  # rows scaled to unit norm: X = 1, so L = 2 and beta = 1
    print(f"digits: {len(ds.x_train)} train / {len(ds.x_test)} test, 64 features, ||x|| <= {ds.feature_norm_bound:g}")
    mech = PNSGDMechanism(learning_rate=1.0, noise_multiplier=1.0, radius=30.0, batch_size=64, passes=passes)
    res = train(SoftmaxRegression(64, 10, rngs=nnx.Rngs(0)), ds, mech, options=QUIET)
    rep, led = res.privacy, res.ledger
    amp, comp = rep.summary(rep.amplified), rep.summary(rep.composition)
    print(f"softmax regression, {passes} pass(es): test accuracy {100 * res.test_accuracy:.1f} %")
    print(f"  epsilon best/median/worst, hidden iterates: {amp['best']:.3g} / {amp['median']:.3g} / {amp['worst']:.3g}")
    print(f"  epsilon best/median/worst, composition:     {comp['best']:.3g} / {comp['median']:.3g} / {comp['worst']:.3g}")
    per_record = rep.record_epsilon(np.asarray(res.state.order))
    print(f"  record 0 of x_train sits at position {int(np.argmax(np.asarray(res.state.order) == 0)) + 1}: "
          f"epsilon {per_record[0]:.3g}")
    print(rep.table())

    assert rep.analysis == "hidden-state" and led.clipped == 0, rep.reason
    assert np.all(rep.epsilon <= rep.composition)
    if args.smoke:
        # One noisy pass: the accuracy varies with the secret noise (27 % seen in CI), so the
        # smoke run only checks it is above chance (10 %); the full run checks >= 80 %.
        assert res.test_accuracy >= 0.15 and amp["worst"] <= 5.0  # one pass: last batch ~ one Gaussian step
    else:
        assert res.test_accuracy >= 0.75, res.test_accuracy  # 77.4-85.5 % over six noise draws
        assert amp["worst"] <= 6.0 and amp["median"] <= 3.5 and comp["median"] >= 15.0

    # At epsilon <= 1 for every record: the binary task (odd vs even digit) with logistic
    # regression, more noise (nu = 6), a small learning rate and 20 passes.
    binary = ds._replace(y_train=ds.y_train % 2, y_test=ds.y_test % 2, num_classes=2, name="digits (odd vs even)")
    logi = train(LogisticRegression(64, rngs=nnx.Rngs(0)), binary,
                 PNSGDMechanism(learning_rate=0.1, noise_multiplier=6.0, radius=10.0, batch_size=64,
                                passes=2 if args.smoke else 20), options=QUIET)
    la = logi.privacy.summary()
    print(f"logistic regression, odd vs even: test accuracy {100 * logi.test_accuracy:.1f} %, epsilon best/median/worst "
          f"{la['best']:.3g} / {la['median']:.3g} / {la['worst']:.3g} (composition "
          f"{np.median(logi.privacy.composition):.3g})")
    assert logi.privacy.analysis == "hidden-state" and la["worst"] <= 1.0
    if not args.smoke:
        assert logi.test_accuracy >= 0.75, logi.test_accuracy

    # A non-convex model: trained, but only the composition bound is reported.
    mlp = train(MLP((64, 32, 10), rngs=nnx.Rngs(0)), ds,
                PNSGDMechanism(learning_rate=0.5, noise_multiplier=1.0, radius=30.0, batch_size=64, passes=passes,
                               clip_norm=1.0), options=QUIET)
    print(f"MLP 64-32-10: test accuracy {100 * mlp.test_accuracy:.1f} %, reported {mlp.privacy.analysis}: "
          f"{mlp.privacy.reason}")
    assert mlp.privacy.analysis == "composition" and mlp.privacy.amplified is None
    print("all claims hold")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
