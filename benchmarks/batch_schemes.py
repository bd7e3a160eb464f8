"""Benchmark: ε of fixed-size and truncated sampling schemes, jaxdp (one batched jit) vs dp_accounting.

Per scheme, a random grid of configurations; jaxdp evaluates the whole grid as one batched
event under ``jax.jit`` (compile time reported separately, best of ``--repeats``), and the
peer runs per configuration on a subsample (its rate extrapolated per configuration):

* sampling without replacement (replace-one), T steps: dp_accounting ``RdpAccountant``
  (REPLACE_ONE) on ``SampledWithoutReplacementDpEvent``, the same theorem: the largest
  relative ε difference is printed;
* truncated Poisson (add/remove-one): dp_accounting ``PLDAccountant`` on
  ``TruncatedSubsampledGaussianDpEvent`` (its only accountant for the event; a different,
  PLD analysis, so the ε of both are printed side by side, not compared for equality);
* sampling with replacement: dp_accounting 0.6.0 has the event but no accountant; jaxdp
  alone is timed.

    python benchmarks/batch_schemes.py                  # 2,000 configurations per scheme
    python benchmarks/batch_schemes.py --peer-sample 20
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DELTA = 1e-5


def _time_jaxdp(make_event, args, repeats):
    import jax

    import jaxdp.accounting as A

    with jax.enable_x64(True):
        f = jax.jit(lambda *xs: A.epsilon(make_event(*xs), DELTA))
        t0 = time.perf_counter()
        f(*args).block_until_ready()
        compile_s = time.perf_counter() - t0
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            eps = f(*args).block_until_ready()
            best = min(best, time.perf_counter() - t0)
    return np.asarray(eps), compile_s, best


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", type=int, default=2000)
    p.add_argument("--peer-sample", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import dp_accounting as dpa
    from dp_accounting.pld import pld_privacy_accountant as pld
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    import jaxdp.accounting as A

    rng = np.random.default_rng(0)
    n = args.configs
    sub = rng.choice(n, size=min(args.peer_sample, n), replace=False)
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}; {n} configurations per scheme, peer on {len(sub)}")

    # Sampling without replacement.
    recs = rng.integers(1_000, 100_000, n).astype(float)
    m = np.maximum(1.0, np.round(np.exp(rng.uniform(math.log(1e-3), math.log(0.1), n)) * recs))
    sig = np.exp(rng.uniform(math.log(0.6), math.log(5.0), n))
    steps = rng.integers(100, 10_000, n).astype(float)
    eps, comp, best = _time_jaxdp(
        lambda a, b, c, d: A.SelfComposed(A.SampledWithoutReplacement(a, b, A.Gaussian(c, relation="replace_one")), d),
        (recs, m, sig, steps), args.repeats)
    t0 = time.perf_counter()
    ref = []
    for i in sub:
        acc = rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
        ev = dpa.SampledWithoutReplacementDpEvent(int(recs[i]), int(m[i]), dpa.GaussianDpEvent(float(sig[i])))
        acc.compose(dpa.SelfComposedDpEvent(ev, int(steps[i])))
        ref.append(acc.get_epsilon(DELTA))
    peer = (time.perf_counter() - t0) / len(sub)
    rel = np.max(np.abs(eps[sub] / np.array(ref) - 1.0))
    print(f"without replacement: jaxdp {best / n * 1e6:.1f} µs/config (compile {comp:.1f} s); dp_accounting RDP "
          f"{peer * 1e3:.1f} ms/config; ratio {peer / (best / n):.0f}x; max rel. ε difference {rel:.2e}")

    # Truncated Poisson.
    recs = rng.integers(1_000, 100_000, n).astype(float)
    q = np.exp(rng.uniform(math.log(1e-3), math.log(0.05), n))
    cap = np.ceil(q * recs + 4.0 * np.sqrt(q * recs) + 1.0)
    sig = np.exp(rng.uniform(math.log(0.6), math.log(5.0), n))
    steps = rng.integers(100, 3_000, n).astype(float)
    eps, comp, best = _time_jaxdp(
        lambda a, b, c, d, e: A.SelfComposed(A.TruncatedPoissonSampled(a, b, c, A.Gaussian(d)), e),
        (q, recs, cap, sig, steps), args.repeats)
    t0 = time.perf_counter()
    ref = []
    for i in sub:
        acc = pld.PLDAccountant()
        ev = dpa.TruncatedSubsampledGaussianDpEvent(int(recs[i]), float(q[i]), int(cap[i]), float(sig[i]))
        acc.compose(dpa.SelfComposedDpEvent(ev, int(steps[i])))
        ref.append(acc.get_epsilon(DELTA))
    peer = (time.perf_counter() - t0) / len(sub)
    ratio = np.median(eps[sub] / np.array(ref))
    print(f"truncated Poisson: jaxdp RDP {best / n * 1e6:.1f} µs/config (compile {comp:.1f} s); dp_accounting PLD "
          f"{peer * 1e3:.1f} ms/config; ratio {peer / (best / n):.0f}x; median ε jaxdp RDP / dp_accounting PLD "
          f"{ratio:.3f} (cap = mean + 4 sd)")

    # Sampling with replacement (no peer accountant).
    recs = rng.integers(1_000, 100_000, n).astype(float)
    sig = np.exp(rng.uniform(math.log(0.6), math.log(5.0), n))
    steps = rng.integers(100, 10_000, n).astype(float)
    eps, comp, best = _time_jaxdp(
        lambda a, c, d: A.SelfComposed(A.SampledWithReplacement(a, 64, A.Gaussian(c, relation="replace_one")), d),
        (recs, sig, steps), args.repeats)
    print(f"with replacement (m = 64): jaxdp {best / n * 1e6:.1f} µs/config (compile {comp:.1f} s); "
          "dp_accounting 0.6.0: no accountant for the event")
    print(f"load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
