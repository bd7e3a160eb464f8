"""Benchmark: time per pass (epoch) of DP-SBCD against DP-SGD on the same network and data.

Workload: the paper's synthetic shape (scikit-learn ``make_classification``, 6,000 × 20,
5 classes, 4,800 training rows), a bias-free ``LipschitzMLP`` (20, 200, 200, 200, 5) as in
Chen & Liu's experiment (``--width`` to change), batch 960 (5 steps per pass), float32, CPU.

* ``dpsbcd``: :func:`jaxdp.training.train` with ``DPSBCDMechanism`` (the common trainer:
  lifted per-record state, x/U block updates with a linear solve per layer, power iteration,
  noisy prox step, one ``lax.scan`` per pass, ledger and report);
* ``dpsgd``: :func:`jaxdp.training.train` with ``DPSGDMechanism`` (Poisson sampling with
  expected batch 960, per-example clipping, optax SGD).

Each method is run for ``P1`` and ``P2`` passes once to compile (discarded), then timed again
(wall clock of the whole call); the time per pass is ``(t(P2) - t(P1)) / (P2 - P1)``, so the
fixed costs (accounting, set-up, any compilation left) cancel. The ratio dpsbcd/dpsgd is
printed. Run::

    python benchmarks/sbcd_epoch.py            # P1 = 2, P2 = 12
    python benchmarks/sbcd_epoch.py --smoke    # tiny network, P1 = 1, P2 = 2
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import optax
from flax import nnx
from sklearn.datasets import make_classification

from jaxdp.data import from_arrays
from jaxdp.models import LipschitzMLP, softmax_cross_entropy_loss
from jaxdp.training import DPSBCDMechanism, DPSGDMechanism, RunOptions, train


def _data():
    x, y = make_classification(n_samples=6000, n_features=20, n_informative=10, n_redundant=5, n_classes=5,
                               n_clusters_per_class=2, class_sep=1.5, random_state=0)
    x = (x - x.mean(0)) / x.std(0)
    return from_arrays(x.astype(np.float32), y, normalize=True, test_fraction=0.2, seed=0)


def _time(fn, passes):
    t = time.perf_counter()
    fn(passes)
    return time.perf_counter() - t


def main(argv=None) -> int:
    warnings.filterwarnings("ignore", message="noise_seed is fixed")  # timing only: no model is released
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--width", type=int, default=200)
    args = ap.parse_args(argv)
    width = 16 if args.smoke else args.width
    p1, p2 = (1, 2) if args.smoke else (2, 12)
    features = (20, width, width, width, 5)
    ds = _data()
    batch = 960

    def sbcd(passes):
        model = LipschitzMLP(features, rngs=nnx.Rngs(0), max_spectral_norm=3.0)
        mech = DPSBCDMechanism(learning_rate=0.01, noise_temperature=[0.01] * passes, clip_norm=1.0, contraction=1.0,
                               batch_size=batch)
        res = train(model, ds, mech, delta=1e-5, noise_seed=0, options=RunOptions(progress=False))
        jax.block_until_ready(res.model.layers[-1].kernel[...])

    def sgd(passes):
        model = LipschitzMLP(features, rngs=nnx.Rngs(0), max_spectral_norm=3.0)
        mech = DPSGDMechanism(noise_multiplier=1.0, clip_norm=1.0, optimizer=optax.sgd(0.5), batch_size=batch,
                              passes=passes, loss_fn=softmax_cross_entropy_loss)
        res = train(model, ds, mech, delta=1e-5, noise_seed=0, options=RunOptions(progress=False))
        jax.block_until_ready(jax.tree.leaves(nnx.state(res.model)))

    print(f"machine: {platform.machine()} {os.cpu_count()} cores, jax {jax.__version__}, network {features}, "
          f"batch {batch}, {len(ds.x_train)} rows, load average {os.getloadavg()[0]:.1f}")
    out = {}
    for name, fn in (("dpsbcd", sbcd), ("dpsgd", sgd)):
        fn(p1), fn(p2)  # compile
        t1, t2 = _time(fn, p1), _time(fn, p2)
        out[name] = max(t2 - t1, 0.0) / (p2 - p1)
        print(f"{name:7s} {p1:2d} passes {t1:7.2f} s, {p2:2d} passes {t2:7.2f} s -> {1e3 * out[name]:8.1f} ms per pass",
              flush=True)
    if out["dpsgd"] > 0:
        print(f"ratio dpsbcd / dpsgd per pass: {out['dpsbcd'] / out['dpsgd']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
