"""Benchmark: ε of the dp_accounting parity events, jaxdp (one batched jit) vs dp_accounting's RdpAccountant.

Randomized response (replace-one), zCDP and single-epoch tree aggregation, each
self-composed: a random grid of configurations evaluated by jaxdp as one batched event
under ``jax.jit`` (compile time reported separately, best of ``--repeats``), and by
dp_accounting per configuration on a subsample (rate extrapolated per configuration). The
largest relative ε difference is printed. Also timed, without a peer (no implementation of
it is published as a library): ``shuffled_lower_epsilon`` (Chua et al. 2024), one pass and
several.

    python benchmarks/parity_events.py                 # 2,000 configurations per event
    python benchmarks/parity_events.py --peer-sample 50
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


def _time(f, args, repeats):
    import jax

    with jax.enable_x64(True):
        g = jax.jit(f)
        t0 = time.perf_counter()
        g(*args).block_until_ready()
        compile_s = time.perf_counter() - t0
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = g(*args).block_until_ready()
            best = min(best, time.perf_counter() - t0)
    return np.asarray(out), compile_s, best


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", type=int, default=2000)
    p.add_argument("--peer-sample", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shuffle-configs", type=int, default=64)
    args = p.parse_args()

    import dp_accounting as dpa
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    import jaxdp.accounting as A

    nr = dpa.NeighboringRelation
    rng = np.random.default_rng(0)
    n = args.configs
    sub = rng.choice(n, size=min(args.peer_sample, n), replace=False)
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}; {n} configurations per event, peer on {len(sub)}")
    counts = rng.integers(1, 5000, n).astype(float)
    cases = {
        "randomized response": (
            lambda a, b, c: A.epsilon(A.SelfComposed(A.RandomizedResponse(a, b), c), DELTA),
            (rng.uniform(0.05, 1.0, n), rng.integers(2, 50, n).astype(float), counts),
            lambda a, b, c: dpa.SelfComposedDpEvent(dpa.RandomizedResponseDpEvent(float(a), int(b)), int(c)),
            nr.REPLACE_ONE),
        "zCDP": (
            lambda a, b, c: A.epsilon(A.SelfComposed(A.ZCDP(a, b), c), DELTA),
            (10.0 ** rng.uniform(-6, -1, n), 10.0 ** rng.uniform(-8, -3, n), counts),
            lambda a, b, c: dpa.SelfComposedDpEvent(dpa.ZCDpEvent(float(a), float(b)), int(c)),
            nr.ADD_OR_REMOVE_ONE),
        "tree aggregation (step counts 1000, 37)": (
            lambda a, c: A.epsilon(A.SelfComposed(A.SingleEpochTreeAggregation(a, (1000, 37)), c), DELTA),
            (rng.uniform(0.5, 30.0, n), counts),
            lambda a, c: dpa.SelfComposedDpEvent(dpa.SingleEpochTreeAggregationDpEvent(float(a), [1000, 37]), int(c)),
            nr.REPLACE_SPECIAL),
    }
    for name, (f, xs, dp_event, relation) in cases.items():
        eps, comp, best = _time(f, xs, args.repeats)
        t0 = time.perf_counter()
        ref = []
        for i in sub:
            acc = rdp.RdpAccountant(neighboring_relation=relation)
            acc.compose(dp_event(*(x[i] for x in xs)))
            ref.append(acc.get_epsilon(DELTA))
        peer = (time.perf_counter() - t0) / len(sub)
        rel = np.max(np.abs(eps[sub] / np.array(ref) - 1.0))
        print(f"{name}: jaxdp {best / n * 1e6:.1f} µs/config (compile {comp:.1f} s); dp_accounting RDP "
              f"{peer * 1e3:.2f} ms/config; ratio {peer / (best / n):.0f}x; max rel. ε difference {rel:.1e}")

    m = args.shuffle_configs
    sig = rng.uniform(0.5, 4.0, m)
    nb = rng.integers(10, 10_000, m).astype(float)
    for passes in (1, 5):
        _, comp, best = _time(lambda a, b: A.shuffled_lower_epsilon(a, b, passes, DELTA), (sig, nb), args.repeats)
        print(f"shuffled_lower_epsilon, {passes} pass(es): {best / m * 1e3:.2f} ms/config over {m} configurations "
              f"(compile {comp:.1f} s); no peer library")
    print(f"load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
